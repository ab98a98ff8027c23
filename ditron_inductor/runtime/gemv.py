"""The decode GEMM (templates/gemv.py) on the host: its launch configs and launches.

One row: blocks of 8 weight rows x 1024 of K on 8 warps. Narrow outputs (N <= 2048: a
tensor-parallel layer's q, k, v) would leave SMs without a program: longer K slices on 16 warps,
and 4 weight rows a block from N <= 1024. 2-16 rows: tl.dot on the rows padded to 16, 32 weight
rows x 512 of K on 4 warps.
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
    """The launch config for `rows` rows of `n` output columns."""
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
    """a @ b (into out, if given); the caller checked scheduler.decode_gemm.gemv_applies."""
    M, K = a.shape
    N = b.shape[1]
    config = config or config_for(M, N)
    assert config_fits(config, M), f"{config} with {M} rows"
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if out.numel() == 0 or K == 0:
        return out.zero_()
    launch(gemv_kernel, (cdiv(N, config.block_n),), a, b, out, M, N, K,
           a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
           BLOCK_M=block_m(M), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
           num_warps=config.num_warps)
    stats["decode_mm"] += 1
    return out


def decode_mm_group(a: torch.Tensor, bs: list[torch.Tensor],
                    config: Optional[GemvConfig] = None) -> list[torch.Tensor]:
    """[a @ b for b in bs] (2 or 3 of them) in one launch; the caller checked gemv_applies."""
    assert 2 <= len(bs) <= MAX_GROUP, f"{len(bs)} products"
    M, K = a.shape
    widths = [b.shape[1] for b in bs]
    config = config or config_for(M, sum(widths))
    assert config_fits(config, M), f"{config} with {M} rows"
    outs = [torch.empty((M, n), dtype=a.dtype, device=a.device) for n in widths]
    if M == 0 or K == 0:
        return [out.zero_() for out in outs]
    programs = [cdiv(n, config.block_n) for n in widths]
    b2, out2, n2 = (bs[2], outs[2], widths[2]) if len(bs) == 3 else (bs[1], outs[1], 0)
    launch(gemv_group_kernel, (sum(programs),), a, bs[0], bs[1], b2, outs[0], outs[1], out2, M,
           widths[0], widths[1], n2, K, programs[0], programs[1], a.stride(0), a.stride(1),
           bs[0].stride(0), bs[0].stride(1), bs[1].stride(0), bs[1].stride(1), b2.stride(0),
           b2.stride(1), outs[0].stride(0), outs[1].stride(0), out2.stride(0),
           BLOCK_M=block_m(M), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
           num_warps=config.num_warps)
    stats["decode_mm_group"] += 1
    return outs
