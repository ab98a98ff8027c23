"""The fused CUDA implementations of the ditron ops (registered with `ops.register_fused`).

All-gather + GEMM (one call, epoch e, this rank r of W, A chunk c = rank c's shard):
  main stream   wait DONE[p] >= e-2 for every peer (they finished reading my buffer of parity e%2)
                copy my shard into my symmetric buffer (parity e%2); READY[r] = e on every peer
  main stream   my shard into my rows of the gathered A, chunk_flags[r] = e
  copy streams  for p = r+1, r+2, ...: wait READY[p] >= e; copy-engine pull of p's shard into
                the gathered A;
                chunk_flags[p] = e (or an event, for the cuBLAS plan); finally DONE[r] = e on
                every peer
  main stream   the GEMM: a persistent Triton kernel whose tiles wait on chunk_flags (plan gemm=
                "triton"), or cuBLAS on groups of chunks in arrival order, each group after the
                events of its chunks (plan gemm="cublas"); then join the copy streams
  (plan transfer="sm", opt-in: one Triton kernel on a few SMs pulls every chunk instead of the
  copy engine, templates/transfer.py, and the GEMM leaves those SMs free)

GEMM + reduce-scatter (chunk c of the output rows belongs to rank c):
  main stream   for p = r+1, r+2, ..., r-1: partial_p = A[rows of p] @ B (+bias), then an event
  side stream   after each event: wait DONE[p] >= e-1 (p has reduced the last call, its slot is
                free); copy-engine push of partial_p into p's receive slot r; READY[r] = e on p
  main stream   my own partial straight into my receive slot r; wait READY[q] >= e for every q;
                out = sum of the W slots (x 1/W for avg); DONE[r] = e on every peer; join
  (plan transfer="sm": SMs pull and sum my rows of every rank's partial beside one persistent
  GEMM instead, runtime/reduce_scatter.py; it declines what it cannot serve, which this path
  then runs)

Signals are 4-byte copy-engine copies of a word holding the epoch (driver.py, context.py): every
stream operation is a ctypes driver call (~50 per fused call at W=8) because a torch op or a
Triton launch costs 10-100x more host time on the benchmark machine.

Each function returns None (the op runs its reference path) for inputs it does not serve.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton

from ..log_names import LOGGER_NAME
from ..ops import register_fused
from ..scheduler.plan import SM, TRITON, AllGatherPlan, FusedPlan, GemmTile, ReduceScatterPlan
from ..scheduler.task import Task
from . import driver
from .context import OpContext, get_context, wait_polls

log = logging.getLogger(LOGGER_NAME)

DTYPES = (torch.bfloat16, torch.float16)
# calls served by the fused path (tests check that the fused path, not the fallback, ran)
stats = {"all_gather_matmul": 0, "matmul_reduce_scatter": 0}


def decline(msg: str):
    log.debug("fused path declined: %s", msg)
    return None


# ---------------------------------------------------------------------------- stream-side flags


def _wait_geq(ctx: OpContext, plan: FusedPlan, stream: int, idx: int, value: int) -> None:
    """The stream (a CUstream handle) waits until my symmetric flag word idx >= value."""
    if value <= 0:
        return
    if plan.debug_waits:  # bounded: a kernel that gives up and names the flag
        from ..templates.comm import wait_flags_kernel

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            wait_flags_kernel[(1,)](ctx.flags.local.view(torch.int32), idx, 1, value,
                                    wait_polls(plan), ctx.err)
    else:
        driver.wait_geq(stream, ctx.flag_addr(idx), value)


def check_errors(ctx: OpContext, plan: FusedPlan, what: str, flag_name=None) -> None:
    """In debug mode, raise if a bounded wait of the last call gave up, naming its flag
    (`flag_name(code)`; by default the flag word and epoch)."""
    if not plan.debug_waits or torch.cuda.is_current_stream_capturing():
        return
    torch.cuda.synchronize()
    code = int(ctx.err.item())
    if code:
        ctx.err.zero_()
        flag = flag_name(code) if flag_name else f"flag {code - 1} (epoch {ctx.epoch})"
        raise RuntimeError(
            f"ditron: {what} on rank {ctx.rank}: a wait on {flag} gave up after "
            f"{plan.wait_timeout_s} s; a peer never signalled it (ranks running different "
            "programs?)")


def _gemm_failed(ctx: OpContext, main: int, exc: Exception):
    """The GEMM could not be launched (every rank fails alike: same config, same compiler). The
    transfers already queued complete (the peers signalled), the main stream joins them so the
    protocol's invariants hold, and the op takes its reference path."""
    driver.stream_wait(main, ctx.ev_end)
    log.warning("ditron: fused GEMM failed (%s: %s); running the reference path",
                type(exc).__name__, str(exc)[:300])
    return None


# ---------------------------------------------------------------------------- GEMM launchers


def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ok(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Optional[bool]:
    """None if TMA cannot take these operands, else whether B is given transposed ([N, K] rows)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return None
    k, n = b.shape
    if k % 8 or n % 8 or a.stride(1) != 1 or out.stride(1) != 1:
        return None
    if a.stride(0) % 8 or out.stride(0) % 8:
        return None
    for t in (a, b, out):
        if t.data_ptr() % 16:
            return None
    if b.stride(1) == 1 and b.stride(0) % 8 == 0:
        return False
    if b.stride(0) == 1 and b.stride(1) % 8 == 0:
        return True
    return None


def triton_gemm(a, b, bias, out, tile: GemmTile, *, flags=None, err=None, rows_per_chunk=1,
                first_row=0, epoch=0, num_progs=None, proxy_fence=False, polls=0):
    """out = a @ b (+ bias) with the persistent tile program; with flags, tiles wait on them
    (polls > 0: each wait gives up after that many polls, in debug mode)."""
    from ..templates.ag_gemm import ag_gemm_kernel, ag_gemm_tma_kernel

    m, k = a.shape
    n = b.shape[1]
    bm, bn, bk, group_m = tile.block_m, tile.block_n, tile.block_k, tile.group_m
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = num_progs or num_sms(a.device)
    if polls and flags is not None:
        sms = max(1, sms - 2)  # debug waits run as kernels on the side stream: leave them SMs
    progs = max(1, min(sms, tiles))
    wait = flags is not None
    if flags is None:
        flags = out  # unused
    if err is None:
        err = out
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    launch = dict(num_warps=tile.warps, num_stages=tile.stages)
    b_trans = tma_ok(a, b, out) if tile.tma else None
    if b_trans is not None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        b_desc = (TensorDescriptor.from_tensor(b.t(), [bn, bk]) if b_trans
                  else TensorDescriptor.from_tensor(b, [bk, bn]))
        c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
        ag_gemm_tma_kernel[(progs,)](
            a_desc, b_desc, c_desc, bias_arg, flags, err, m, n, k,
            rows_per_chunk, first_row, epoch, polls,
            HAS_BIAS=has_bias, WAIT=wait, B_TRANS=b_trans, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=group_m, NUM_PROGS=progs, PROXY_FENCE=proxy_fence, **launch)
    else:
        ag_gemm_kernel[(progs,)](
            a, b, out, bias_arg, flags, err, m, n, k,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            rows_per_chunk, first_row, epoch, polls,
            HAS_BIAS=has_bias, WAIT=wait, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=group_m, NUM_PROGS=progs, **launch)
    return out


def matmul_into(a, b, bias, out, tile: Optional[GemmTile] = None):
    """out = a @ b (+ bias): cuBLAS, or the Triton tile program where a tile is given."""
    if tile is not None:
        return triton_gemm(a, b, bias, out, tile)
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


def _runs(chunks: list[int]) -> list[tuple[int, int]]:
    """Consecutive chunk ids -> [first, last] runs (the ring order wraps from W-1 to 0)."""
    runs = []
    for c in chunks:
        if runs and runs[-1][1] == c - 1:
            runs[-1] = (runs[-1][0], c)
        else:
            runs.append((c, c))
    return runs


def chunk_groups(world: int, rank: int, sizes) -> list[list[int]]:
    """Arrival order (own chunk, then rank+1, rank+2, ...) cut into groups of the given sizes."""
    order = [(rank + i) % world for i in range(world)]
    groups, i = [], 0
    for s in sizes:
        if i >= world:
            break
        groups.append(order[i:i + s])
        i += s
    if i < world:
        groups.append(order[i:])
    return [g for g in groups if g]


# ---------------------------------------------------------------------------- all-gather + GEMM


@register_fused("all_gather_matmul")
def all_gather_matmul_fused(task: Task, plan: AllGatherPlan, a_shard, weights, biases, gather_dim,
                            group_name, world_size):
    if torch.cuda.is_current_stream_capturing():
        return decline("CUDA graph capture (epochs are host values)")
    if gather_dim != 0:
        if not task.rank_chunks_contiguous:
            return decline(f"gather_dim {gather_dim} interleaves the ranks' rows")
        # every dim before gather_dim has size 1: the same rows as a gather on dim 0
        lead = list(a_shard.shape[:gather_dim])
        outs = all_gather_matmul_fused(task, plan, a_shard.reshape(a_shard.shape[gather_dim:]),
                                       weights, biases, 0, group_name, world_size)
        if outs is not None:
            outs[0] = outs[0].view(lead + list(outs[0].shape))
        return outs
    if a_shard.dtype not in DTYPES or a_shard.dim() < 2:
        return decline(f"dtype {a_shard.dtype} / rank {a_shard.dim()}")
    k = a_shard.shape[-1]
    for w, b in zip(weights, biases):
        if w.dim() != 2 or w.shape[0] != k or w.dtype != a_shard.dtype or not w.is_cuda:
            return decline("weight shape/dtype")
        if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[1] or b.dtype != w.dtype
                              or b.stride(0) != 1):
            return decline("bias shape/dtype")
    rows = a_shard.numel() // k
    if rows == 0 or k == 0:
        return decline("empty input")
    esize = a_shard.element_size()
    shard_bytes = rows * k * esize
    half = max(shard_bytes, 1)
    ctx = get_context("all_gather_matmul", group_name, plan.symm_mem_backend, 2 * half)
    half = ctx.data.nbytes // 2
    W, r = ctx.world, ctx.rank
    e = ctx.next_epoch()
    parity = e % 2
    M = rows * W

    main = torch.cuda.current_stream().cuda_stream
    a2d = a_shard.reshape(rows, k)
    if not a2d.is_contiguous():
        a2d = a2d.contiguous()
    src = a2d.data_ptr()
    peers = [(r + i) % W for i in range(1, W)]  # ring order: the chunk of rank+1 first

    # 1. my buffer of this parity is free once every peer has pulled it two calls ago (DONE);
    #    fill it and tell the peers (READY[r] = e on each)
    for p in peers:
        _wait_geq(ctx, plan, main, ctx.DONE + p, e - 2)
    off = parity * half
    driver.memcpy(ctx.data_addrs[r] + off, src, shard_bytes, main)
    ctx.signal(main, 0, e, [ctx.peer_flag_addr(p, ctx.READY + r) for p in peers])

    use_triton = plan.gemm == TRITON
    gathered = torch.empty((M, k), dtype=a_shard.dtype, device=a_shard.device)
    g0 = gathered.data_ptr()
    flags0 = ctx.chunk_flags.data_ptr()

    if plan.transfer == SM and not (use_triton and shard_bytes % 4 == 0 and not plan.debug_waits):
        return decline("the SM pull takes a Triton GEMM, whole 4-byte words and unbounded waits")
    polls = wait_polls(plan)
    if plan.transfer == SM:
        # 2'. a few SMs pull every chunk (templates/transfer.py); the GEMM leaves them free and
        #     waits on the chunks' arrival counters
        nprog = plan.comm_sms
        counts, expect = ctx.counters(nprog)
        driver.record(ctx.ev_start, main)
        driver.stream_wait(ctx.side.cuda_stream, ctx.ev_start)
        from ..templates.transfer import ag_pull_kernel

        with torch.cuda.stream(ctx.side):
            ag_pull_kernel[(nprog,)](
                ctx.data.ptr_table, off // 4, gathered.view(-1).view(torch.int32),
                ctx.flags.local.view(torch.int32), counts, ctx.err, r, W, shard_bytes // 4,
                e, polls, BLOCK=plan.pull_block, num_warps=plan.pull_warps)
        # I have read every peer's buffer of this parity (DONE[r] = e on each)
        ctx.signal(ctx.side.cuda_stream, 1, e,
                   [ctx.peer_flag_addr(p, ctx.DONE + r) for p in peers])
        driver.record(ctx.ev_end, ctx.side.cuda_stream)
        outs = [torch.empty((M, w.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
                for w in weights]
        try:
            for w, b, out in zip(weights, biases, outs):
                triton_gemm(gathered, w, b, out, plan.tile, flags=counts, err=ctx.err,
                            rows_per_chunk=rows, first_row=r * rows, epoch=expect,
                            num_progs=num_sms(a_shard.device) - nprog, proxy_fence=True,
                            polls=polls)
        except Exception as exc:  # noqa: BLE001 - e.g. a config Triton cannot compile
            return _gemm_failed(ctx, main, exc)
        return _all_gather_done(ctx, plan, main, a_shard, gathered, outs)

    # 2. copy streams: the peers' shards pulled in ring order (the k-th on stream k % S), each
    #    followed by its chunk flag (Triton GEMM) or event (cuBLAS); my own rows on the main
    #    stream: a local copy runs on SMs, not on the copy engine (benchmarks/bench_copy.py), so
    #    on a copy stream, beside the GEMM, it held back every pull queued behind it
    sides = [s.cuda_stream for s in ctx.sides(plan.copy_streams)]
    driver.record(ctx.ev_start, main)
    for sh in sides:
        driver.stream_wait(sh, ctx.ev_start)
    for i, c in enumerate([r] + peers):
        sh = main if c == r else sides[(i - 1) % len(sides)]
        if c != r:
            _wait_geq(ctx, plan, sh, ctx.READY + c, e)
        driver.memcpy(g0 + c * shard_bytes, src if c == r else ctx.data_addrs[c] + off,
                      shard_bytes, sh)
        if use_triton:
            driver.write(sh, flags0 + 4 * c, e)
        else:
            driver.record(ctx.ev_chunks[c], sh)
    for sh, ev in zip(sides[1:], ctx.ev_sides):
        driver.record(ev, sh)
        driver.stream_wait(sides[0], ev)
    # I have read every peer's buffer of this parity (DONE[r] = e on each)
    ctx.signal(sides[0], 1, e, [ctx.peer_flag_addr(p, ctx.DONE + r) for p in peers])
    driver.record(ctx.ev_end, sides[0])

    # 3. the GEMM(s), overlapping the transfers
    outs = [torch.empty((M, w.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
            for w in weights]
    if use_triton:
        try:
            for w, b, out in zip(weights, biases, outs):
                triton_gemm(gathered, w, b, out, plan.tile, flags=ctx.chunk_flags, err=ctx.err,
                            rows_per_chunk=rows, first_row=r * rows, epoch=e, polls=polls)
        except Exception as exc:  # noqa: BLE001 - e.g. a config Triton cannot compile
            return _gemm_failed(ctx, main, exc)
    else:
        groups = chunk_groups(W, r, plan.groups)
        for g in groups:
            for c0, c1 in _runs(g):
                lo, hi = c0 * rows, (c1 + 1) * rows
                if (c0, c1) == (r, r):
                    a_rows = a2d  # my own rows alone: straight from the input, no wait at all
                else:
                    for c in range(c0, c1 + 1):
                        driver.stream_wait(main, ctx.ev_chunks[c])
                    a_rows = gathered[lo:hi]
                for w, b, out in zip(weights, biases, outs):
                    matmul_into(a_rows, w, b, out[lo:hi])
    return _all_gather_done(ctx, plan, main, a_shard, gathered, outs)


def _all_gather_done(ctx: OpContext, plan: AllGatherPlan, main: int, a_shard, gathered,
                     outs) -> list:
    """Join the transfer streams, surface kernel-side errors, and shape the op's outputs."""
    driver.stream_wait(main, ctx.ev_end)
    check_errors(ctx, plan, "all_gather_matmul")
    stats["all_gather_matmul"] += 1
    shape = list(a_shard.shape)
    shape[0] *= ctx.world
    return [gathered.view(shape)] + outs


# ------------------------------------------------------------------------ GEMM + reduce-scatter


@register_fused("matmul_reduce_scatter")
def matmul_reduce_scatter_fused(task: Task, plan: ReduceScatterPlan, a, b, bias, out_shape, scatter_dim,
                                reduce_op, group_name, world_size):
    if reduce_op not in ("sum", "avg"):
        return decline(f"reduce_op {reduce_op}")
    if scatter_dim != 0:
        if not task.rank_chunks_contiguous:
            return decline(f"scatter_dim {scatter_dim} interleaves the ranks' rows")
        # every dim before scatter_dim has size 1: the same rows as a scatter on dim 0
        lead = list(out_shape[:scatter_dim])
        out = matmul_reduce_scatter_fused(task, plan, a, b, bias, list(out_shape[scatter_dim:]),
                                          0, reduce_op, group_name, world_size)
        return None if out is None else out.view(lead + list(out.shape))
    if a.dtype not in DTYPES or a.dim() != 2 or b.dim() != 2 or b.dtype != a.dtype:
        return decline("dtype or rank")
    if bias is not None and (bias.dim() != 1 or bias.dtype != a.dtype or bias.shape[0] != b.shape[1]):
        return decline("bias")
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
    esize = a.element_size()
    chunk_bytes = rows * N * esize
    ctx = get_context("matmul_reduce_scatter", group_name, plan.symm_mem_backend, W * chunk_bytes)
    r = ctx.rank
    e = ctx.next_epoch()
    main = torch.cuda.current_stream().cuda_stream
    side = ctx.side.cuda_stream
    tile = plan.tile if plan.gemm == TRITON else None

    driver.record(ctx.ev_start, main)
    driver.stream_wait(side, ctx.ev_start)
    tape = ctx.tape_addr(1, e)
    driver.write(side, tape, e)
    staging = torch.empty((W - 1, rows, N), dtype=a.dtype, device=a.device)
    st0 = staging.data_ptr()
    for i in range(1, W):
        p = (r + i) % W  # the chunk for rank+1 first
        matmul_into(a[p * rows:(p + 1) * rows], b, bias, staging[i - 1], tile)
        driver.record(ctx.ev_chunks[p], main)
        driver.stream_wait(side, ctx.ev_chunks[p])
        _wait_geq(ctx, plan, side, ctx.DONE + p, e - 1)  # p has reduced the last call: slot r is free
        driver.memcpy(ctx.data_addrs[p] + r * chunk_bytes, st0 + (i - 1) * chunk_bytes,
                      chunk_bytes, side)
        driver.memcpy(ctx.peer_flag_addr(p, ctx.READY + r), tape, 4, side)  # READY[r] = e on p
    mine = ctx.data.view(-1, a.dtype, (W, rows, N))
    matmul_into(a[r * rows:(r + 1) * rows], b, bias, mine[r], tile)
    for q in range(W):
        if q != r:
            _wait_geq(ctx, plan, main, ctx.READY + q, e)
    if plan.reduce == TRITON:
        from ..templates.reduce import reduce_slots_kernel

        out = torch.empty((rows, N), dtype=a.dtype, device=a.device)
        n = rows * N
        reduce_slots_kernel[(triton.cdiv(n, 4096),)](
            mine, out, n, n, W, (1.0 / W) if reduce_op == "avg" else 1.0, BLOCK=4096,
            num_warps=8)
    elif reduce_op == "avg":
        out = torch.mean(mine, dim=0)
    else:
        out = torch.sum(mine, dim=0)
    # my slots are free again (DONE[r] = e on every peer)
    ctx.signal(main, 0, e, [ctx.peer_flag_addr(q, ctx.DONE + r) for q in range(W) if q != r])
    driver.record(ctx.ev_end, side)
    driver.stream_wait(main, ctx.ev_end)
    check_errors(ctx, plan, "matmul_reduce_scatter")
    stats["matmul_reduce_scatter"] += 1
    return out.view(out_shape_scattered)
