"""The GEMM of a fused plan on float8 operands (the scaled ops, FP8 tensor parallelism).

A cuBLAS plan of all_gather_scaled_mm or scaled_mm_reduce_scatter runs its bf16 op's protocol,
passing a `Scaled` to `launch.matmul_into`: the GEMM becomes torch._scaled_mm into the same output
rows, in the output dtype (bf16/fp16, what the protocol's partials and sums hold). A rowwise
scale_a ([M, 1]) is sliced with A's rows; scale_b is whole. The Triton GEMMs take no float8: a
plan naming one declines before any protocol step, alike on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..scheduler.precision import FLOAT8
from .launch import DTYPES, bias_serves


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A GEMM as torch._scaled_mm (scales: one, or per row of A / per column of B)."""

    scale_a: torch.Tensor
    scale_b: torch.Tensor
    out_dtype: torch.dtype
    use_fast_accum: bool

    @classmethod
    def of(cls, scale_a, scale_b, out_dtype, a_dtype, use_fast_accum) -> "Scaled":
        """The op's arguments; rowwise scales laid out as _scaled_mm checks them (stride 1 along
        the size-1 dim, which a layout Inductor chose need not have: ops._scaled_mm does the
        same for the reference)."""
        if scale_a.numel() > 1 or scale_b.numel() > 1:
            scale_a, scale_b = scale_a.reshape(-1, 1), scale_b.reshape(1, -1)
        return cls(scale_a, scale_b, out_dtype or a_dtype, use_fast_accum)

    @property
    def rowwise(self) -> bool:
        return self.scale_a.numel() > 1 or self.scale_b.numel() > 1

    def matmul_into(self, a_rows, b, bias, out, first_row: int = 0) -> None:
        """out = a_rows @ b scaled (+ bias), a_rows being A's rows from first_row on."""
        scale_a = self.scale_a
        if self.rowwise:
            scale_a = scale_a[first_row:first_row + a_rows.shape[0]]
        torch._scaled_mm(a_rows, b, scale_a, self.scale_b, bias=bias, out_dtype=self.out_dtype,
                         use_fast_accum=self.use_fast_accum, out=out)

    @classmethod
    def checked(cls, a, weights, scale_a, scales_b, biases, out_dtype,
                use_fast_accum) -> tuple[list["Scaled"], Optional[str]]:
        """([Scaled per weight], None) for A [rows, K] by each weight, or ([], why) where
        _scaled_mm would reject one."""
        gemms = [cls.of(scale_a, s, out_dtype, a.dtype, use_fast_accum) for s in scales_b]
        why = next(filter(None, (g.declines(a, w, bias)
                                 for g, w, bias in zip(gemms, weights, biases))), None)
        return ([], why) if why else (gemms, None)

    def declines(self, a, b, bias) -> Optional[str]:
        """Why a fused plan cannot run _scaled_mm on these operands, or None. Checked before any
        protocol step: a _scaled_mm that fails after the peers were signalled would leave them
        waiting, where the reference raises its own error on every rank."""
        if a.dtype not in FLOAT8 or b.dtype not in FLOAT8 or a.dim() != 2 or b.dim() != 2:
            return f"fp8: operands {a.dtype} @ {b.dtype}, not 2-d float8"
        if self.out_dtype not in DTYPES:
            return (f"fp8: output dtype {self.out_dtype} (the fused partials and sums are "
                    "bf16 or fp16)")
        if self.rowwise and self.out_dtype != torch.bfloat16:
            return "fp8: rowwise scales with a bf16 output only (torch's rowwise _scaled_mm)"
        k, n = b.shape
        if k % 16 or n % 16 or a.stride(1) != 1 or b.stride(0) != 1:
            return (f"fp8: K={k}, N={n} and layouts _scaled_mm cannot take (multiples of 16, A "
                    "row-major, B column-major)")
        if not bias_serves(bias, self.out_dtype, n):
            return "fp8: bias shape/dtype"
        if not (a.is_cuda and b.is_cuda):
            return "fp8: operands not on CUDA"
        return None


@dataclasses.dataclass(frozen=True)
class ScaledSum:
    """A sum of _scaled_mm products over the same rows (the input gradient of layers sharing
    their input), each term with its own scales: a plan slices the first term as it slices A and
    B, the others' rows alike, each product added in the output dtype as the graph's adds did."""

    first: Scaled
    others: tuple  # (a, b, Scaled) of each further term

    @property
    def out_dtype(self) -> torch.dtype:
        return self.first.out_dtype

    def matmul_into(self, a_rows, b, bias, out, first_row: int = 0) -> None:
        self.first.matmul_into(a_rows, b, bias, out, first_row)
        rows = slice(first_row, first_row + a_rows.shape[0])
        term = torch.empty_like(out)
        for a_i, b_i, gemm in self.others:
            gemm.matmul_into(a_i[rows], b_i, None, term, first_row)
            out += term
