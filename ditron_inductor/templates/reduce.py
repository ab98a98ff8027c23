"""The sums of the received partials, slot s holding rank s's partial of my rows: the
reduce-scatter's out = scale * the W slots' sum in fp32 (scale 1 for "sum", 1/W for "avg";
reduce_slots_kernel), and the copy-engine all-reduce's sum + residual + RMSNorm
(sum_slots_norm_kernel).
"""

import triton
import triton.language as tl

from .all_reduce import weighted
from .all_reduce_push import store_h


@triton.jit
def reduce_slots_kernel(src_ptr, out_ptr, n, slot_stride, world, scale, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.full([BLOCK], 0.0, tl.float32)
    ptrs = src_ptr + offs
    for _ in range(world):
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += slot_stride
    tl.store(out_ptr + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_slots_norm_kernel(slots_ptr, slot_stride, h_ptr, y_ptr, res_ptr, w_ptr, M, N, eps,
                          WORLD: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                          W_FP32: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The copy-engine all-reduce's end: ROWS whole rows a program (BLOCK_N >= N); h and y in
    the reference's roundings (templates/all_reduce.py), y from h's rounded values."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    idx = rows[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for q in tl.static_range(WORLD):
        acc += tl.load(slots_ptr + q * slot_stride + idx, mask=mask, other=0.0).to(tl.float32)
    h = store_h(h_ptr, res_ptr, idx, mask, acc.to(h_ptr.dtype.element_ty), HAS_RES)
    if NORM:
        h32 = tl.where(mask, h.to(tl.float32), 0.0)
        rstd = tl.rsqrt(tl.sum(h32 * h32, 1) / N + eps)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = weighted(h32 * rstd[:, None], w, y_ptr.dtype.element_ty, W_FP32)
        tl.store(y_ptr + idx, y, mask=mask)
