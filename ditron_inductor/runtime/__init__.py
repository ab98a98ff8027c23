"""Runtime of the fused ops: symmetric memory per process group, per-op contexts, and the fused
CUDA implementations, which importing this package registers with `ops.register_fused`.

Imported lazily by `ops._load_fused_impls` on the first CUDA call with a fused plan (it imports
triton, and nvshmem where that backend is chosen).
"""

from . import all_reduce, fused  # noqa: F401  (registers the implementations)
from .context import clear_contexts


def shutdown() -> None:
    """Drop every context (before destroying the process groups). NVSHMEM finalises at exit."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    clear_contexts()
    from .symm import close_all

    close_all()
