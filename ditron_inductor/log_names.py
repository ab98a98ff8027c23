"""Where ditron_inductor logs, and which ranks say it.

Every module logs to the logger "ditron"; `TORCH_LOGS=ditron` turns it on with no import of ours,
as torch accepts any importable module name there and the package ships an empty top-level
module `ditron` for it. Every rank makes the same decisions, so at INFO only rank 0 speaks unless
`TORCH_LOGS=+ditron` or `ditron.log_all_ranks` (DITRON_LOG_ALL_RANKS=1); warnings come from every
rank.
"""

import contextlib
import contextvars
import logging
import sys

LOGGER_NAME = "ditron"


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank()


_all_ranks = contextvars.ContextVar("ditron_log_all_ranks", default=False)


@contextlib.contextmanager
def all_ranks_logging(on: bool):
    """Every rank's INFO lines while the pass runs with ditron.log_all_ranks."""
    token = _all_ranks.set(on)
    try:
        yield
    finally:
        _all_ranks.reset(token)


class _RankZeroAtInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or logger.isEnabledFor(logging.DEBUG):
            return True
        return _all_ranks.get() or _rank() == 0


logger = logging.getLogger(LOGGER_NAME)
if not any(isinstance(f, _RankZeroAtInfo) for f in logger.filters):
    logger.addFilter(_RankZeroAtInfo())
