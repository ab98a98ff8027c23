"""Decode GEMM: out[M, N] = a[M, K] @ b[K, N] for a few rows (M <= 16), b a linear layer's weight
read as its transpose (b = W.t(), W [N, K] row-major, so b's K stride is 1).

A decode step's matmuls move the weights once and do almost no arithmetic: they are bound by
memory bandwidth. Each program owns BLOCK_N output columns, i.e. BLOCK_N rows of W, and walks K
in BLOCK_K slices, so every load is a run of contiguous weight bytes; a row of `a` is reused
across the program's BLOCK_N columns from L1/L2. With a single row (BLOCK_M == 1) the product is
a multiply and a row sum on CUDA cores (tl.dot needs 16 rows); with more rows, tl.dot with the
rows padded to BLOCK_M.
"""

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(a_ptr, b_ptr, out_ptr, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
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
