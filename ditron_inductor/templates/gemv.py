"""Decode GEMM: out[M, N] = a[M, K] @ b[K, N] for a few rows (M <= 16), b a linear layer's weight
read as its transpose (b = W.t(), W [N, K] row-major, so b's K stride is 1).

A decode step's matmuls are bound by memory bandwidth: they read the weights once and do little
arithmetic. Each program owns BLOCK_N output columns (rows of W) and walks K in BLOCK_K slices,
so every load is contiguous weight bytes; a's rows are reused across them from L1/L2. One row
(BLOCK_M == 1): a multiply and a row sum on CUDA cores (tl.dot needs 16 rows); more rows: tl.dot
on the rows padded to BLOCK_M. `gemv_group_kernel` runs two or three products of the same rows in
one launch: fewer launches and gaps between kernels.
"""

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(a_ptr, b_ptr, out_ptr, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _gemv_columns(a_ptr, b_ptr, out_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  stride_om, stride_on, tl.program_id(0), BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def gemv_group_kernel(a_ptr, b0_ptr, b1_ptr, b2_ptr, out0_ptr, out1_ptr, out2_ptr,
                      M, N0, N1, N2, K, programs0, programs1, stride_am, stride_ak,
                      stride_b0k, stride_b0n, stride_b1k, stride_b1n, stride_b2k, stride_b2n,
                      stride_o0m, stride_o1m, stride_o2m,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Up to three products of the same rows `a` (a decode step's q/k/v, or gate/up) in one
    launch: programs [0, programs0) compute a @ b0, the next programs1 a @ b1, the rest a @ b2
    (N2 0 where there are two). Outputs are row-major."""
    pid = tl.program_id(0)
    if pid < programs0:
        _gemv_columns(a_ptr, b0_ptr, out0_ptr, M, N0, K, stride_am, stride_ak, stride_b0k,
                      stride_b0n, stride_o0m, 1, pid, BLOCK_M, BLOCK_N, BLOCK_K)
    elif pid < programs0 + programs1:
        _gemv_columns(a_ptr, b1_ptr, out1_ptr, M, N1, K, stride_am, stride_ak, stride_b1k,
                      stride_b1n, stride_o1m, 1, pid - programs0, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        _gemv_columns(a_ptr, b2_ptr, out2_ptr, M, N2, K, stride_am, stride_ak, stride_b2k,
                      stride_b2n, stride_o2m, 1, pid - programs0 - programs1, BLOCK_M, BLOCK_N,
                      BLOCK_K)


@triton.jit
def _gemv_columns(a_ptr, b_ptr, out_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, pid_n,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Output columns [pid_n * BLOCK_N, + BLOCK_N) of a @ b."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn  # [BLOCK_N, 1]: W's rows
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(b_cols + k[None, :] * stride_bk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)[None, :]
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
