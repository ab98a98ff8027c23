"""What an EP-W rank computes in an MoE layer's dispatch and combine when the transfers cost
nothing, on one GPU: the fused plans beside NCCL all-to-all + torch._grouped_mm.

    python benchmarks/bench_ep_local_work.py --worlds 2,4,8 --out benchmarks/results/<name>
    python benchmarks/bench_ep_local_work.py --device cpu --tiny          # smoke run (interpreter)

bench_moe_ep.py times the fused ops on W GPUs, transfers and all; this is the rank-local part
(as bench_rank_local_work.py is for TP), at the expert layers of bench_moe.py (Mixtral-8x7B,
Qwen3-30B-A3B, DeepSeek-V3's EP-8 slice; the experts per rank given there, W x as many in all).
One GPU plays rank 0 of W: its T tokens each pick top-k distinct experts of all W ranks',
uniformly at random (router weights: softmax of the picked scores), and each peer's T tokens
likewise, of which the rows for rank 0's experts are what that peer sends it (random rows). The
layer, as transformers_ep.DitronAllToAllEP runs it, from the router's choice to the weighted sum
(the splits are host-known, as after the layer's .tolist() of the exchanged counts, a host sync
both paths need and neither times):
  routing   (both, "common") argsort of the chosen experts, the counts (scatter_add; the counts
            all-to-all's local part: my counts for my experts copied into the received counts,
            the peers' as arrived), the send rows x[order // k], the received rows' expert-major
            order (expert_major_order) and offsets;
  dispatch  unfused: NCCL's local part, my rows for me copied into the receive buffer whose peer
            rows count as arrived, rows = received[by_expert], torch._grouped_mm by gate and up;
            fused: runtime.moe_dispatch.call, the runtime's own host steps and kernels (publish,
            signal, waits, push, the waiting grouped GEMMs, the error check) on an emulated rank;
            --inference: as an inference graph's op runs it, storing no rows output (plan
            rows=False: the later GEMM reads the receive buffer, the rows are its view); the
            unfused path gathers its rows for its GEMMs either way;
  act       (both) silu(gate) * up;
  combine   unfused: torch._grouped_mm by down, the un-permutation back[by_expert] = y, NCCL's
            local part (my rows' products copied into the returned rows, the peers' as arrived);
            fused: runtime.moe_combine.call likewise;
  sums      (both) the returned rows put back in pair order, weighted by the router and summed
            per token (fp32, cast back).
The emulated rank (EmulatedRank): rank 0's symmetric buffers are real device memory of the
runtime's layouts; the peers' are stubs. Every flag or counter a wait reads is set as arrived
(READY, ARRIVED, the tile counters start at 2^30); the signals write the stubs' flag words
(stream writes into this GPU's memory instead of a peer's). The peers' rows already sit in my
receive buffers where their puts would have landed them: in the dispatch's at their expert-major
rows, in the combine's at their senders' starts. The put kernels run over all my rows but store
only those for me: the dispatch's peers' route tables are stubs whose every row is unclaimed
(-1: the kernel's route lookups run, from local memory, and skip the row), and the combine's
sender table is a static copy of mine whose send ends put every row past my own rows to no rank
(rank 0's rows for itself come first). So the rows to peers are neither read nor written on
either path (the transfers: bench_moe_ep.py's tables add them), and rank 0's real table, as
publish writes it, is not what the combine's put reads.

Each emulation's outputs (rows, gate, up, the returned rows, the layer's output) are checked
against a float32 reference before it is timed (rows left out are NaN and fail). Timing: CUDA
events around --iters calls queued while the device spins, the median of --reps, the contenders
of a row in turn in each repetition (bench_rank_local_work's; a repetition whose host fell
behind the spin is retried with a longer one, then with fewer calls queued: `timed`); the
host's own ms per call beside it; then a torch.profiler run of --profile calls of each, kernel
device time bucketed by kernel name (and, for generic kernels, by the step that launched it):
gemm, routing, flags (the waits and the flag words), copies (row placement, permutations),
sums, other; idle: the profiled calls' span less the time some kernel ran (no spin there: the
host's launch gaps count, as do the stream's flag writes and waits). --stages also times each
path's dispatch and combine alone. Writes <out>.json and <out>.md (command, machine, date).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter (before its import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_fused import spin_device  # noqa: E402
from benchmarks.bench_moe import LAYERS, PLANS, layer_weights  # noqa: E402
from ditron_inductor.runtime import (faults, moe, moe_combine, moe_dispatch,  # noqa: E402
                                     moe_routes)
from ditron_inductor.runtime.context import OpContext  # noqa: E402
from ditron_inductor.runtime.symm import SymmBuffer  # noqa: E402
from ditron_inductor.scheduler import policy  # noqa: E402
from ditron_inductor.scheduler.plan import GroupedMmPlan  # noqa: E402
from ditron_inductor.transformers_ep import expert_major_order  # noqa: E402

# the smoke run's tile: rows and weights through pointers, 3 programs
TINY_PLAN = dict(block_m=16, block_n=32, block_k=32, group_m=2, stages=2, warps=4, progs=3,
                 tma_a=False, tma_b=False)
ARRIVED = 1 << 30  # what every waited-on word and counter holds: arrived, for 2^30 more rows
MAX_REL_ERR = 2e-2
BUCKETS = ("gemm", "routing", "flags", "copies", "sums", "other")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4,8", help="EP degrees W (one rank of each emulated)")
    p.add_argument("--models", default="mixtral,qwen3,deepseek")
    p.add_argument("--tokens", default="128,512,2048,8192,16384", help="tokens per rank")
    p.add_argument("--plans", default="default,128x256_tma",
                   help="fused tiles (bench_moe PLANS labels; 'default': the scheduler's plan, "
                        "its tile by the rows per expert); LABEL/steps: that plan with each "
                        "signal and wait a step of its own (bench_ep_local_work.steps)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", type=int, default=3, metavar="CALLS",
                   help="CUDA: profile CALLS calls of each contender for the split (0: none)")
    p.add_argument("--stages", action=argparse.BooleanOptionalAction, default=True,
                   help="also time each path's dispatch and combine alone")
    p.add_argument("--inference", action="store_true",
                   help="the layer as inference: the fused dispatch stores no rows output "
                        "(GroupedMmPlan rows=False; the unfused path's work is the same)")
    p.add_argument("--wait-timeout-s", type=float, default=None,
                   help="the plans' wait bound (default: the runtime's, a process group's "
                        "600 s; 0: unbounded)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the tiny layer (CPU smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: warn at every synchronising operation of the timed calls")
    p.add_argument("--out", help="write <out>.json and <out>.md")
    args = p.parse_args(argv)
    if args.tiny:
        args.models = "tiny"
        if args.plans == p.get_default("plans"):
            args.plans = "tiny"
        if args.tokens == p.get_default("tokens"):
            args.tokens = "16"
    return args


# ------------------------------------------------------------------------ the emulated rank


class EmulatedRank:
    """Rank 0 of `world` as the fused runtime's steps see an OpContext (runtime/context.py):
    its symmetric data and flags (SymmBuffer over my memory and the peers' stubs), epochs, the
    signal, the error words. flags.words (what the waits read, and the combine's takes its
    counts back off) holds `ARRIVED` in every word; flags.view(-1) and ptr_table[0] (what my put
    counts on) are a live copy of their own."""

    READY = 0

    def __init__(self, world: int, data: torch.Tensor, data_stubs, flag_words: int, device,
                 timeout_s: float):
        self.rank, self.world, self.DONE, self.device = 0, world, world, torch.device(device)
        self.data = SymmBuffer(data, [data, *data_stubs])
        live = torch.zeros(4 * flag_words, dtype=torch.uint8, device=device)
        stubs = [torch.zeros(4 * flag_words, dtype=torch.uint8, device=device)
                 for _ in range(world - 1)]
        self.flags = SymmBuffer(live, [live, *stubs])
        self.arrived = torch.full((flag_words,), ARRIVED, dtype=torch.int32, device=device)
        self.flags.words = self.arrived
        self.flag_bases = [t.data_ptr() for t in self.flags.peers]
        self.timeout_s = timeout_s
        self.fault_id, self.err = faults.error_words(self.device)
        self.epoch = 0

    next_epoch = OpContext.next_epoch
    peer_flag_addr = OpContext.peer_flag_addr

    def signal(self, stream, epoch: int, dst_addrs) -> None:
        if self.device.type == "cuda":
            OpContext.signal(self, stream, epoch, dst_addrs)
        else:  # host memory (the interpreter): no stream
            for addr in dst_addrs:
                ctypes.c_int32.from_address(addr).value = epoch


def dispatch_rank(world: int, x_rows: int, k: int, dtype, experts: int, block_m: int, device,
                  timeout_s: float):
    """(EmulatedRank, layout, state) of the fused dispatch on rank 0: the runtime's layout and
    state (moe_dispatch.dispatch_layout, new_state) over my buffer, its tile counters as
    arrived; each peer's stub holds a route table whose rows are all unclaimed."""
    capacity = max(64, 1 << max(0, world * x_rows - 1).bit_length())  # as moe_dispatch.dispatch
    layout = moe_dispatch.dispatch_layout(world, capacity, k, dtype, experts, block_m)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    data[:4 * layout.tiles].view(torch.int32).fill_(ARRIVED)
    stubs = []
    for _ in range(world - 1):
        stub = torch.zeros(layout.recv_offset, dtype=torch.uint8, device=device)
        table = stub[layout.table_offset:].view(torch.int32)
        table[2 * world:2 * world + capacity].fill_(-1)  # dst_row: no row of mine is claimed
        stubs.append(stub)
    ctx = EmulatedRank(world, data, stubs, 2 * world, device, timeout_s)
    return ctx, layout, moe_dispatch.new_state(ctx, layout)


def combine_rank(world: int, received: int, n: int, dtype, own_rows: int, starts, device,
                 timeout_s: float):
    """(EmulatedRank, layout, state) of the fused combine on rank 0 (moe_combine.context_of,
    new_state), the put's sender table a static copy of mine (each sender's start) whose send
    ends stop at my rows for myself: rows past them go to no rank."""
    _, layout = moe_combine.context_of(world, received, n, dtype)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    stubs = [torch.zeros(256, dtype=torch.uint8, device=device) for _ in range(world - 1)]
    ctx = EmulatedRank(world, data, stubs, moe_combine.arrived_word(world, world), device,
                       timeout_s)
    state = moe_combine.new_state(ctx, layout)
    sender = torch.tensor(list(starts) + [own_rows] * world, dtype=torch.int32, device=device)
    state.table_table = torch.tensor([sender.data_ptr(), *(s.data_ptr() for s in stubs)],
                                     dtype=torch.int64, device=device)
    state.sender_table = sender  # kept alive
    return ctx, layout, state


def stream_signal_and_wait(ctx, plan, stream, addrs, input_split_sizes, epoch: int) -> None:
    """moe_dispatch.signal_and_wait as a stream write of READY per peer (ctx.signal), then the
    wait kernel: the '/steps' plans."""
    ctx.signal(stream, epoch, [ctx.peer_flag_addr(p, ctx.READY + ctx.rank)
                               for p in range(ctx.world) if p != ctx.rank])
    moe_dispatch.wait_ready(ctx, plan, stream, input_split_sizes, epoch)


@contextlib.contextmanager
def steps(label: str):
    """The runtime's steps, or for a '/steps' label each signal and wait a step of its own, as
    before they were merged into other launches: READY by a stream write per peer
    (stream_signal_and_wait) after the dispatch's publish kernel, then the wait for READY, and
    the waits for the rows (the dispatch's before a library GEMM, the combine's ARRIVED) in
    launches after the put's."""
    if not label.endswith("/steps"):
        yield
        return
    publish, put_rows = moe_routes.publish, moe_routes.put_rows
    saved = moe_dispatch.signal_and_wait, moe_combine.signal_and_wait
    moe_dispatch.signal_and_wait = moe_combine.signal_and_wait = stream_signal_and_wait
    moe_routes.publish = lambda *args, handshake=None, **kw: publish(*args, **kw) and False
    moe_routes.put_rows = lambda *args, wait=None, **kwargs: put_rows(*args, **kwargs) and False
    try:
        yield
    finally:
        moe_dispatch.signal_and_wait, moe_combine.signal_and_wait = saved
        moe_routes.publish, moe_routes.put_rows = publish, put_rows


@contextlib.contextmanager
def host_streams(device: str):
    """On CPU the runtime's steps run with no stream (the interpreter launches on none)."""
    if device == "cuda":
        yield
        return
    saved = moe_dispatch.current_stream, moe_combine.current_stream
    moe_dispatch.current_stream = moe_combine.current_stream = lambda: None
    try:
        yield
    finally:
        moe_dispatch.current_stream, moe_combine.current_stream = saved


# ------------------------------------------------------------------------ one rank's data


@dataclasses.dataclass
class Routed:
    """Rank 0's tokens and routing, the splits, and the peers' rows as arrived."""

    x: torch.Tensor  # [T, H]
    ids: torch.Tensor  # [T, k] global experts, distinct per token
    weights: torch.Tensor  # [T, k] fp32 router weights
    recv_counts: torch.Tensor  # [W, E] int64: row p, the rows peer p sends to my experts
    in_splits: list  # rows I send to each rank
    out_splits: list  # rows each rank sends me
    peer_rows: torch.Tensor  # [sum(out_splits[1:]), H]: what the peers send me, rank-major
    back_rows: torch.Tensor  # [sum(in_splits[1:]), H]: my rows' products the peers return


def routed(layer, tokens: int, world: int, device, dtype, gen) -> Routed:
    e, k, h = layer.experts, layer.top_k, layer.hidden

    def choose():
        scores = torch.rand(tokens, world * e, generator=gen, device=device)
        return scores.topk(k, dim=1)

    top = choose()
    ids = top.indices
    counts = [torch.bincount(ids[ids < e], minlength=e)]
    for _ in range(world - 1):
        peer = choose().indices
        counts.append(torch.bincount(peer[peer < e], minlength=e))
    recv_counts = torch.stack(counts).to(torch.int64)
    in_splits = torch.bincount(ids.reshape(-1) // e, minlength=world).tolist()
    out_splits = recv_counts.sum(1).tolist()
    return Routed(
        x=torch.randn(tokens, h, generator=gen, device=device).to(dtype),
        ids=ids, weights=torch.softmax(top.values, dim=1), recv_counts=recv_counts,
        in_splits=in_splits, out_splits=out_splits,
        peer_rows=torch.randn(sum(out_splits[1:]), h, generator=gen, device=device).to(dtype),
        back_rows=torch.randn(sum(in_splits[1:]), h, generator=gen, device=device).to(dtype))


# ------------------------------------------------------------------------ the layer's steps

_STEP = "ep:"


def step(name: str):
    """A profiler range naming the step whose generic kernels (fills, elementwise, reductions)
    its bucket takes."""
    return torch.profiler.record_function(_STEP + name)


class Layer:
    """The layer's steps on rank 0 (module docstring), each path's own buffers, and the float32
    reference of its products."""

    def __init__(self, layer, r: Routed, weights, plans: dict, device: str, dtype,
                 timeout_s: float):
        self.layer, self.r, self.device, self.dtype = layer, r, device, dtype
        self.gate, self.up, self.down = weights
        self.world, self.tokens = len(r.in_splits), r.x.shape[0]
        self.own = r.in_splits[0]  # my rows for myself (= r.out_splits[0])
        self.received, self.sent = sum(r.out_splits), sum(r.in_splits)
        # persistent receive buffers of the unfused path, the peers' rows as arrived
        self.got = torch.empty(self.received, layer.hidden, device=device, dtype=dtype)
        self.got[self.own:] = r.peer_rows
        self.returned = torch.empty(self.sent, layer.hidden, device=device, dtype=dtype)
        self.returned[self.own:] = r.back_rows
        self.recv_counts = r.recv_counts.clone()  # row 0 rewritten by each call
        self.recv_counts[0] = -1
        self.reference()
        self.plans, ranks = {}, {}
        for label, plan in plans.items():
            plan = plan.for_rows(self.sent, layer.experts)  # as dispatch() and combine() do
            if plan.block_m not in ranks:  # the runtime's contexts: one per size class
                d = dispatch_rank(self.world, self.sent, layer.hidden, dtype, layer.experts,
                                  plan.block_m, device, timeout_s)
                starts = [sum(r.in_splits[:p]) for p in range(self.world)]
                c = combine_rank(self.world, self.sent, layer.hidden, dtype, self.own, starts,
                                 device, timeout_s)
                ranks[plan.block_m] = d, c
            self.plans[label] = (plan, *ranks[plan.block_m])
            self.arrive(label)

    def close(self) -> None:
        """Forget my emulated contexts in runtime.faults, whose note of each call's waits holds
        them (a real context lives as long as the process; these go with their row)."""
        for _, (dctx, _, _), (cctx, _, _) in self.plans.values():
            for ctx in (dctx, cctx):
                faults._sites.pop(ctx.fault_id, None)

    # the peers' rows where their puts land them
    def arrive(self, label: str) -> None:
        _, (dctx, dlayout, _), (cctx, clayout, _) = self.plans[label]
        recv = dctx.data.view(-1, self.dtype, [dlayout.capacity, dlayout.k], dlayout.recv_offset)
        recv[:self.received] = self.ref["rows"]
        recv[self.position_of_own] = float("nan")  # my put writes them
        back = cctx.data.view(-1, self.dtype, [clayout.capacity, clayout.k], clayout.recv_offset)
        back[self.own:self.sent] = self.r.back_rows
        back[:self.own] = float("nan")

    def reference(self) -> None:
        r, f32 = self.r, torch.float32
        order, by_expert, offsets, x_send = self.routing()
        received = torch.cat([x_send[:self.own], r.peer_rows])
        rows = received[by_expert]
        counts = self.recv_counts.sum(0).tolist()

        def grouped(a, w):  # one fp32 product per expert
            return torch.cat([p @ w[e].to(f32) for e, p in enumerate(a.to(f32).split(counts))])

        gate, up = grouped(rows, self.gate), grouped(rows, self.up)
        h = torch.nn.functional.silu(gate) * up
        y = grouped(h.to(self.dtype), self.down)
        back = torch.empty_like(y)
        back[by_expert] = y
        returned = torch.cat([back[:self.own], r.back_rows.to(f32)])
        inverse = torch.empty_like(by_expert)
        inverse[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        self.position_of_own = inverse[:self.own]  # expert-major rows of my rows for me
        self.ref = dict(rows=rows, gate=gate, up=up, h=h.to(self.dtype), returned=returned,
                        out=self.sums(returned, order))

    def routing(self):
        r, e, k = self.r, self.layer.experts, self.layer.top_k
        with step("routing"):
            flat = r.ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.zeros(self.world * e, dtype=torch.int64, device=flat.device)
            counts = counts.scatter_add(0, flat, torch.ones_like(flat))
            self.recv_counts[0].copy_(counts[:e])  # the counts all-to-all's local part
            by_expert = expert_major_order(self.recv_counts, self.received)
            offsets = torch.cumsum(self.recv_counts.sum(0), 0, dtype=torch.int32)
            x_send = r.x[order // k]
        return order, by_expert, offsets, x_send

    def sums(self, returned, order):
        with step("sums"):
            pairs = torch.empty_like(returned)
            pairs[order] = returned
            pairs = pairs.view(self.tokens, self.layer.top_k, -1)
            return (pairs * self.r.weights.unsqueeze(-1)).sum(1).to(self.dtype)

    @staticmethod
    def act(gate, up):
        with step("act"):
            return torch.nn.functional.silu(gate) * up

    # the two paths' dispatch and combine
    def unfused_dispatch(self, x_send, by_expert, offsets):
        with step("copies"):
            self.got[:self.own].copy_(x_send[:self.own])  # NCCL's local part
            rows = self.got[by_expert]
        with step("gemm"):
            return rows, [torch._grouped_mm(rows, w, offs=offsets) for w in (self.gate, self.up)]

    def unfused_combine(self, h, by_expert, offsets):
        with step("gemm"):
            y = torch._grouped_mm(h, self.down, offs=offsets)
        with step("copies"):
            back = torch.empty_like(y)
            back[by_expert] = y
            self.returned[:self.own].copy_(back[:self.own])  # NCCL's local part
        return self.returned

    def fused_dispatch(self, label, x_send, by_expert, offsets):
        plan, (ctx, layout, state), _ = self.plans[label]
        r = self.r
        with step("fused_dispatch"), host_streams(self.device), steps(label):
            rows, *outs = moe_dispatch.call(ctx, layout, state, plan, x_send, r.out_splits,
                                            r.in_splits, by_expert, [self.gate, self.up],
                                            offsets, moe.grouped_gemm)
        return rows, outs

    def fused_combine(self, label, h, by_expert, offsets):
        plan, _, (ctx, layout, state) = self.plans[label]
        r = self.r
        with step("fused_combine"), host_streams(self.device), steps(label):
            return moe_combine.call(ctx, layout, state, plan, h, self.down, offsets, by_expert,
                                    r.in_splits, r.out_splits, moe.grouped_gemm)

    # the contenders: fn() -> (outputs by name)
    def path(self, label=None, stage="layer"):
        fused = label is not None

        def dispatch(x_send, by_expert, offsets):
            if fused:
                return self.fused_dispatch(label, x_send, by_expert, offsets)
            return self.unfused_dispatch(x_send, by_expert, offsets)

        def combine(h, by_expert, offsets):
            if fused:
                return self.fused_combine(label, h, by_expert, offsets)
            return self.unfused_combine(h, by_expert, offsets)

        def layer():
            order, by_expert, offsets, x_send = self.routing()
            rows, (gate, up) = dispatch(x_send, by_expert, offsets)
            returned = combine(self.act(gate, up), by_expert, offsets)
            return dict(rows=rows, gate=gate, up=up, returned=returned,
                        out=self.sums(returned, order))

        fixed = self.routing()  # the stages alone start from the routing's results

        _, fixed_by_expert, fixed_offsets, fixed_x_send = fixed

        def dispatch_alone():
            rows, (gate, up) = dispatch(fixed_x_send, fixed_by_expert, fixed_offsets)
            return dict(rows=rows, gate=gate, up=up)

        def combine_alone():
            return dict(returned=combine(self.ref["h"], fixed_by_expert, fixed_offsets))

        return {"layer": layer, "dispatch": dispatch_alone, "combine": combine_alone}[stage]

    def common(self):
        """The steps both paths run (routing, act, sums) around the reference's products."""
        gate, up = self.ref["gate"].to(self.dtype), self.ref["up"].to(self.dtype)
        returned = self.ref["returned"].to(self.dtype)

        def run():
            order = self.routing()[0]
            self.act(gate, up)
            return dict(out=self.sums(returned, order))
        return run

    def check(self, fn, label=None) -> float:
        """The largest relative error of fn's outputs against the reference (NaN or inf where a
        row was left out); rows must match exactly."""
        if label is not None:
            self.arrive(label)
        self.got[:self.own] = float("nan")  # the unfused path's rows for me: its copies write them
        self.returned[:self.own] = float("nan")
        outs = fn()
        errs = []
        for name, out in outs.items():
            ref = self.ref[name]
            if name == "rows":
                errs.append(0.0 if torch.equal(out, ref.to(out.dtype)) else math.inf)
            else:
                err = rel_err(out, ref)
                errs.append(math.inf if math.isnan(err) else err)  # max() would skip a NaN
        return max(errs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """|out - ref| / |ref| (bench_compute_parity's), over chunks of rows in float32: no float64
    copy of a 16384-token layer's tensors."""
    num = den = 0.0
    step = max(1, (1 << 26) // max(1, out[0].numel()))
    for lo in range(0, out.shape[0], step):
        o, r = out[lo:lo + step].float(), ref[lo:lo + step].float()
        num += float(((o - r) ** 2).sum(dtype=torch.float64))
        den += float((r ** 2).sum(dtype=torch.float64))
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


# ------------------------------------------------------------------------ timing and profile


def timed(fns: dict, device: str, iters: int, reps: int, warmup: int) -> tuple[dict, list]:
    """({name: median ms per call}, [names timed host-bound]): as bench_rank_local_work.timed
    (device time: CUDA events around `iters` calls queued while the device spins, the
    contenders in turn in each repetition), the warm-up a parameter, and a repetition whose
    host fell behind the spin retried with a longer spin, then with fewer calls queued (a deep
    queue of the fused calls' copies and flag writes blocks the host: the driver's queue, not
    the work); where even one call's queueing outlasts the spin, events around host and device
    together, and the contender is named host-bound."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    host_bound = []
    for _ in range(reps):
        for name, fn in fns.items():
            ms = _one_rep(fn, device, iters)
            if ms is None:
                if name not in host_bound:
                    host_bound.append(name)
                ms = _host_and_device_ms(fn, iters)
            times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}, host_bound


SPIN_MS = 2.0


def _one_rep(fn, device: str, iters: int):
    """ms per call of one repetition, or None (host-bound)."""
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    calls = iters
    while True:
        spin = SPIN_MS
        for _ in range(3):  # 2, 8, 32 ms
            torch.cuda.synchronize()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            spin_device(spin)  # the host queues the calls meanwhile
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            behind = start.query()
            end.synchronize()
            if not behind:
                return start.elapsed_time(end) / calls
            spin *= 4
        if calls == 1:
            return None
        calls = max(1, calls // 2)


def _host_and_device_ms(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def host_ms(fns: dict, device: str, iters: int) -> dict:
    """{name: the host's ms per call} with nothing queued before: where it is about the
    device's time, a call waits for the device (a host sync), or its launches take that long."""
    out = {}
    for name, fn in fns.items():
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out[name] = (time.perf_counter() - t0) * 1e3 / iters
        if device == "cuda":
            torch.cuda.synchronize()
    return out


# kernel-name marks, the first match of the lower-cased name winning
NAME_BUCKETS = (
    ("gemm", ("grouped_gemm", "gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma")),
    ("flags", ("wait_flags", "wait")),
    ("routing", ("publish_routes", "sort", "scan", "bincount", "histogram", "htod")),
    ("copies", ("put_rows", "memcpy", "index", "catarray", "gather")),
)
# the bucket of a kernel no name mark claims (fills, elementwise, reductions), by its step
STEP_BUCKETS = {"routing": "routing", "sums": "sums", "act": "other", "copies": "copies",
                "gemm": "gemm", "fused_dispatch": "routing"}  # the route table's -1 fill


def bucket_of(name: str, step_name) -> str:
    lower = name.lower()
    for bucket, marks in NAME_BUCKETS:
        if any(m in lower for m in marks):
            return bucket
    return STEP_BUCKETS.get(step_name, "other")


def split_of(events, calls: int) -> dict:
    """{bucket: device ms per call} of the profiler's kernels (and copies), plus busy (the
    union of their spans) and span (first start to last end) per call."""
    from torch.autograd import DeviceType

    from benchmarks.e2e_llama import busy

    kernels = [e for e in events if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    linked: dict = {}  # kernel name -> [(us, step)] of the kernels a CPU op launched
    for e in events:
        if e.device_type != DeviceType.CPU or not getattr(e, "kernels", None):
            continue
        parent, step_name = e, None
        while parent is not None:
            if parent.name.startswith(_STEP):
                step_name = parent.name[len(_STEP):]
                break
            parent = parent.cpu_parent
        for kern in e.kernels:
            linked.setdefault(kern.name, []).append((kern.duration, step_name))
    out = dict.fromkeys(BUCKETS, 0.0)
    totals: dict = {}
    for e in kernels:
        totals[e.name] = totals.get(e.name, 0.0) + e.device_time_total
    by_name = {}
    for name, total in totals.items():
        known = 0.0
        for us, step_name in linked.get(name, ()):
            out[bucket_of(name, step_name)] += us / 1e3 / calls
            known += us
        if total > known:  # no launching op found: by its name alone
            out[bucket_of(name, None)] += (total - known) / 1e3 / calls
        by_name[name] = total / 1e3 / calls
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    out["busy"] = busy(spans) / 1e3 / calls
    out["span"] = (spans[-1][1] - spans[0][0]) / 1e3 / calls if spans else 0.0
    out["top"] = [[n[:100], round(ms, 4)] for n, ms in
                  sorted(by_name.items(), key=lambda kv: -kv[1])[:10]]
    return out


def profiled(fn, calls: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return split_of(prof.events(), calls)


# ------------------------------------------------------------------------ the rows


def plans_of(args) -> dict:
    out = {}
    for label in args.plans.split(","):
        base = label.split("/")[0]
        params = TINY_PLAN if base == "tiny" else PLANS[base]
        # a label that names no tile: as the scheduler plans it, its tile and its dispatch's
        # GEMM engine by the rows per expert
        rules = ({} if "block_m" in params else dict(
            small_expert_rows=policy.SMALL_EXPERT_ROWS,
            library_rows=policy.LIBRARY_DISPATCH_ROWS,
            library_below_rows=policy.LIBRARY_DISPATCH_BELOW_ROWS,
            library_combine_rows=policy.LIBRARY_COMBINE_ROWS))
        out[label] = dataclasses.replace(GroupedMmPlan(), label=label,
                                         **{**rules, **params},
                                         wait_timeout_s=args.wait_timeout_s,
                                         rows=not args.inference)
    return out


def contenders(lay: Layer, stages: bool) -> dict:
    fns = {"unfused": lay.path(), "common": lay.common()}
    for label in lay.plans:
        fns[f"fused:{label}"] = lay.path(label)
    if stages:
        for stage in ("dispatch", "combine"):
            fns[f"unfused {stage}"] = lay.path(stage=stage)
            for label in lay.plans:
                fns[f"fused:{label} {stage}"] = lay.path(label, stage)
    return fns


def run(args) -> list[dict]:
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter: fp16 dots
    timeout_s = faults.DEFAULT_TIMEOUT_S  # a process group's, as the runtime reads it
    plans = plans_of(args)
    rows, t0 = [], time.time()
    for model in args.models.split(","):
        layer = LAYERS[model]
        torch.manual_seed(args.seed)
        weights = layer_weights(layer, device, dtype)  # nn.Linear's layout, seen as [E, K, N]
        for world in (int(w) for w in args.worlds.split(",")):
            for tokens in (int(t) for t in args.tokens.split(",")):
                gen = torch.Generator(device=device).manual_seed(args.seed + 7919 * world
                                                                 + tokens)
                r = routed(layer, tokens, world, device, dtype, gen)
                lay = Layer(layer, r, weights, plans, device, dtype, timeout_s)
                fns = contenders(lay, args.stages)
                row = dict(model=layer.name, experts_per_rank=layer.experts, hidden=layer.hidden,
                           inter=layer.inter, top_k=layer.top_k, world=world, tokens=tokens,
                           rows_sent=lay.sent, rows_received=lay.received, own_rows=lay.own,
                           plans=list(plans), inference=args.inference, rel_err={}, ms={},
                           split={})
                for name, fn in fns.items():
                    label = name.split(":", 1)[1].split(" ")[0] if ":" in name else None
                    err = lay.check(fn, label)
                    row["rel_err"][name] = err
                    if not err < MAX_REL_ERR:
                        raise SystemExit(
                            f"{layer.name} W={world} T={tokens} {name}: the emulation computes "
                            f"something else (relative error {err:.3g})")
                if args.sync_debug and device == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                row["ms"], row["host_bound"] = timed(fns, device, args.iters, args.reps,
                                                     args.warmup)
                if args.sync_debug and device == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
                row["host_ms"] = host_ms(fns, device, max(1, args.iters // 2))
                if device == "cuda" and args.profile:
                    row["split"] = {name: profiled(fn, args.profile)
                                    for name, fn in fns.items() if " " not in name}
                if device == "cuda":
                    row["peak_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
                    torch.cuda.reset_peak_memory_stats()
                rows.append(row)
                print(row_line(row, row["plans"][0]), f"({time.time() - t0:.0f} s)", flush=True)
                lay.close()
                del lay, fns, r
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------ the report

SPLIT_KEYS = ("gemm", "routing", "flags", "copies", "sums", "other")
HEAD = ["model", "W", "tokens", "rows sent / recv", "plan", "unfused ms", "fused ms",
        "fused / unfused", "common ms", "ops: fused / unfused", "dispatch: fused / unfused",
        "combine: fused / unfused", "host ms: unfused / fused", "unfused split", "fused split"]


def _split_text(split: dict) -> str:
    if not split:
        return "-"
    idle = split["span"] - split["busy"]
    return " / ".join(f"{split[k]:.3f}" for k in SPLIT_KEYS) + f" (idle {idle:.3f})"


def row_line(row: dict, label: str) -> str:
    ms = row["ms"]
    unfused, fused, common = ms["unfused"], ms[f"fused:{label}"], ms["common"]

    def ratio(a, b):
        return f"{a / b:.2f}" if a is not None and b else "-"

    stage = [ratio(ms.get(f"fused:{label} {s}"), ms.get(f"unfused {s}"))
             for s in ("dispatch", "combine")]
    host = row.get("host_ms", {})

    def cell(name):  # a host-bound time is the host's and the device's together
        return f"{ms[name]:.3f}" + (" (host-bound)" if name in row.get("host_bound", ()) else "")

    cells = [row["model"], str(row["world"]), str(row["tokens"]),
             f"{row['rows_sent']} / {row['rows_received']}", label, cell("unfused"),
             cell(f"fused:{label}"), ratio(fused, unfused), f"{common:.3f}",
             ratio(fused - common, unfused - common) if unfused > common else "-", *stage,
             f"{host['unfused']:.3f} / {host[f'fused:{label}']:.3f}" if host else "-",
             _split_text(row["split"].get("unfused", {})),
             _split_text(row["split"].get(f"fused:{label}", {}))]
    return "| " + " | ".join(cells) + " |"


def machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.machine()}, Triton interpreter)"


def report(rows: list[dict], args, argv) -> str:
    import triton

    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    lines = [f"# An EP-W rank's local work in the MoE dispatch and combine, transfers free "
             f"({machine(args.device)})", "",
             f"- command: `python benchmarks/bench_ep_local_work.py {' '.join(argv)}`",
             f"- machine: {machine(args.device)}; {date}; torch {torch.__version__}, triton "
             f"{triton.__version__}",
             "- ms: median device ms per layer call (routing, dispatch, act, combine, weighted "
             "sum) of rank 0 of W; common: the routing, act and sum both paths run; ops: "
             "(path - common); split (torch.profiler, device ms per call): "
             + " / ".join(SPLIT_KEYS) + ", idle = span - busy", "",
             "| " + " | ".join(HEAD) + " |", "|" + " --- |" * len(HEAD)]
    lines += [row_line(r, label) for r in rows for label in r["plans"]]
    return "\n".join(lines + ["", *summary(rows)]) + "\n"


def summary(rows: list[dict]) -> list[str]:
    """Per plan: the largest fused / unfused over the rows (the goal: at most 1.00 at each), and
    of the ops alone."""
    lines = []
    for label in (rows[0]["plans"] if rows else ()):
        ratios = [(r["ms"][f"fused:{label}"] / r["ms"]["unfused"], r) for r in rows]
        ops = [(r["ms"][f"fused:{label}"] - r["ms"]["common"])
               / (r["ms"]["unfused"] - r["ms"]["common"]) for r in rows
               if r["ms"]["unfused"] > r["ms"]["common"]]
        worst, at = max(ratios, key=lambda item: item[0])
        lines.append(
            f"- fused:{label}: fused / unfused {min(x for x, _ in ratios):.2f}-{worst:.2f} "
            f"(worst {at['model']} W={at['world']} T={at['tokens']}), at most 1.00 at "
            f"{sum(x <= 1.0 for x, _ in ratios)} of {len(ratios)} rows; ops alone at most "
            f"{max(ops, default=math.nan):.2f}")
    return lines


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows = run(args)
    text = report(rows, args, argv)
    if args.out:
        meta = dict(command="python benchmarks/bench_ep_local_work.py " + " ".join(argv),
                    machine=machine(args.device), torch=torch.__version__,
                    date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
