"""Decode attention (templates/decode_attention.py) on the host: which inputs it takes, the split
of each (batch, head)'s keys into runs (enough programs to keep every SM reading, PROGRAMS_PER_SM
per SM; whole BLOCK_L tiles a run), the two launches.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..templates.decode_attention import (decode_attention_combine_kernel,
                                          decode_attention_split_kernel)
from .kernel_launch import cdiv, launch, next_power_of_2
from .launch import num_sms

BLOCK_L = 64  # keys per tile
MAX_ROWS = 64  # query rows (packed heads x queries) per (batch, head)
MAX_SPLITS = 128
PROGRAMS_PER_SM = 2
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

stats = {"decode_attention": 0}  # calls served by the template (tests check it ran)


def decode_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             mask: Optional[torch.Tensor]) -> Optional[str]:
    """None where the template takes these inputs, else why not (SDPA serves them)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "query, keys and values are not 4-D"
    batch, heads, rows, dim = q.shape
    if k.shape != (batch, heads, k.shape[2], dim) or v.shape != k.shape:
        return (f"keys {tuple(k.shape)} / values {tuple(v.shape)} do not match query "
                f"{tuple(q.shape)}")
    if rows > MAX_ROWS:
        return f"{rows} query rows, over {MAX_ROWS}"
    if dim < 16 or dim > 256 or dim & (dim - 1):
        return f"head size {dim} (16 to 256, a power of 2)"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "a head dimension not contiguous"
    if mask is not None and not (mask.dtype == torch.bool or mask.dtype == q.dtype):
        return f"a {mask.dtype} mask"
    if mask is not None and mask.dim() > 4:
        return f"a {mask.dim()}-D mask"
    return None


def keys_per_split(batch_heads: int, keys: int, programs: int) -> int:
    """Keys a run: about `programs` programs over batch x heads, whole tiles, at most
    MAX_SPLITS runs."""
    tiles = max(1, cdiv(keys, BLOCK_L))
    splits = min(tiles, MAX_SPLITS, max(1, cdiv(programs, batch_heads)))
    return cdiv(tiles, splits) * BLOCK_L


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Optional[torch.Tensor], scale: float,
                     split_keys: Optional[int] = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v through the template (the caller checked
    decode_attention_applies); `split_keys` overrides the keys per run."""
    batch, heads, rows, dim = q.shape
    keys = k.shape[2]
    out = torch.empty((batch, heads, rows, dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if split_keys is None:
        programs = PROGRAMS_PER_SM * (num_sms(q.device) if q.is_cuda else 4)
        split_keys = keys_per_split(batch * heads, keys, programs)
    splits = max(1, cdiv(keys, split_keys))
    block_r = max(16, next_power_of_2(rows))
    slots = batch * heads * splits * block_r  # each run's rows, padded to block_r
    part = torch.empty((slots, dim), dtype=torch.float32, device=q.device)
    run_max = torch.empty((slots,), dtype=torch.float32, device=q.device)
    run_sum = torch.empty_like(run_max)
    has_mask = mask is not None
    # SDPA's broadcast: stride 0 where the mask repeats (no mask: q, a pointer the kernel skips)
    mask = mask.expand(batch, heads, rows, keys) if has_mask else q
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    launch(decode_attention_split_kernel, (batch * heads, splits), q, k, v, mask, part, run_max,
           run_sum, heads, rows, keys, split_keys, float(scale), *q.stride()[:3],
           *k.stride()[:3], *v.stride()[:3], *mask.stride(),
           HAS_MASK=has_mask, BOOL_MASK=mask.dtype == torch.bool, PRECISION=precision,
           BLOCK_R=block_r, BLOCK_L=BLOCK_L, D=dim, num_warps=4)
    launch(decode_attention_combine_kernel, (batch * heads * rows,), part, run_max, run_sum, out,
           heads, rows, splits, *out.stride()[:3],
           BLOCK_R=block_r, BLOCK_S=max(2, next_power_of_2(splits)), D=dim, num_warps=4)
    stats["decode_attention"] += 1
    return out
