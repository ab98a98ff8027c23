"""What the all-reduce kernels share beyond the flag protocol (flags.py): lamport's empty mark
and the norm of one row (the kernels: all_reduce_push.py, all_reduce_lamport.py).

Every rank's partial product P_q = a_q @ b_q (+ bias) [M, N] lies in rank q's symmetric data
buffer (written there by cuBLAS), reached through the peer-pointer table `data_table`. The result
on every rank is h = sum_q P_q (+ residual) and, with NORM, y = RMSNorm(h) * weight. Roundings
follow the reference op: the all-reduced sum is rounded to the dtype, then the residual is added
and rounded again (h), and y follows `ops.rms_norm_reference` (weight_in_fp32 or not).
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
    """What every all-reduce program starts from: its id, the number of programs, this call's
    epoch (the epoch words: flags.py) and the partial's element count (int32: the runtime keeps
    its buffers below 2**31 elements)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(epoch_ptr + 1)
    return pid, nprog, epoch, M * N


@triton.jit
def weighted(normed, w32, dtype: tl.constexpr, W_FP32: tl.constexpr):
    """y = the normalised h (fp32, a row or rows) times the weight (fp32, a row: broadcast over
    the rows) in `dtype`, in the roundings of ops.rms_norm_reference: once (weight_in_fp32), else
    the normalised h first, then its product with the weight."""
    if W_FP32:
        y = (normed * w32).to(dtype)
    else:
        y = (normed.to(dtype).to(tl.float32) * w32).to(dtype)
    return y


@triton.jit
def norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """y = RMSNorm(h) * weight for one row of h whose sum of squares is sum_sq. h was written by
    other programs: its loads skip this SM's L1 (.cg)."""
    base = row * N  # int32: the runtime keeps its buffers below 2**31 elements
    rstd = tl.rsqrt(sum_sq / N + eps)
    tl.debug_barrier()  # h of this row may have been stored by this program's threads
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        h = tl.load(h_ptr + base + cols, mask=mask, other=0.0, cache_modifier=".cg")
        h = h.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = weighted(h * rstd, w, y_ptr.dtype.element_ty, W_FP32)
        tl.store(y_ptr + base + cols, y, mask=mask)
