"""grouped_mm_all_to_all on more than one rank, fused, the dispatch's transpose: each product row
goes to the row of its destination's receive buffer where the all-to-all would land it.

One call, epoch e, on rank r, on the caller's stream:
  1. publish  where each sender's rows start among r's received rows and where r's rows to each
              rank end (moe_routes.publish_splits);
  2. read     READY + r = e on every peer, then one wait until READY + q >= e for each rank q
              that r sends rows to, in one launch (moe_dispatch.signal_and_wait);
  3. push     the GEMM stores product row j at row_index[j] (the send order: the reference's
              index_put), then the put kernel sends each row to its rank q, at q's start for r
              plus its index among r's rows to q, adding one to q's ARRIVED + r (release, after
              the rows); plan.combine_gemm TORCH: torch._grouped_mm stores them in expert
              order and the put kernel sends row j as send row row_index[j];
  4. collect  one wait until each ARRIVED + p = the rows from p (its count in r's table), which
              it takes back off (ARRIVED is 0 again), in the put's launch (its last program),
              then the rows copied out.
A count per sender: a row that never lands names its sender, and no sender's surplus hides
another's missing rows. Each destination row gets one store, so the result does not depend on
the order tiles or ranks run in.

Reuse with no barrier, as the dispatch's: r's table, buffer and ARRIVED of call e + 1 are written
by r in stream order or by senders after READY + r >= e + 1, which follows r's call-e collect
(every row landed, so every sender had read r's table). ARRIVED is set back rather than grown
(counting a sender's every row, an int32 would wrap after 2^31 / rows calls); no row counts
before r's next READY, which follows the wait that sets it back. Every rank receives as many
rows (the size class comes from them): faults.check_shapes compares them once per shape. Not
checked on the host (each would need a synchronisation or a collective): row_index is a
permutation (a repeated entry writes one row twice and another never, which the counts miss;
accumulate, where the reference sums such rows, declines); what q receives from r is what r
sends.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..scheduler.plan import TORCH, GroupedMmPlan
from . import faults, moe_routes
from .context import OpContext, build_outside_graph_pools, get_context, wait_limit
from .kernel_launch import current_stream, next_power_of_2
from .launch import check_errors, decline, wait_words
from .moe_dispatch import Layout, grouped_mm_takes, ready_addrs, signal_and_wait

OP = "grouped_mm_all_to_all"


def arrived_word(world: int, sender: int = 0) -> int:
    """The flag word after READY and DONE counting the rows landed here from `sender`."""
    return 2 * world + sender


@dataclasses.dataclass
class CombineState:
    table_table: torch.Tensor  # [world] int64: each rank's table (its starts)
    recv_table: torch.Tensor  # [world] int64: each rank's receive buffer
    count_table: torch.Tensor  # [world] int64: each rank's ARRIVED word for my rows
    ready_addrs: torch.Tensor  # [world] int64: the address of each rank's READY + me


_states: "weakref.WeakKeyDictionary[OpContext, CombineState]" = weakref.WeakKeyDictionary()


def new_state(ctx, layout: Layout) -> CombineState:
    return CombineState(table_table=ctx.data.ptr_table + layout.table_offset,
                        recv_table=ctx.data.ptr_table + layout.recv_offset,
                        count_table=ctx.flags.ptr_table + 4 * arrived_word(layout.world,
                                                                           ctx.rank),
                        ready_addrs=ready_addrs(ctx))


def combine_layout(world: int, capacity: int, n: int, dtype: torch.dtype) -> Layout:
    """[the starts, the send ends and the rows from each sender | the receive buffer]; ARRIVED
    is a flag word (the stream waits on it)."""
    return Layout(world, capacity, n, dtype, tiles=0,
                  table_words=moe_routes.split_words(world) + world)


def context_of(world: int, received: int, n: int, dtype: torch.dtype) -> tuple:
    """(context name, layout): a context per power-of-two size class of `received`."""
    capacity = max(64, next_power_of_2(received))
    return f"{OP}:{capacity}x{n}:{dtype}", combine_layout(world, capacity, n, dtype)


def problem(plan: GroupedMmPlan, left, weight, row_index, accumulate: bool,
            received: int) -> str:
    """Why the multi-rank combine declines ("" if it serves), from rank-invariant properties
    only (every rank receives as many rows back): every rank declines alike, before any step."""
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
    faults.check_shapes(OP, group_name, (received, n, str(left.dtype)), plan.wait_timeout_s)
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
    return call(ctx, layout, state, plan, left, weight, offsets, row_index, output_split_sizes,
                input_split_sizes, grouped_gemm)


def call(ctx, layout: Layout, state: CombineState, plan: GroupedMmPlan, left, weight, offsets,
         row_index, output_split_sizes, input_split_sizes, grouped_gemm) -> torch.Tensor:
    """One call's steps 1-4 on my context, its signals and waits included, then the error check
    (benchmarks/bench_ep_local_work.py runs it on an emulated rank)."""
    world_size = layout.world
    e = ctx.next_epoch()
    main = current_stream()
    publish(ctx, layout, output_split_sizes, input_split_sizes)
    signal_and_wait(ctx, plan, main, state.ready_addrs, input_split_sizes, e)
    waited = push(ctx, layout, state, plan, left, weight, offsets, row_index, grouped_gemm,
                  arrival_wait(ctx, layout, plan))
    expected = list(output_split_sizes)
    out = collect(ctx, layout, plan, main, sum(expected), waited)
    check_errors(ctx, plan, OP, lambda code, peer: (
        f"{wait_name(code - 1, world_size)} (rows expected from each rank {expected}, sent to "
        f"each {list(input_split_sizes)})"))
    return out


def wait_name(word: int, world: int) -> str:
    if word >= arrived_word(world):
        return (f"the arrival count of rank {word - arrived_word(world)}'s rows (rows it sent "
                "never landed)")
    return f"rank {word - OpContext.READY}'s READY (its starts never published)"


def flag_words(ctx, layout: Layout) -> torch.Tensor:
    """My flag words: READY + r, DONE + r, then ARRIVED + p."""
    return ctx.flags.view(-1, torch.int32, [arrived_word(layout.world, layout.world)], 0)


# A call's steps on one rank, signals apart (the interpreter tests run them on emulated ranks)


def publish(ctx, layout: Layout, output_split_sizes, input_split_sizes) -> None:
    """1. Where each sender's rows start among mine and how many come (and where mine to each
    rank end)."""
    table = ctx.data.view(-1, torch.int32, [layout.table_words], layout.table_offset)
    moe_routes.publish_splits(table, output_split_sizes, input_split_sizes, counts=True)


def push(ctx, layout: Layout, state: CombineState, plan: GroupedMmPlan, left, weight, offsets,
         row_index, grouped_gemm, wait: "moe_routes.ArrivalWait | None" = None) -> bool:
    """3. (after the receivers' READY) The GEMM's rows here (TRITON: in send order; TORCH: in
    expert order, sent by row_index), then each put into its receiver's buffer, then `wait`
    in the put's launch. Rows past offsets[-1] (no expert's: undefined, as torch._grouped_mm
    leaves them) are sent all the same, since the receivers count every row. Whether it
    waited (not where I send no rows)."""
    rows = left.shape[0]
    if plan.combine_gemm == TORCH and grouped_mm_takes(left, [weight]):
        staged = torch._grouped_mm(left, weight, offs=offsets)
        send_index = None if row_index is None else row_index.contiguous()
    else:
        staged = torch.empty((rows, weight.shape[-1]), dtype=left.dtype, device=left.device)
        grouped_gemm(plan, left, weight, offsets, staged, rows=rows, c_index=row_index)
        send_index = None
    return moe_routes.put_rows(staged, state.table_table, state.recv_table, state.count_table,
                               ctx.rank, layout.world, 0, expert_major=False,
                               send_index=send_index, wait=wait) and wait is not None


def arrived_counts(ctx, layout: Layout) -> torch.Tensor:
    """My table's rows from each sender (what ARRIVED + p reaches)."""
    return ctx.data.view(-1, torch.int32, [layout.world],
                         layout.table_offset + 4 * moe_routes.split_words(layout.world))


def arrival_wait(ctx, layout: Layout, plan: GroupedMmPlan) -> "moe_routes.ArrivalWait":
    """4's wait in the put's launch: each ARRIVED + p until the rows from p, taken back off."""
    return moe_routes.ArrivalWait(False, ctx.flags.words, arrived_word(layout.world),
                                  arrived_counts(ctx, layout), (1 << layout.world) - 1,
                                  wait_limit(plan, ctx), faults.site_words(ctx, plan.site))


def collect(ctx, layout: Layout, plan: GroupedMmPlan, stream, received: int,
            waited: bool = False) -> torch.Tensor:
    """4. Once each ARRIVED + p holds the rows from p (my table's counts, then taken back off
    it: the push waited, or where it did not, a wait launch here), the received rows out of
    the buffer, which the next call's senders overwrite."""
    world = layout.world
    if not waited:
        wait_words(ctx, plan, stream, arrived_word(world), (1 << world) - 1, 0,
                   arrived_counts(ctx, layout))
    recv = ctx.data.view(-1, layout.dtype, [layout.capacity, layout.k], layout.recv_offset)
    return recv[:received].clone()
