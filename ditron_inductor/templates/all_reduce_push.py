"""GEMM + all-reduce (+ residual + RMSNorm): the push kernel, a two-shot with no end barrier.

The partials P_q = a_q @ b_q (+ bias) [M, N] lie flat in the ranks' symmetric data buffers, as for
the kernels of all_reduce.py, cut into blocks of BLOCK elements. Block g is owned by rank g % W,
so block row i (blocks W*i .. W*i + W - 1, contiguous) holds one block of every rank, and every
row chunk of the GEMM holds blocks of every rank.

One launch per rank, P programs, all resident at once (P <= MAX_PROGS, fewer than the SMs):
1. REDUCE: program pid raises STARTED[pid][rank] on every rank (the GEMM before this kernel wrote
   my partial) and waits for STARTED[pid][q] of every rank q in my own flags: a barrier per
   program, whose waits poll local words (no NVLink round trip per poll, no word polled by more
   than one program). Then, for each of my blocks g = W*i + rank, i = pid, pid + P, ...
   sums the W partials in fp32, rounds to the dtype (the all-reduce's own rounding, as in the
   reference) and stores the sum into block g of every rank's buffer: a push, whose stores need
   no reply. Then it raises PUSHED[pid][rank] on every rank.
2. COPY: program pid waits for PUSHED[pid][q] of every rank q: block rows pid, pid + P, ... of my
   buffer then hold every owner's sums; it copies them to h, adding my residual.
3. NORMALISE (with NORM): every program raises LOCAL[pid] and waits for all my programs' LOCAL
   (h is whole), then normalises rows pid, pid + P, ... of h into y.
The last program through advances the epoch (epoch words as in all_reduce.py).

Per rank 2 (W-1)/W of the partial crosses NVLink, as in any two-shot, and a call waits on the
network twice (STARTED, PUSHED), with no end-of-call barrier: when my kernel ends, every rank's
program p has read my block of its own and pushed into my buffer (it raises PUSHED[p] on me only
after both), so the next call's GEMM may overwrite my buffer; and no rank pushes the next call's
sums before my next kernel raises STARTED. Each sum is computed once, by its owner, and
copied to every rank: all ranks get the same bits.

CHUNKED (prefill): the GEMM runs in row chunks on the main stream and READY[j] is raised after
chunk j; this kernel runs beside it on a side stream on a few SMs and, before a block, waits for
the chunk holding the block's last row (chunks complete in order on every rank).

REDUCE / COPY / NORMALISE are all on for GPUs. The interpreter runs one rank, and one program, at
a time: it launches each phase separately for every rank (producers before consumers).
"""

import triton
import triton.language as tl

from .all_reduce import (K_ERR_LOCAL, K_ERR_PUSHED, K_ERR_READY, K_ERR_STARTED, K_LOCAL,
                         K_MAX_PROGS, K_PUSHED, K_READY, K_STARTED, norm_row, wait_all,
                         wait_peers)
from .comm import peer_ptr

_DYNAMIC = ["M", "eps", "rank", "rows_per_chunk", "limit"]


@triton.jit
def normalise_rows(h_ptr, y_ptr, w_ptr, M, N, eps, W_FP32: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = RMSNorm(h) * weight for rows pid, pid + P, ... (h written by every program: .cg
    loads, which skip this SM's L1)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for row in range(pid, M, nprog):
        ss = tl.full([BLOCK_N], 0.0, tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            h = tl.load(h_ptr + row * N + cols, mask=cols < N, other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            ss += h * h
        norm_row(h_ptr, y_ptr, w_ptr, row, N, tl.sum(ss, 0), eps, W_FP32, BLOCK_N, CACHE=".cg")


@triton.jit(do_not_specialize=_DYNAMIC)
def push_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr,
                h_ptr, y_ptr, res_ptr, w_ptr, M, N, eps, rank, rows_per_chunk, limit,
                HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr,
                WORLD_P2: tl.constexpr, CHUNKED: tl.constexpr = False,
                REDUCE: tl.constexpr = True, COPY: tl.constexpr = True,
                NORMALISE: tl.constexpr = True):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(epoch_ptr + 1)
    dtype = h_ptr.dtype.element_ty
    numel = M * N  # int32: the runtime keeps 2 * M * N below 2**31
    block_rows = tl.cdiv(tl.cdiv(numel, BLOCK), WORLD)
    offs = tl.arange(0, BLOCK)
    ranks = tl.arange(0, WORLD_P2)
    peer_flags = tl.load(flag_table + ranks, mask=ranks < WORLD, other=0).to(
        tl.pointer_type(tl.int32))
    if REDUCE:
        if not CHUNKED:
            tl.atomic_xchg(peer_flags + K_STARTED + pid * WORLD + rank, epoch,
                           mask=ranks < WORLD, sem="release", scope="sys")
            wait_all(flags_ptr + K_STARTED + pid * WORLD + ranks, ranks < WORLD, epoch, limit,
                     err_ptr, K_ERR_STARTED)
            tl.debug_barrier()
        ready = 0  # CHUNKED: chunks [0, ready) are complete on every rank
        for i in range(pid, block_rows, nprog):
            start = (i * WORLD + rank) * BLOCK
            idx = start + offs
            mask = idx < numel
            if CHUNKED:
                need = ((tl.minimum(start + BLOCK, numel) - 1) // N) // rows_per_chunk
                if need >= ready:
                    wait_peers(flag_table, K_READY + need, epoch, limit, err_ptr, K_ERR_READY,
                               WORLD, WORLD_P2)
                    ready = need + 1
            acc = tl.zeros([BLOCK], tl.float32)
            for q in tl.static_range(WORLD):
                acc += tl.load(peer_ptr(data_table, q, dtype, True) + idx, mask=mask,
                               other=0.0).to(tl.float32)
            total = acc.to(dtype)
            for q in tl.static_range(WORLD):
                tl.store(peer_ptr(data_table, q, dtype, True) + idx, total, mask=mask)
        tl.debug_barrier()  # every thread's stores, then the signal that releases them
        tl.atomic_xchg(peer_flags + K_PUSHED + pid * WORLD + rank, epoch, mask=ranks < WORLD,
                       sem="release", scope="sys")
    if COPY:
        wait_all(flags_ptr + K_PUSHED + pid * WORLD + ranks, ranks < WORLD, epoch, limit,
                 err_ptr, K_ERR_PUSHED)
        tl.debug_barrier()
        mine = peer_ptr(data_table, rank, dtype, True)
        for i in range(pid, block_rows, nprog):
            for q in tl.static_range(WORLD):
                idx = (i * WORLD + q) * BLOCK + offs
                mask = idx < numel
                h = tl.load(mine + idx, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_RES:
                    res = tl.load(res_ptr + idx, mask=mask, other=0.0)
                    h = (h.to(tl.float32) + res.to(tl.float32)).to(dtype)
                tl.store(h_ptr + idx, h, mask=mask)
        if NORM:
            tl.debug_barrier()
            tl.atomic_xchg(flags_ptr + K_LOCAL + pid, epoch, sem="release", scope="gpu")
    if NORM and NORMALISE:
        progs = tl.arange(0, K_MAX_PROGS)
        wait_all(flags_ptr + K_LOCAL + progs, progs < nprog, epoch, limit, err_ptr, K_ERR_LOCAL)
        tl.debug_barrier()
        normalise_rows(h_ptr, y_ptr, w_ptr, M, N, eps, W_FP32, BLOCK_N)
    if (NORM and NORMALISE) or (not NORM and COPY):  # the phase that ends the call
        arrived = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == nprog - 1:
            tl.atomic_xchg(arrive_ptr, 0, sem="relaxed", scope="gpu")
            tl.store(epoch_ptr, epoch)
            tl.store(epoch_ptr + 1, epoch + 1)
