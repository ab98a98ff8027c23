"""What the all-reduce kernels (all_reduce_push.py, all_reduce_lamport.py) share beyond the flags
(flags.py): lamport's empty mark and the norm's rounding.

Rank q's partial P_q = a_q @ b_q (+ bias) [M, N] lies in its symmetric buffer (peer pointers:
`data_table`). Every rank computes h = sum_q P_q (+ residual) and, with NORM, y = RMSNorm(h) *
weight, in the reference's roundings: the sum rounded to the dtype, then the residual added and
rounded again; y as `rms_norm.rms_norm_reference`.
"""

import triton
import triton.language as tl

# lamport's empty mark (all_reduce_lamport.py): -0.0, the int16 view of bfloat16 / float16 -0.0
EMPTY_BITS = -32768
K_EMPTY_BITS = tl.constexpr(EMPTY_BITS)  # the same for the kernels (constexpr globals only)


@triton.jit
def is_empty(x):
    return x.to(tl.int16, bitcast=True) == K_EMPTY_BITS


@triton.jit
def sendable(x):
    """x with -0.0 (the empty mark) sent as +0.0."""
    return tl.where(is_empty(x), tl.zeros_like(x), x)


@triton.jit
def call_start(epoch_ptr, M, N):
    """(program id, programs, this call's epoch, the partial's elements: int32, as the runtime
    keeps its buffers below 2**31 elements)."""
    return tl.program_id(0), tl.num_programs(0), tl.load(epoch_ptr + 1), M * N


@triton.jit
def weighted(normed, w32, dtype: tl.constexpr, W_FP32: tl.constexpr):
    """y = normed (fp32 rows) * w32 (fp32, one row) in `dtype`, rounded as
    rms_norm.rms_norm_reference: once (W_FP32), else normed first, then the product."""
    if W_FP32:
        y = (normed * w32).to(dtype)
    else:
        y = (normed.to(dtype).to(tl.float32) * w32).to(dtype)
    return y
