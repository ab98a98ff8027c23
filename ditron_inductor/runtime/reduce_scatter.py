"""Fused GEMM + reduce-scatter on symmetric memory, two plans (chunk c of the output rows
belongs to rank c).

Copy engine (transfer="copy_engine"; templates/reduce.py sums the slots for reduce="triton"):
  main stream   for p = r+1, r+2, ..., r-1: partial_p = A[rows of p] @ B (+bias), then an event
  side stream   after each event: wait DONE[p] >= e-1 (p has reduced the last call, its slot is
                free); copy-engine push of partial_p into p's receive slot r; READY[r] = e on p
  main stream   my own partial straight into my receive slot r; wait READY[q] >= e for every q;
                out = sum of the W slots (x 1/W for avg); DONE[r] = e on every peer; join

Pull and accumulate (accumulate=True, cuBLAS; _pull_accumulate): the partials stay with their
maker until their owner pulls them, so that the owner's own product, last, lands on them:
  main stream   wait DONE[p] >= e-2 for every peer (it pulled my buffer of parity e%2); for each
                row chunk s of S, for p = r+1, ...: my partial for p's chunk s into my buffer's
                slot p; READY[r] = base + s + 1 on p (base: the chunks the context announced
                before this call, OpContext.announcements)
  side stream   for each chunk s, each peer q: wait READY[q] >= base + s + 1; copy-engine pull of
                my rows of chunk s from q's slot r into my output (3+ ranks: into a staging slot
                per peer); DONE[r] = e on every peer
  main stream   for each chunk s, after its pulls: (3+ ranks: the staging slots summed into my
                output) my own product added by cuBLAS with beta = 1 (x 1/W for avg); join
The reduction needs no kernel of its own after the last GEMM (at 2 ranks none at all): the pulls
of chunk s run beside the GEMMs of the chunks after it.

SM pull (transfer="sm"; kernels: templates/gemm_ready.py with SLICES = W, and
templates/reduce_scatter.py). One call on rank r: the persistent Triton GEMM on SMs - P programs
of the main stream writes a @ b (+ bias) into the half of my symmetric buffer of the call's epoch
parity, chunk by chunk (each chunk holds row-blocks of every rank's slice), raising READY per
chunk; beside it, on P programs of the side stream, pull_reduce_kernel sums my slice of every
rank's partial as the chunks become ready: the transfer rides on SM loads over NVLink and
overlaps the GEMM. It is for machines where the copy engine is slow (~150 GB/s per GPU through
the plans on the 8-GPU machine, SM loads 320-350: ARCHITECTURE.md); on 2 and 4 H200, where the
copy engine pulls ~330, it is slower than the copy-engine plan. Epochs are device words, as for
the all-reduce (runtime/all_reduce.py): nothing on the host changes between calls, so a call
captured in a CUDA graph replays correctly once the context exists.

What this plan declines (operands TMA cannot take, slices that are not whole row-blocks of the
GEMM's tile) takes the op's reference path.

FP8 (scaled_mm_reduce_scatter): the copy-engine plan with cuBLAS, each rank's rows a
torch._scaled_mm (runtime/scaled.py) into the same staging rows and receive slot, in the output
dtype (bf16/fp16: what is pushed and summed); a rowwise scale_a is sliced with the rows; a sum of
terms, each term's _scaled_mm of those rows added there. Plans with a Triton GEMM
(gemm="triton", the SM pull) decline.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..scheduler.plan import CUBLAS, SM, TRITON, ReduceScatterPlan
from ..scheduler.task import Task
from ..templates import flags
from ..templates.reduce_scatter import pull_reduce_kernel
from . import driver
from .context import device_epoch, get_context, size_class, wait_limit
from .kernel_launch import cdiv, current_stream, launch
from .launch import (WAIT_NAMES, MatmulSum, check_errors, decline, gemm_beside, matmul_into,
                     num_sms, ready_gemm, tile_launch, tma_ok, wait_geq)
from .scaled import Scaled, ScaledSum

CONTEXT = "matmul_reduce_scatter_pull"
ACCUMULATE_CONTEXT = "matmul_reduce_scatter_accumulate"
# calls served by the fused path, and those of them the SM pull served (tests check which ran)
stats = {"matmul_reduce_scatter": 0, "pulled": 0, "scaled_mm_reduce_scatter": 0}


def scaled_mm_reduce_scatter_fused(task: Task, plan: ReduceScatterPlan, a, b, scale_a, scale_b,
                                   bias, out_dtype, use_fast_accum, out_shape, scatter_dim,
                                   reduce_op, group_name, world_size):
    """a, b, scale_a, scale_b: one per term of the sum (ScaledSum), one for a single product."""
    # declined before the protocol starts, alike on every rank (plan, shapes and dtypes agree)
    if plan.gemm != CUBLAS or plan.transfer == SM:
        return decline("fp8: the copy-engine plan with cuBLAS only (_scaled_mm per rank's rows; "
                       "the Triton GEMMs take no float8)")
    if plan.accumulate:
        return decline("fp8: not the plan that accumulates (_scaled_mm accumulates into nothing)")
    gemms = []
    for i, (a_i, b_i, s_a, s_b) in enumerate(zip(a, b, scale_a, scale_b)):
        gemm, why = Scaled.checked(a_i, [b_i], s_a, [s_b], [bias if i == 0 else None],
                                   out_dtype, use_fast_accum)
        if why:
            return decline(why)
        gemms += gemm
    scaled = gemms[0] if len(gemms) == 1 else ScaledSum(gemms[0],
                                                         tuple(zip(a[1:], b[1:], gemms[1:])))
    return _reduce_scatter(task, plan, a[0], b[0], bias, out_shape, scatter_dim, reduce_op,
                           group_name, world_size, scaled)


def matmul_reduce_scatter_fused(task: Task, plan: ReduceScatterPlan, a, b, bias, out_shape,
                                scatter_dim, reduce_op, group_name, world_size):
    """a, b: the op's terms, one each for a single matmul; a sum of several (MatmulSum) on the
    copy-engine plan with cuBLAS, declined before the protocol starts, alike on every rank."""
    terms, why = MatmulSum.of(a, b)
    if why:
        return decline(why)
    if terms is not None and not plan.takes_terms:
        return decline("a sum of matmul products: the copy-engine plan with cuBLAS only (each "
                       "further term accumulated into the rows)")
    if bias is not None and (bias.dim() != 1 or bias.dtype != a[0].dtype
                             or bias.shape[0] != b[0].shape[1]):
        return decline("bias")
    return _reduce_scatter(task, plan, a[0], b[0], bias, out_shape, scatter_dim, reduce_op,
                           group_name, world_size, terms)


def _reduce_scatter(task: Task, plan: ReduceScatterPlan, a, b, bias, out_shape, scatter_dim,
                    reduce_op, group_name, world_size,
                    scaled: Optional[Scaled | ScaledSum | MatmulSum] = None):
    """The first term's a and b; scaled: the GEMM where it is not a @ b, checked already: the
    scaled op's (float8 operands, Scaled.declines; a ScaledSum for several terms), or a sum
    of matmul products (MatmulSum)."""
    if reduce_op not in ("sum", "avg"):
        return decline(f"reduce_op {reduce_op}")
    if scatter_dim != 0:
        if not task.rank_chunks_contiguous:
            return decline(f"scatter_dim {scatter_dim} interleaves the ranks' rows")
        # every dim before scatter_dim has size 1: the same rows as a scatter on dim 0
        lead = list(out_shape[:scatter_dim])
        out = _reduce_scatter(task, plan, a, b, bias, list(out_shape[scatter_dim:]), 0,
                              reduce_op, group_name, world_size, scaled)
        return None if out is None else out.view(lead + list(out.shape))
    dtype = scaled.out_dtype if scaled else a.dtype  # the partials', the sums' and the output's
    M, K = a.shape
    N = b.shape[1]
    W = world_size
    shape = list(out_shape) if len(out_shape) else [M, N]
    if M % W or shape[0] % W or M * N == 0:
        return decline("rows do not divide by the world size")
    out_shape_scattered = [shape[0] // W] + shape[1:]
    if plan.transfer == SM:  # the reduction pulled by SMs beside the GEMM
        from .reduce_scatter import matmul_reduce_scatter_pull

        out = matmul_reduce_scatter_pull(task, plan, a, b, bias, reduce_op)
        if out is None:
            return None
        stats["matmul_reduce_scatter"] += 1
        return out.view(out_shape_scattered)
    if torch.cuda.is_current_stream_capturing():
        return decline("CUDA graph capture (epochs are host values)")
    rows = M // W
    if plan.accumulate:
        out = _pull_accumulate(task, plan, a, b, bias, scaled, dtype, rows, N, reduce_op,
                               group_name)
        return out.view(out_shape_scattered)
    esize = dtype.itemsize
    chunk_bytes = rows * N * esize
    ctx = get_context("matmul_reduce_scatter", group_name, plan.symm_mem_backend, W * chunk_bytes)
    r = ctx.rank
    e = ctx.next_epoch()
    main = current_stream()
    side = ctx.side.cuda_stream
    tile = plan.tile if plan.gemm == TRITON else None

    driver.record(ctx.ev_start, main)
    driver.stream_wait(side, ctx.ev_start)
    staging = torch.empty((W - 1, rows, N), dtype=dtype, device=a.device)
    st0 = staging.data_ptr()
    for i, p in enumerate(task.ring_order(r)[1:], start=1):  # the chunk for rank+1 first
        matmul_into(a[p * rows:(p + 1) * rows], b, bias, staging[i - 1], tile, scaled, p * rows)
        driver.record(ctx.ev_chunks[p], main)
        driver.stream_wait(side, ctx.ev_chunks[p])
        # p has reduced the last call: slot r is free
        wait_geq(ctx, plan, side, ctx.DONE + p, e - 1)
        driver.memcpy(ctx.data_addrs[p] + r * chunk_bytes, st0 + (i - 1) * chunk_bytes,
                      chunk_bytes, side)
        ctx.signal(side, e, [ctx.peer_flag_addr(p, ctx.READY + r)])  # READY[r] = e on p
    mine = ctx.data.view(-1, dtype, (W, rows, N))
    matmul_into(a[r * rows:(r + 1) * rows], b, bias, mine[r], tile, scaled, r * rows)
    for q in range(W):
        if q != r:
            wait_geq(ctx, plan, main, ctx.READY + q, e)
    if plan.reduce == TRITON:
        from ..templates.reduce import reduce_slots_kernel

        out = torch.empty((rows, N), dtype=dtype, device=a.device)
        n = rows * N
        launch(reduce_slots_kernel, (cdiv(n, 4096),), mine, out, n, n, W,
               (1.0 / W) if reduce_op == "avg" else 1.0, BLOCK=4096, num_warps=8)
    elif reduce_op == "avg":
        out = torch.mean(mine, dim=0)
    else:
        out = torch.sum(mine, dim=0)
    # my slots are free again (DONE[r] = e on every peer)
    ctx.signal(main, e, [ctx.peer_flag_addr(q, ctx.DONE + r) for q in range(W) if q != r])
    driver.record(ctx.ev_end, side)
    driver.stream_wait(main, ctx.ev_end)
    check_errors(ctx, plan, task.op)
    stats[task.op] += 1
    return out.view(out_shape_scattered)


def accumulate_chunks(rows: int, chunks: int) -> int:
    """The row chunks of each rank's partial in the pull-and-accumulate plan: the most, up to
    `chunks`, that cut `rows` evenly."""
    return next(c for c in range(max(1, min(chunks, rows)), 0, -1) if rows % c == 0)


def _pull_accumulate(task: Task, plan: ReduceScatterPlan, a, b, bias, sums: Optional[MatmulSum],
                     dtype, rows: int, N: int, reduce_op: str, group_name: str):
    """My rows [rows, N] of the reduced sum (module docstring: pull and accumulate); `sums`: the
    further terms of a sum of products, else None."""
    S = accumulate_chunks(rows, plan.chunks)
    sub = rows // S
    esize = dtype.itemsize
    slot_bytes = rows * N * esize
    W = task.world_size
    # two parities of W slots (slot p: my partial for rank p)
    ctx = get_context(ACCUMULATE_CONTEXT, group_name, plan.symm_mem_backend, 2 * W * slot_bytes)
    r = ctx.rank
    e = ctx.next_epoch()
    base = ctx.announcements(S)
    half = ctx.data.nbytes // 2
    off = (e % 2) * half
    slots = ctx.data.view(-1, dtype, (W, rows, N), off)
    main, side = current_stream(), ctx.side.cuda_stream
    peers = task.ring_order(r)[1:]
    out = torch.empty((rows, N), dtype=dtype, device=a.device)
    staging = torch.empty((W - 1, rows, N), dtype=dtype, device=a.device) if W > 2 else None
    driver.record(ctx.ev_start, main)
    driver.stream_wait(side, ctx.ev_start)

    # my partials for the peers, chunk by chunk (every peer's chunk s before any chunk s + 1)
    for p in peers:
        wait_geq(ctx, plan, main, ctx.DONE + p, e - 2)
    for s in range(S):
        for p in peers:
            first = p * rows + s * sub
            matmul_into(a[first:first + sub], b, bias, slots[p, s * sub:(s + 1) * sub], None,
                        sums, first)
            ctx.signal(main, base + s + 1, [ctx.peer_flag_addr(p, ctx.READY + r)])

    # my rows of theirs, pulled as each chunk is announced
    pulled = ctx.chunk_events(S)
    for s in range(S):
        for i, q in enumerate(peers):
            wait_geq(ctx, plan, side, ctx.READY + q, base + s + 1)
            dst = out if staging is None else staging[i]
            driver.memcpy(dst[s * sub:].data_ptr(),
                          ctx.data_addrs[q] + off + r * slot_bytes + s * sub * N * esize,
                          sub * N * esize, side)
        driver.record(pulled[s], side)
    ctx.signal(side, e, [ctx.peer_flag_addr(q, ctx.DONE + r) for q in peers])
    driver.record(ctx.ev_end, side)

    # my own product onto them, chunk by chunk
    for s in range(S):
        rows_out = out[s * sub:(s + 1) * sub]
        first = r * rows + s * sub
        if not peers:  # one rank: nothing to add onto
            matmul_into(a[first:first + sub], b, bias, rows_out, None, sums, first)
            continue
        driver.stream_wait(main, pulled[s])
        if staging is not None:
            torch.sum(staging[:, s * sub:(s + 1) * sub], dim=0, out=rows_out)
        rows_out.addmm_(a[first:first + sub], b)
        for a_i, b_i in sums.others if sums is not None else ():
            rows_out.addmm_(a_i[first:first + sub], b_i)
        if bias is not None:
            rows_out.add_(bias)
    if reduce_op == "avg":
        out.mul_(1.0 / W)
    driver.stream_wait(main, ctx.ev_end)
    check_errors(ctx, plan, task.op)
    stats[task.op] += 1
    return out


def chunk_blocks(slice_blocks: int, chunks: int) -> int:
    """Row-blocks of each slice per chunk: the fewest that cut a slice of `slice_blocks` into
    equal chunks, at most `chunks` of them (and MAX_CHUNKS)."""
    most = max(1, min(chunks, flags.MAX_CHUNKS))
    return next(g for g in range(1, slice_blocks + 1)
                if slice_blocks % g == 0 and slice_blocks // g <= most)


def pull_declines(m: int, k: int, n: int, world: int, esize: int, block_m: int) -> Optional[str]:
    """Why this plan cannot serve the shape (the GEMM's tile block_m rows high), or None."""
    if k == 0:
        return "K = 0"
    if (m // world) % block_m:
        return f"slices of {m // world} rows are not whole {block_m}-row blocks"
    if world > flags.MAX_WORLD:
        return f"the flags serve up to {flags.MAX_WORLD} ranks"
    if size_class(2 * m * n * esize) // esize >= 2 ** 31:
        return "more than 2**31 elements in the buffers (32-bit offsets)"
    return None


def matmul_reduce_scatter_pull(task, plan: ReduceScatterPlan, a, b, bias, reduce_op: str):
    """My slice [M / W, N] of the reduced a @ b (+ bias), or None (declined: the op runs its
    reference path)."""
    (m, k), n, world = a.shape, b.shape[1], task.world_size
    tile = tile_launch(plan.tile)
    why = pull_declines(m, k, n, world, a.element_size(), tile["BLOCK_M"])
    if why:
        return decline(why)
    capturing = torch.cuda.is_current_stream_capturing()
    ctx = get_context(CONTEXT, task.group_name, plan.symm_mem_backend, 2 * m * n * a.element_size(),
                      flag_words=flags.FLAG_WORDS, create=not capturing)
    if ctx is None:
        return decline("CUDA graph capture before any eager call of this size class")
    half = ctx.data.nbytes // a.element_size() // 2 // 16 * 16  # fixed per context
    partial = ctx.data.view(-1, a.dtype, (m, n))
    b_trans = tma_ok(a, b, partial)
    if b_trans is None:
        return decline("operands TMA cannot take (alignment, strides)")
    dev = device_epoch(ctx)
    rows = m // world
    per_chunk = chunk_blocks(rows // tile["BLOCK_M"], plan.chunks)
    sms = num_sms(a.device)
    progs = max(1, min(plan.comm_sms, sms - 4))
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    gemm_beside(
        ctx, dev,
        lambda: ready_gemm(ctx, dev, a, b, bias, partial, b_trans, world * per_chunk,
                           sms - progs, tile, slices=world, parity_elems=half),
        lambda side: launch(
            pull_reduce_kernel, (progs,), ctx.data.ptr_table, ctx.flags.ptr_table, dev.epoch,
            dev.arrive, ctx.err, out, rows, n, ctx.rank, per_chunk * tile["BLOCK_M"], half,
            1.0 / world, wait_limit(plan), stream=side, BLOCK=plan.pull_block,
            SCALE=reduce_op == "avg", num_warps=plan.pull_warps,
            **flags.world_constants(world)))
    check_errors(ctx, plan, task.op, lambda code: WAIT_NAMES.get(code, code))
    stats["pulled"] += 1
    return out
