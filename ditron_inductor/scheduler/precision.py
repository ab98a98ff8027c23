"""Whether a Triton GEMM may compute a task's products: the precision torch promised the user.

Triton's tl.dot takes float32 operands as TF32 (10 mantissa bits); torch computes float32
matmuls in full precision unless the user allowed TF32 (`torch.backends.cuda.matmul.fp32_precision
= "tf32"`, `torch.set_float32_matmul_precision("high")`, or the older `allow_tf32 = True`), and
cuBLAS follows that. A fused plan whose GEMM is Triton would give a float32 model coarser numbers
than the graph it replaces, silently; so where TF32 is not allowed the scheduler takes only plans
whose GEMM is cuBLAS (the decode template's one-row product multiplies and sums in float32). The
setting is read at compile time as Inductor reads it for its own templates (and keys its cache on
it); every rank runs the same script, so every rank reads the same.
"""

from __future__ import annotations

from typing import Optional

import torch

from .task import Task


def tf32_allowed() -> bool:
    """Whether torch lets float32 CUDA matmuls use TF32. torch >= 2.9 says it in `fp32_precision`
    (reading the older `allow_tf32` raises there once the new setting was used)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    return precision == "tf32" if precision is not None else bool(matmul.allow_tf32)


def triton_gemm_refused(task: Task) -> Optional[str]:
    """Why a Triton GEMM may not compute the task's products, or None."""
    if task.dtype != torch.float32 or tf32_allowed():
        return None
    return ("float32 without TF32 (torch.backends.cuda.matmul.fp32_precision is not 'tf32'): a "
            "Triton GEMM would take the operands as TF32, so only cuBLAS GEMMs")
