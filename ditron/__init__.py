"""The name behind `TORCH_LOGS=ditron`.

torch accepts, in TORCH_LOGS, any importable module name and then shows that module's logger.
ditron_inductor logs to the logger "ditron", so this empty module makes `TORCH_LOGS=ditron` (and
`+ditron`) valid before anything of ours is imported, on every torch version. It holds no code;
the package is `ditron_inductor`.
"""
