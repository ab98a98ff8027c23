"""all_to_all_grouped_mm on more than one rank, fused: each rank pushes x's rows straight into
the receivers' expert-major receive buffers; each receiver's GEMM tile starts once its rows have
landed. The exchange does not overlap the GEMM: a tile's rows come from anywhere in the senders'
x.

One call, epoch e, on rank r, on the caller's stream:
  1. publish  r's routes into its symmetric table and this call's rows per tile onto expect
              (moe_routes.publish);
  2. read     READY + r = e on every peer, then one wait until READY + q >= e for each rank q
              that r sends rows to: in the publish kernel's last program, after every
              program's routes (handshake; signal_and_wait's launch where r receives none);
  3. push     put_rows_kernel: each row to its expert-major row on its receiver, then one onto
              that tile's counter there (release, after the rows); TORCH (below): then its
              last program waits until every tile's counter reached expect[tile];
  4. GEMM     plan.dispatch_gemm TORCH: torch._grouped_mm per weight over the receive buffer (the
              rows output: a copy of it; plan.rows False: its view). TRITON: the first
              weight's GEMM runs each tile once its counter reached expect[tile], reading the
              receive buffer and storing the rows output, which the others read (plan.rows
              False: no rows output stored, the others read the receive buffer).
Every rank signals before it waits (2): no rank waits on one that waits on it.

Reuse with no reset or barrier: r's table and buffer of call e + 1 are written after r's call-e
GEMM (by r in stream order, by senders after READY + r >= e + 1), which waited for every row of
call e, so every sender to r (which reads before it pushes) had read r's call-e table. Counters
only grow, each call expecting its rows on top of the last's (int32: they wrap after 2^31 rows
through one tile, not handled).
x has as many rows on every rank (the size class comes from world * x's rows):
faults.check_shapes compares them once per shape. Not checked on the host (each would need a
synchronisation or a collective): row_index is a permutation (a repeated entry leaves a tile
short, its wait endless: a bounded wait, plan.wait_timeout_s, reports it); offsets[-1] = the
received rows (rows past it, in no waiting tile, could be copied to the rows output before they
land). What differs between ranks raises rather than declines: a decline would leave one rank in
the reference's all-to-all, the others waiting on it.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..scheduler.plan import TORCH, GroupedMmPlan
from ..templates.grouped_gemm import ERR_ROWS, wait_tiles_kernel
from . import faults, moe_routes
from .context import OpContext, build_outside_graph_pools, get_context, wait_limit
from .kernel_launch import current_stream, launch, next_power_of_2
from .launch import check_errors, context_flag, decline, wait_words

OP = "all_to_all_grouped_mm"
ALIGN = 256


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class Layout:
    """The context's symmetric bytes: [tile counters | route table | receive buffer] (the
    combine's: no counters, the starts as its table, rows of N)."""

    world: int
    capacity: int  # received rows
    k: int  # the received rows' width
    dtype: torch.dtype
    tiles: int
    table_words: int

    @property
    def table_offset(self) -> int:
        return _aligned(4 * self.tiles)

    @property
    def recv_offset(self) -> int:
        return self.table_offset + _aligned(4 * self.table_words)

    @property
    def nbytes(self) -> int:
        return self.recv_offset + self.capacity * self.k * self.dtype.itemsize


@dataclasses.dataclass
class DispatchState:
    expect: torch.Tensor  # [tiles] int32: each tile's counter once this call's rows landed
    table_table: torch.Tensor  # [world] int64: each rank's route table
    recv_table: torch.Tensor  # [world] int64: each rank's receive buffer
    count_table: torch.Tensor  # [world] int64: each rank's tile counters
    ready_addrs: torch.Tensor  # [world] int64: the address of each rank's READY + me
    done: torch.Tensor  # [1] int32: the publish kernel's programs done (set back by the last)


_states: "weakref.WeakKeyDictionary[OpContext, DispatchState]" = weakref.WeakKeyDictionary()


def dispatch_layout(world: int, capacity: int, k: int, dtype: torch.dtype, experts: int,
                    block_m: int) -> Layout:
    return Layout(world, capacity, k, dtype, moe_routes.max_tiles(capacity, experts, block_m),
                  moe_routes.table_words(world, capacity))


def new_state(ctx, layout: Layout) -> DispatchState:
    return DispatchState(
        expect=torch.zeros(layout.tiles, dtype=torch.int32, device=ctx.data.ptr_table.device),
        table_table=ctx.data.ptr_table + layout.table_offset,
        recv_table=ctx.data.ptr_table + layout.recv_offset,
        count_table=ctx.data.ptr_table.clone(), ready_addrs=ready_addrs(ctx),
        done=torch.zeros(1, dtype=torch.int32, device=ctx.data.ptr_table.device))


def ready_addrs(ctx) -> torch.Tensor:
    """[world] int64: where my READY goes on each rank (word READY + me of its flags)."""
    return ctx.flags.ptr_table + 4 * (ctx.READY + ctx.rank)


def _state(ctx: OpContext, layout: Layout) -> DispatchState:
    state = _states.get(ctx)
    if state is None:
        def build():
            # symmetric memory comes uninitialised: zeroed, synchronised, before my first READY
            ctx.data.view(-1, torch.int32, [layout.tiles], 0).zero_()
            return new_state(ctx, layout)

        state = _states[ctx] = build_outside_graph_pools(ctx.device, build)
    return state


def problem(plan: GroupedMmPlan, x, row_index, weights) -> str:
    """Why the multi-rank dispatch declines ("" if it serves), from rank-invariant properties
    only (every rank sends as many rows), so that every rank declines alike."""
    if x.shape[0] < plan.min_rows:
        return f"{x.shape[0]} rows to send, fewer than the plan's {plan.min_rows}"
    if x.device.type != "cuda":
        return f"x on {x.device.type}"
    if torch.cuda.is_current_stream_capturing():
        return "under CUDA-graph capture (the routes are published from host-known splits)"
    if row_index is not None and row_index.dtype not in (torch.int32, torch.int64):
        return f"row index {row_index.dtype}"
    if x.shape[1] == 0 or any(w.shape[-1] == 0 for w in weights):
        return "an empty row or weight"
    return ""


def dispatch(plan: GroupedMmPlan, x, output_split_sizes, input_split_sizes, row_index, weights,
             offsets, group_name: str, world_size: int, grouped_gemm):
    """[rows, rows @ W_0, ...] as all_to_all_grouped_mm_reference computes them; None: declined
    (the op runs its reference). grouped_gemm: runtime.moe's launcher."""
    why = problem(plan, x, row_index, weights)
    if why:
        return decline(f"{OP} on {world_size} ranks: {why}")
    k, experts = x.shape[1], weights[0].shape[0]
    faults.check_shapes(OP, group_name, (x.shape[0], k, str(x.dtype), experts),
                        plan.wait_timeout_s)
    received = sum(output_split_sizes)
    if (sum(input_split_sizes) != x.shape[0] or len(input_split_sizes) != world_size
            or len(output_split_sizes) != world_size):
        raise ValueError(f"{OP}: splits {input_split_sizes}/{output_split_sizes} for "
                         f"{x.shape[0]} rows on {world_size} ranks")
    if row_index is not None and row_index.shape[0] != received:
        raise ValueError(f"{OP}: a row index of {row_index.shape[0]} entries for {received} "
                         "received rows (the fused dispatch needs a permutation)")
    capacity = max(64, next_power_of_2(world_size * x.shape[0]))
    if received > capacity:
        raise ValueError(f"{OP}: {received} rows received, more than {world_size} ranks' "
                         f"{x.shape[0]} rows (x's rows differ between ranks?)")
    layout = dispatch_layout(world_size, capacity, k, x.dtype, experts, plan.block_m)
    ctx = get_context(f"{OP}:{capacity}x{k}:{x.dtype}:{experts}:{plan.block_m}", group_name,
                      plan.symm_mem_backend, layout.nbytes)
    state = _state(ctx, layout)
    return call(ctx, layout, state, plan, x, output_split_sizes, input_split_sizes, row_index,
                weights, offsets, grouped_gemm)


def call(ctx, layout: Layout, state: DispatchState, plan: GroupedMmPlan, x, output_split_sizes,
         input_split_sizes, row_index, weights, offsets, grouped_gemm) -> list:
    """One call's steps 1-4 on my context, its signals and waits included, then the error check
    (benchmarks/bench_ep_local_work.py runs it on an emulated rank)."""
    e = ctx.next_epoch()
    main = current_stream()
    if not publish(ctx, layout, state, output_split_sizes, input_split_sizes, row_index, offsets,
                   plan.block_m, handshake(ctx, plan, state, input_split_sizes, e)):
        signal_and_wait(ctx, plan, main, state.ready_addrs, input_split_sizes, e)
    waited = push(ctx, layout, state, x,
                  tiles_wait(ctx, layout, state, plan) if library(ctx, layout, plan, weights)
                  else None)
    outputs = compute(ctx, layout, state, plan, sum(output_split_sizes), weights, offsets,
                      grouped_gemm, waited)
    check_errors(ctx, plan, OP, lambda code, peer: (
        "a tile's arrival counter (its rows never landed)" if code == ERR_ROWS
        else context_flag(ctx, code)))
    return outputs


# A call's steps on one rank, signals apart (the interpreter tests run them on emulated ranks)


def publish(ctx, layout: Layout, state: DispatchState, output_split_sizes, input_split_sizes,
            row_index, offsets, block_m: int,
            handshake: "moe_routes.Handshake | None" = None) -> bool:
    """1. My routes into my table, this call's rows per tile onto expect; then `handshake`
    (step 2) in the same launch. Whether it ran (not where I receive no rows)."""
    table = ctx.data.view(-1, torch.int32, [layout.table_words], layout.table_offset)
    return moe_routes.publish(table, output_split_sizes, input_split_sizes, row_index, offsets,
                              block_m, state.expect, handshake=handshake)


def ready_mask(ctx, input_split_sizes) -> int:
    """The ranks whose READY I wait for: those I send rows to, myself apart."""
    return sum(1 << q for q, n in enumerate(input_split_sizes) if n and q != ctx.rank)


def peers_mask(ctx) -> int:
    return ((1 << ctx.world) - 1) & ~(1 << ctx.rank)


def wait_ready(ctx, plan: GroupedMmPlan, stream, input_split_sizes, epoch: int,
               signal=None) -> None:
    """2. The receivers I send rows to have published: READY + q >= epoch for each (signal:
    launch.wait_words's signals before it)."""
    wait_words(ctx, plan, stream, ctx.READY, ready_mask(ctx, input_split_sizes), epoch,
               signal=signal)


def signal_and_wait(ctx, plan: GroupedMmPlan, stream, addrs: torch.Tensor, input_split_sizes,
                    epoch: int) -> None:
    """2. READY + me = epoch on every peer (addrs: ready_addrs), then wait_ready, in one launch:
    a stream write per peer costs about as much device time as a small kernel."""
    wait_ready(ctx, plan, stream, input_split_sizes, epoch,
               signal=(addrs, peers_mask(ctx), epoch))


def handshake(ctx, plan: GroupedMmPlan, state: DispatchState, input_split_sizes,
              epoch: int) -> "moe_routes.Handshake":
    """Step 2 as signal_and_wait does it, for the publish kernel's last program."""
    return moe_routes.Handshake(state.done, state.ready_addrs, peers_mask(ctx), epoch,
                                ctx.flags.words, ready_mask(ctx, input_split_sizes),
                                wait_limit(plan, ctx), faults.site_words(ctx, plan.site))


def push(ctx, layout: Layout, state: DispatchState, x,
         wait: "moe_routes.ArrivalWait | None" = None) -> bool:
    """3. (after the receivers' READY) My rows, each to its route, counted there; then `wait`
    in the same launch. Whether it waited (not where I send no rows)."""
    return moe_routes.put_rows(x.contiguous(), state.table_table, state.recv_table,
                               state.count_table, ctx.rank, layout.world, layout.capacity,
                               expert_major=True, wait=wait) and wait is not None


def library(ctx, layout: Layout, plan: GroupedMmPlan, weights) -> bool:
    """Whether step 4 runs torch._grouped_mm, which waits for every row first."""
    return plan.dispatch_gemm == TORCH and grouped_mm_takes(receive_buffer(ctx, layout), weights)


def receive_buffer(ctx, layout: Layout) -> torch.Tensor:
    return ctx.data.view(-1, layout.dtype, [layout.capacity, layout.k], layout.recv_offset)


def tiles_wait(ctx, layout: Layout, state: DispatchState, plan: GroupedMmPlan):
    """Until every tile's counter reached expect[tile]: every row of this call landed."""
    return moe_routes.ArrivalWait(True, ctx.data.view(-1, torch.int32, [layout.tiles], 0), 0,
                                  state.expect, layout.tiles, wait_limit(plan, ctx),
                                  faults.site_words(ctx, plan.site))


def compute(ctx, layout: Layout, state: DispatchState, plan: GroupedMmPlan, received: int,
            weights, offsets, grouped_gemm, waited: bool = False) -> list:
    """4. The grouped GEMMs over the receive buffer, after every row landed (TORCH: the push
    waited, or where it did not, a wait launch here) or each tile of the first after its own
    rows (TRITON: the first stores the op's rows output, the others read that). Without
    plan.rows (the graph does not use the rows output) nothing is stored: the GEMMs read the
    receive buffer and the rows output is its view, valid until my next call's rows land (the
    world-1 path, runtime/moe.py, stores its rows always)."""
    counters = ctx.data.view(-1, torch.int32, [layout.tiles], 0)
    recv = receive_buffer(ctx, layout)
    err = faults.site_words(ctx, plan.site)
    if library(ctx, layout, plan, weights):
        if not waited:
            wait = tiles_wait(ctx, layout, state, plan)
            launch(wait_tiles_kernel, (1,), wait.words, wait.wants, wait.count, wait.limit,
                   wait.err, BLOCK=min(1024, next_power_of_2(wait.count)),
                   PROXY_FENCE=recv.device.type == "cuda")
        rows = recv[:received]
        outs = [torch._grouped_mm(rows, w, offs=offsets) for w in weights]
        return [rows.clone() if plan.rows else rows] + outs
    rows_out = (torch.empty((received, layout.k), dtype=layout.dtype, device=recv.device)
                if plan.rows else None)
    outs = [torch.empty((received, w.shape[-1]), dtype=layout.dtype, device=recv.device)
            for w in weights]
    for i, (w, out) in enumerate(zip(weights, outs)):
        if i == 0:
            grouped_gemm(plan, recv, w, offsets, out, rows=received, rows_out=rows_out,
                         wait=(counters, state.expect, err, wait_limit(plan, ctx)))
        else:
            grouped_gemm(plan, recv if rows_out is None else rows_out, w, offsets, out,
                         rows=received)
    return [recv[:received] if rows_out is None else rows_out] + outs


def grouped_mm_takes(a: torch.Tensor, weights) -> bool:
    """Whether torch._grouped_mm takes these operands: 16-byte aligned bases and strides (all
    but the unit one)."""
    return all(t.data_ptr() % 16 == 0 and all(s == 1 or s * t.element_size() % 16 == 0
                                              for s in t.stride())
               for t in (a, *weights))
