"""grouped_mm_all_to_all on more than one rank, fused, the dispatch's transpose: each product row
of the experts' grouped GEMM goes straight to the row of its destination's receive buffer where
the all-to-all would land it; the receiver's output is that buffer once every row has come.

One call, epoch e, on rank r, all on the caller's stream:
  1. publish   into r's symmetric table (one host-to-device copy) where each sender's rows start
               among r's received rows (start_r[p] = sum of output_split_sizes[:p]) and where
               r's rows to each rank end among its own; then, after it, READY + r = e on every
               peer;
  2. read      wait until READY + q >= e for each rank q that r sends rows to: product row j
               goes to rank q, row start_q[r] + row_index[j] - s_q, where q's rows [s_q, s_q +
               n_q) of what r sends hold row_index[j];
  3. push      staged_push (the default): the GEMM stores row j at row_index[j] locally (in
               place of the reference's index_put), then the put kernel sends each row and adds
               one to q's ARRIVED + r (release, after the rows). Else the GEMM's epilogue sends
               the rows (its remote stores slow it down), adding one per row and n-tile;
  4. collect   wait until each ARRIVED + p = the rows from p (x n-tiles, unstaged), copy the
               rows out, set the ARRIVED words back to 0.
A count per sender: a row that never lands names its sender, and no sender's surplus hides
another's missing rows. Each destination row gets one store (row_index a permutation): the
result does not depend on the order tiles or ranks run in.

Buffer reuse with no barrier, as for the dispatch: r's table, buffer and ARRIVED of call e + 1
are written by r in stream order or by senders that saw READY + r >= e + 1, which r signals
after its call-e collect waited for every row (so every sender had read r's call-e table).
ARRIVED is reset, not grown as the dispatch's counters (rows x n-tiles a call would wrap an
int32 within a few thousand calls); no row counts before r's next READY, after the reset.
Not checked on the host (each would need a synchronisation or a collective): every rank
receives as many rows (its tokens x top-k: the size class comes from it); row_index is a
permutation (a repeated entry writes one row twice and leaves another unwritten, which the
counts miss; with accumulate the reference sums such rows, hence accumulate declines); what q
receives from r is what r sends it.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..scheduler.plan import GroupedMmPlan
from . import moe_routes
from .context import OpContext, build_outside_graph_pools, get_context
from .kernel_launch import cdiv, current_stream, next_power_of_2
from .launch import check_errors, decline, wait_geq
from .moe_dispatch import Layout

OP = "grouped_mm_all_to_all"


def arrived_word(world: int, sender: int = 0) -> int:
    """The flag word after READY and DONE that counts the rows landed here from `sender`."""
    return 2 * world + sender


@dataclasses.dataclass
class CombineState:
    """Per context, local: the peers' addresses as the kernel takes them."""

    table_table: torch.Tensor  # [world] int64: each rank's table (its starts)
    recv_table: torch.Tensor  # [world] int64: each rank's receive buffer
    count_table: torch.Tensor  # [world] int64: each rank's ARRIVED word for my rows


_states: "weakref.WeakKeyDictionary[OpContext, CombineState]" = weakref.WeakKeyDictionary()


def new_state(ctx, layout: Layout) -> CombineState:
    return CombineState(table_table=ctx.data.ptr_table + layout.table_offset,
                        recv_table=ctx.data.ptr_table + layout.recv_offset,
                        count_table=ctx.flags.ptr_table + 4 * arrived_word(layout.world,
                                                                           ctx.rank))


def combine_layout(world: int, capacity: int, n: int, dtype: torch.dtype) -> Layout:
    """[the starts and send ends | the receive buffer]; ARRIVED is a flag word, for the stream
    waits."""
    return Layout(world, capacity, n, dtype, tiles=0,
                  table_words=moe_routes.split_words(world))


def context_of(world: int, received: int, n: int, dtype: torch.dtype) -> tuple:
    """(context name, layout) for `received` rows of n: a context per power-of-two size class."""
    capacity = max(64, next_power_of_2(received))
    return f"{OP}:{capacity}x{n}:{dtype}", combine_layout(world, capacity, n, dtype)


def problem(plan: GroupedMmPlan, left, weight, row_index, accumulate: bool,
            received: int) -> str:
    """Why the multi-rank combine declines ("" if it serves), from rank-invariant properties
    only (the rows received back are as many on every rank), so that every rank declines alike
    before any protocol step."""
    if received < plan.min_rows:
        return f"{received} rows to receive, fewer than the plan's {plan.min_rows}"
    if row_index is not None and accumulate:
        return "rows summed into one (accumulate): each row is stored once, never added"
    if row_index is not None and row_index.dtype not in (torch.int32, torch.int64):
        return f"row index {row_index.dtype}"
    if left.shape[1] == 0 or weight.shape[-1] == 0:
        return "an empty row or weight"
    if left.device.type != "cuda":
        return f"rows on {left.device.type}"
    if torch.cuda.is_current_stream_capturing():
        return "under CUDA-graph capture (the starts are published from host-known splits)"
    return ""


def combine(plan: GroupedMmPlan, left, weight, offsets, row_index, accumulate: bool,
            output_split_sizes, input_split_sizes, group_name: str, world_size: int,
            grouped_gemm):
    """grouped_mm_all_to_all_reference's result; None: declined (the op runs its reference).
    grouped_gemm: runtime.moe's launcher."""
    received = sum(output_split_sizes)
    why = problem(plan, left, weight, row_index, accumulate, received)
    if why:
        return decline(f"{OP} on {world_size} ranks: {why}")
    rows, n = left.shape[0], weight.shape[-1]
    if (sum(input_split_sizes) != rows or len(input_split_sizes) != world_size
            or len(output_split_sizes) != world_size):
        raise ValueError(f"{OP}: splits {input_split_sizes}/{output_split_sizes} for {rows} "
                         f"rows on {world_size} ranks (the fused combine sends each row once)")
    if row_index is not None and row_index.shape[0] != rows:
        raise ValueError(f"{OP}: a row index of {row_index.shape[0]} entries for {rows} rows")
    name, layout = context_of(world_size, received, n, left.dtype)
    ctx = get_context(name, group_name, plan.symm_mem_backend, layout.nbytes,
                      flag_words=arrived_word(world_size, world_size))
    state = _states.get(ctx)
    if state is None:
        state = _states[ctx] = build_outside_graph_pools(ctx.device,
                                                         lambda: new_state(ctx, layout))
    r, e = ctx.rank, ctx.next_epoch()
    main = current_stream()
    publish(ctx, layout, output_split_sizes, input_split_sizes)
    ctx.signal(main, e, [ctx.peer_flag_addr(p, ctx.READY + r)
                            for p in range(world_size) if p != r])
    for q, count in enumerate(input_split_sizes):  # the receivers I send to have published
        if count and q != r:
            wait_geq(ctx, plan, main, ctx.READY + q, e)
    push(ctx, layout, state, plan, left, weight, offsets, row_index, grouped_gemm)
    expected = expected_counts(layout, plan, output_split_sizes)
    for p, count in enumerate(expected):
        wait_geq(ctx, plan, main, arrived_word(world_size, p), count)
    before_reset = flag_words(ctx, layout).clone() if plan.debug_waits else None  # reported
    out = collect(ctx, layout, received)
    check_errors(ctx, plan, OP, lambda code: (
        f"{wait_name(code - 1, world_size)}; flag words {before_reset.tolist()} (READY and "
        f"DONE of ranks 0..{world_size - 1}, then ARRIVED from each: expected {expected}); "
        f"rows this rank sent to each rank {list(input_split_sizes)}"))
    return out


def wait_name(word: int, world: int) -> str:
    if word >= arrived_word(world):
        return (f"the arrival count of rank {word - arrived_word(world)}'s rows (rows it sent "
                "never landed)")
    return f"rank {word - OpContext.READY}'s READY (its starts never published)"


def flag_words(ctx, layout: Layout) -> torch.Tensor:
    """My flag words: READY + r, DONE + r, then ARRIVED + p."""
    return ctx.flags.view(-1, torch.int32, [arrived_word(layout.world, layout.world)], 0)


# A call's steps on one rank, without the signals (the interpreter tests run them on emulated
# ranks)


def publish(ctx, layout: Layout, output_split_sizes, input_split_sizes) -> None:
    """1. Where each sender's rows start among mine (and where mine to each rank end)."""
    table = ctx.data.view(-1, torch.int32, [layout.table_words], layout.table_offset)
    moe_routes.publish_splits(table, output_split_sizes, input_split_sizes)


def push(ctx, layout: Layout, state: CombineState, plan: GroupedMmPlan, left, weight, offsets,
         row_index, grouped_gemm) -> None:
    """3. (after the receivers' READY) Each product row into its receiver's buffer, counted
    there: staged, or from the GEMM's epilogue after moe_routes.routes."""
    if plan.staged_push:
        staged_push(ctx, layout, state, plan, left, weight, offsets, row_index, grouped_gemm)
        return
    dst_rank, dst_row, _ = moe_routes.routes(state.table_table, ctx.rank, layout.world,
                                             left.shape[0], 0, row_index, expert_major=False)
    grouped_gemm(plan, left, weight, offsets, left, rows=left.shape[0], c_index=dst_row,
                 push=(dst_rank, state.recv_table, state.count_table))


def staged_push(ctx, layout: Layout, state: CombineState, plan: GroupedMmPlan, left, weight,
                offsets, row_index, grouped_gemm) -> None:
    """The GEMM stores its rows here in send order (row j at row_index[j]), then the put kernel
    sends each, one count per row. Rows past offsets[-1] belong to no expert: their products
    are undefined, as torch._grouped_mm leaves them, and sent all the same (the counts expect
    every row)."""
    rows = left.shape[0]
    staged = torch.empty((rows, weight.shape[-1]), dtype=left.dtype, device=left.device)
    grouped_gemm(plan, left, weight, offsets, staged, rows=rows, c_index=row_index)
    moe_routes.put_rows(staged, state.table_table, state.recv_table, state.count_table,
                        ctx.rank, layout.world, 0, expert_major=False)


def expected_counts(layout: Layout, plan: GroupedMmPlan, output_split_sizes) -> list:
    """ARRIVED + p once every row from p landed: a count per row (and n-tile, unstaged)."""
    per_row = 1 if plan.staged_push else cdiv(layout.k, plan.block_n)
    return [rows * per_row for rows in output_split_sizes]


def collect(ctx, layout: Layout, received: int) -> torch.Tensor:
    """4. (after the ARRIVED waits) The received rows out of the buffer, which the next call's
    senders overwrite; the ARRIVED words back to 0."""
    recv = ctx.data.view(-1, layout.dtype, [layout.capacity, layout.k], layout.recv_offset)
    out = recv[:received].clone()
    flag_words(ctx, layout)[arrived_word(layout.world):].zero_()
    return out
