"""All-gather + GEMM: a persistent GEMM whose tiles wait for the chunk of A they read.

The gathered A [M, K] fills chunk by chunk while the kernel runs (chunk c, rows_per_chunk rows,
came from rank c; `flag_ptr[c] >= epoch`: it has landed). Each of NUM_PROGS programs walks tiles
pid, pid + NUM_PROGS, ... of a schedule that groups GROUP_M row-blocks for L2 reuse of B and
rotates the row-blocks to start at this rank's own chunk (local already), then follow the ring
order in which the others arrive. Before its K loop a tile waits for the chunks its rows span; a
per-program bitmask of chunks seen polls each flag at most once after it is set. WAIT=False: a
plain persistent GEMM.

`ag_gemm_kernel` loads through pointers (any strides; the fallback where TMA cannot take the
operands), `ag_gemm_tma_kernel` through TMA descriptors (16-byte aligned rows). The copy engine
or an earlier kernel writes A, so TMA's async-proxy reads need no proxy fence after the flag.
"""

import triton
import triton.language as tl

from .flags import wait_rows
from .schedule import ring_member

# Ceil-divisions and zero fills are written out: tl.cdiv and tl.zeros are not interpreted when
# triton was imported before TRITON_INTERPRET=1 was set (a test session that imported Inductor).


@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, first_m, GROUP_M: tl.constexpr):
    """Tile index of the schedule -> (row-block, column-block); row-blocks rotated by first_m."""
    num_in_group = GROUP_M * num_pid_n
    group_id = tile // num_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    vm = first_pid_m + (tile % num_in_group) % group_size_m
    pid_n = (tile % num_in_group) // group_size_m
    pid_m = ring_member(first_m, vm, num_pid_m)
    return pid_m, pid_n


# these change between calls: never specialise on them (epoch 1 would compile a second kernel)
_DYNAMIC = ["rows_per_chunk", "first_row", "epoch", "limit"]


@triton.jit(do_not_specialize=_DYNAMIC)
def ag_gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, flag_ptr, err_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    rows_per_chunk, first_row, epoch, limit,
    HAS_BIAS: tl.constexpr, WAIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_pid_m * num_pid_n
    first_m = (first_row + BLOCK_M - 1) // BLOCK_M % num_pid_m
    seen = tl.full([], 0, tl.int64)
    for tile in range(pid, num_tiles, NUM_PROGS):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, first_m, GROUP_M)
        row0 = pid_m * BLOCK_M
        if WAIT:
            seen = wait_rows(flag_ptr, seen, row0, tl.minimum(row0 + BLOCK_M, M), rows_per_chunk,
                             epoch, limit, err_ptr)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :] * stride_bn
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for kk in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            k_left = K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias[None, :].to(tl.float32)
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def tma_tile_product(a_desc, b_desc, row0, col0, k_tiles, B_TRANS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 tile A[row0:, :] @ B[:, col0:] through TMA descriptors (B^T [N, K] when
    B_TRANS): the K loop of every TMA GEMM template."""
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for kk in range(k_tiles):
        a = a_desc.load([row0, kk * BLOCK_K])
        if B_TRANS:
            b = b_desc.load([col0, kk * BLOCK_K]).T
        else:
            b = b_desc.load([kk * BLOCK_K, col0])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=_DYNAMIC)
def ag_gemm_tma_kernel(
    a_desc, b_desc, c_desc, bias_ptr, flag_ptr, err_ptr,
    M, N, K,
    rows_per_chunk, first_row, epoch, limit,
    HAS_BIAS: tl.constexpr, WAIT: tl.constexpr, B_TRANS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
):
    """Same schedule; A [M, K], B [K, N] (B^T [N, K] when B_TRANS) and C [M, N] through TMA
    descriptors (out-of-range rows/columns read as zero and are not stored)."""
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_pid_m * num_pid_n
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    first_m = (first_row + BLOCK_M - 1) // BLOCK_M % num_pid_m
    seen = tl.full([], 0, tl.int64)
    for tile in range(pid, num_tiles, NUM_PROGS):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, first_m, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        if WAIT:
            seen = wait_rows(flag_ptr, seen, row0, tl.minimum(row0 + BLOCK_M, M), rows_per_chunk,
                             epoch, limit, err_ptr)
        acc = tma_tile_product(a_desc, b_desc, row0, col0, k_tiles, B_TRANS, BLOCK_M, BLOCK_N,
                               BLOCK_K)
        if HAS_BIAS:
            offs_n = col0 + tl.arange(0, BLOCK_N)
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias[None, :].to(tl.float32)
        c_desc.store([row0, col0], acc.to(c_desc.dtype))
