"""Fused GEMM + all-reduce (+ residual + RMSNorm) on symmetric memory: the GEMM writes a @ b (+
bias) into my symmetric buffer (the grouped-GEMM ops copy their input there instead, `Copied`),
then the plan's algo reduces it (scheduler/plan.AllReducePlan says what each does; the protocols:
templates/all_reduce_push.py, all_reduce_lamport.py, and _copy_engine here). push has one context
per (group, size class), shared by the ops; each other algo its own.

Every kernel leaves the buffers free for the next call's GEMM when it ends, and the epochs are
device words the kernels advance (copy_engine's 0/1 flags end each call as they began): nothing
on the host changes between calls, so a call captured in a CUDA graph replays correctly. Context
setup is collective and synchronises: a capture before any eager call of its size class declines
(Inductor's CUDA-graph trees warm up eagerly first, which creates the context).

The scaled (FP8) all-reduce has no fused path: it runs as _scaled_mm + NCCL.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch

from ..rms_norm import reciprocal_rms
from ..scheduler.plan import COPY_ENGINE, COPY_ENGINE_MAX_N, GEMV, TRITON, AllReducePlan
from ..scheduler.task import Task
from ..templates import flags
from ..templates.all_reduce_lamport import EMPTY_BITS, lamport_all_kernel, lamport_kernel
from ..templates.all_reduce_push import push_all_kernel, push_kernel
from ..templates.reduce import sum_slots_norm_kernel
from . import driver, faults
from .context import (OpContext, build_outside_graph_pools, device_epoch, get_context, size_class,
                      wait_limit)
from .launch import (DTYPES, MatmulSum, bias_serves, check_errors, decline, gemm_beside,
                     kernel_flag, matmul_into, num_sms, ready_gemm, tile_launch, tma_ok,
                     wait_geq)
from .kernel_launch import cdiv, current_stream, launch, next_power_of_2
from .symm import group_barrier

stats = {"matmul_all_reduce": 0, "matmul_all_reduce_rmsnorm": 0, "grouped_mm_all_reduce": 0,
         "grouped_mm_all_reduce_rmsnorm": 0}
_CONTEXT = "all_reduce"
_MAX_BLOCK = 16384  # push_grid's largest block


def _buffer_elements(algo: str, numel: int, world: int) -> tuple[str, int]:
    """(context name, buffer elements) for `numel`. push_all's slots may be overwritten only by
    its own kind of call and lamport's words must hold the empty mark between calls: a context
    each. lamport's slack holds its scatter's last, partial, block row."""
    if algo in ("push_all", "lamport_all"):
        return f"{_CONTEXT}_{algo}", _regions(algo, world) * _slot_stride(numel)
    if algo == "lamport":
        slack = flags.MAX_WORLD * _MAX_BLOCK
        return _CONTEXT + "_lamport", _regions(algo, world) * _slot_stride(numel + slack)
    return _CONTEXT, numel


def _regions(algo: str, world: int) -> int:
    """The equal regions of an algo's buffer (the templates' module docs)."""
    return {"push_all": 1 + 2 * world, "lamport_all": 1 + 2 * world, "lamport": 5}.get(algo, 1)


def region_elements(buffer_elements: int, algo: str, world: int) -> int:
    """Elements per region, 16-byte aligned; fixed per context, so the regions never move."""
    return buffer_elements // _regions(algo, world) // 16 * 16


def _slot_stride(numel: int) -> int:
    return cdiv(numel, 16) * 16  # slots start 16-byte aligned


def _declines(a, b, bias, residual, norm_weight, weight_in_fp32, reduce_op, shape):
    """Why the fused path cannot serve these inputs, or None."""
    if reduce_op != "sum":
        return f"reduce_op {reduce_op}"
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        return f"dtype {a.dtype} @ {b.dtype}"
    if a.dim() != 2 or b.dim() != 2:
        return "operands not 2-d"
    dtype = a.dtype
    m, n = a.shape[0], b.shape[1]
    if m == 0 or n == 0 or a.shape[1] == 0:
        return "empty"
    if not bias_serves(bias, dtype, n):
        return "bias"
    if residual is not None and (residual.dtype != dtype or residual.numel() != m * n
                                 or not residual.is_contiguous()):
        return "residual dtype/shape/layout"
    if norm_weight is not None:
        if norm_weight.dim() != 1 or norm_weight.shape[0] != n or not norm_weight.is_contiguous():
            return "norm weight shape"
        if norm_weight.dtype != dtype and not (weight_in_fp32
                                                and norm_weight.dtype == torch.float32):
            return "norm weight dtype (the reference would return another dtype)"
    if shape[-1] != n:
        return "out_shape does not end in N"
    return None


def all_reduce_fused(task, plan, a, b, bias, out_shape, residual, norm_weight, eps,
                     weight_in_fp32, reduce_op, producer=None):
    """(h, y) (y None without norm_weight), or None where declined. producer: what computes the
    partial in place of a @ b: a sum of matmul products (MatmulSum, already checked; a and b
    are its first term's), or a computed tensor's rows (Copied)."""
    m, n = a.shape[0], b.shape[1]
    shape = list(out_shape) if len(out_shape) else [m, n]
    why = _declines(a, b, bias, residual, norm_weight, weight_in_fp32, reduce_op, shape)
    if why:
        return decline(why)
    dtype = a.dtype
    faults.check_shapes(task.op, task.group_name, (m, n, str(dtype)), plan.wait_timeout_s)
    algo = plan.algo
    if algo == COPY_ENGINE:
        out = _copy_engine(task, plan, a, b, bias, residual, norm_weight, eps, weight_in_fp32,
                           dtype, producer)
        if out is None:
            return None
        stats[task.op] += 1
        return out[0].view(shape), (None if out[1] is None else out[1].view(shape))
    if task.world_size > flags.MAX_WORLD:
        return decline(f"the all-reduce kernels' flags serve up to {flags.MAX_WORLD} ranks")
    context, elems = _buffer_elements(algo, m * n, task.world_size)
    esize = dtype.itemsize
    if size_class(elems * esize) // esize >= 2 ** 31:
        return decline("more than 2**31 elements in the buffers (32-bit offsets)")
    capturing = torch.cuda.is_current_stream_capturing()
    ctx = get_context(context, task.group_name, plan.symm_mem_backend, elems * esize,
                      flag_words=flags.FLAG_WORDS, create=not capturing)
    if ctx is None:
        return decline("CUDA graph capture before any eager call of this size class")
    dev = device_epoch(ctx)
    partial = ctx.data.view(-1, dtype, (m, n))
    b_trans = tma_ok(a, b, partial) if plan.overlap and plan.gemm == TRITON else None
    if plan.overlap and plan.gemm == TRITON and b_trans is None:
        return decline("the Triton GEMM beside push: operands TMA cannot take")
    h = torch.empty((m, n), dtype=dtype, device=a.device)
    y = torch.empty_like(h) if norm_weight is not None else None
    common = (ctx.data.ptr_table, ctx.flags.ptr_table, ctx.flags.words,
              dev.epoch, dev.arrive, faults.site_words(ctx, plan.site), h,
              h if y is None else y,
              h if residual is None else residual, h if norm_weight is None else norm_weight)
    consts = dict(HAS_RES=residual is not None, NORM=norm_weight is not None,
                  W_FP32=bool(weight_in_fp32), **flags.world_constants(ctx.world))
    if algo == "push":
        _push(ctx, dev, plan, a, b, bias, partial, b_trans, common, consts, float(eps),
              producer)
    else:
        _after_gemm(ctx, plan, a, b, bias, partial, common, consts, float(eps), producer)
    check_errors(ctx, plan, task.op, kernel_flag)
    stats[task.op] += 1
    return h.view(shape), (None if y is None else y.view(shape))


def _row_chunks(plan: AllReducePlan, m):
    """(row chunks, rows per chunk) of the chunked cuBLAS GEMM."""
    chunks = max(1, min(plan.chunks, flags.MAX_CHUNKS, m))
    rows = cdiv(m, chunks)
    return cdiv(m, rows), rows


def _cublas_chunks(ctx, dev, a, b, bias, partial, rows, producer=None):
    """The GEMM in row chunks on the main stream, chunk 0 first on every rank (the order the
    reduction takes them in), READY[j] raised after chunk j by a 4-byte copy of the device epoch
    word. cuBLAS takes every SM: the push programs beside it wait for its waves."""
    m = partial.shape[0]
    main = current_stream()
    current_epoch = dev.epoch.data_ptr() + 4
    for j in range(cdiv(m, rows)):
        lo, hi = j * rows, min((j + 1) * rows, m)
        matmul_into(a[lo:hi], b, bias, partial[lo:hi], scaled=producer, first_row=lo)
        driver.memcpy(ctx.flag_addr(flags.READY + j), current_epoch, 4, main)


def _ready_gemm_rows(plan: AllReducePlan, m):
    """Rows per chunk of the persistent GEMM beside push: whole row-blocks, about plan.chunks
    chunks, at most MAX_CHUNKS."""
    blocks = cdiv(m, plan.tile.block_m)
    chunks = max(1, min(plan.chunks, flags.MAX_CHUNKS))
    group = max(cdiv(blocks, chunks), cdiv(blocks, flags.MAX_CHUNKS))
    return group * plan.tile.block_m


@functools.lru_cache(maxsize=1024)  # called per call with the same few sizes
def push_grid(world, numel, sms, block=0, warps=0, progs=0, norm=False):
    """(programs, BLOCK, warps) of a push kernel (world=1 for the one-shots). A thread moves a
    16-byte vector per peer (BLOCK = 256 x warps; 16384: 32 warps, two vectors). BLOCK grows
    with the data, for more bytes in flight per SM: 256 to 1024 with about 32 programs or more,
    4096 from 64 such blocks per rank, 16384 from one per program; with a norm at least 1024
    (its rows take 4 warps, not 1). Fewer programs than SMs: the kernel waits on its own
    programs, so all must be resident. block, warps, progs: a plan's choice (0: by size)."""
    per_rank = cdiv(numel, world)
    small = max(1024 if norm else 256,
                min(1024, next_power_of_2(per_rank // 32 + 1) // 2))
    block = block or (_MAX_BLOCK if per_rank >= flags.MAX_PROGS * _MAX_BLOCK
                      else 4096 if per_rank >= 64 * 4096 else small)
    warps = warps or (32 if block >= _MAX_BLOCK else max(1, min(8, block // 256)))
    cap = min(progs or flags.MAX_PROGS, flags.MAX_PROGS, sms - 4)
    return max(1, min(cap, cdiv(per_rank, block))), block, warps


def _launch(consts, n, block, warps):
    """A push kernel's constexprs: the call's, push_grid's BLOCK and warps, the norm's row tile
    (BLOCK_N, at most 1024 elements a warp) and ROW_BLOCK (row_block)."""
    return dict(consts, BLOCK=block, BLOCK_N=min(next_power_of_2(n), 1024 * warps),
                ROW_BLOCK=row_block(n, block) if consts["NORM"] else 0, num_warps=warps)


def row_block(n: int, block: int) -> int:
    """N where each block holds whole rows (N a power of two dividing BLOCK), so the copy-out
    normalises them in the same pass; else 0."""
    return n if n & (n - 1) == 0 and block % n == 0 else 0


def decode_grid(plan: AllReducePlan, world: int, m: int, n: int, sms: int, norm: bool):
    """push_grid's, except that a one-shot with a norm, N a power of two in [1024, 16384] and
    no block named by the plan takes a row a block (warps = N / 512), normalised as written: no
    barrier, no second pass over h. lamport keeps push_grid's blocks: a row per owner would
    leave it far fewer programs."""
    block = plan.block
    one_shot = plan.algo in ("push_all", "lamport_all")
    if norm and one_shot and not block and n & (n - 1) == 0 and 1024 <= n <= _MAX_BLOCK:
        block = n
    warps = plan.warps or (max(4, min(32, block // 512)) if block and block == n else 0)
    return push_grid(world, m * n, sms, block, warps, plan.progs, norm=norm)


def _push(ctx, dev, plan: AllReducePlan, a, b, bias, partial, b_trans, common, consts, eps,
          producer=None):
    """The GEMM, then push_kernel on the same stream; with overlap, its REDUCE beside the GEMM
    on the side stream on `progs` programs, its COPY and NORMALISE after it on every SM."""
    m, n = partial.shape
    sms = num_sms(a.device)
    limit = wait_limit(plan, ctx)
    progs, block, warps = push_grid(ctx.world, m * n, sms, plan.block, plan.warps, plan.progs,
                                    norm=consts["NORM"])
    meta = _launch(consts, n, block, warps)
    if not plan.overlap:
        matmul_into(a, b, bias, partial, scaled=producer, decode=plan.gemm == GEMV)
        launch(push_kernel, (progs,), *common, m, n, eps, ctx.rank, m, progs, limit, **meta)
        return
    if plan.gemm == TRITON:
        rows = _ready_gemm_rows(plan, m)
        queue_gemm = lambda: ready_gemm(  # noqa: E731
            ctx, dev, a, b, bias, partial, b_trans, rows // plan.tile.block_m, sms - progs,
            tile_launch(plan.tile))
    else:
        rows = _row_chunks(plan, m)[1]
        queue_gemm = lambda: _cublas_chunks(  # noqa: E731
            ctx, dev, a, b, bias, partial, rows, producer)
    gemm_beside(ctx, dev, queue_gemm, lambda side: launch(
        push_kernel, (progs,), *common, m, n, eps, ctx.rank, rows, progs, limit,
        stream=side, CHUNKED=True, COPY=False, NORMALISE=False, **meta))
    # COPY needs a multiple of `progs` programs, the norm's barrier all of them resident;
    # CHUNKED as the REDUCE launch, which left my own blocks to this one
    copy_progs = progs * max(1, min(flags.MAX_PROGS, sms - 4) // progs)
    launch(push_kernel, (copy_progs,), *common, m, n, eps, ctx.rank, rows, progs, limit,
           CHUNKED=True, SEND=False, REDUCE=False, **meta)


def _after_gemm(ctx, plan: AllReducePlan, a, b, bias, partial, common, consts, eps,
                producer=None):
    """The whole GEMM, then push_all's or a lamport kernel; a lamport context's words hold the
    empty mark before its first call."""
    m, n = partial.shape
    if plan.algo != "push_all" and ctx not in _marked_empty:
        build_outside_graph_pools(ctx.device, lambda: _mark_empty(ctx))
        _marked_empty.add(ctx)
    two_shot = plan.algo == "lamport"
    progs, block, warps = decode_grid(plan, ctx.world if two_shot else 1, m, n,
                                      num_sms(a.device), consts["NORM"])
    stride = region_elements(ctx.data.nbytes // partial.element_size(), plan.algo, ctx.world)
    meta = _launch(consts, n, block, warps)
    if two_shot and not plan.block:  # rows a block only where the plan names the block
        meta["ROW_BLOCK"] = 0
    matmul_into(a, b, bias, partial, scaled=producer, decode=plan.gemm == GEMV)
    # push_all's slots begin one region in (after the partial), a region each
    kernel, regions = {"push_all": (push_all_kernel, (stride, stride)),
                       "lamport": (lamport_kernel, (stride,)),
                       "lamport_all": (lamport_all_kernel, (stride,))}[plan.algo]
    launch(kernel, (progs,), *common, m, n, eps, ctx.rank, *regions, wait_limit(plan, ctx), **meta)


_marked_empty: "weakref.WeakSet[OpContext]" = weakref.WeakSet()


def _mark_empty(ctx):
    """Every word of my buffer = the empty mark, on every rank before any rank sends."""
    ctx.data.local.view(torch.int16).fill_(EMPTY_BITS)
    group_barrier(ctx.backend.group)


# the copy-engine plan's sum + norm kernel: about this many elements a program (whole rows)
SUM_NORM_ELEMENTS = 8192


@dataclasses.dataclass(frozen=True)
class CopyEngineLayout:
    """A copy-engine call's addresses and copies on this rank, worked out once per (context, M,
    N, dtype, chunks): an eager call pays the host's time per call."""

    slots: torch.Tensor
    chunk_rows: tuple
    my_chunks: tuple  # my slot's rows of each chunk (cuBLAS writes them)
    sides: tuple  # copy streams (CUstream handles), one per peer up to MAX_STREAMS
    copies: tuple  # per chunk, per stream: ((dst, src, nbytes), ...)
    done_waits: tuple  # per stream: (the DONE flag words of its peers, ...)
    peers: tuple  # ring order, rank+1 first
    ready_to: tuple  # per stream: the peers' READY[r] words
    done_to: tuple  # every peer's DONE[r] word


_layouts: "weakref.WeakKeyDictionary[OpContext, dict]" = weakref.WeakKeyDictionary()
_MAX_LAYOUTS = 64  # per context (dynamic M): start over past it


def copy_engine_layout(ctx, task: Task, plan: AllReducePlan, dtype, m: int,
                       n: int) -> CopyEngineLayout:
    """The layout of this shape on this context, made at its first call."""
    per_shape = _layouts.setdefault(ctx, {})
    key = (m, n, dtype, plan.chunks)
    if key in per_shape:
        return per_shape[key]
    if len(per_shape) >= _MAX_LAYOUTS:
        per_shape.clear()
    chunks, rows = _row_chunks(plan, m)
    r, world = ctx.rank, ctx.world
    slots = ctx.data.view(-1, dtype, (world, m, n))
    slot_bytes, row_bytes = m * n * dtype.itemsize, n * dtype.itemsize
    mine = slots[r]
    peers = tuple(task.ring_order(r)[1:])
    sides = tuple(s.cuda_stream for s in ctx.sides(len(peers))) if peers else ()
    peers_of = [peers[i::len(sides)] for i in range(len(sides))]
    chunk_rows = tuple((j * rows, min((j + 1) * rows, m)) for j in range(chunks))
    layout = per_shape[key] = CopyEngineLayout(
        slots=slots, chunk_rows=chunk_rows,
        my_chunks=tuple(mine[lo:hi] for lo, hi in chunk_rows), sides=sides,
        copies=tuple(tuple(tuple((ctx.data_addrs[p] + r * slot_bytes + lo * row_bytes,
                                  mine.data_ptr() + lo * row_bytes, (hi - lo) * row_bytes)
                                 for p in ps) for ps in peers_of) for lo, hi in chunk_rows),
        done_waits=tuple(tuple(ctx.DONE + p for p in ps) for ps in peers_of), peers=peers,
        ready_to=tuple(tuple(ctx.peer_flag_addr(p, ctx.READY + r) for p in ps)
                       for ps in peers_of),
        done_to=tuple(ctx.peer_flag_addr(q, ctx.DONE + r) for q in peers))
    return layout


# copy-engine contexts whose DONE words an eager call has set (capture needs it done)
_copy_engine_set_up: "weakref.WeakSet[OpContext]" = weakref.WeakSet()
# the copy-engine flags, READY from word 0 and DONE from word W (word q of each written by
# rank q): their names where a bounded wait gives up
COPY_ENGINE_FLAGS = ("READY (a peer's partial)", "DONE (a peer freeing my slot)")


def _copy_engine_context(task: Task, plan: AllReducePlan, nbytes: int):
    """The copy-engine context, or None (declined) in a capture before any eager call made it
    (its setup is collective). Its first call sets the DONE words to 1 (my slot on each peer is
    free) with no barrier: only this rank reads them, and a peer writes one only after my first
    READY reached it."""
    capturing = torch.cuda.is_current_stream_capturing()
    ctx = get_context(f"{_CONTEXT}_{COPY_ENGINE}", task.group_name, plan.symm_mem_backend,
                      nbytes, create=not capturing)
    if ctx is not None and ctx not in _copy_engine_set_up and not capturing:
        ctx.flags.words[ctx.DONE:ctx.DONE + ctx.world].fill_(1)
        _copy_engine_set_up.add(ctx)
    if ctx is None or ctx not in _copy_engine_set_up:
        return decline("CUDA graph capture before any eager call of this size class")
    return ctx


def _sum_norm(slots, h, y, residual, norm_weight, eps, weight_in_fp32):
    """sum_slots_norm_kernel, whole rows a program: h = the sum of the W slots [W, M, N] (+
    residual), y = RMSNorm(h) * weight with a norm weight."""
    world, m, n = slots.shape
    block_n = next_power_of_2(n)
    row_tile = max(1, SUM_NORM_ELEMENTS // block_n)
    launch(sum_slots_norm_kernel, (cdiv(m, row_tile),), slots, m * n, h,
           h if y is None else y, h if residual is None else residual,
           h if norm_weight is None else norm_weight, m, n, float(eps), WORLD=world,
           HAS_RES=residual is not None, NORM=norm_weight is not None,
           W_FP32=bool(weight_in_fp32), ROWS=row_tile, BLOCK_N=block_n,
           num_warps=max(4, min(16, row_tile * block_n // 512)))


def _take_flag(ctx, plan, stream: int, idx: int) -> None:
    """The stream waits until my flag word idx is 1, then clears it."""
    wait_geq(ctx, plan, stream, idx, 1)
    driver.write(stream, ctx.flag_addr(idx), 0)


def _copy_engine(task: Task, plan: AllReducePlan, a, b, bias, residual, norm_weight, eps,
                 weight_in_fp32, dtype, producer=None):
    """algo="copy_engine": (h, y), or None where declined. My buffer holds W slots of [M, N],
    slot q for rank q's partial. Flags of 0 or 1, set by one rank and cleared by the other, so
    each call leaves them as it found them and queues the same operations (graph replays are
    correct, between eager calls too). On rank r, READY[q]: q's partial is in my slot q; DONE[q]:
    my slot r on q is free (q sets it after its sum).
      main stream   cuBLAS in row chunks straight into my slot r, an event after each
      copy streams  per peer p (ring order from r+1; peer i on stream i % MAX_STREAMS): take
                    DONE[p], copy each chunk into slot r of p once its event fires, READY[r] on p
      main stream   take READY[q] of every peer, sum the W slots (+ residual, norm), DONE[r] on
                    every peer, join the copy streams (they read my slot r, which the next
                    call's GEMM writes)
    The copies ride the copy engine beside the next chunks' GEMMs, which keep every SM. Each rank
    sends W - 1 partials (NCCL's ring 2 (W-1)/W of one): as much at 2 ranks, more beyond."""
    m, n = a.shape[0], b.shape[1]
    world = task.world_size
    if next_power_of_2(n) > COPY_ENGINE_MAX_N:
        return decline(f"the copy-engine all-reduce's sum holds whole rows: N={n} > "
                       f"{COPY_ENGINE_MAX_N}")
    if world * m * n >= 2 ** 31:
        return decline("more than 2**31 elements in the buffers (32-bit offsets)")
    ctx = _copy_engine_context(task, plan, world * m * n * dtype.itemsize)
    if ctx is None:
        return None
    main = current_stream()
    layout = copy_engine_layout(ctx, task, plan, dtype, m, n)
    events = ctx.chunk_events(len(layout.chunk_rows))
    if layout.sides:  # the copy streams follow the main stream's earlier work (and its capture)
        driver.record(ctx.ev_start, main)
    for side, flag_words in zip(layout.sides, layout.done_waits):
        driver.stream_wait(side, ctx.ev_start)
        for idx in flag_words:
            _take_flag(ctx, plan, side, idx)
    for j, ((lo, hi), out) in enumerate(zip(layout.chunk_rows, layout.my_chunks)):
        matmul_into(a[lo:hi], b, bias, out, scaled=producer, first_row=lo)
        if not layout.sides:
            continue
        driver.record(events[j], main)
        for side, copies in zip(layout.sides, layout.copies[j]):
            driver.stream_wait(side, events[j])
            for dst, src, nbytes in copies:
                driver.memcpy(dst, src, nbytes, side)
    for i, (side, ready_to) in enumerate(zip(layout.sides, layout.ready_to)):
        ctx.signal(side, 1, ready_to)
        driver.record(ctx.ev_sides[i], side)
    for q in layout.peers:
        _take_flag(ctx, plan, main, ctx.READY + q)
    h = torch.empty((m, n), dtype=dtype, device=a.device)
    y = torch.empty_like(h) if norm_weight is not None else None
    _sum_norm(layout.slots, h, y, residual, norm_weight, eps, weight_in_fp32)
    ctx.signal(main, 1, layout.done_to)  # my slots on the peers are free again; join the copies
    for i in range(len(layout.sides)):
        driver.stream_wait(main, ctx.ev_sides[i])
    # a bounded wait's code: 1 + the flag word it gave up on
    check_errors(ctx, plan, task.op, lambda code, peer: (
        f"{COPY_ENGINE_FLAGS[(code - 1) // world]} of rank {(code - 1) % world}"))
    return h, y


def matmul_all_reduce_fused(task: Task, plan: AllReducePlan, a, b, bias, out_shape, reduce_op,
                            group_name, world_size):
    """a, b: the op's terms (one each for a single matmul); a sum of several (MatmulSum) runs
    on cuBLAS plans only."""
    terms, why = MatmulSum.of(a, b)
    if why:
        return decline(why)
    if terms is not None and plan.overlap and plan.gemm == TRITON:
        return decline("a sum of matmul products: the persistent Triton GEMM beside push takes "
                       "one term (cuBLAS plans only)")
    out = all_reduce_fused(task, plan, a[0], b[0], bias, out_shape, None, None, 0.0, False,
                           reduce_op, terms)
    return None if out is None else out[0]


def matmul_all_reduce_rmsnorm_fused(task: Task, plan: AllReducePlan, a, b, bias, out_shape,
                                    residual, norm_weight, eps, weight_in_fp32, reduce_op,
                                    group_name, world_size, *, with_rstd=False):
    """[h, y], and with_rstd h's reciprocal RMS: the kernels normalise each row with it but do
    not store it, so it is computed again from h (one more read of h, training graphs only)."""
    return _normed_outputs(all_reduce_fused(task, plan, a, b, bias, out_shape, residual,
                                            norm_weight, eps, weight_in_fp32, reduce_op),
                           eps, with_rstd)


def _normed_outputs(out, eps, with_rstd):
    """The norm ops' [h, y] (+ h's reciprocal RMS) of all_reduce_fused's (h, y), or None."""
    if out is None:
        return None
    return [*out, reciprocal_rms(out[0], eps)] if with_rstd else list(out)


class Copied:
    """The producer of the grouped-GEMM ops: the tensor the graph computed, whose rows are the
    left operand `a`, copied where a GEMM would write its product (b, a zero-row view of the
    tensor, gives only N)."""

    @staticmethod
    def matmul_into(a_rows, b, bias, out, first_row: int = 0) -> None:
        out.copy_(a_rows)


def _all_reduce_computed(task: Task, plan: AllReducePlan, x, residual, norm_weight, eps,
                         weight_in_fp32, reduce_op):
    """all_reduce_fused's (h, y) with x's rows in place of a @ b (Copied), or None where
    declined."""
    if plan.overlap and plan.gemm == TRITON:
        return decline("a computed tensor: the persistent Triton GEMM beside push computes a "
                       "product (cuBLAS plans only)")
    rows = x.reshape(-1, x.shape[-1])
    return all_reduce_fused(task, plan, rows, rows[:0], None, x.shape, residual, norm_weight,
                            eps, weight_in_fp32, reduce_op, Copied)


def grouped_mm_all_reduce_fused(task: Task, plan: AllReducePlan, x, reduce_op, group_name,
                                world_size):
    out = _all_reduce_computed(task, plan, x, None, None, 0.0, False, reduce_op)
    return None if out is None else out[0]


def grouped_mm_all_reduce_rmsnorm_fused(task: Task, plan: AllReducePlan, x, residual,
                                        norm_weight, eps, weight_in_fp32, reduce_op, group_name,
                                        world_size, *, with_rstd=False):
    """matmul_all_reduce_rmsnorm_fused's outputs, for x in place of a @ b."""
    return _normed_outputs(_all_reduce_computed(task, plan, x, residual, norm_weight, eps,
                                                weight_in_fp32, reduce_op), eps, with_rstd)
