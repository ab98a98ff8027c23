"""GEMM + all-reduce (+ residual + RMSNorm): the lamport kernels, a two-shot and a one-shot with
no flags.

Data that carries its own arrival: every receive word starts as the empty mark (-0.0, only the
sign bit set), a sender sends +0.0 in place of -0.0 (it sums the same), and a receiver polls the
data until no mark is left, then marks the words empty again. Each step costs one NVLink one-way
latency, where push (all_reduce_push.py) pays a flag barrier, a network read and a fence per flag.

lamport_kernel: five regions of `stride` elements (fixed per context): the partial (read only
locally), the scatter slots of epoch parity 0 and 1, the sums of parity 0 and 1. Blocks, owners
and each program's block rows as in push. SEND: my partial of block W*i + q into rank q's
scatter slot W*i + rank. REDUCE: poll my slots of block row i until every rank's part is there,
sum in fp32, round, store into block W*i + rank of every rank's sums. COPY: poll my sums of
block row i until every owner's block is there, write h (+ my residual). NORMALISE as in push.
A region of parity p is written again two calls later: a peer starts call e + 2 only after my
call e + 1 sent to it, which follows my call e, whose reads marked the region empty. So nothing
waits at the end of a call and nothing is reset. Each sum is computed once, by its owner: all
ranks get the same bits. 16-bit dtypes only (the mark is one 16-bit word).

lamport_all_kernel: push_all's one-shot (its buffer, its SEND) with the empty mark in place of
STARTED flags: REDUCE polls its blocks of my W slots until no mark is left and sums them in rank
order (the same bits on every rank). Slots of parity p are written again two calls later, by a
rank that finished the call between, which needed my sends of it, made after my reads of them.
The interpreter tests run each phase separately for every rank, as for push.
"""

import triton
import triton.language as tl

# EMPTY_BITS: the runtime marks buffers with it
from .all_reduce import EMPTY_BITS, K_EMPTY_BITS, call_start, is_empty, sendable  # noqa: F401
from .all_reduce_push import end_of_call, finish_block, send_partial_to_all, store_h
from .flags import (K_ERR_SENT, gave_up_before, peer_ptr, polling, record_give_up, wait_start,
                    waited)
from .schedule import owned_block

_DYNAMIC = ["M", "eps", "rank", "limit"]  # `stride` is specialised (16-byte aligned regions)


@triton.jit
def take_when_full(ptrs, mask, limit, err_ptr):
    """Poll *ptrs (where mask) until no word holds the empty mark, mark them empty again and
    return what they held. limit > 0: gives up, reporting K_ERR_SENT."""
    x = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    since = wait_start(limit)
    n = since * 0
    skip = gave_up_before(limit, err_ptr)
    while polling(tl.max(tl.where(mask & is_empty(x), 1, 0)) > 0, n, limit, skip):
        x = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
        n = waited(n, since, limit)
    record_give_up(tl.max(tl.where(mask & is_empty(x), 1, 0)) > 0, skip, err_ptr, K_ERR_SENT,
                   -1, -1, -1)  # the data is its own flag: no epoch
    tl.store(ptrs, tl.full(x.shape, K_EMPTY_BITS, tl.int16).to(x.dtype, bitcast=True), mask=mask)
    return x


@triton.jit(do_not_specialize=_DYNAMIC)
def lamport_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr, h_ptr,
                   y_ptr, res_ptr, w_ptr, M, N, eps, rank, stride, limit, HAS_RES: tl.constexpr,
                   NORM: tl.constexpr, W_FP32: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_N: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                   SEND: tl.constexpr = True, REDUCE: tl.constexpr = True,
                   COPY: tl.constexpr = True, NORMALISE: tl.constexpr = True,
                   ROW_BLOCK: tl.constexpr = 0):
    # flag_table is unused: every all-reduce kernel takes the same leading arguments
    pid, nprog, epoch, numel = call_start(epoch_ptr, M, N)
    dtype = h_ptr.dtype.element_ty
    block_rows = tl.cdiv(tl.cdiv(numel, BLOCK), WORLD)
    offs = tl.arange(0, BLOCK)
    ranks = tl.arange(0, WORLD_P2)
    mine = peer_ptr(data_table, rank, dtype)
    slots = (1 + epoch % 2) * stride  # this call's scatter slots
    sums = (3 + epoch % 2) * stride  # this call's sums
    if SEND:
        for i in range(pid, block_rows, nprog):
            for q in tl.static_range(WORLD):
                idx = owned_block(i, q, WORLD) * BLOCK + offs
                part = sendable(tl.load(mine + idx, mask=idx < numel, other=0.0))
                tl.store(peer_ptr(data_table, q, dtype) + slots
                         + (i * WORLD + rank) * BLOCK + offs, part, mask=idx < numel)
    if REDUCE:
        for i in range(pid, block_rows, nprog):
            idx = owned_block(i, rank, WORLD) * BLOCK + offs
            parts = take_when_full(
                mine + slots + (i * WORLD + ranks[:, None]) * BLOCK + offs[None, :],
                (ranks[:, None] < WORLD) & (idx[None, :] < numel), limit, err_ptr)
            total = sendable(tl.sum(parts.to(tl.float32), axis=0).to(dtype))
            for q in tl.static_range(WORLD):
                tl.store(peer_ptr(data_table, q, dtype) + sums + idx, total,
                         mask=idx < numel)
    if COPY:
        for i in range(pid, block_rows, nprog):
            if ROW_BLOCK > 0:  # block by block: each holds whole rows, normalised as written
                for q in tl.static_range(WORLD):
                    idx = owned_block(i, q, WORLD) * BLOCK + offs
                    finish_block(h_ptr, y_ptr, res_ptr, w_ptr, idx, idx < numel,
                                 take_when_full(mine + sums + idx, idx < numel, limit, err_ptr),
                                 eps, HAS_RES, NORM, W_FP32, BLOCK, ROW_BLOCK)
            else:
                idx = owned_block(i, ranks[:, None], WORLD) * BLOCK + offs[None, :]
                mask = (ranks[:, None] < WORLD) & (idx < numel)
                sums_of_row = take_when_full(mine + sums + idx, mask, limit, err_ptr)
                store_h(h_ptr, res_ptr, idx, mask, sums_of_row, HAS_RES)
    # ROW_BLOCK: COPY normalised the rows, no NORMALISE phase follows
    end_of_call(h_ptr, y_ptr, w_ptr, flags_ptr, arrive_ptr, epoch_ptr, M, N, eps, epoch, limit,
                err_ptr, COPY, NORM and ROW_BLOCK == 0, NORMALISE, W_FP32, BLOCK_N)


@triton.jit(do_not_specialize=_DYNAMIC)
def lamport_all_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr, h_ptr,
                       y_ptr, res_ptr, w_ptr, M, N, eps, rank, stride, limit,
                       HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr,
                       WORLD_P2: tl.constexpr, SEND: tl.constexpr = True,
                       REDUCE: tl.constexpr = True, NORMALISE: tl.constexpr = True,
                       ROW_BLOCK: tl.constexpr = 0):
    """The one-shot for the smallest M with no flags (see the module doc, lamport_all_kernel)."""
    pid, nprog, epoch, numel = call_start(epoch_ptr, M, N)
    dtype = h_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    ranks = tl.arange(0, WORLD_P2)
    mine = peer_ptr(data_table, rank, dtype)
    call_slots = stride + (epoch % 2) * WORLD * stride  # this call's W slots
    if SEND:
        send_partial_to_all(data_table, mine, call_slots, rank, stride, numel, True, BLOCK, WORLD)
    if REDUCE:
        for b in range(pid, tl.cdiv(numel, BLOCK), nprog):
            idx = b * BLOCK + offs
            mask = idx < numel
            parts = take_when_full(mine + call_slots + ranks[:, None] * stride + idx[None, :],
                                   (ranks[:, None] < WORLD) & mask[None, :], limit, err_ptr)
            finish_block(h_ptr, y_ptr, res_ptr, w_ptr, idx, mask,
                         tl.sum(parts.to(tl.float32), axis=0).to(dtype), eps, HAS_RES, NORM,
                         W_FP32, BLOCK, ROW_BLOCK)
    end_of_call(h_ptr, y_ptr, w_ptr, flags_ptr, arrive_ptr, epoch_ptr, M, N, eps, epoch, limit,
                err_ptr, REDUCE, NORM and ROW_BLOCK == 0, NORMALISE, W_FP32, BLOCK_N)
