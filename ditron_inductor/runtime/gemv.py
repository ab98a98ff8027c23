"""The decode GEMM (templates/gemv.py) on the host: which shapes it takes, its launch config.

Launch configs from benchmarks/bench_gemv.py on 1x H200 (benchmarks/results/gemv_h200x1.md):
with one row, blocks of 8 weight rows x 1024 of K on 8 warps were the fastest or within 2% of it
at every Llama-3-8B site at TP 1 and 2 (0.78-0.85x cuBLAS's time at TP 2 but lm_head's 0.97x);
with 4 or 16 rows no config beat cuBLAS by much (0.85-1.07x), and the graph rewrite
(lowering/decode_gemm.py) takes one-row products only. On 1x H100 with longer K slices and 16
warps in the sweep (gemv_h100x1_tp2.md): at narrow outputs (N 512, 2048: k/v and q at TP 2) 8
weight rows leave SMs without a program, and 4 rows x 2048 of K on 16 warps (N 512: 0.0044 ms
against 0.0057) or 8 x 2048 on 16 (N 2048: 0.0078 against 0.0087) were the fastest; elsewhere 8 x
1024 on 8 stayed within 1% of the best.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..templates.gemv import gemv_group_kernel, gemv_kernel
from .kernel_launch import cdiv, launch


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 1024
    num_warps: int = 8


ONE_ROW = GemvConfig()
ONE_ROW_NARROW = GemvConfig(block_n=8, block_k=2048, num_warps=16)  # N <= 2048
ONE_ROW_NARROWER = GemvConfig(block_n=4, block_k=2048, num_warps=16)  # N <= 1024
ROWS = GemvConfig(block_n=32, block_k=512, num_warps=4)  # 2-16 rows: tl.dot's 16-column blocks

MAX_GROUP = 3  # products per gemv_group_kernel launch
stats = {"decode_mm": 0, "decode_mm_group": 0}  # calls served by the template (tests check it ran)


def config_for(rows: int, n: int) -> GemvConfig:
    """The launch config for `rows` rows of `n` output columns (measured, see above)."""
    if rows > 1:
        return ROWS
    return ONE_ROW_NARROWER if n <= 1024 else ONE_ROW_NARROW if n <= 2048 else ONE_ROW


def block_m(rows: int) -> int:
    return 1 if rows == 1 else 16


def config_fits(config: GemvConfig, rows: int) -> bool:
    """tl.dot (more than one row) takes blocks of at least 16 columns."""
    return rows == 1 or config.block_n >= 16


def decode_mm(a: torch.Tensor, b: torch.Tensor, config: Optional[GemvConfig] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b (into out, if given) through the decode GEMM (the caller checked
    scheduler.decode_gemm.gemv_applies)."""
    M, K = a.shape
    N = b.shape[1]
    config = config or config_for(M, N)
    assert config_fits(config, M), f"{config} with {M} rows"
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    launch(gemv_kernel, (cdiv(N, config.block_n),), a, b, out, M, N, K,
           a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
           BLOCK_M=block_m(M), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
           num_warps=config.num_warps)
    stats["decode_mm"] += 1
    return out


def decode_mm_group(a: torch.Tensor, bs: list[torch.Tensor],
                    config: Optional[GemvConfig] = None) -> list[torch.Tensor]:
    """[a @ b for b in bs] (2 or 3 of them) in one launch of the decode GEMM (the caller checked
    gemv_applies for each b)."""
    assert 2 <= len(bs) <= MAX_GROUP, f"{len(bs)} products"
    M, K = a.shape
    widths = [b.shape[1] for b in bs]
    config = config or config_for(M, sum(widths))
    assert config_fits(config, M), f"{config} with {M} rows"
    outs = [torch.empty((M, n), dtype=a.dtype, device=a.device) for n in widths]
    if M == 0 or K == 0:
        return [out.zero_() for out in outs]
    programs = [cdiv(n, config.block_n) for n in widths]
    third = len(bs) == 3
    b2, out2, n2 = (bs[2], outs[2], widths[2]) if third else (bs[1], outs[1], 0)
    launch(gemv_group_kernel, (sum(programs),), a, bs[0], bs[1], b2, outs[0], outs[1], out2, M,
           widths[0], widths[1], n2, K, programs[0], programs[1], a.stride(0), a.stride(1),
           bs[0].stride(0), bs[0].stride(1), bs[1].stride(0), bs[1].stride(1), b2.stride(0),
           b2.stride(1), outs[0].stride(0), outs[1].stride(0), out2.stride(0),
           BLOCK_M=block_m(M), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
           num_warps=config.num_warps)
    stats["decode_mm_group"] += 1
    return outs
