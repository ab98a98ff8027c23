"""Where ditron_inductor logs.

Every module logs to the logger "ditron". `TORCH_LOGS=ditron` turns it on with no import of ours:
torch accepts any importable module name there, and the top-level module `ditron` (an empty
module shipped with this package for that purpose) is one.
"""

LOGGER_NAME = "ditron"
