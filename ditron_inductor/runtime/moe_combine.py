"""grouped_mm_all_to_all on more than one rank, fused: each row of the experts' grouped GEMM goes
straight into its destination rank's receive buffer, at the row where the all-to-all would land it,
and the receiver's output is that buffer once every row has come. By default (staged_push) the GEMM
stores its rows here in the order they are sent and the dispatch's put kernel sends them (0.85-0.87x
NCCL all-to-all + torch._grouped_mm's time at 8192 tokens per rank on 2x H100,
benchmarks/results/moe_ep_h100x2_staged.md: the reference's index_put is the GEMM's stores); else
the GEMM's epilogue pushes each tile's rows (1.22-1.39x there: remote stores from the epilogue).
Passed on 2x H100 (48 consecutive calls on 2 ranks with stream waits, the staged push among them,
2026-11-26; its routes read by torch ops then, by the put and routes kernels of
templates/moe_routes.py since: with them its multi-rank GPU test passed on 2x H100, 48 calls with
stream waits, and bench_moe_ep.py on 2 of 4x H100 was exact against the reference at 0.82-0.95x its
time, moe_ep_h100x4_routes.md, 2026-11-27; on 4 of 4x H100, 48 calls with stream waits,
2026-11-27; with bounded waits, plan.wait_timeout_s > 0, whose waits are kernels that can give up,
5 of 5 runs of 48 calls on 2x H100 since the first launch of a kernel class for the default stream
stays on it, kernel_launch.stream_of: it went to a new stream of torch's pool, the copy after an
arrival wait read before the rows came, and the first call returned one sender's rows as zeros in
14 of 18 runs on 2 and 4 H100s, gpu_checks_s43.log) and on 2x H200 (tests/gpu/test_moe_gpu.py, 24
consecutive calls on 2 ranks; its first GPU runs hung at the first call, rank 0's arrival count
at 600 of 1200, while the count was one word for all
senders raised by one scalar add per tile and rank; now one word per sender, one add per row as the
dispatch counts); CPU-tested below the context (the routes and the kernels' push under the
interpreter: tests/test_moe_interpreter.py). The dispatch's transpose, built from its pieces
(moe_dispatch: the symmetric layout and the signals; moe_routes: the published starts and the put
kernel; the grouped GEMM template with its PUSH epilogue).

One call, epoch e, on rank r (everything on the caller's stream, in this order):
  1. publish   where each sender's rows start among the rows r receives (rank-major:
               start_r[p] = sum of output_split_sizes[:p]) into r's symmetric table, with
               where r's rows to each rank end among its own (one host-to-device copy), then
               signal READY + r = e to every peer (after the table's writes);
  2. read      for each rank q that r sends rows to: wait until READY + q >= e; the put kernel
               (or, for the epilogue's push, a routes kernel) reads start_q[r] from q's table:
               row j of the product goes to rank q, row start_q[r] + row_index[j] - s_q, where
               q's rows [s_q, s_q + n_q) of what r sends (input_split_sizes) hold row_index[j];
  3. push      staged: the grouped GEMM stores row j at row_index[j] of a local buffer, then
               the put kernel writes each row there and adds one to q's ARRIVED + r (a flag word
               per sender; release, after the rows); from the epilogue: the grouped GEMM stores
               each row there, then a release add of one per row and n-tile; no atomics on
               the data either way;
  4. collect   wait until each ARRIVED + p = the rows I receive from p (x the n-tiles for the
               epilogue's push), copy the buffer's rows out (the op's output), set the ARRIVED
               words back to 0.
A count per sender, not one for all: a row that never lands names its sender, and a receiver
cannot mistake one sender's surplus for another's missing rows.
Each destination row is written by exactly one store of one rank (row_index a permutation):
the result does not depend on the order in which tiles or ranks run.

Why the buffers can be reused call after call without a barrier: as for the dispatch, r's
table, receive buffer and ARRIVED of call e + 1 are written only by r in stream order or by
senders that saw READY + r >= e + 1, which r signals after its call-e collect; that collect
waited for every row, so every sender that sent r a row had read r's call-e table. ARRIVED is
set back to 0 rather than grown (as the dispatch's tile counters are): it grows by rows x
n-tiles a call, and would wrap an int32 within a few thousand calls; no call-(e + 1) row
counts before r's READY of call e + 1, which comes after the reset.
Assumptions not checked on the host (each would need a synchronisation or a collective):
  - every rank receives the same number of rows (its tokens x top-k, which it dispatched): the
    buffers' size class (every rank allocates the same symmetric memory) is derived from it
    (the rows each expert rank computes differ with the routing: they cannot give it);
  - row_index is a permutation of the rows sent (a repeated entry writes one row twice and
    leaves another unwritten, which the counts do not see: the reference with accumulate sums
    such rows, hence accumulate declines);
  - what rank q receives from r (q's output_split_sizes[r]) is what r sends it, as the
    all-to-all requires.
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
    """The flag word (after READY + r and DONE + r) that counts the rows landed here from
    `sender`."""
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
    """[the starts and send ends | the receive buffer]: ARRIVED is a flag word (stream waits
    take it)."""
    return Layout(world, capacity, n, dtype, tiles=0,
                  table_words=moe_routes.split_words(world))


def context_of(world: int, received: int, n: int, dtype: torch.dtype) -> tuple:
    """(the name of the context, its layout) of a call that receives `received` rows of n: one
    context per power-of-two size class of the rows."""
    capacity = max(64, next_power_of_2(received))
    return f"{OP}:{capacity}x{n}:{dtype}", combine_layout(world, capacity, n, dtype)


def problem(plan: GroupedMmPlan, left, weight, row_index, accumulate: bool,
            received: int) -> str:
    """Why the multi-rank combine declines ("" if it serves): rank-invariant properties only
    (graph, dtypes, widths; the rows received back, a rank's tokens x top-k, as many on every
    rank), so every rank declines alike, before any protocol step."""
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


# The steps of a call on one rank, apart from the signals between them (what the interpreter
# test runs on emulated ranks: tests/test_moe_interpreter.py).


def publish(ctx, layout: Layout, output_split_sizes, input_split_sizes) -> None:
    """1. Where each sender's rows start among mine (and where mine to each rank end)."""
    table = ctx.data.view(-1, torch.int32, [layout.table_words], layout.table_offset)
    moe_routes.publish_splits(table, output_split_sizes, input_split_sizes)


def push(ctx, layout: Layout, state: CombineState, plan: GroupedMmPlan, left, weight, offsets,
         row_index, grouped_gemm) -> None:
    """2 and 3 (after the receivers' signals): each product row into its receiver's buffer,
    counted there: staged (the GEMM, then the put kernel) or from the GEMM's epilogue, its
    rows' routes read first (moe_routes.routes)."""
    if plan.staged_push:
        staged_push(ctx, layout, state, plan, left, weight, offsets, row_index, grouped_gemm)
        return
    dst_rank, dst_row, _ = moe_routes.routes(state.table_table, ctx.rank, layout.world,
                                             left.shape[0], 0, row_index, expert_major=False)
    grouped_gemm(plan, left, weight, offsets, left, rows=left.shape[0], c_index=dst_row,
                 push=(dst_rank, state.recv_table, state.count_table))


def staged_push(ctx, layout: Layout, state: CombineState, plan: GroupedMmPlan, left, weight,
                offsets, row_index, grouped_gemm) -> None:
    """plan.staged_push: the GEMM stores its rows here, in the order they are sent (row j at
    row_index[j], as the reference's index_put puts them), then the put kernel sends each to
    its receiver, one count per row. The push from the GEMM's epilogue measured 1.6-2.9x the
    plain GEMM's time on 2x H100 (benchmarks/results/moe_ep_h100x2_profile.md). Rows past
    offsets[-1] belong to no expert: their products are undefined, as torch._grouped_mm leaves
    them, and sent all the same (the counts expect every row)."""
    rows = left.shape[0]
    staged = torch.empty((rows, weight.shape[-1]), dtype=left.dtype, device=left.device)
    grouped_gemm(plan, left, weight, offsets, staged, rows=rows, c_index=row_index)
    moe_routes.put_rows(staged, state.table_table, state.recv_table, state.count_table,
                        ctx.rank, layout.world, 0, expert_major=False)


def expected_counts(layout: Layout, plan: GroupedMmPlan, output_split_sizes) -> list:
    """ARRIVED + p once every row p sent me landed: one count per row and n-tile (one per
    row for the staged push)."""
    per_row = 1 if plan.staged_push else cdiv(layout.k, plan.block_n)
    return [rows * per_row for rows in output_split_sizes]


def collect(ctx, layout: Layout, received: int) -> torch.Tensor:
    """4. (after each ARRIVED + p reached expected_counts) The rows I received, out of the
    buffer, which the next call's senders overwrite; the ARRIVED words back to 0 for the next
    call."""
    recv = ctx.data.view(-1, layout.dtype, [layout.capacity, layout.k], layout.recv_offset)
    out = recv[:received].clone()
    flag_words(ctx, layout)[arrived_word(layout.world):].zero_()
    return out
