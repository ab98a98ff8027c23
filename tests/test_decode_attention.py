"""The decode attention template (templates/decode_attention.py): its numbers under the Triton
interpreter against SDPA on odd shapes (rows, keys and runs of keys no multiple of the tiles,
one run and many), every mask SDPA takes (none, boolean, additive, broadcast over heads or rows),
a row with every key masked, and what it refuses; the op off CUDA.

On the GPU machine: tests/gpu/test_decode_attention_gpu.py (bfloat16, Llama's decode shapes,
CUDA graphs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditron_inductor import ops  # noqa: F401 - defines torch.ops.ditron.decode_attention
from ditron_inductor.runtime.decode_attention import (BLOCK_L, decode_attention,
                                                      decode_attention_applies, keys_per_split)


def qkv(batch, heads, rows, keys, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(dtype) for shape in
                 ((batch, heads, rows, dim), (batch, heads, keys, dim), (batch, heads, keys, dim)))


def make_mask(kind, batch, heads, rows, keys, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "bool [b,1,r,L]":  # each row sees key 0 and about half of the rest
        return (torch.rand(batch, 1, rows, keys, generator=gen) > 0.5) | (torch.arange(keys) == 0)
    if kind == "bool [b,1,1,L] (a decode step's)":
        return (torch.arange(keys) < keys - 5)[None, None, None, :].expand(batch, 1, 1, keys)
    if kind == "float [b,h,r,L]":
        return torch.randn(batch, heads, rows, keys, generator=gen).to(dtype)
    raise ValueError(kind)


def reference(q, k, v, mask, scale):
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          scale=scale)


# bfloat16 tl.dot is wrong under the interpreter (numpy has no bfloat16): float16 stands in
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask_kind", ["none", "bool [b,1,r,L]", "bool [b,1,1,L] (a decode step's)",
                                       "float [b,h,r,L]"])
@pytest.mark.parametrize("batch,heads,rows,keys,dim,split", [
    (2, 3, 5, 77, 16, None),  # the default split, keys no multiple of the tile
    (1, 2, 16, 3 * BLOCK_L + 2, 32, BLOCK_L),  # 4 runs, the last of 2 keys
    (3, 1, 1, 200, 16, 2 * BLOCK_L),  # one row (R 1 padded to 16)
    (1, 1, 33, 40, 64, None),  # rows over 32 (padded to 64), one short run
])
def test_matches_sdpa(dtype, mask_kind, batch, heads, rows, keys, dim, split):
    q, k, v = qkv(batch, heads, rows, keys, dim, dtype, seed=rows + keys)
    mask = make_mask(mask_kind, batch, heads, rows, keys, dtype)
    assert decode_attention_applies(q, k, v, mask) is None
    out = decode_attention(q, k, v, mask, 0.3, split)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), reference(q, k, v, mask, 0.3), rtol=tol, atol=tol)


def test_strided_inputs_as_the_packing_leaves_them():
    # q a view of [b, s, h, d] transposed, k and v slices of a larger cache
    q = torch.randn(2, 1, 8, 32).transpose(1, 2).reshape(2, 2, 4, 32)
    cache = torch.randn(2, 2, 100, 32)
    k, v = cache[:, :, :90], torch.randn(2, 2, 90, 64)[..., ::2].contiguous()
    mask = (torch.arange(90) < 70)[None, None, None, :].expand(2, 1, 4, 90)
    out = decode_attention(q, k, v, mask, 32 ** -0.5, BLOCK_L)
    torch.testing.assert_close(out, reference(q, k, v, mask, 32 ** -0.5), rtol=1e-5, atol=1e-5)


def test_a_row_with_every_key_masked_is_zeros_not_nan():
    q, k, v = qkv(1, 2, 3, 130, 16, torch.float32)
    mask = torch.ones(1, 1, 3, 130, dtype=torch.bool)
    mask[:, :, 1] = False  # row 1 sees nothing, in every run
    out = decode_attention(q, k, v, mask, 0.25, BLOCK_L)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    keep = [0, 2]
    torch.testing.assert_close(out[:, :, keep], reference(q, k, v, mask, 0.25)[:, :, keep])


def test_keys_per_split_fills_the_programs_in_whole_tiles():
    assert keys_per_split(4, 1152, 264) == BLOCK_L  # B 1, 4 heads: 18 runs of one tile
    assert keys_per_split(64, 1152, 264) == 4 * BLOCK_L  # B 16: 5 runs (the last half) per head
    assert keys_per_split(512, 1152, 264) == 18 * BLOCK_L  # enough programs: one run
    assert keys_per_split(1, 10 ** 6, 264) % BLOCK_L == 0  # at most MAX_SPLITS runs
    assert keys_per_split(1, 10 ** 6, 264) * 128 >= 10 ** 6


@pytest.mark.parametrize("change, reason", [
    (lambda q, k, v, m: (q[:, :, :1].expand(2, 2, 65, 16).contiguous(), k, v, m), "65 query rows"),
    (lambda q, k, v, m: (q[..., :12], k[..., :12], v[..., :12], m), "head size 12"),
    (lambda q, k, v, m: (q, k.half(), v, m), "dtypes"),
    (lambda q, k, v, m: (q, k, v[:, :1], m), "do not match"),
    (lambda q, k, v, m: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v, m),
     "not contiguous"),
    (lambda q, k, v, m: (q, k, v, m.to(torch.int32)), "torch.int32 mask"),
    (lambda q, k, v, m: (q, k, v, m[None]), "5-D mask"),
])
def test_what_it_refuses_says_why(change, reason):
    q, k, v = qkv(2, 2, 4, 50, 16, torch.float32)
    mask = torch.ones(2, 1, 4, 50, dtype=torch.bool)
    assert reason in decode_attention_applies(*change(q, k, v, mask))


def test_the_op_off_cuda_is_sdpa():
    q, k, v = qkv(2, 2, 4, 50, 16, torch.float32)
    mask = make_mask("bool [b,1,r,L]", 2, 2, 4, 50, torch.float32)
    out = torch.ops.ditron.decode_attention(q, k, v, mask, 0.5)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5))
