"""GEMM + all-reduce (+ residual + RMSNorm): the push kernels, all-reduces with no end barrier.

push_kernel (push, and push_scatter with SCATTER): a two-shot. The partials P_q = a_q @ b_q
(+ bias) [M, N] lie flat in the first half of the ranks' symmetric data buffers (all_reduce.py
has what the kernels share), cut into blocks of BLOCK elements. Block g is owned by rank g % W, so
block row i (blocks W*i .. W*i + W - 1, contiguous) holds one block of every rank, and every row
chunk of the GEMM holds blocks of every rank.

One launch per rank, P programs, all resident at once (P <= MAX_PROGS, fewer than the SMs):
1. SEND: program pid raises STARTED[pid][rank] on every rank (the GEMM before this kernel wrote
   my partial). With SCATTER it first stores my partial of each block of its block rows into the
   block's owner's slot for me (slot (W*i + rank) of the owner's second half, at `slots`).
2. REDUCE: program pid waits for STARTED[pid][q] of every rank q in my own flags: a barrier per
   program, whose waits poll local words (no NVLink round trip per poll, no word polled by more
   than one program). Then, for each of my blocks g = W*i + rank, i = pid, pid + P, ...
   sums the W partials in fp32 (read from the peers' buffers, or with SCATTER from my own
   slots: no network read), rounds to the dtype (the all-reduce's own rounding, as in the
   reference) and stores the sum into block g of every other rank's buffer: a push, whose
   stores need no reply. My own block it finishes from registers: h = sum + my residual (and y,
   below), with no round trip through my buffer (not CHUNKED: there the sums go into my buffer
   too, for the COPY launch on every SM). Then it raises PUSHED[pid][rank] on every rank.
3. COPY: program pid waits for PUSHED[pid][q] of every rank q: block rows pid, pid + P, ... of my
   buffer then hold the other owners' sums; it copies them to h, adding my residual (each rank
   its own residual: h is the reference's on every rank, whatever the residuals).
4. NORMALISE (with NORM): every program raises LOCAL[pid] and waits for all my programs' LOCAL
   (h is whole), then normalises rows pid, pid + P, ... of h into y. Where a block holds whole
   rows (ROW_BLOCK = N, a power of two dividing BLOCK), REDUCE and COPY normalise each block's
   rows as they write them instead: no second pass over h, no barrier. At world size 1 that is
   4 passes of M x N after the GEMM (read the partial and the residual, write h and y), as
   Inductor's residual + norm kernel makes (CHUNKED: 6); 1/W of the sums skip my buffer at
   world size W.
The last program through advances the epoch (the epoch words: all_reduce.py).

Per rank 2 (W-1)/W of the partial crosses NVLink (push: once each way; push_scatter: twice
outwards), and a call waits on the network twice (STARTED, PUSHED), with no end-of-call barrier:
- my first half: every rank's program p has read my block of its own and pushed into my buffer
  before it raises PUSHED[p] on me, so when my kernel ends the next call's GEMM may overwrite my
  buffer; and no rank pushes the next call's sums before my next kernel raises STARTED;
- my slots (SCATTER): a peer stores into them in its next call before any wait, but it has seen
  my PUSHED of this call, raised after I read them; the slots sit at a fixed offset (half the
  buffer), so the copy-out of a larger M in this call never shares words with them.
Each sum is computed once, by its owner, and copied to every rank: all ranks get the same bits.

Phases may run as separate launches of one call (the same BLOCK): push_progs = the programs of
the launch that ran REDUCE; a launch that runs COPY without it has a multiple of that many (its
block rows pid, pid + P, ... were all pushed by program pid % push_progs of every rank).

CHUNKED (prefill): the GEMM runs beside this kernel, which runs on a few SMs on a side stream:
cuBLAS in row chunks on the main stream, READY[j] raised after chunk j, or the persistent GEMM of
templates/gemm_ready.py, which raises READY[j] when chunk j's last tile is stored. Before a
block, a program waits for every chunk up to the one holding the block's last row that it has
not yet seen (the persistent GEMM finishes chunks only about in order). No SEND; COPY and
NORMALISE run in a second launch on the main stream once the GEMM is done, on every SM.

push_all_kernel (push_all, the smallest M): a one-shot with one network wait. The buffer holds
the partial, then 2 W slots of `stride` elements (fixed per context): the slots of epoch parity
e % 2, one per sender.
1. SEND: program pid stores blocks pid, pid + P, ... of my partial into my slot on every rank,
   then raises STARTED[pid][rank] on every rank.
2. REDUCE: it waits for STARTED[pid][q] of every rank, sums its blocks over my W slots (local
   reads), adds my residual and writes h. 3. NORMALISE as above.
W - 1 partials leave each rank, against the two-shot's 2 (W-1)/W of one, so it wins only where
latency rules (M <= 8 on 8x H200). Slots of the same parity are written again two calls later:
by then every rank has raised STARTED in the call between, which it does only after finishing
the call that read them. A context of its own (runtime/all_reduce.py): that argument holds only
between calls of this kernel.

The phases are all on for GPUs. The interpreter runs one rank, and one program, at a time: it
launches each phase separately for every rank (producers before consumers).
"""

import triton
import triton.language as tl

from .all_reduce import call_start, norm_row, sendable, weighted
from .flags import (K_ERR_LOCAL, K_ERR_PUSHED, K_ERR_STARTED, K_LOCAL, K_MAX_PROGS, K_PUSHED,
                    K_STARTED, finish_call, peer_ptr, wait_all, wait_chunks_through)
from .schedule import owned_block

_DYNAMIC = ["M", "eps", "rank", "rows_per_chunk", "push_progs", "limit"]  # `slots` is specialised
# (on divisibility by 16, so that loads from the slots stay 16-byte vectors): one value per context


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
        norm_row(h_ptr, y_ptr, w_ptr, row, N, tl.sum(ss, 0), eps, W_FP32, BLOCK_N)


@triton.jit
def rows_written(flags_ptr, epoch):
    """Raise LOCAL[pid]: this program's share of h is written (after every thread's stores)."""
    tl.debug_barrier()
    tl.atomic_xchg(flags_ptr + K_LOCAL + tl.program_id(0), epoch, sem="release", scope="gpu")


@triton.jit
def normalise_when_written(h_ptr, y_ptr, w_ptr, flags_ptr, M, N, eps, epoch, limit, err_ptr,
                           W_FP32: tl.constexpr, BLOCK_N: tl.constexpr):
    """Wait for every program's LOCAL (h is whole: a barrier over this GPU's programs), then
    normalise rows pid, pid + P, ... of h into y."""
    progs = tl.arange(0, K_MAX_PROGS)
    wait_all(flags_ptr + K_LOCAL + progs, progs < tl.num_programs(0), epoch, limit, err_ptr,
             K_ERR_LOCAL)
    tl.debug_barrier()
    normalise_rows(h_ptr, y_ptr, w_ptr, M, N, eps, W_FP32, BLOCK_N)


@triton.jit
def store_h(h_ptr, res_ptr, idx, mask, s, HAS_RES: tl.constexpr):
    """h = the all-reduced s (+ my residual, added in fp32 and rounded, as the reference); h's
    values are returned."""
    if HAS_RES:
        res = tl.load(res_ptr + idx, mask=mask, other=0.0)
        s = (s.to(tl.float32) + res.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + idx, s, mask=mask)
    return s


@triton.jit
def store_h_and_y(h_ptr, y_ptr, res_ptr, w_ptr, idx, mask, s, eps, HAS_RES: tl.constexpr,
                  W_FP32: tl.constexpr, BLOCK: tl.constexpr, ROW: tl.constexpr):
    """h as store_h, and y = RMSNorm(h) * weight, for a block of whole rows of ROW (= N)
    elements: the copy-out and the norm in one pass over the block, from registers (no second
    read of h, no barrier over the programs). The roundings are norm_row's."""
    h = store_h(h_ptr, res_ptr, idx, mask, s, HAS_RES)
    rows = tl.reshape(h.to(tl.float32), [BLOCK // ROW, ROW])
    rstd = tl.rsqrt(tl.sum(rows * rows, 1) / ROW + eps)
    w = tl.load(w_ptr + tl.arange(0, ROW)).to(tl.float32)
    y = weighted(rows * rstd[:, None], w, y_ptr.dtype.element_ty, W_FP32)
    tl.store(y_ptr + tl.reshape(idx, [BLOCK // ROW, ROW]), y,
             mask=tl.reshape(mask, [BLOCK // ROW, ROW]))


@triton.jit
def finish_block(h_ptr, y_ptr, res_ptr, w_ptr, idx, mask, s, eps, HAS_RES: tl.constexpr,
                 NORM: tl.constexpr, W_FP32: tl.constexpr, BLOCK: tl.constexpr,
                 ROW_BLOCK: tl.constexpr):
    """A block of all-reduced sums s into h (+ residual), and where the block holds whole rows
    (ROW_BLOCK) into y too."""
    if NORM and ROW_BLOCK > 0:
        store_h_and_y(h_ptr, y_ptr, res_ptr, w_ptr, idx, mask, s, eps, HAS_RES, W_FP32, BLOCK,
                      ROW_BLOCK)
    else:
        store_h(h_ptr, res_ptr, idx, mask, s, HAS_RES)


@triton.jit
def end_of_call(h_ptr, y_ptr, w_ptr, flags_ptr, arrive_ptr, epoch_ptr, M, N, eps, epoch, limit,
                err_ptr, WROTE_H: tl.constexpr, NORM: tl.constexpr, NORMALISE: tl.constexpr,
                W_FP32: tl.constexpr, BLOCK_N: tl.constexpr):
    """What every all-reduce kernel does once this program's rows of h are written (WROTE_H:
    the phase that wrote them ran): with NORM, raise LOCAL and (NORMALISE) normalise after the
    barrier over this GPU's programs; the phase that ends the call advances the epoch."""
    if WROTE_H and NORM:
        rows_written(flags_ptr, epoch)
    if NORM and NORMALISE:
        normalise_when_written(h_ptr, y_ptr, w_ptr, flags_ptr, M, N, eps, epoch, limit, err_ptr,
                               W_FP32, BLOCK_N)
    if (NORM and NORMALISE) or (not NORM and WROTE_H):
        finish_call(arrive_ptr, epoch_ptr, epoch)


@triton.jit(do_not_specialize=_DYNAMIC)
def push_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr,
                h_ptr, y_ptr, res_ptr, w_ptr, M, N, eps, rank, rows_per_chunk, push_progs, slots,
                limit,
                HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr,
                WORLD_P2: tl.constexpr, CHUNKED: tl.constexpr = False,
                SCATTER: tl.constexpr = False, SEND: tl.constexpr = True,
                REDUCE: tl.constexpr = True, COPY: tl.constexpr = True,
                NORMALISE: tl.constexpr = True, ROW_BLOCK: tl.constexpr = 0):
    pid, nprog, epoch, numel = call_start(epoch_ptr, M, N)
    # REDUCE finishes my own blocks (`own`) where the launch runs COPY on the same programs:
    # not beside the GEMM (CHUNKED), whose few programs would then carry all of a world-1 norm
    if CHUNKED:
        own = -1  # no rank's blocks: the sums go into every buffer, COPY finishes them all
    else:
        own = rank
    dtype = h_ptr.dtype.element_ty
    block_rows = tl.cdiv(tl.cdiv(numel, BLOCK), WORLD)
    offs = tl.arange(0, BLOCK)
    ranks = tl.arange(0, WORLD_P2)
    peer_flags = tl.load(flag_table + ranks, mask=ranks < WORLD, other=0).to(
        tl.pointer_type(tl.int32))
    mine = peer_ptr(data_table, rank, dtype, True)
    if SEND and not CHUNKED:
        if SCATTER:  # my partial of each block of my block rows, into its owner's slot for me
            for i in range(pid, block_rows, nprog):
                for q in tl.static_range(WORLD):
                    idx = owned_block(i, q, WORLD) * BLOCK + offs
                    part = tl.load(mine + idx, mask=idx < numel, other=0.0)
                    tl.store(peer_ptr(data_table, q, dtype, True) + slots
                             + (i * WORLD + rank) * BLOCK + offs, part, mask=idx < numel)
            tl.debug_barrier()  # every thread's stores, then the signal that releases them
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
                if SCATTER:  # rank q's partial of block g, pushed into my slot for q
                    part = tl.load(mine + slots + (i * WORLD + q) * BLOCK + offs, mask=mask,
                                   other=0.0, cache_modifier=".cg")
                else:
                    part = tl.load(peer_ptr(data_table, q, dtype, True) + idx, mask=mask,
                                   other=0.0)
                acc += part.to(tl.float32)
            total = acc.to(dtype)
            for q in tl.static_range(WORLD):
                tl.store(peer_ptr(data_table, q, dtype, True) + idx, total,
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
    # ROW_BLOCK: REDUCE and COPY normalised their rows themselves, no NORMALISE phase (nor its
    # barrier) follows
    end_of_call(h_ptr, y_ptr, w_ptr, flags_ptr, arrive_ptr, epoch_ptr, M, N, eps, epoch, limit,
                err_ptr, COPY, NORM and ROW_BLOCK == 0, NORMALISE, W_FP32, BLOCK_N)


@triton.jit
def send_partial_to_all(data_table, mine, call_slots, rank, stride, numel, MARKED: tl.constexpr,
                        BLOCK: tl.constexpr, WORLD: tl.constexpr):
    """The one-shots' SEND (push_all, lamport_all): blocks pid, pid + P, ... of my partial into
    my slot of this call's slots on every rank, mine included. MARKED: -0.0 (lamport's empty
    mark) is sent as +0.0."""
    dtype = mine.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    for b in range(tl.program_id(0), tl.cdiv(numel, BLOCK), tl.num_programs(0)):
        idx = b * BLOCK + offs
        part = tl.load(mine + idx, mask=idx < numel, other=0.0)
        if MARKED:
            part = sendable(part)
        for q in tl.static_range(WORLD):
            tl.store(peer_ptr(data_table, q, dtype, True) + call_slots + rank * stride + idx,
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
    mine = peer_ptr(data_table, rank, dtype, True)
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
