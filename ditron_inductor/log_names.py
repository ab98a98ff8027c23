"""Where ditron_inductor logs, and which ranks say it.

Every module logs to the logger "ditron". `TORCH_LOGS=ditron` turns it on with no import of ours:
torch accepts any importable module name there, and the top-level module `ditron` (an empty
module shipped with this package for that purpose) is one.

Every rank makes the same decisions, so at INFO only rank 0 speaks; at `TORCH_LOGS=+ditron`, or
with the option `ditron.log_all_ranks` (DITRON_LOG_ALL_RANKS=1), every rank does, and warnings
always come from every rank.
"""

import logging
import sys

LOGGER_NAME = "ditron"


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank()


class _RankZeroAtInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or logger.isEnabledFor(logging.DEBUG):
            return True
        from . import config

        return config.log_all_ranks or _rank() == 0


logger = logging.getLogger(LOGGER_NAME)
if not any(isinstance(f, _RankZeroAtInfo) for f in logger.filters):
    logger.addFilter(_RankZeroAtInfo())
