"""The dtypes the fused CUDA kernels serve, and why float32 is not among them.

The fused kernels compute in bfloat16 and float16 (their products in the Triton or cuBLAS GEMMs,
their sums in float32), and the FP8 ops take float8 operands of `torch._scaled_mm`. A float32
task stays with NCCL + cuBLAS, which Inductor schedules as before: the runtime has no float32
path, and the Triton GEMMs would read float32 operands as TF32 (10 mantissa bits, `tl.dot`'s
default) where torch computes them in full precision unless the user allowed TF32. The decision
says so in the log instead of naming a plan the runtime would not run.
"""

from __future__ import annotations

from typing import Optional

import torch

from .task import Task

FUSED_DTYPES = (torch.bfloat16, torch.float16)  # what the fused kernels compute in
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # the scaled ops' operands


def unserved_dtype(task: Task) -> Optional[str]:
    """Why the fused CUDA kernels do not serve the task's dtypes (a scaled op's: its float8
    operands' and its output's), or None."""
    if task.out_dtype is None:
        served, dtype = task.dtype in FUSED_DTYPES, str(task.dtype)
    else:  # a scaled op
        served = task.dtype in FLOAT8 and task.out_dtype in FUSED_DTYPES
        dtype = f"{task.dtype} -> {task.out_dtype}"
    if served:
        return None
    return (f"dtype {dtype}: the fused kernels compute in bfloat16 / float16 (their Triton "
            f"GEMMs would read float32 as TF32); NCCL + cuBLAS as before")
