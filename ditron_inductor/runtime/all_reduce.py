"""Fused GEMM + all-reduce (+ residual + RMSNorm) on symmetric memory (kernels:
templates/all_reduce_push.py and all_reduce_lamport.py; what they share: all_reduce.py).

One call on rank r: cuBLAS writes a @ b (+ bias) into my symmetric buffer, then one kernel. The
plan (scheduler/cost_model.all_reduce_params picks by M) names the kernel:
  push_all (M <= 8 on more than 4 ranks): every rank stores its whole partial into a slot on
      every rank, waits once, sums its slots locally, adds its residual, normalises the rows.
  lamport (M 17-128 on up to 4 ranks): the partials are stored into their owners' slots, the
      owners' sums into every rank, with no flags: every receive word starts as -0.0, which no
      sender sends, and a receiver polls the data itself. lamport_all (M <= 16 on up to 4
      ranks): push_all with that mark instead of flags. The one-shots take a row a block where
      the rows allow (decode_grid): the norm in the same pass, no barrier.
  push (the rest): each rank sums its blocks from every peer and pushes the sums to every peer,
      copies the sums out adding its residual, normalises the rows; with overlap=True the kernel
      runs on a few SMs beside the GEMM (side stream), waiting on each row chunk's READY:
      gemm="triton", a persistent Triton GEMM on the other SMs that raises READY per finished
      chunk (templates/gemm_ready.py); else cuBLAS in row chunks, each followed by a 4-byte copy
      from the device epoch word into READY.
  push_scatter: push with the partials stored into their owners' slots instead of read by them
      (level with push at M 16-32, slower above: run only when a plan names it).
  copy_engine (prefill on 2 ranks): cuBLAS in row chunks on every SM, each chunk copied into
      my slot on every peer by the copy engine beside the next chunk's GEMM, then one kernel
      sums the slots, adds the residual and normalises (_copy_engine). Its flags are set and
      cleared within each call (no epochs).
  copy_engine_two_shot (a plan that names it; on 4x H100 slower than push beside the Triton
      GEMM, so never chosen): each rank's slice of the rows copied to it beside the GEMM,
      reduced there, the sums gathered by the copy engine (_copy_engine_two_shot).
One context per (group, size class) is shared by both ops and by push and push_scatter; push_all,
lamport and lamport_all have their own (_buffer_elements says why), and so have the copy-engine
plans (their slots, and flags of their own protocols).

Epochs are device words that the kernels advance, and every kernel leaves the buffers free for
the next call's GEMM when it ends (push: every peer has read and pushed before it raises PUSHED;
push_all and the lamport kernels: epoch-parity regions); copy_engine's flags end each call as
they began: nothing on the host changes between calls, and a call captured in a CUDA graph
replays correctly. The context must exist before capture (its setup is collective and
synchronises): a call captured before any eager call of its size class takes the reference
path. Inductor's CUDA-graph trees warm up eagerly first, which creates it.

FP8 (scaled_mm_all_reduce; the matcher fuses no RMSNorm tail into it): the same plans, the
GEMM a torch._scaled_mm (runtime/scaled.py) into the partial, which holds the output dtype
(bf16/fp16), the row chunks of the overlapped cuBLAS plan with their rows of a rowwise scale_a.
The overlapped plan with the persistent Triton GEMM declines.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import NamedTuple, Optional

import torch

from ..scheduler.plan import (
    COPY_ENGINE,
    COPY_ENGINE_MAX_N,
    COPY_ENGINE_TWO_SHOT,
    GEMV,
    TRITON,
    AllReducePlan,
)
from ..scheduler.task import Task
from ..templates import flags
from ..templates.all_reduce_lamport import EMPTY_BITS, lamport_all_kernel, lamport_kernel
from ..templates.all_reduce_push import push_all_kernel, push_kernel
from ..templates.reduce import sum_slots_norm_kernel
from . import driver
from .context import (
    OpContext,
    build_outside_graph_pools,
    device_epoch,
    get_context,
    size_class,
    wait_limit,
)
from .launch import (
    DTYPES,
    WAIT_NAMES,
    MatmulSum,
    check_errors,
    decline,
    gemm_beside,
    matmul_into,
    num_sms,
    ready_gemm,
    tile_launch,
    tma_ok,
    wait_geq,
)
from .kernel_launch import cdiv, current_stream, launch, next_power_of_2
from .scaled import Scaled
from .symm import group_barrier

stats = {"matmul_all_reduce": 0, "matmul_all_reduce_rmsnorm": 0, "scaled_mm_all_reduce": 0}
_CONTEXT = "all_reduce"


_MAX_BLOCK = 16384  # push_grid's largest block


def _buffer_elements(algo: str, numel: int, world: int) -> tuple[str, int]:
    """(context name, elements of its symmetric buffer) for a call of `numel` elements: room for
    every region (_regions) of the algorithm's layout. push_all has a context of its own: its
    slots are safe to overwrite only after calls of its own kind (module doc of
    templates/all_reduce_push.py); so have lamport and lamport_all: their receive words must
    hold the empty mark between calls, which no other kernel keeps. push and push_scatter share
    one. The slack: room for the scatter's (and lamport's) last, partial, block row."""
    slack = flags.MAX_WORLD * _MAX_BLOCK
    if algo in ("push_all", "lamport_all"):
        return f"{_CONTEXT}_{algo}", _regions(algo, world) * _slot_stride(numel)
    if algo == "lamport":
        return _CONTEXT + "_lamport", _regions(algo, world) * _slot_stride(numel + slack)
    return _CONTEXT, _regions(algo, world) * (numel + slack)


def _regions(algo: str, world: int) -> int:
    """The equal regions an algorithm's buffer is cut into: push and push_scatter, the partial
    and the scatter slots; push_all and lamport_all, the partial and W slots of each epoch
    parity; lamport, the partial, the scatter slots and the sums of each epoch parity."""
    return {"push_all": 1 + 2 * world, "lamport_all": 1 + 2 * world, "lamport": 5}.get(algo, 2)


def region_elements(buffer_elements: int, algo: str, world: int) -> int:
    """Elements per region of a buffer that size (fixed per context, so per call the regions
    never move; 16-byte aligned)."""
    return buffer_elements // _regions(algo, world) // 16 * 16


def _slot_stride(numel: int) -> int:
    return cdiv(numel, 16) * 16  # slots start 16-byte aligned


def _block_n(n: int) -> int:
    return min(4096, next_power_of_2(n))


def _declines(a, b, bias, residual, norm_weight, weight_in_fp32, reduce_op, shape,
              scaled=None):
    """Why the fused path cannot serve these inputs, or None (a scaled GEMM's operands and
    output dtype: Scaled.declines)."""
    if reduce_op != "sum":
        return f"reduce_op {reduce_op}"
    if scaled is None and (a.dtype not in DTYPES or b.dtype != a.dtype):
        return f"dtype {a.dtype} @ {b.dtype}"
    if a.dim() != 2 or b.dim() != 2:
        return "operands not 2-d"
    dtype = scaled.out_dtype if scaled else a.dtype  # the partial's and the output's
    m, n = a.shape[0], b.shape[1]
    if m == 0 or n == 0 or a.shape[1] == 0:
        return "empty"
    if bias is not None and (bias.dim() != 1 or bias.dtype != dtype or bias.shape[0] != n):
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
                     weight_in_fp32, reduce_op, scaled: Optional[Scaled | MatmulSum] = None):
    """(h, y) (y None without norm_weight), or None for inputs this path does not serve.
    scaled: the GEMM where it is not a @ b, its operands checked already: the scaled op's
    (float8 operands, Scaled.declines) or a sum of matmul products (MatmulSum, a and b the
    first term's), else None."""
    m, n = a.shape[0], b.shape[1]
    shape = list(out_shape) if len(out_shape) else [m, n]
    why = _declines(a, b, bias, residual, norm_weight, weight_in_fp32, reduce_op, shape, scaled)
    if why:
        return decline(why)
    dtype = scaled.out_dtype if scaled else a.dtype
    algo = plan.algo
    if algo in (COPY_ENGINE, COPY_ENGINE_TWO_SHOT):
        run = _copy_engine if algo == COPY_ENGINE else _copy_engine_two_shot
        out = run(task, plan, a, b, bias, residual, norm_weight, eps, weight_in_fp32, dtype,
                  scaled)
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
              dev.epoch, dev.arrive, ctx.err, h, h if y is None else y,
              h if residual is None else residual, h if norm_weight is None else norm_weight)
    consts = dict(HAS_RES=residual is not None, NORM=norm_weight is not None,
                  W_FP32=bool(weight_in_fp32), **flags.world_constants(ctx.world))
    if algo == "push_all":
        _push_all(ctx, plan, a, b, bias, partial, common, consts, float(eps), scaled)
    elif algo in ("lamport", "lamport_all"):
        _lamport(ctx, plan, a, b, bias, partial, common, consts, float(eps), scaled)
    else:
        _push(ctx, dev, plan, a, b, bias, partial, b_trans, common, consts, float(eps), scaled)
    check_errors(ctx, plan, task.op, lambda code: WAIT_NAMES.get(code, code))
    stats[task.op] += 1
    return h.view(shape), (None if y is None else y.view(shape))


def _row_chunks(plan: AllReducePlan, m):
    """(number of row chunks, rows per chunk) of the cuBLAS GEMM beside push (overlap=True)."""
    chunks = max(1, min(plan.chunks, flags.MAX_CHUNKS, m))
    rows = cdiv(m, chunks)
    return cdiv(m, rows), rows


def _cublas_chunks(ctx, dev, a, b, bias, partial, rows, carveout=None, scaled=None):
    """The GEMM in row chunks on the main stream, chunk 0 first on every rank (the order the
    reduction takes them in), READY[j] raised after chunk j by a 4-byte copy from the device
    epoch word. carveout: SMs cuBLAS leaves free (PyTorch's experimental SM carve-out, for the
    push beside it; None: cuBLAS takes every SM, the push programs wait for its waves).
    scaled: each chunk a _scaled_mm of its rows (runtime/scaled.py)."""
    m = partial.shape[0]
    main = current_stream()
    current_epoch = dev.epoch.data_ptr() + 4
    carve = carveout is not None and hasattr(torch._C, "_set_sm_carveout_experimental")
    if carve:
        before = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(carveout)
    try:
        for j in range(cdiv(m, rows)):
            lo, hi = j * rows, min((j + 1) * rows, m)
            matmul_into(a[lo:hi], b, bias, partial[lo:hi], scaled=scaled, first_row=lo)
            driver.memcpy(ctx.flag_addr(flags.READY + j), current_epoch, 4, main)
    finally:
        if carve:
            torch._C._set_sm_carveout_experimental(before)


def _ready_gemm_rows(plan: AllReducePlan, m):
    """Rows per chunk of the persistent GEMM beside push: whole row-blocks, about plan.chunks
    chunks, at most MAX_CHUNKS."""
    blocks = cdiv(m, plan.tile.block_m)
    chunks = max(1, min(plan.chunks, flags.MAX_CHUNKS))
    group = max(cdiv(blocks, chunks), cdiv(blocks, flags.MAX_CHUNKS))
    return group * plan.tile.block_m


@functools.lru_cache(maxsize=1024)  # called per call with the same few sizes
def push_grid(world, numel, sms, block=0, warps=0, progs=0, norm=False):
    """(programs, BLOCK, warps) of a push kernel (push_all: world=1, every rank handles every
    element): one 16-byte vector of 16-bit elements per thread and peer in a block (BLOCK = 256 x
    warps, at most 8 warps; 16384: 32 warps, two vectors); blocks of 256 to 1024 elements with
    about 32 or more programs at work, 4096 from 64 blocks of 4096 per rank up (measured best at
    M=32 and M >= 2048, all_reduce_h200x8_push_first.md, and at M=256,
    all_reduce_h200x8_push_scatter_push_all.md), 16384 from a block per program (MAX_PROGS)
    up: 4x the bytes in flight per SM (at world size 1 on H100, GEMM + push after it took 1.05x
    the time of cuBLAS + Inductor's residual + norm, against 1.22x with blocks of 4096:
    compute_parity_h100x1.md); with a norm at least 1024 (its rows go to 4 warps, not 1:
    faster at M=1, all_reduce_h200x8_push_remote_ready.md); fewer programs than SMs (the kernel
    waits on its own programs: all must be resident). block, warps, progs: a plan's choice (0:
    by size)."""
    per_rank = cdiv(numel, world)
    small = max(1024 if norm else 256,
                min(1024, next_power_of_2(per_rank // 32 + 1) // 2))
    block = block or (_MAX_BLOCK if per_rank >= flags.MAX_PROGS * _MAX_BLOCK
                      else 4096 if per_rank >= 64 * 4096 else small)
    warps = warps or (32 if block >= _MAX_BLOCK else max(1, min(8, block // 256)))
    cap = min(progs or flags.MAX_PROGS, flags.MAX_PROGS, sms - 4)
    return max(1, min(cap, cdiv(per_rank, block))), block, warps


def _launch(consts, n, block, warps):
    """A push kernel's compile-time launch arguments: the call's constants, BLOCK and warps
    from push_grid, the norm's row tile (BLOCK_N, at most 1024 elements a warp) and, where a
    block holds whole rows, ROW_BLOCK (row_block)."""
    return dict(consts, BLOCK=block, BLOCK_N=min(next_power_of_2(n), 1024 * warps),
                ROW_BLOCK=row_block(n, block) if consts["NORM"] else 0, num_warps=warps)


def row_block(n: int, block: int) -> int:
    """N where each block of the push kernel holds whole rows (N a power of two dividing
    BLOCK): its copy-out normalises them in the same pass; else 0."""
    return n if n & (n - 1) == 0 and block % n == 0 else 0


def decode_grid(plan: AllReducePlan, world: int, m: int, n: int, sms: int, norm: bool):
    """(programs, BLOCK, warps) of the one-shots and lamport (the decode kernels): push_grid's,
    but for a one-shot with a norm over rows of N elements (a power of two up to 16384) and no
    block named by the plan, blocks of whole rows (one for N >= 1024, warps = N / 512): the
    kernel normalises each block's rows as it writes them, with no barrier over its programs and
    no second pass over h. On 2 and 4 H100s that saved 1-2 us at M=1 and cost lamport's
    two-shot 2-5 us at M 16-128 (a row per owner: 4-16x fewer programs):
    all_reduce_h100x4_decode_rows.md."""
    block = plan.block
    one_shot = plan.algo in ("push_all", "lamport_all")
    if norm and one_shot and not block and n & (n - 1) == 0 and 1024 <= n <= _MAX_BLOCK:
        block = n
    warps = plan.warps or (max(4, min(32, block // 512)) if block and block == n else 0)
    return push_grid(world, m * n, sms, block, warps, plan.progs, norm=norm)


def _region(ctx, partial, algo):
    """Elements per region of this context's buffer (region_elements)."""
    return region_elements(ctx.data.nbytes // partial.element_size(), algo, ctx.world)


def _push(ctx, dev, plan: AllReducePlan, a, b, bias, partial, b_trans, common, consts, eps,
          scaled=None):
    """The GEMM, then the push kernel (templates/all_reduce_push.py) on the same stream. With
    overlap the push kernel's REDUCE runs beside the GEMM on the side stream, on `progs`
    programs (default 32): gemm="triton", the persistent GEMM on the other SMs, raising READY
    per chunk of whole row-blocks; else cuBLAS in row chunks (carveout=True: told to leave the
    push's SMs free, not yet measured). Its COPY and NORMALISE follow on the main stream on
    every SM. push_scatter: the partials reach their owners by stores into the second half of
    the buffer."""
    m, n = partial.shape
    scatter = plan.algo == "push_scatter"
    sms = num_sms(a.device)
    limit = wait_limit(plan)
    progs, block, warps = push_grid(ctx.world, m * n, sms, plan.block, plan.warps, plan.progs,
                                    norm=consts["NORM"])
    meta = dict(_launch(consts, n, block, warps), SCATTER=scatter)
    slots = _region(ctx, partial, plan.algo)
    if not plan.overlap:
        matmul_into(a, b, bias, partial, scaled=scaled, decode=plan.gemm == GEMV)
        launch(push_kernel, (progs,), *common, m, n, eps, ctx.rank, m, progs, slots, limit,
               **meta)
        return
    if plan.gemm == TRITON:
        rows = _ready_gemm_rows(plan, m)
        queue_gemm = lambda: ready_gemm(  # noqa: E731
            ctx, dev, a, b, bias, partial, b_trans, rows // plan.tile.block_m, sms - progs,
            tile_launch(plan.tile))
    else:
        rows = _row_chunks(plan, m)[1]
        carveout = progs if plan.carveout else None
        queue_gemm = lambda: _cublas_chunks(  # noqa: E731
            ctx, dev, a, b, bias, partial, rows, carveout, scaled)
    gemm_beside(ctx, dev, queue_gemm, lambda side: launch(
        push_kernel, (progs,), *common, m, n, eps, ctx.rank, rows, progs, slots, limit,
        stream=side, CHUNKED=True, COPY=False, NORMALISE=False, **meta))
    # the copy-out (+ residual) and the norm once the GEMM is done, on a multiple of `progs`
    # programs (the COPY phase's condition), as many as fit at once (the norm's barrier);
    # CHUNKED as the REDUCE beside the GEMM: it left my own blocks to this launch
    copy_progs = progs * max(1, min(flags.MAX_PROGS, sms - 4) // progs)
    launch(push_kernel, (copy_progs,), *common, m, n, eps, ctx.rank, rows, progs, slots, limit,
           CHUNKED=True, SEND=False, REDUCE=False, **meta)


def _push_all(ctx, plan: AllReducePlan, a, b, bias, partial, common, consts, eps, scaled=None):
    """The GEMM, then push_all_kernel: every rank's partial into a slot on every rank (the
    slots of this call's epoch parity), one wait, a local sum."""
    m, n = partial.shape
    progs, block, warps = decode_grid(plan, 1, m, n, num_sms(a.device), consts["NORM"])
    stride = _region(ctx, partial, "push_all")
    matmul_into(a, b, bias, partial, scaled=scaled, decode=plan.gemm == GEMV)
    launch(push_all_kernel, (progs,), *common, m, n, eps, ctx.rank, stride, stride,
           wait_limit(plan), **_launch(consts, n, block, warps))


def _lamport(ctx, plan: AllReducePlan, a, b, bias, partial, common, consts, eps, scaled=None):
    """The GEMM, then lamport_kernel or (lamport_all, push_all's grid: every rank handles
    every element) lamport_all_kernel (templates/all_reduce_lamport.py) on its context, whose
    words all hold the empty mark before the first call."""
    m, n = partial.shape
    if ctx not in _marked_empty:
        build_outside_graph_pools(ctx.device, lambda: _mark_empty(ctx))
        _marked_empty.add(ctx)
    one_shot = plan.algo == "lamport_all"
    progs, block, warps = decode_grid(plan, 1 if one_shot else ctx.world, m, n,
                                      num_sms(a.device), consts["NORM"])
    stride = _region(ctx, partial, plan.algo)
    meta = _launch(consts, n, block, warps)
    if not one_shot and not plan.block:  # the two-shot's rows measured slower on 2 and 4 ranks
        meta["ROW_BLOCK"] = 0            # (decode_grid): only a block a plan names takes them
    matmul_into(a, b, bias, partial, scaled=scaled, decode=plan.gemm == GEMV)
    kernel = lamport_all_kernel if one_shot else lamport_kernel
    launch(kernel, (progs,), *common, m, n, eps, ctx.rank, stride, wait_limit(plan), **meta)


_marked_empty: "weakref.WeakSet[OpContext]" = weakref.WeakSet()


def _mark_empty(ctx):
    """Every word of my buffer = the empty mark, on every rank before any rank sends (setup)."""
    ctx.data.local.view(torch.int16).fill_(EMPTY_BITS)
    group_barrier(ctx.backend.group)


# the copy-engine plan's sum + norm kernel: about this many elements a program (whole rows)
SUM_NORM_ELEMENTS = 8192


@dataclasses.dataclass(frozen=True)
class CopyEngineLayout:
    """What a copy-engine call of one shape does on this rank, worked out once per (context,
    M, N, dtype, the plan's chunks) (the host's time per call is what an eager launch pays):
    the slots [W, M, N] of the buffer, each row chunk's rows, its view of my slot and the
    copies of it into my slot on each peer, per copy stream; the peers each stream serves; the
    flag words READY and DONE go to."""

    slots: torch.Tensor
    chunk_rows: tuple  # ((lo, hi), ...)
    my_chunks: tuple  # my slot's rows of each chunk (cuBLAS writes them)
    sides: tuple  # copy streams (CUstream handles), one per peer up to MAX_STREAMS
    copies: tuple  # per chunk, per stream: ((dst, src, nbytes), ...)
    done_waits: tuple  # per stream: (the DONE flag words of its peers, ...)
    peers: tuple  # ring order, rank+1 first
    ready_to: tuple  # per stream: the peers' READY[r] words
    done_to: tuple  # every peer's DONE[r] word


_layouts: "weakref.WeakKeyDictionary[OpContext, dict]" = weakref.WeakKeyDictionary()
_MAX_LAYOUTS = 64  # per context (dynamic M): start over past it


def _cached_layout(ctx, key, build):
    """The context's layout for `key` (a copy-engine plan and its shape), built at the first
    call that needs it."""
    per_shape = _layouts.setdefault(ctx, {})
    layout = per_shape.get(key)
    if layout is None:
        if len(per_shape) >= _MAX_LAYOUTS:
            per_shape.clear()
        layout = per_shape[key] = build()
    return layout


def copy_engine_layout(ctx, task: Task, plan: AllReducePlan, dtype, m: int,
                       n: int) -> CopyEngineLayout:
    """The layout of a call of this shape on this context, made at its first call."""
    return _cached_layout(ctx, (COPY_ENGINE, m, n, dtype, plan.chunks),
                          lambda: _copy_engine_layout(ctx, task, plan, dtype, m, n))


def _copy_engine_layout(ctx, task: Task, plan: AllReducePlan, dtype, m: int,
                        n: int) -> CopyEngineLayout:
    chunks, rows = _row_chunks(plan, m)
    r, world = ctx.rank, ctx.world
    slots = ctx.data.view(-1, dtype, (world, m, n))
    slot_bytes, row_bytes = m * n * dtype.itemsize, n * dtype.itemsize
    mine = slots[r]
    peers = tuple(task.ring_order(r)[1:])
    sides = tuple(s.cuda_stream for s in ctx.sides(len(peers))) if peers else ()
    peers_of = [peers[i::len(sides)] for i in range(len(sides))]
    chunk_rows = tuple((j * rows, min((j + 1) * rows, m)) for j in range(chunks))
    return CopyEngineLayout(
        slots=slots, chunk_rows=chunk_rows,
        my_chunks=tuple(mine[lo:hi] for lo, hi in chunk_rows), sides=sides,
        copies=tuple(tuple(tuple((ctx.data_addrs[p] + r * slot_bytes + lo * row_bytes,
                                  mine.data_ptr() + lo * row_bytes, (hi - lo) * row_bytes)
                                 for p in ps) for ps in peers_of) for lo, hi in chunk_rows),
        done_waits=tuple(tuple(ctx.DONE + p for p in ps) for ps in peers_of), peers=peers,
        ready_to=tuple(tuple(ctx.peer_flag_addr(p, ctx.READY + r) for p in ps)
                       for ps in peers_of),
        done_to=tuple(ctx.peer_flag_addr(q, ctx.DONE + r) for q in peers))


# the copy-engine contexts whose first eager call set their flags up (capture needs it done)
_copy_engine_set_up: "weakref.WeakSet[OpContext]" = weakref.WeakSet()


# The copy-engine plans' flags: two groups of W words (word q of a group written by rank q),
# READY from word 0 and then, from word W (OpContext.DONE), the one-shot's DONE or the two-shot's
# GATHERED: their names where a bounded wait gives up
ONE_SHOT_FLAGS = ("READY (a peer's partial)", "DONE (a peer freeing my slot)")
TWO_SHOT_FLAGS = ("READY (a peer's partial of my slice)", "GATHERED (a peer's sums)")


def _copy_engine_context(task: Task, plan: AllReducePlan, algo: str, nbytes: int,
                         done_starts_set: bool):
    """The context of a copy-engine plan, or None (declined) in a CUDA graph capture before any
    eager call made it (its setup is collective). done_starts_set (the one-shot): at its first
    call the words from DONE on are set to 1, each saying that my slot on a peer is free; only
    this rank reads them, and a peer sets one only after my first signal reached it."""
    capturing = torch.cuda.is_current_stream_capturing()
    ctx = get_context(f"{_CONTEXT}_{algo}", task.group_name, plan.symm_mem_backend, nbytes,
                      create=not capturing)
    if ctx is not None and ctx not in _copy_engine_set_up and not capturing:
        if done_starts_set:
            ctx.flags.words[ctx.DONE:ctx.DONE + ctx.world].fill_(1)
        _copy_engine_set_up.add(ctx)
    if ctx is None or ctx not in _copy_engine_set_up:
        return decline("CUDA graph capture before any eager call of this size class")
    return ctx


def _sum_norm(slots, slot_stride, h, y, residual, norm_weight, m, n, eps, weight_in_fp32,
              world):
    """templates/reduce.sum_slots_norm_kernel on ROWS whole rows a program: h = the sum of the
    `world` slots (+ residual), y = its RMSNorm where a norm weight is given."""
    block_n = next_power_of_2(n)
    row_tile = max(1, SUM_NORM_ELEMENTS // block_n)
    launch(sum_slots_norm_kernel, (cdiv(m, row_tile),), slots, slot_stride, h,
           h if y is None else y, h if residual is None else residual,
           h if norm_weight is None else norm_weight, m, n, float(eps), WORLD=world,
           HAS_RES=residual is not None, NORM=norm_weight is not None,
           W_FP32=bool(weight_in_fp32), ROWS=row_tile, BLOCK_N=block_n,
           num_warps=max(4, min(16, row_tile * block_n // 512)))


def _copy_engine_declines(m, n, elements):
    """Why a copy-engine plan cannot serve [M, N] with buffers of `elements`, or None."""
    if next_power_of_2(n) > COPY_ENGINE_MAX_N:
        return f"the copy-engine all-reduce's sum holds whole rows: N={n} > {COPY_ENGINE_MAX_N}"
    if elements >= 2 ** 31:
        return "more than 2**31 elements in the buffers (32-bit offsets)"
    return None


def _copy_engine_flag(ctx, names, code: int) -> str:
    """The flag word a bounded wait of a copy-engine plan gave up on (its code - 1), by the
    plan's flag names."""
    group, q = divmod(code - 1, ctx.world)
    return f"{names[group]} of rank {q}"


def _take_flag(ctx, plan, stream: int, idx: int) -> None:
    """The stream waits until my flag word idx is 1, then clears it (a 0/1 flag's consumer)."""
    wait_geq(ctx, plan, stream, idx, 1)
    driver.write(stream, ctx.flag_addr(idx), 0)


def _copy_engine(task: Task, plan: AllReducePlan, a, b, bias, residual, norm_weight, eps,
                 weight_in_fp32, dtype, scaled=None):
    """algo="copy_engine": (h, y), or None where declined. Every rank's buffer holds W slots of
    [M, N], slot q for rank q's partial. Its flags hold 0 or 1, set by one rank and cleared by
    the other, so every call leaves them as it found them and queues the same operations: a
    call captured in a CUDA graph replays correctly, between eager calls too. On rank r:
      READY[q] = 1: rank q's partial is in my slot q (q sets it, I clear it once I waited)
      DONE[q] = 1: my slot r on rank q is free (q sets it after its sum, I clear it before my
                   copies into it; 1 from the context's first call, _copy_engine_context)
    One call on rank r:
      main stream   cuBLAS in plan.chunks row chunks straight into my slot r, an event after each
      copy streams  (after the main stream's earlier work) peer p (ring order, rank+1 first;
                    peer i on stream i % MAX_STREAMS): wait DONE[p] = 1, clear it; each chunk's
                    rows go into slot r of p as the chunk's event fires; then READY[r] = 1 on p
      main stream   wait READY[q] = 1 and clear it for every peer q, then one kernel sums the W
                    slots, adds my residual and normalises (templates/reduce.
                    sum_slots_norm_kernel); DONE[r] = 1 on every peer; join the copy streams (my
                    slot r is read by them until then: the next call's GEMM writes it)
    The copies ride on the copy engine beside the next chunks' GEMMs, which keep every SM: only
    the last chunk's copy and the sum are left after the GEMM. W - 1 partials leave each rank
    (NCCL's ring sends 2 (W-1)/W of one): at 2 ranks as much, beyond more."""
    m, n = a.shape[0], b.shape[1]
    world = task.world_size
    why = _copy_engine_declines(m, n, world * m * n)
    if why:
        return decline(why)
    ctx = _copy_engine_context(task, plan, COPY_ENGINE, world * m * n * dtype.itemsize, True)
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
        matmul_into(a[lo:hi], b, bias, out, scaled=scaled, first_row=lo)
        if not layout.sides:
            continue
        driver.record(events[j], main)
        for side, copies in zip(layout.sides, layout.copies[j]):
            driver.stream_wait(side, events[j])
            for dst, src, nbytes in copies:
                driver.memcpy(dst, src, nbytes, side)
    for i, (side, ready_to) in enumerate(zip(layout.sides, layout.ready_to)):
        for dst in ready_to:
            driver.write(side, dst, 1)
        driver.record(ctx.ev_sides[i], side)
    for q in layout.peers:
        _take_flag(ctx, plan, main, ctx.READY + q)
    h = torch.empty((m, n), dtype=dtype, device=a.device)
    y = torch.empty_like(h) if norm_weight is not None else None
    _sum_norm(layout.slots, m * n, h, y, residual, norm_weight, m, n, eps, weight_in_fp32, world)
    for dst in layout.done_to:  # my slots on the peers are free again; join the copies
        driver.write(main, dst, 1)
    for i in range(len(layout.sides)):
        driver.stream_wait(main, ctx.ev_sides[i])
    check_errors(ctx, plan, task.op, lambda code: _copy_engine_flag(ctx, ONE_SHOT_FLAGS, code))
    return h, y


class TwoShotPeer(NamedTuple):
    """What the two-shot copy-engine plan moves to one peer p, from rank r: the copies as
    (dst, src, bytes), the flag words it raises on p."""

    stream: int  # index of the copy stream serving p
    scatter: tuple  # my partial of p's slice into my slot on p
    gather: tuple  # my slice's sums into my rows of p's gathered sums
    ready_to: int  # READY[r] on p: my partial of its slice is there
    gathered_to: int  # GATHERED[r] on p: my slice's sums are there


@dataclasses.dataclass(frozen=True)
class TwoShotLayout:
    """A two-shot call of one shape on this rank, worked out once per (context, M, N, dtype):
    rank q's slice of the rows (balanced: sizes differ by at most one row), the GEMM's slices
    in order (ring order from rank+1, my own last) and each one's output (my slot of the
    receive slots for my own, the send rows for the others'), the buffer's views, the work of
    each peer (ring order) and the copy streams."""

    slices: tuple  # ((lo, hi), ...) of rank q
    order: tuple  # the GEMM's slices: the peers', then mine
    outs: tuple  # per slice of `order`, the view the GEMM writes
    recv: torch.Tensor  # [W, R, N]: slot q holds rank q's partial of my slice (R: its largest)
    gathered: torch.Tensor  # [M, N]: every slice's sums (mine written by my sum)
    sides: tuple  # copy streams (CUstream handles)
    peers: tuple  # TwoShotPeer of each peer, in ring order (= order[:-1])
    gathered_waits: tuple  # my GATHERED words, one per peer in ring order


def _balanced_slices(m: int, world: int) -> tuple:
    base, extra = divmod(m, world)
    bounds = [q * base + min(q, extra) for q in range(world + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def two_shot_elements(m: int, n: int, world: int) -> int:
    """The two-shot plan's buffer: W receive slots of a slice's rows, the send rows, the
    gathered sums."""
    return world * cdiv(m, world) * n + 2 * m * n


def two_shot_layout(ctx, task: Task, dtype, m: int, n: int) -> TwoShotLayout:
    """The layout of a call of this shape on this context, made at its first call."""
    return _cached_layout(ctx, (COPY_ENGINE_TWO_SHOT, m, n, dtype),
                          lambda: _two_shot_layout(ctx, task, dtype, m, n))


def _two_shot_layout(ctx, task: Task, dtype, m: int, n: int) -> TwoShotLayout:
    r, world = ctx.rank, ctx.world
    slices = _balanced_slices(m, world)
    rows, row_bytes = cdiv(m, world), n * dtype.itemsize
    recv_bytes = world * rows * row_bytes
    gathered_at = recv_bytes + m * row_bytes  # byte offsets in the buffer of every rank
    recv = ctx.data.view(-1, dtype, (world, rows, n))
    send = ctx.data.view(-1, dtype, (m, n), byte_offset=recv_bytes)
    gathered = ctx.data.view(-1, dtype, (m, n), byte_offset=gathered_at)
    ring = tuple(task.ring_order(r)[1:])
    sides = tuple(s.cuda_stream for s in ctx.sides(len(ring))) if ring else ()
    mine_lo, mine_hi = slices[r]
    gathered_flags = ctx.DONE  # GATHERED: the two-shot's second group (TWO_SHOT_FLAGS)
    peers = tuple(TwoShotPeer(
        stream=i % len(sides),
        scatter=(ctx.data_addrs[p] + r * rows * row_bytes, send[slices[p][0]].data_ptr(),
                 (slices[p][1] - slices[p][0]) * row_bytes),
        gather=(ctx.data_addrs[p] + gathered_at + mine_lo * row_bytes,
                gathered[mine_lo].data_ptr(), (mine_hi - mine_lo) * row_bytes),
        ready_to=ctx.peer_flag_addr(p, ctx.READY + r),
        gathered_to=ctx.peer_flag_addr(p, gathered_flags + r)) for i, p in enumerate(ring))
    order = ring + (r,)
    return TwoShotLayout(
        slices=slices, order=order,
        outs=tuple(recv[r][:hi - lo] if q == r else send[lo:hi]
                   for q in order for lo, hi in [slices[q]]),
        recv=recv, gathered=gathered, sides=sides, peers=peers,
        gathered_waits=tuple(gathered_flags + q for q in ring))


def _copy_engine_two_shot(task: Task, plan: AllReducePlan, a, b, bias, residual, norm_weight,
                          eps, weight_in_fp32, dtype, scaled=None):
    """algo="copy_engine_two_shot": (h, y), or None where declined. Rank q reduces slice q of the
    rows (two_shot_layout); the reduce-scatter rides on the copy engine beside the GEMM, the
    all-gather after the sums: 2 (W-1)/W of the partial leave each rank, as NCCL's ring (the
    one-shot copy_engine sends W - 1 partials), and only the gather is left after the GEMM.
    Flags hold 0 or 1, set by one rank and cleared by the other (capturable, as copy_engine's),
    on rank r: READY[q] (q's partial of my slice is in my slot q), GATHERED[q] (q's sums are in
    my gathered rows). One call on rank r:
      main stream   cuBLAS per slice, the peers' in ring order into the send rows (an event
                    after each), mine last into my slot r
      copy streams  peer p: p's slice into slot r on p as its event fires; READY[r] = 1 on p
      main stream   take READY[q] of every peer; the sum of my slot's W partials, rounded to
                    the dtype, into my gathered rows
      copy streams  (after the sum) peer p: my gathered rows into p's; GATHERED[r] = 1 on p
      main stream   take GATHERED[q] of every peer; one kernel adds my residual to the
                    gathered sums (h: the one-shot's roundings, whatever residual each rank
                    holds) and normalises them (y); join the copy streams
    No flag says that a place on a peer is free again (the one-shot's DONE): the gather makes
    every call a barrier. My copies of the next call into p start after my GEMM of its first
    slice, which follows my last pass of this call, which waited for p's GATHERED, which p
    raised after its sum (the reader of my slot on p); and p's copies of its sums into my rows
    follow p's sum, which waits for my READY of that call, raised after my GEMM of p's slice,
    which follows my last pass (the reader of my gathered rows)."""
    m, n = a.shape[0], b.shape[1]
    world = task.world_size
    if m < world:
        return decline(f"fewer rows than ranks: each rank reduces a slice of them (M={m})")
    elements = two_shot_elements(m, n, world)
    why = _copy_engine_declines(m, n, elements)
    if why:
        return decline(why)
    ctx = _copy_engine_context(task, plan, COPY_ENGINE_TWO_SHOT, elements * dtype.itemsize,
                               False)
    if ctx is None:
        return None
    main = current_stream()
    layout = two_shot_layout(ctx, task, dtype, m, n)
    events, r = ctx.chunk_events(world), ctx.rank
    ring = layout.order[:-1]
    for j, (q, out) in enumerate(zip(layout.order, layout.outs)):
        lo, hi = layout.slices[q]
        matmul_into(a[lo:hi], b, bias, out, scaled=scaled, first_row=lo)
        if q == r:
            continue
        peer = layout.peers[j]
        side = layout.sides[peer.stream]
        driver.record(events[j], main)
        driver.stream_wait(side, events[j])
        driver.memcpy(*peer.scatter, side)
        driver.write(side, peer.ready_to, 1)
    for q in ring:
        _take_flag(ctx, plan, main, ctx.READY + q)
    lo, hi = layout.slices[r]
    _sum_norm(layout.recv, layout.recv[0].numel(), layout.gathered[lo:hi], None, None, None,
              hi - lo, n, eps, False, world)
    if ring:  # my slice's sums are in place
        driver.record(ctx.ev_end, main)
    for i, side in enumerate(layout.sides):
        driver.stream_wait(side, ctx.ev_end)
        for peer in layout.peers[i::len(layout.sides)]:
            driver.memcpy(*peer.gather, side)
            driver.write(side, peer.gathered_to, 1)
        driver.record(ctx.ev_sides[i], side)
    for idx in layout.gathered_waits:
        _take_flag(ctx, plan, main, idx)
    h = torch.empty((m, n), dtype=dtype, device=a.device)
    y = torch.empty_like(h) if norm_weight is not None else None
    _sum_norm(layout.gathered, m * n, h, y, residual, norm_weight, m, n, eps, weight_in_fp32, 1)
    for i in range(len(layout.sides)):
        driver.stream_wait(main, ctx.ev_sides[i])
    check_errors(ctx, plan, task.op, lambda code: _copy_engine_flag(ctx, TWO_SHOT_FLAGS, code))
    return h, y


def matmul_all_reduce_fused(task: Task, plan: AllReducePlan, a, b, bias, out_shape, reduce_op,
                            group_name, world_size):
    """a, b: the op's terms, one each for a single matmul; a sum of several (MatmulSum) on the
    plans whose GEMM is cuBLAS, declined before the protocol starts, alike on every rank."""
    terms, why = MatmulSum.of(a, b)
    if why:
        return decline(why)
    if terms is not None and plan.overlap and plan.gemm == TRITON:
        return decline("a sum of matmul products: the persistent Triton GEMM beside push takes "
                       "one term (cuBLAS plans only)")
    out = all_reduce_fused(task, plan, a[0], b[0], bias, out_shape, None, None, 0.0, False,
                           reduce_op, terms)
    return None if out is None else out[0]


def scaled_mm_all_reduce_fused(task: Task, plan: AllReducePlan, a, b, scale_a, scale_b, bias,
                               out_dtype, use_fast_accum, out_shape, reduce_op, group_name,
                               world_size):
    # declined before the protocol starts, alike on every rank (plan, shapes and dtypes agree)
    if plan.overlap and plan.gemm == TRITON:
        return decline("fp8: the persistent Triton GEMM beside push takes no float8 (cuBLAS "
                       "plans only)")
    gemms, why = Scaled.checked(a, [b], scale_a, [scale_b], [bias], out_dtype, use_fast_accum)
    if why:
        return decline(why)
    out = all_reduce_fused(task, plan, a, b, bias, out_shape, None, None, 0.0, False, reduce_op,
                           gemms[0])
    return None if out is None else out[0]


def matmul_all_reduce_rmsnorm_fused(task: Task, plan: AllReducePlan, a, b, bias, out_shape,
                                    residual, norm_weight, eps, weight_in_fp32, reduce_op,
                                    group_name, world_size):
    return all_reduce_fused(task, plan, a, b, bias, out_shape, residual, norm_weight, eps,
                            weight_in_fp32, reduce_op)
