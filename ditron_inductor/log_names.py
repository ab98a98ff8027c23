"""The `ditron` name for TORCH_LOGS.

`register` runs from torch's own import (the `torch.backends` entry point), before torch parses
TORCH_LOGS, so it must stay cheap and must not import torch._inductor.
"""

LOGGER_NAME = "ditron_inductor"
ALIAS = "ditron"


def register() -> None:
    from torch._logging import _internal

    if not _internal.log_registry.is_log(ALIAS):
        _internal.register_log(ALIAS, LOGGER_NAME)
