"""Fused GEMM + reduce-scatter with the reduction beside the GEMM (plan transfer="sm"; kernels:
templates/gemm_ready.py with SLICES = W, and templates/reduce_scatter.py).

One call on rank r: the persistent Triton GEMM on SMs - P programs of the main stream writes
a @ b (+ bias) into the half of my symmetric buffer of the call's epoch parity, chunk by chunk (each
chunk holds row-blocks of every rank's slice), raising READY per chunk; beside it, on P programs
of the side stream, pull_reduce_kernel sums my slice of every rank's partial as the chunks
become ready: the transfer rides on SM loads over NVLink and overlaps the GEMM. It is for
machines where the copy engine is slow (~150 GB/s per GPU through the plans on the 8-GPU
machine, SM loads 320-350: ARCHITECTURE.md); on 2 and 4 H200, where the copy engine pulls ~330,
it is slower than the copy-engine plan (benchmarks/NOTES.md, session 6). Epochs are device
words, as for the all-reduce (runtime/all_reduce.py): nothing on the host changes between calls,
so a call captured in a CUDA graph replays correctly once the context exists.

What this plan declines (operands TMA cannot take, slices that are not whole row-blocks of the
GEMM's tile) takes the op's reference path.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..scheduler.plan import ReduceScatterPlan
from ..templates import all_reduce as kernels
from ..templates.reduce_scatter import pull_reduce_kernel
from .all_reduce import WAIT_NAMES, device_epoch, gemm_beside, ready_gemm, tile_launch
from .context import get_context, size_class, wait_polls
from .fused import check_errors, decline, num_sms, tma_ok

CONTEXT = "matmul_reduce_scatter_pull"
stats = {"pulled": 0}  # calls this path served (tests check that it, not the fallback, ran)


def chunk_blocks(slice_blocks: int, chunks: int) -> int:
    """Row-blocks of each slice per chunk: the fewest that cut a slice of `slice_blocks` into
    equal chunks, at most `chunks` of them (and MAX_CHUNKS)."""
    most = max(1, min(chunks, kernels.MAX_CHUNKS))
    return next(g for g in range(1, slice_blocks + 1)
                if slice_blocks % g == 0 and slice_blocks // g <= most)


def pull_declines(m: int, k: int, n: int, world: int, esize: int, block_m: int) -> Optional[str]:
    """Why this plan cannot serve the shape (the GEMM's tile block_m rows high), or None."""
    if k == 0:
        return "K = 0"
    if (m // world) % block_m:
        return f"slices of {m // world} rows are not whole {block_m}-row blocks"
    if world > kernels.MAX_WORLD:
        return f"the flags serve up to {kernels.MAX_WORLD} ranks"
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
                      flag_words=kernels.FLAG_WORDS, create=not capturing)
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
        dev,
        lambda: ready_gemm(ctx, dev, a, b, bias, partial, b_trans, world * per_chunk,
                           sms - progs, tile, slices=world, parity_elems=half),
        lambda: pull_reduce_kernel[(progs,)](
            ctx.data.ptr_table, ctx.flags.ptr_table, dev.epoch, dev.arrive, ctx.err, out, rows,
            n, ctx.rank, per_chunk * tile["BLOCK_M"], half, 1.0 / world, wait_polls(plan),
            BLOCK=plan.pull_block, SCALE=reduce_op == "avg", num_warps=plan.pull_warps,
            **kernels.world_constants(world)))
    check_errors(ctx, plan, task.op, lambda code: WAIT_NAMES.get(code, code))
    stats["pulled"] += 1
    return out
