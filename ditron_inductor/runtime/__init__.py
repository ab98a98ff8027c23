"""Runtime of the fused ops: symmetric memory (symm.py), per-op contexts (context.py), the hot
path's CUDA driver calls (driver.py), what the ops share (launch.py), and a module per op.

`ops` imports it lazily, on the first CUDA call with a fused plan (it imports triton, and nvshmem
where chosen); nothing here imports `ops`.
"""

import torch

from .all_gather import all_gather_matmul_fused, all_gather_scaled_mm_fused
from .all_reduce import (grouped_mm_all_reduce_fused, grouped_mm_all_reduce_rmsnorm_fused,
                         matmul_all_reduce_fused, matmul_all_reduce_rmsnorm_fused)
from .context import clear_contexts
from .matmul_all_gather import matmul_all_gather_fused
from .moe import all_to_all_grouped_mm_fused, grouped_mm_all_to_all_fused
from .reduce_scatter import matmul_reduce_scatter_fused, scaled_mm_reduce_scatter_fused
from .symm import close_all

# op name -> fn(task, plan, *op_args) -> outputs, or None where the plan cannot serve the input
# (scaled_mm_all_reduce has none: it runs its reference, _scaled_mm + NCCL)
FUSED_IMPLS = {
    "all_gather_matmul": all_gather_matmul_fused,
    "matmul_reduce_scatter": matmul_reduce_scatter_fused,
    "matmul_all_gather": matmul_all_gather_fused,
    "matmul_all_reduce": matmul_all_reduce_fused,
    "matmul_all_reduce_rmsnorm": matmul_all_reduce_rmsnorm_fused,
    "grouped_mm_all_reduce": grouped_mm_all_reduce_fused,
    "grouped_mm_all_reduce_rmsnorm": grouped_mm_all_reduce_rmsnorm_fused,
    "all_gather_scaled_mm": all_gather_scaled_mm_fused,
    "scaled_mm_reduce_scatter": scaled_mm_reduce_scatter_fused,
    "all_to_all_grouped_mm": all_to_all_grouped_mm_fused,
    "grouped_mm_all_to_all": grouped_mm_all_to_all_fused,
}


def shutdown() -> None:
    """Drop every context (before destroying the process groups). NVSHMEM finalises at exit."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    clear_contexts()
    close_all()
