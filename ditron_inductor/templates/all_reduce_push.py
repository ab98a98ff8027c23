"""GEMM + all-reduce (+ residual + RMSNorm): the push kernels, all-reduces with no end barrier.

push_kernel (push), a two-shot. The partials [M, N] lie flat in the ranks' symmetric buffers in
blocks of BLOCK elements; block g is owned by rank g % W, so block row i (blocks W*i .. W*i +
W - 1) and every row chunk of the GEMM hold blocks of every rank. P programs a rank, all
resident (P <= MAX_PROGS, fewer than the SMs):
1. SEND: program pid raises STARTED[pid][rank] on every rank (the GEMM before wrote my partial).
2. REDUCE: it waits for STARTED[pid][q] of every q in my own flags: a barrier per program whose
   polls are local (no NVLink round trip per poll, no word polled by two programs). For each of
   my blocks g = W*i + rank, i = pid, pid + P, ...: the W partials summed in fp32, rounded to
   the dtype (the reference's rounding) and pushed into block g of every other rank (stores need
   no reply); my own block goes from registers to h (not CHUNKED). Then PUSHED[pid][rank] on
   every rank.
3. COPY: it waits for PUSHED[pid][q] of every q, then copies the other owners' sums in block rows
   pid, pid + P, ... to h, adding my residual (each rank its own: h is the reference's).
4. NORMALISE (NORM): every program raises LOCAL[pid] and waits for all my programs' LOCAL, then
   normalises rows pid, pid + P, ... into y. Where a block holds whole rows (ROW_BLOCK = N, a
   power of two dividing BLOCK), REDUCE and COPY normalise as they write: no second pass, no
   barrier.
The last program through advances the epoch. No end barrier: every rank's program p has read its
block of my buffer and pushed into it before it raises PUSHED[p] on me, so after my kernel the
next GEMM may overwrite my buffer, and no rank pushes the next call's sums before my next
STARTED. Each sum is computed once, by its owner: all ranks get the same bits.

Phases may run as separate launches of one call (the same BLOCK): push_progs is the REDUCE
launch's program count, and a COPY launch has a multiple of it.

CHUNKED (prefill): REDUCE runs on a few SMs on a side stream beside the GEMM (cuBLAS in row
chunks raising READY[j] after chunk j, or templates/gemm_ready.py's persistent GEMM raising it
once chunk j's last tile is stored). Before a block, a program waits for every chunk it has not
yet seen through the one holding the block's last row (the persistent GEMM finishes chunks only
about in order). No SEND; COPY and NORMALISE follow in a second launch on every SM.

push_all_kernel (push_all, the smallest M), a one-shot with one network wait: after the partial,
2 W slots of `stride` elements, W per epoch parity. SEND: program pid stores its blocks of my
partial into my slot on every rank, then raises STARTED[pid][rank] on every rank. REDUCE: after
STARTED[pid][q] of every q, it sums its blocks over my W slots (local reads), adds my residual,
writes h. Each rank sends W - 1 partials (the two-shot 2 (W-1)/W of one): it wins only where
latency rules. A parity's slots are written again two calls later, by a rank that raised
STARTED in the call between, after finishing the call that read them; that holds only between
calls of this kernel, hence its own context.

The interpreter runs one rank and one program at a time, so its tests launch each phase
separately for every rank, producers before consumers.
"""

import triton
import triton.language as tl

from .all_reduce import call_start, sendable, weighted
from .flags import (K_ERR_LOCAL, K_ERR_PUSHED, K_ERR_STARTED, K_LOCAL, K_MAX_PROGS, K_PUSHED,
                    K_STARTED, finish_call, peer_ptr, wait_all, wait_chunks_through)
from .schedule import owned_block

# push_all's `slots` and `stride` stay specialised (divisible by 16: the slots' loads stay
# 16-byte vectors); they take one value per context
_DYNAMIC = ["M", "eps", "rank", "rows_per_chunk", "push_progs", "limit"]


@triton.jit
def normalise_rows(h_ptr, y_ptr, w_ptr, M, N, eps, W_FP32: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = RMSNorm(h) * weight for rows pid, pid + P, ..., two passes over each row (every
    program wrote h: its loads skip this SM's L1, .cg)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for row in range(pid, M, nprog):
        ss = tl.full([BLOCK_N], 0.0, tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            h = tl.load(h_ptr + row * N + cols, mask=cols < N, other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            ss += h * h
        rstd = tl.rsqrt(tl.sum(ss, 0) / N + eps)
        tl.debug_barrier()  # h of this row may have been stored by this program's threads
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            h = tl.load(h_ptr + row * N + cols, mask=cols < N, other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            y = weighted(h * rstd, w, y_ptr.dtype.element_ty, W_FP32)
            tl.store(y_ptr + row * N + cols, y, mask=cols < N)


@triton.jit
def store_h(h_ptr, res_ptr, idx, mask, s, HAS_RES: tl.constexpr):
    """h = the all-reduced s (+ my residual, added in fp32 and rounded, as the reference);
    returns h's values."""
    if HAS_RES:
        res = tl.load(res_ptr + idx, mask=mask, other=0.0)
        s = (s.to(tl.float32) + res.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + idx, s, mask=mask)
    return s


@triton.jit
def finish_block(h_ptr, y_ptr, res_ptr, w_ptr, idx, mask, s, eps, HAS_RES: tl.constexpr,
                 NORM: tl.constexpr, W_FP32: tl.constexpr, BLOCK: tl.constexpr,
                 ROW_BLOCK: tl.constexpr):
    """Sums s into h (+ residual); where the block holds whole rows of ROW_BLOCK (= N) elements,
    y = RMSNorm(h) * weight too, in one pass from registers (normalise_rows' roundings)."""
    h = store_h(h_ptr, res_ptr, idx, mask, s, HAS_RES)
    if NORM and ROW_BLOCK > 0:
        rows = tl.reshape(h.to(tl.float32), [BLOCK // ROW_BLOCK, ROW_BLOCK])
        rstd = tl.rsqrt(tl.sum(rows * rows, 1) / ROW_BLOCK + eps)
        w = tl.load(w_ptr + tl.arange(0, ROW_BLOCK)).to(tl.float32)
        y = weighted(rows * rstd[:, None], w, y_ptr.dtype.element_ty, W_FP32)
        tl.store(y_ptr + tl.reshape(idx, [BLOCK // ROW_BLOCK, ROW_BLOCK]), y,
                 mask=tl.reshape(mask, [BLOCK // ROW_BLOCK, ROW_BLOCK]))


@triton.jit
def end_of_call(h_ptr, y_ptr, w_ptr, flags_ptr, arrive_ptr, epoch_ptr, M, N, eps, epoch, limit,
                err_ptr, WROTE_H: tl.constexpr, NORM: tl.constexpr, NORMALISE: tl.constexpr,
                W_FP32: tl.constexpr, BLOCK_N: tl.constexpr):
    """Once this program's rows of h are written (WROTE_H: that phase ran): with NORM raise
    LOCAL[pid] and (NORMALISE) normalise once every program's LOCAL says h is whole; the call's
    last phase advances the epoch."""
    if WROTE_H and NORM:
        tl.debug_barrier()  # every thread's stores, then the flag that releases them
        tl.atomic_xchg(flags_ptr + K_LOCAL + tl.program_id(0), epoch, sem="release", scope="gpu")
    if NORM and NORMALISE:
        progs = tl.arange(0, K_MAX_PROGS)
        wait_all(flags_ptr + K_LOCAL + progs, progs < tl.num_programs(0), epoch, limit, err_ptr,
                 K_ERR_LOCAL)
        tl.debug_barrier()
        normalise_rows(h_ptr, y_ptr, w_ptr, M, N, eps, W_FP32, BLOCK_N)
    if (NORM and NORMALISE) or (not NORM and WROTE_H):
        finish_call(arrive_ptr, epoch_ptr, epoch)


@triton.jit(do_not_specialize=_DYNAMIC)
def push_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr,
                h_ptr, y_ptr, res_ptr, w_ptr, M, N, eps, rank, rows_per_chunk, push_progs, limit,
                HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr,
                WORLD_P2: tl.constexpr, CHUNKED: tl.constexpr = False,
                SEND: tl.constexpr = True,
                REDUCE: tl.constexpr = True, COPY: tl.constexpr = True,
                NORMALISE: tl.constexpr = True, ROW_BLOCK: tl.constexpr = 0):
    pid, nprog, epoch, numel = call_start(epoch_ptr, M, N)
    # REDUCE finishes my own blocks from registers, except beside the GEMM (CHUNKED), whose few
    # programs would then carry all of a world-1 norm: there the sums go into every buffer
    own = -1 if CHUNKED else rank
    dtype = h_ptr.dtype.element_ty
    block_rows = tl.cdiv(tl.cdiv(numel, BLOCK), WORLD)
    offs = tl.arange(0, BLOCK)
    ranks = tl.arange(0, WORLD_P2)
    peer_flags = tl.load(flag_table + ranks, mask=ranks < WORLD, other=0).to(
        tl.pointer_type(tl.int32))
    mine = peer_ptr(data_table, rank, dtype)
    if SEND and not CHUNKED:
        tl.atomic_xchg(peer_flags + K_STARTED + pid * WORLD + rank, epoch,
                       mask=ranks < WORLD, sem="release", scope="sys")
    if REDUCE:
        if not CHUNKED:
            wait_all(flags_ptr + K_STARTED + pid * WORLD + ranks, ranks < WORLD, epoch, limit,
                     err_ptr, K_ERR_STARTED)
            tl.debug_barrier()
        ready = 0  # CHUNKED: chunks [0, ready) are complete on every rank
        for i in range(pid, block_rows, nprog):
            start = owned_block(i, rank, WORLD) * BLOCK
            idx = start + offs
            mask = idx < numel
            if CHUNKED:
                ready = wait_chunks_through(flag_table, ready, tl.minimum(start + BLOCK, numel) - 1,
                                            N, rows_per_chunk, epoch, limit, err_ptr, WORLD,
                                            WORLD_P2)
            acc = tl.zeros([BLOCK], tl.float32)
            for q in tl.static_range(WORLD):
                part = tl.load(peer_ptr(data_table, q, dtype) + idx, mask=mask, other=0.0)
                acc += part.to(tl.float32)
            total = acc.to(dtype)
            for q in tl.static_range(WORLD):
                tl.store(peer_ptr(data_table, q, dtype) + idx, total,
                         mask=mask & (offs * 0 + q != own))
            if not CHUNKED:  # my own block, from registers
                finish_block(h_ptr, y_ptr, res_ptr, w_ptr, idx, mask, total, eps, HAS_RES, NORM,
                             W_FP32, BLOCK, ROW_BLOCK)
        tl.debug_barrier()  # every thread's stores, then the signal that releases them
        tl.atomic_xchg(peer_flags + K_PUSHED + pid * WORLD + rank, epoch, mask=ranks < WORLD,
                       sem="release", scope="sys")
    if COPY:  # block rows pid, pid + P, ... were pushed by program pid % push_progs of each rank
        wait_all(flags_ptr + K_PUSHED + (pid % push_progs) * WORLD + ranks, ranks < WORLD, epoch,
                 limit, err_ptr, K_ERR_PUSHED)
        tl.debug_barrier()
        for i in range(pid, block_rows, nprog):
            for q in tl.static_range(WORLD):  # all but my own blocks, finished by REDUCE
                idx = owned_block(i, q, WORLD) * BLOCK + offs
                mask = (idx < numel) & (offs * 0 + q != own)
                s = tl.load(mine + idx, mask=mask, other=0.0, cache_modifier=".cg")
                finish_block(h_ptr, y_ptr, res_ptr, w_ptr, idx, mask, s, eps, HAS_RES, NORM,
                             W_FP32, BLOCK, ROW_BLOCK)
    # ROW_BLOCK: REDUCE and COPY normalised their rows, no NORMALISE phase follows
    end_of_call(h_ptr, y_ptr, w_ptr, flags_ptr, arrive_ptr, epoch_ptr, M, N, eps, epoch, limit,
                err_ptr, COPY, NORM and ROW_BLOCK == 0, NORMALISE, W_FP32, BLOCK_N)


@triton.jit
def send_partial_to_all(data_table, mine, call_slots, rank, stride, numel, MARKED: tl.constexpr,
                        BLOCK: tl.constexpr, WORLD: tl.constexpr):
    """The one-shots' SEND: blocks pid, pid + P, ... of my partial into my slot of this call's
    slots on every rank, mine included. MARKED (lamport_all): -0.0 sent as +0.0."""
    dtype = mine.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    for b in range(tl.program_id(0), tl.cdiv(numel, BLOCK), tl.num_programs(0)):
        idx = b * BLOCK + offs
        part = tl.load(mine + idx, mask=idx < numel, other=0.0)
        if MARKED:
            part = sendable(part)
        for q in tl.static_range(WORLD):
            tl.store(peer_ptr(data_table, q, dtype) + call_slots + rank * stride + idx,
                     part, mask=idx < numel)


@triton.jit(do_not_specialize=_DYNAMIC)
def push_all_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr,
                    h_ptr, y_ptr, res_ptr, w_ptr, M, N, eps, rank, slots, stride, limit,
                    HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr,
                    WORLD_P2: tl.constexpr, SEND: tl.constexpr = True,
                    REDUCE: tl.constexpr = True, NORMALISE: tl.constexpr = True,
                    ROW_BLOCK: tl.constexpr = 0):
    """The one-wait all-reduce for the smallest M (see the module doc, push_all)."""
    pid, nprog, epoch, numel = call_start(epoch_ptr, M, N)
    dtype = h_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    ranks = tl.arange(0, WORLD_P2)
    mine = peer_ptr(data_table, rank, dtype)
    call_slots = slots + (epoch % 2) * WORLD * stride  # this call's half of the slots
    if SEND:
        send_partial_to_all(data_table, mine, call_slots, rank, stride, numel, False, BLOCK,
                            WORLD)
        tl.debug_barrier()  # every thread's stores, then the signal that releases them
        peer_flags = tl.load(flag_table + ranks, mask=ranks < WORLD, other=0).to(
            tl.pointer_type(tl.int32))
        tl.atomic_xchg(peer_flags + K_STARTED + pid * WORLD + rank, epoch, mask=ranks < WORLD,
                       sem="release", scope="sys")
    if REDUCE:  # once every rank's same program has sent: sum my slots, add my residual
        wait_all(flags_ptr + K_STARTED + pid * WORLD + ranks, ranks < WORLD, epoch, limit,
                 err_ptr, K_ERR_STARTED)
        tl.debug_barrier()
        for b in range(pid, tl.cdiv(numel, BLOCK), nprog):
            idx = b * BLOCK + offs
            mask = idx < numel
            acc = tl.zeros([BLOCK], tl.float32)
            for q in tl.static_range(WORLD):
                acc += tl.load(mine + call_slots + q * stride + idx, mask=mask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
            finish_block(h_ptr, y_ptr, res_ptr, w_ptr, idx, mask, acc.to(dtype), eps, HAS_RES,
                         NORM, W_FP32, BLOCK, ROW_BLOCK)
    end_of_call(h_ptr, y_ptr, w_ptr, flags_ptr, arrive_ptr, epoch_ptr, M, N, eps, epoch, limit,
                err_ptr, REDUCE, NORM and ROW_BLOCK == 0, NORMALISE, W_FP32, BLOCK_N)
