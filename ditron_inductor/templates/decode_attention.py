"""Decode attention: out[b, h] = softmax(q[b, h] k[b, h]^T * scale + mask) v[b, h] for a few query
rows (R <= 64) against a long key/value cache (L keys), split along the keys (flash decoding).

Bound by memory bandwidth, a decode step's attention needs every SM reading the cache, which one
program per (batch, key/value head) does not give at small batches. So each (batch, head) is
split into `splits` runs of keys: `decode_attention_split_kernel` computes each run's weighted
sum, row maxima and sums (online softmax over BLOCK_L-key tiles, tl.dot on the rows padded to
BLOCK_R); `decode_attention_combine_kernel` merges each row's runs. Fully masked rows get zeros.

The rows are a grouped-query head's packed query heads (lowering/gqa_packing.py): q [B, KV, R, D]
and k, v [B, KV, L, D], each with its last dimension contiguous; the mask (bool: True attends;
or float: added to the scores) is read through its strides, 0 where SDPA broadcasts it.
"""

import triton
import triton.language as tl


@triton.jit
def decode_attention_split_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, part_ptr, max_ptr, sum_ptr,
        KV, R, L, keys_per_split, scale,
        sq_b, sq_h, sq_r, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_h, sm_r, sm_l,
        HAS_MASK: tl.constexpr, BOOL_MASK: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, D: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = bh // KV
    h = bh % KV
    rows = tl.arange(0, BLOCK_R)
    dims = tl.arange(0, D)
    row_ok = rows < R
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_r + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    k_head = k_ptr + b.to(tl.int64) * sk_b + h * sk_h
    v_head = v_ptr + b.to(tl.int64) * sv_b + h * sv_h
    mask_rows = mask_ptr + b * sm_b + h * sm_h + rows[:, None] * sm_r
    row_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, L)
    for first in range(start, end, BLOCK_L):
        keys = first + tl.arange(0, BLOCK_L)
        key_ok = keys < end
        k = tl.load(k_head + keys[None, :].to(tl.int64) * sk_l + dims[:, None],
                    mask=key_ok[None, :], other=0.0)
        scores = tl.dot(q, k, input_precision=PRECISION) * scale
        if HAS_MASK:
            in_bounds = row_ok[:, None] & key_ok[None, :]
            bias = tl.load(mask_rows + keys[None, :] * sm_l, mask=in_bounds, other=0)
            if BOOL_MASK:
                scores = tl.where(bias != 0, scores, float("-inf"))
            else:
                scores += bias.to(tl.float32)
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all masked so far: no NaN
        rescale = tl.exp(row_max - shift)
        p = tl.exp(scores - shift[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)
        v = tl.load(v_head + keys[:, None].to(tl.int64) * sv_l + dims[None, :],
                    mask=key_ok[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
    slot = (bh * splits + split) * BLOCK_R + rows
    tl.store(part_ptr + slot[:, None].to(tl.int64) * D + dims[None, :], acc)
    tl.store(max_ptr + slot, row_max)
    tl.store(sum_ptr + slot, row_sum)


@triton.jit
def decode_attention_combine_kernel(
        part_ptr, max_ptr, sum_ptr, out_ptr, KV, R, splits, so_b, so_h, so_r,
        BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    bh = pid // R
    row = pid % R
    runs = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D)
    run_ok = runs < splits
    slot = (bh * splits + runs) * BLOCK_R + row
    run_max = tl.load(max_ptr + slot, mask=run_ok, other=float("-inf"))
    run_sum = tl.load(sum_ptr + slot, mask=run_ok, other=0.0)
    top = tl.max(run_max, 0)
    weight = tl.exp(run_max - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(weight * run_sum, 0)
    part = tl.load(part_ptr + slot[:, None].to(tl.int64) * D + dims[None, :],
                   mask=run_ok[:, None], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    b = bh // KV
    h = bh % KV
    tl.store(out_ptr + b * so_b + h * so_h + row * so_r + dims,
             out.to(out_ptr.dtype.element_ty))
