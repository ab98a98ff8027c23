"""Fused GEMM + all-gather of its output on symmetric memory (slot q of the gathered output is
rank q's product).

One call (epoch e, rank r of W; my buffer holds W slots of [M, N], slot q for rank q's product):
  main stream   my product by cuBLAS in plan.chunks row chunks, straight into my slot r, an
                event after each
  side stream   wait DONE[p] >= e-1 for every peer p (p has copied the last call's slots out:
                its slot r is free); after each chunk's event, a copy-engine push of the chunk's
                rows into slot r on every peer (rank+1 first); then READY[r] = e on every peer
  main stream   wait READY[q] >= e for every q; out = the slots concatenated along the gather
                dim (the copy the graph's split + cat made anyway); DONE[r] = e on every peer;
                join the side stream
Each chunk's pushes run beside the next chunk's GEMM: the last chunk's are exposed. Epochs are
host values: a call declines during CUDA graph capture.
"""

from __future__ import annotations

import torch

from ..scheduler.plan import MatmulAllGatherPlan
from ..scheduler.task import Task
from . import driver, faults
from .context import get_context
from .kernel_launch import current_stream
from .launch import DTYPES, bias_serves, check_errors, decline, matmul_into, wait_geq

# calls served by the fused path (tests check that the fused path, not the fallback, ran)
stats = {"matmul_all_gather": 0}

ROW_ALIGN = 128  # chunks start on a multiple of the GEMM's tile rows where the rows allow


def chunk_bounds(m: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each row chunk: `chunks` about equal parts of m rows, no empty one."""
    chunks = max(1, min(chunks, m))
    step = -(-m // chunks)
    if m >= ROW_ALIGN * chunks:
        step = -(-step // ROW_ALIGN) * ROW_ALIGN
    return [(lo, min(lo + step, m)) for lo in range(0, m, step)]


def matmul_all_gather_fused(task: Task, plan: MatmulAllGatherPlan, a, b, bias, out_shape,
                            gather_dim, group_name, world_size):
    if (a.dtype not in DTYPES or b.dtype != a.dtype or a.dim() != 2 or b.dim() != 2
            or a.shape[1] != b.shape[0]):
        return decline("dtype, rank or shape of the operands")
    if not bias_serves(bias, a.dtype, b.shape[1]):
        return decline("bias")
    M, N, W = a.shape[0], b.shape[1], world_size
    shape = list(out_shape) if len(out_shape) else [M, N]
    if M * N == 0:
        return decline("an empty product")
    if torch.cuda.is_current_stream_capturing():
        return decline("CUDA graph capture (epochs are host values)")
    faults.check_shapes(task.op, group_name, (M, N, str(a.dtype)), plan.wait_timeout_s)
    row_bytes = N * a.dtype.itemsize
    ctx = get_context(task.op, group_name, plan.symm_mem_backend, W * M * row_bytes)
    r = ctx.rank
    e = ctx.next_epoch()
    peers = task.ring_order(r)[1:]
    main = current_stream()
    side = ctx.side.cuda_stream
    slots = ctx.data.view(-1, a.dtype, (W, M, N))

    driver.record(ctx.ev_start, main)
    driver.stream_wait(side, ctx.ev_start)
    for p in peers:  # p has copied the last call's slots out: my slot on p is free
        wait_geq(ctx, plan, side, ctx.DONE + p, e - 1)
    bounds = chunk_bounds(M, plan.chunks)
    events = ctx.chunk_events(len(bounds))
    for i, (lo, hi) in enumerate(bounds):
        matmul_into(a[lo:hi], b, bias, slots[r, lo:hi])
        driver.record(events[i], main)
        driver.stream_wait(side, events[i])
        offset = (r * M + lo) * row_bytes
        for p in peers:
            driver.memcpy(ctx.data_addrs[p] + offset, ctx.data_addrs[r] + offset,
                          (hi - lo) * row_bytes, side)
    ctx.signal(side, e, [ctx.peer_flag_addr(p, ctx.READY + r) for p in peers])
    for q in peers:
        wait_geq(ctx, plan, main, ctx.READY + q, e)
    out = torch.cat([slots[q].view(shape) for q in range(W)], dim=gather_dim)
    # my slots are free again (DONE[r] = e on every peer)
    ctx.signal(main, e, [ctx.peer_flag_addr(q, ctx.DONE + r) for q in peers])
    driver.record(ctx.ev_end, side)
    driver.stream_wait(main, ctx.ev_end)
    check_errors(ctx, plan, task.op)
    stats[task.op] += 1
    return out
