"""Fused all-gather + GEMM on symmetric memory (kernels: templates/ag_gemm.py, transfer.py).

One call (epoch e, rank r of W; chunk c of the gathered A is rank c's shard):
  local stream  wait DONE[p] >= e-2 for every peer p (it has pulled my buffer of parity e%2);
                copy my shard into that buffer and my rows of the gathered A; READY[r] = e on
                every peer
  copy streams  for p = r+1, r+2, ...: wait READY[p] >= e, copy-engine pull of p's shard, then
                chunk_flags[p] = e (Triton) or an event (cuBLAS); finally DONE[r] = e on every peer
  main stream   the GEMM: a persistent Triton kernel whose tiles wait on chunk_flags, or cuBLAS
                on groups of chunks in arrival order, each after its chunks' events
The local stream is the main one before the Triton GEMM, which reads my rows from the gathered A
(both copies one kernel); beside cuBLAS, whose GEMM of my rows reads the input, a stream of its
own. ready_before_gemm and barrier_beside move the buffer's copy and a barrier (wait READY[p] >=
e for every peer) before the GEMM (scheduler/plan.AllGatherPlan).

FP8 (all_gather_scaled_mm): the cuBLAS plan on float8 bytes, each group's GEMM a _scaled_mm;
tensorwise scales only (a rowwise scale_a would need its own gather). Flags are stream writes
and waits of the driver (context.py; driver.py says why).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..scheduler.plan import CUBLAS, TRITON, AllGatherPlan
from ..scheduler.precision import FLOAT8
from ..scheduler.task import Task
from ..templates.transfer import copy_twice_kernel
from . import driver, faults
from .context import OpContext, get_context, wait_limit
from .kernel_launch import current_stream, launch, preload
from .launch import (DTYPES, check_errors, decline, gemm_failed, matmul_into, num_sms, triton_gemm,
                     wait_geq)
from .scaled import Scaled

# calls served by the fused path (tests check that the fused path, not the fallback, ran)
stats = {"all_gather_matmul": 0, "all_gather_scaled_mm": 0}


def all_gather_scaled_mm_fused(task: Task, plan: AllGatherPlan, a_shard, scale_a, weights,
                               scales_b, biases, out_dtype, use_fast_accum, gather_dim,
                               group_name, world_size):
    # what _scaled_mm would reject once the peers were signalled
    if plan.gemm != CUBLAS:
        return decline("fp8: the cuBLAS plan only (_scaled_mm per group of chunks)")
    if scale_a.numel() != 1 or any(s.numel() != 1 for s in scales_b):
        return decline(f"fp8: {task.scales} scales (tensorwise only)")
    scaled, why = Scaled.checked(a_shard.reshape(-1, a_shard.shape[-1]), weights, scale_a,
                                 scales_b, biases, out_dtype, use_fast_accum)
    if why:
        return decline(why)
    return all_gather_matmul_fused(task, plan, a_shard, weights, biases, gather_dim, group_name,
                                   world_size, scaled)


def chunk_runs(chunks: list[int]) -> list[tuple[int, int]]:
    """Consecutive chunk ids -> [first, last] runs (the ring order wraps from W-1 to 0)."""
    runs = []
    for c in chunks:
        if runs and runs[-1][1] == c - 1:
            runs[-1] = (runs[-1][0], c)
        else:
            runs.append((c, c))
    return runs


def chunk_groups(order: list[int], sizes) -> list[list[int]]:
    """The arrival (ring) order, own chunk first, cut into groups of the given sizes."""
    groups, i = [], 0
    for s in sizes:
        groups.append(order[i:i + s])
        i += s
    groups.append(order[i:])  # the chunks the sizes leave over
    return [g for g in groups if g]


def all_gather_matmul_fused(task: Task, plan: AllGatherPlan, a_shard, weights, biases, gather_dim,
                            group_name, world_size, scaled: Optional[list[Scaled]] = None):
    """scaled: the scaled op's GEMM of each weight (float8 operands), else None."""
    if torch.cuda.is_current_stream_capturing():
        return decline("CUDA graph capture (epochs are host values)")
    if gather_dim != 0:
        if not task.rank_chunks_contiguous:
            return decline(f"gather_dim {gather_dim} interleaves the ranks' rows")
        # every dim before gather_dim has size 1: the same rows as a gather on dim 0
        lead = list(a_shard.shape[:gather_dim])
        outs = all_gather_matmul_fused(task, plan, a_shard.reshape(a_shard.shape[gather_dim:]),
                                       weights, biases, 0, group_name, world_size, scaled)
        if outs is not None:
            outs[0] = outs[0].view(lead + list(outs[0].shape))
        return outs
    if a_shard.dtype not in (FLOAT8 if scaled else DTYPES) or a_shard.dim() < 2:
        return decline(f"dtype {a_shard.dtype} / rank {a_shard.dim()}")
    k = a_shard.shape[-1]
    out_dtype = scaled[0].out_dtype if scaled else a_shard.dtype
    for w, b in zip(weights, biases):
        w_dtype_ok = w.dtype in FLOAT8 if scaled else w.dtype == a_shard.dtype
        if w.dim() != 2 or w.shape[0] != k or not w_dtype_ok or w.device != a_shard.device:
            return decline("weight shape/dtype/device")
        if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[1] or b.dtype != out_dtype
                              or b.stride(0) != 1):
            return decline("bias shape/dtype")
    if a_shard.numel() == 0:
        return decline("empty input")
    rows = a_shard.numel() // k
    shard_bytes = rows * k * a_shard.element_size()
    faults.check_shapes("all_gather_matmul", group_name, (rows, k, str(a_shard.dtype)),
                        plan.wait_timeout_s)
    ctx = get_context("all_gather_matmul", group_name, plan.symm_mem_backend, 2 * shard_bytes)
    W, r = ctx.world, ctx.rank
    e = ctx.next_epoch()
    M = rows * W

    main = current_stream()
    a2d = a_shard.reshape(rows, k).contiguous()
    src = a2d.data_ptr()
    order = task.ring_order(r)
    peers = order[1:]

    use_triton = plan.gemm == TRITON
    driver.record(ctx.ev_start, main)  # the input is ready
    local = main if use_triton else ctx.local.cuda_stream  # the module docstring says why
    if local != main:
        driver.stream_wait(local, ctx.ev_start)

    off = e % 2 * (ctx.data.nbytes // 2)  # my buffer of this call's parity
    gathered = torch.empty((M, k), dtype=a_shard.dtype, device=a_shard.device)
    limit = wait_limit(plan, ctx)

    # before the Triton GEMM, one kernel makes both local copies, loaded before anything is
    # queued (kernel_launch.preload says why); beside cuBLAS it is no faster than two memcpys
    copy_twice = (copy_twice_args(ctx, a2d, gathered, off,
                                  COPY_TWICE_PROGRAMS_PER_SM * num_sms(a_shard.device))
                  if use_triton else None)
    if copy_twice is not None:
        preload(*copy_twice, **COPY_TWICE_META)

    # 1. my buffer of this parity, then READY. ready_before_gemm: on the main stream, as beside
    #    cuBLAS's persistent kernels (every SM) a local copy waits for the GEMM's last wave, and
    #    every peer's pull (hence its GEMM of my rows) with it
    buffer = main if plan.ready_before_gemm else local
    for p in peers:
        wait_geq(ctx, plan, buffer, ctx.DONE + p, e - 2)
    if copy_twice is not None:
        launch(*copy_twice, stream=buffer, **COPY_TWICE_META)
    else:
        driver.memcpy(ctx.data_addrs[r] + off, src, shard_bytes, buffer)
    ctx.signal(buffer, e, [ctx.peer_flag_addr(p, ctx.READY + r) for p in peers])
    if buffer != local:  # my rows of the gathered A after that copy, not before it
        driver.record(ctx.ev_buffer, main)
        driver.stream_wait(local, ctx.ev_buffer)
    g0 = gathered.data_ptr()
    flags0 = ctx.chunk_flags.data_ptr()

    # 2. the pulls in ring order, the k-th on copy stream k % S; my rows on the local stream:
    #    a local copy runs on SMs (benchmarks/bench_copy.py), so on a copy stream beside the
    #    GEMM it would hold back every pull queued behind it
    sides = [s.cuda_stream for s in ctx.sides(plan.copy_streams)]
    for sh in sides:
        driver.stream_wait(sh, ctx.ev_start)
    if plan.ready_before_gemm:
        # the barrier (as in PyTorch's async TP), the pulls after it through an event: waited
        # for on the copy streams, the pulls would start well after my READY has gone out
        barrier = local if plan.barrier_beside else main
        for p in peers:
            wait_geq(ctx, plan, barrier, ctx.READY + p, e)
        driver.record(ctx.ev_ready, barrier)
        for sh in sides:
            driver.stream_wait(sh, ctx.ev_ready)
    for i, c in enumerate([r] + peers):
        sh = local if c == r else sides[(i - 1) % len(sides)]
        if c != r:
            if not plan.ready_before_gemm:
                wait_geq(ctx, plan, sh, ctx.READY + c, e)
            driver.memcpy(g0 + c * shard_bytes, ctx.data_addrs[c] + off, shard_bytes, sh)
        elif copy_twice is None:
            driver.memcpy(g0 + c * shard_bytes, src, shard_bytes, sh)
        if use_triton:
            driver.write(sh, flags0 + 4 * c, e)
        else:
            driver.record(ctx.ev_chunks[c], sh)
    for sh, ev in zip(sides[1:], ctx.ev_sides):
        driver.record(ev, sh)
        driver.stream_wait(sides[0], ev)
    # I have read every peer's buffer of this parity (DONE[r] = e on each)
    ctx.signal(sides[0], e, [ctx.peer_flag_addr(p, ctx.DONE + r) for p in peers])
    driver.record(ctx.ev_end, sides[0])

    # 3. the GEMM(s), overlapping the transfers
    outs = [torch.empty((M, w.shape[1]), dtype=out_dtype, device=a_shard.device)
            for w in weights]
    if use_triton:
        try:
            for w, b, out in zip(weights, biases, outs):
                triton_gemm(gathered, w, b, out, plan.tile, flags=ctx.chunk_flags,
                            err=faults.site_words(ctx, plan.site),
                            rows_per_chunk=rows, first_row=r * rows, epoch=e, limit=limit,
                            waits_beside=bool(peers))
        except Exception as exc:  # noqa: BLE001 - e.g. a config Triton cannot compile
            return gemm_failed(ctx, main, exc)
    else:
        groups = chunk_groups(order, plan.groups)
        for g in groups:
            for c0, c1 in chunk_runs(g):
                lo, hi = c0 * rows, (c1 + 1) * rows
                if (c0, c1) == (r, r):
                    a_rows = a2d  # my own rows alone: straight from the input, no wait at all
                else:
                    for c in range(c0, c1 + 1):
                        driver.stream_wait(main, ctx.ev_chunks[c])
                    a_rows = gathered[lo:hi]
                for i, (w, b, out) in enumerate(zip(weights, biases, outs)):
                    matmul_into(a_rows, w, b, out[lo:hi], scaled=scaled[i] if scaled else None)
        driver.stream_wait(main, ctx.ev_chunks[r])  # my rows of the gathered A
    op = "all_gather_scaled_mm" if scaled else "all_gather_matmul"
    driver.stream_wait(main, ctx.ev_end)  # join the transfer streams
    check_errors(ctx, plan, op)
    stats[op] += 1
    shape = list(a_shard.shape)
    shape[0] *= W
    return [gathered.view(shape)] + outs


# the local copies' kernel: a few programs per SM in a grid-stride loop (one grid for every size)
COPY_TWICE_META = dict(BLOCK=4096, num_warps=8)
COPY_TWICE_PROGRAMS_PER_SM = 2


def copy_twice_args(ctx: OpContext, a2d, gathered, off: int, programs: int) -> Optional[tuple]:
    """launch's arguments for my shard -> my symmetric buffer (at byte `off`) and my rows of the
    gathered A; None where the shard is not whole aligned 4-byte words (two memcpys then)."""
    nbytes = a2d.numel() * a2d.element_size()
    if nbytes % 4 or a2d.data_ptr() % 4 or off % 4:
        return None
    words = nbytes // 4
    src = a2d.view(-1).view(torch.int32)
    mine = gathered.view(-1).view(torch.int32)[ctx.rank * words:(ctx.rank + 1) * words]
    buffer = ctx.data.view(-1, torch.int32, (words,), off)
    return copy_twice_kernel, (programs,), src, buffer, mine, words
