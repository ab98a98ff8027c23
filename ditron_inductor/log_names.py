"""Where ditron_inductor logs, and which ranks say it.

Every module logs to the logger "ditron"; `TORCH_LOGS=ditron` turns it on with no import of ours,
as torch accepts any importable module name there and the package ships an empty top-level
module `ditron` for it. Every rank makes the same decisions, so at INFO only rank 0 speaks unless
`TORCH_LOGS=+ditron` or `ditron.log_all_ranks` (DITRON_LOG_ALL_RANKS=1); warnings come from every
rank. Each line is printed once, by torch's handler, whatever handlers the root logger has.
"""

import contextlib
import contextvars
import logging
import sys

LOGGER_NAME = "ditron"


def process_rank() -> int:
    """This process's rank in the default group, 0 where there is none."""
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
        return _all_ranks.get() or process_rank() == 0


def _configure_like_torch(logger: logging.Logger) -> None:
    """Handle the logger as torch handles its own: registered with torch._logging, so that
    `TORCH_LOGS` and `set_logs` set its level and give it torch's handler; at WARNING unless
    asked (a root logger at INFO, as torchtitan sets it, does not turn ditron's log on); and not
    propagating, so that a root handler does not print each line a second time. TORCH_LOGS=ditron,
    read at torch's import, attaches torch's handler before this module is imported, and torch
    leaves such a logger propagating. Without TORCH_LOGS a warning reaches no handler and is
    printed by Python's last-resort handler, once."""
    try:
        from torch._logging import _internal
    except ImportError:  # a torch without its logging registry: the logger stays as it is
        return
    if LOGGER_NAME not in _internal.log_registry.get_log_qnames():
        _internal.register_log(LOGGER_NAME, LOGGER_NAME)
    if logger.level == logging.NOTSET and not any(
            _internal._is_torch_handler(h) for h in logger.handlers):
        logger.setLevel(logging.WARNING)
    logger.propagate = False


logger = logging.getLogger(LOGGER_NAME)
if not any(isinstance(f, _RankZeroAtInfo) for f in logger.filters):
    logger.addFilter(_RankZeroAtInfo())
    _configure_like_torch(logger)
