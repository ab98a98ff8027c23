"""Fused GEMM + reduce-scatter on symmetric memory (chunk c of the output rows belongs to rank c;
the sum's kernel: templates/reduce.py).

One call (epoch e, rank r of W; my receive buffer holds W slots, slot q for rank q's partial):
  main stream   for p = r+1, r+2, ..., r-1: partial_p = A[rows of p] @ B (+bias) by cuBLAS into a
                staging buffer, then an event
  side stream   after each event: wait DONE[p] >= e-1 (p has reduced the last call: its slot is
                free), copy-engine push of partial_p into p's slot r, READY[r] = e on p
  main stream   my own partial straight into my slot r; wait READY[q] >= e for every q; out = the
                slots' sum (x 1/W for avg) by torch or reduce_slots_kernel (plan reduce);
                DONE[r] = e on every peer; join the side stream
Epochs are host values: a call declines during CUDA graph capture. A sum of matmul products
(MatmulSum) accumulates each further term's product of the same rows before the push. FP8
(scaled_mm_reduce_scatter): each rank's rows a torch._scaled_mm (runtime/scaled.py) in the
output dtype (what is pushed and summed), a rowwise scale_a sliced with the rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..scheduler.plan import TRITON, ReduceScatterPlan
from ..scheduler.task import Task
from ..templates.reduce import reduce_slots_kernel
from . import driver, faults
from .context import get_context
from .kernel_launch import cdiv, current_stream, launch
from .launch import MatmulSum, bias_serves, check_errors, decline, matmul_into, wait_geq
from .scaled import Scaled, ScaledSum

# calls served by the fused path (tests check that the fused path, not the fallback, ran)
stats = {"matmul_reduce_scatter": 0, "scaled_mm_reduce_scatter": 0}


def scaled_mm_reduce_scatter_fused(task: Task, plan: ReduceScatterPlan, a, b, scale_a, scale_b,
                                   bias, out_dtype, use_fast_accum, out_shape, scatter_dim,
                                   reduce_op, group_name, world_size):
    """a, b, scale_a, scale_b: one per term of the sum (ScaledSum), one for a single product."""
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
    """a, b: the op's terms (several: a sum of products, MatmulSum)."""
    terms, why = MatmulSum.of(a, b)
    if why:
        return decline(why)
    if not bias_serves(bias, a[0].dtype, b[0].shape[1]):
        return decline("bias")
    return _reduce_scatter(task, plan, a[0], b[0], bias, out_shape, scatter_dim, reduce_op,
                           group_name, world_size, terms)


def _reduce_scatter(task: Task, plan: ReduceScatterPlan, a, b, bias, out_shape, scatter_dim,
                    reduce_op, group_name, world_size,
                    scaled: Optional[Scaled | ScaledSum | MatmulSum] = None):
    """The first term's a and b; scaled: the GEMM where it is not a @ b, checked already (float8:
    a Scaled, or a ScaledSum of terms; a sum of matmul products: a MatmulSum)."""
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
    M, N = a.shape[0], b.shape[1]
    W = world_size
    shape = list(out_shape) if len(out_shape) else [M, N]
    if M % W or shape[0] % W or M * N == 0:
        return decline("rows do not divide by the world size")
    out_shape_scattered = [shape[0] // W] + shape[1:]
    if torch.cuda.is_current_stream_capturing():
        return decline("CUDA graph capture (epochs are host values)")
    rows = M // W
    chunk_bytes = rows * N * dtype.itemsize
    faults.check_shapes("matmul_reduce_scatter", group_name, (M, N, str(dtype)),
                        plan.wait_timeout_s)
    ctx = get_context("matmul_reduce_scatter", group_name, plan.symm_mem_backend, W * chunk_bytes)
    r = ctx.rank
    e = ctx.next_epoch()
    main = current_stream()
    side = ctx.side.cuda_stream

    driver.record(ctx.ev_start, main)
    driver.stream_wait(side, ctx.ev_start)
    staging = torch.empty((W - 1, rows, N), dtype=dtype, device=a.device)
    st0 = staging.data_ptr()
    for i, p in enumerate(task.ring_order(r)[1:], start=1):  # the chunk for rank+1 first
        matmul_into(a[p * rows:(p + 1) * rows], b, bias, staging[i - 1], scaled=scaled,
                    first_row=p * rows)
        driver.record(ctx.ev_chunks[p], main)
        driver.stream_wait(side, ctx.ev_chunks[p])
        # p has reduced the last call: slot r is free
        wait_geq(ctx, plan, side, ctx.DONE + p, e - 1)
        driver.memcpy(ctx.data_addrs[p] + r * chunk_bytes, st0 + (i - 1) * chunk_bytes,
                      chunk_bytes, side)
        ctx.signal(side, e, [ctx.peer_flag_addr(p, ctx.READY + r)])  # READY[r] = e on p
    mine = ctx.data.view(-1, dtype, (W, rows, N))
    matmul_into(a[r * rows:(r + 1) * rows], b, bias, mine[r], scaled=scaled, first_row=r * rows)
    for q in range(W):
        if q != r:
            wait_geq(ctx, plan, main, ctx.READY + q, e)
    if plan.reduce == TRITON:
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

