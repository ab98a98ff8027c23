"""GEMM + all-reduce with overlap: a persistent GEMM that raises READY per finished row chunk.

C = A @ B (+ bias) goes into my symmetric buffer (the partial the all-reduce reads) on a grid
that leaves SMs to the push kernel beside it (templates/all_reduce_push.py, CHUNKED). Chunk c =
row-blocks [c * GROUP_M, (c + 1) * GROUP_M); ag_gemm.tile_coords' grouped order with GROUP_M =
one chunk keeps every program on one or two chunks, so chunks finish about in order (the push
waits for every chunk up to the one it needs: order is not required).

After its stores a tile counts itself in counts[c] (acquire-release at system scope, after a
barrier over the program's threads); the program that counts the chunk's last tile resets the
counter (no later tile of this call touches it; the next call's GEMM is queued after this
call's push) and raises READY[c] = epoch with release at system scope, for the peers' push
programs polling it over NVLink. A and B come in through TMA descriptors (B^T [N, K] when
B_TRANS); C is stored through pointers, whose stores the barrier and the release order (a TMA
store would complete asynchronously).
"""

import triton
import triton.language as tl

from .ag_gemm import tile_coords, tma_tile_product
from .flags import K_READY


@triton.jit(do_not_specialize=["M"])
def gemm_ready_kernel(a_desc, b_desc, c_ptr, bias_ptr, flags_ptr, counts_ptr, epoch_ptr,
                      M, N, K, HAS_BIAS: tl.constexpr, B_TRANS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr):
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr + 1)  # the current call's (advanced by the kernel beside it)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    for tile in range(pid, num_pid_m * num_pid_n, NUM_PROGS):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, 0, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = tma_tile_product(a_desc, b_desc, row0, col0, k_tiles, B_TRANS, BLOCK_M, BLOCK_N,
                               BLOCK_K)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias[None, :].to(tl.float32)
        tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
        tl.debug_barrier()  # every thread's stores, then the count that releases them
        chunk = pid_m // GROUP_M
        tiles = tl.minimum(GROUP_M, num_pid_m - chunk * GROUP_M) * num_pid_n
        counted = tl.atomic_add(counts_ptr + chunk, 1, sem="acq_rel", scope="sys")
        if counted == tiles - 1:
            tl.atomic_xchg(counts_ptr + chunk, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(flags_ptr + K_READY + chunk, epoch, sem="release", scope="sys")
