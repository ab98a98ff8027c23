"""Which matmuls take the decode GEMM template (templates/gemv.py) instead of cuBLAS.

A decode step multiplies a row per sequence by each weight: at batch 16 and below the product
reads the weight once and is bound by memory bandwidth. There a whole decode step measured faster
with the template than with cuBLAS (whose split-K GEMMs add a reduction kernel and a gap each),
also where a product alone is near parity. Where the option `ditron.decode_gemm` is on:
- a plain `aten.mm` of at most DECODE_ROWS rows (lowering/decode_gemm.py rewrites it into
  ditron.decode_mm);
- the GEMM of a fused all-reduce of one row (its plan's gemm=GEMV, `with_decode_gemm`): with
  more rows the fused all-reduce was measured with cuBLAS only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .plan import CUBLAS, GEMV, AllReducePlan, FusedPlan
from .task import MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM, Task

MAX_ROWS = 16  # what the template computes (tl.dot pads the rows to 16)
DECODE_ROWS = MAX_ROWS  # plain matmuls: a decode step measured faster up to here
ALL_REDUCE_ROWS = 1  # the fused all-reduce's GEMM: measured faster with one row
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gemv_applies(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """None if the template computes a @ b (real or fake tensors), else why not."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return "not a 2-D matmul"
    if not statically_known_true(a.shape[0] <= MAX_ROWS):
        return f"{a.shape[0]} rows (more than {MAX_ROWS})"
    if not statically_known_true(b.stride(0) == 1):
        return "b is not a weight's transpose (K stride != 1)"
    if a.dtype != b.dtype or a.dtype not in DTYPES:
        return f"dtypes {a.dtype} / {b.dtype}"
    return None


def mm_not_rewritten(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """None if a graph's mm(a, b) (fake tensors) becomes ditron.decode_mm, else why not."""
    if a.device.type != "cuda":
        return f"on {a.device.type}, not CUDA"
    if not statically_known_true(a.shape[0] <= DECODE_ROWS):
        return f"{a.shape[0]} rows (more than {DECODE_ROWS})"
    if a.dtype == torch.float32 and not statically_known_true(a.shape[0] == 1):
        return "float32 with more than one row (the template's tl.dot would round to TF32)"
    return gemv_applies(a, b)


def with_decode_gemm(plan: FusedPlan, task: Task, decode_gemm: bool = True) -> FusedPlan:
    """The all-reduce plan of a one-row task with its GEMM in the template (its runtime checks
    the operands' layout and takes cuBLAS where the template does not apply)."""
    if (decode_gemm and isinstance(plan, AllReducePlan) and plan.gemm == CUBLAS
            and not plan.overlap and task.op in (MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM)
            and task.dtype in DTYPES and statically_known_true(task.m == ALL_REDUCE_ROWS)):
        return dataclasses.replace(plan, gemm=GEMV)
    return plan
