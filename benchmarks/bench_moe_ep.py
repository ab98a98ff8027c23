"""MoE expert parallelism on several ranks: the fused dispatch (ditron.all_to_all_grouped_mm:
rows pushed into the experts' ranks, each GEMM tile starting when its rows landed) and combine
(ditron.grouped_mm_all_to_all: the down GEMM's rows stored in send order, then put back) beside
what an EP layer runs without ditron, NCCL all-to-all + torch._grouped_mm, at the expert layers of
bench_moe.py (Mixtral-8x7B, Qwen3-30B-A3B, a DeepSeek-V3 slice: the experts per rank given
there, so the model has world x as many), tokens per rank 128-16384.

    torchrun --nproc-per-node 2 benchmarks/bench_moe_ep.py --out benchmarks/results/moe_ep_h100x2
    torchrun --nproc-per-node 2 benchmarks/bench_moe_ep.py --device cpu --tiny --out /tmp/moe_ep

Each rank routes its tokens (top-k distinct experts of all ranks', uniformly at random) and sends
one row per (token, expert), sorted by expert, as an EP layer does after its router; the split
sizes and each received row's expert are exchanged once per input set, outside the timed calls
(the fused ops take host split sizes, as the layer has them after its exchange of counts):
  gate+up  nccl:  all_to_all_single of the rows, rows[row_index] (expert-major), two grouped
                  GEMMs (gate, up);
           fused: all_to_all_grouped_mm with a GroupedMmPlan of each tile (PLANS of bench_moe);
  down     nccl:  the grouped GEMM (down), its rows put back in arrival order (row_index), the
                  reverse all_to_all_single;
           fused: grouped_mm_all_to_all (accumulate off: each row goes back once; the sum of a
                  token's top-k rows, after it, is the same for both and not timed).
Each fused output is checked against the NCCL contender's (relative error) and counted only where
the fused path served the call (on CPU it never does: the reference runs, and the row says so).
Timing: bench_fused.bench on CUDA (CUDA events around --iters calls after a sync of every rank,
the median of --reps, the maximum over ranks; eager launches: the multi-rank ops decline under
CUDA-graph capture); the host's clock on CPU. Writes <out>.json ({meta, rows}) and <out>.md.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_compute_parity import rel_err  # noqa: E402
from benchmarks.bench_fused import (  # noqa: E402
    bench_on,
    max_over_ranks,
    ranks_meta,
    write_tables,
)
from benchmarks.bench_moe import (  # noqa: E402
    LAYERS,
    PLANS,
    TINY_PLANS,
    MoeLayer,
    close_group,
    init_group,
    layer_weights,
    plan_text,
    served_count,
)
from ditron_inductor import ops  # noqa: E402, F401 - torch.ops.ditron.*
from ditron_inductor.scheduler.task import (  # noqa: E402
    ALL_TO_ALL_GROUPED_MM,
    GROUPED_MM_ALL_TO_ALL,
)

STAGES = {"gate+up": ALL_TO_ALL_GROUPED_MM, "down": GROUPED_MM_ALL_TO_ALL}
MAX_REL_ERR = 2e-2  # bf16 products in another order


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/moe_ep")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="the tiny layer only (a smoke run)")
    ap.add_argument("--models", default="mixtral,qwen3,deepseek")
    ap.add_argument("--tokens", default="128,512,2048,8192,16384", help="tokens per rank")
    ap.add_argument("--plans", default="default,128x128_tma",
                    help="fused tiles (PLANS labels; 'default': the plan's default tile)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="CUDA: also profile CALLS calls of each contender (torch profiler on "
                         "every rank): its kernels' device time per call, rank 0's, in the JSON "
                         "and the table's notes")
    args = ap.parse_args(argv)
    if args.tiny:
        args.models, args.tokens, args.iters, args.reps = "tiny", "16,37", 2, 2
        args.plans = ",".join(TINY_PLANS)
    unknown = set(args.plans.split(",")) - {*PLANS, *TINY_PLANS}
    if unknown:
        ap.error(f"--plans: unknown tile(s) {sorted(unknown)}; known: {[*PLANS, *TINY_PLANS]}")
    return args


def ep_inputs(layer: MoeLayer, tokens: int, world: int, group, device, dtype, gen) -> dict:
    """One input set of this rank: the rows it sends (one per token and chosen expert, sorted by
    expert), the split sizes both ways, and, for the rows it receives, row_index (their
    expert-major order), offsets and the down projection's input h."""
    experts = layer.experts * world
    chosen = torch.rand(tokens, experts, generator=gen).topk(layer.top_k, dim=1).indices
    expert = chosen.reshape(-1).sort().values
    send = torch.bincount(expert // layer.experts, minlength=world).to(device)  # NCCL: on GPUs
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    in_splits, out_splits = send.tolist(), recv.tolist()
    received = torch.empty(sum(out_splits), dtype=expert.dtype, device=device)
    dist.all_to_all_single(received, expert.to(device), out_splits, in_splits, group=group)
    local = received % layer.experts
    return dict(
        x=torch.randn(expert.numel(), layer.hidden, generator=gen).to(device, dtype),
        in_splits=in_splits, out_splits=out_splits,
        row_index=torch.argsort(local, stable=True).to(device),
        offsets=torch.cumsum(torch.bincount(local, minlength=layer.experts), 0).to(
            torch.int32).to(device),
        h=torch.randn(received.numel(), layer.inter, generator=gen).to(device, dtype))


def nccl_contender(stage: str, weights, group):
    """The unfused EP layer's stage: NCCL all-to-all + torch._grouped_mm."""
    gate, up, down = weights
    if stage == "gate+up":
        def call(i):
            got = i["x"].new_empty(sum(i["out_splits"]), i["x"].shape[1])
            dist.all_to_all_single(got, i["x"], i["out_splits"], i["in_splits"], group=group)
            rows = got[i["row_index"]]
            return [torch._grouped_mm(rows, w, offs=i["offsets"]) for w in (gate, up)]
    else:
        def call(i):
            y = torch._grouped_mm(i["h"], down, offs=i["offsets"])
            back = torch.empty_like(y)
            back[i["row_index"]] = y
            out = y.new_empty(sum(i["in_splits"]), y.shape[1])
            dist.all_to_all_single(out, back, i["in_splits"], i["out_splits"], group=group)
            return [out]
    return call


def fused_contender(stage: str, weights, group_name: str, world: int, text: str):
    gate, up, down = weights
    ditron = torch.ops.ditron
    if stage == "gate+up":
        def call(i):
            return list(ditron.all_to_all_grouped_mm(
                i["x"], i["out_splits"], i["in_splits"], i["row_index"], [gate, up],
                i["offsets"], group_name, world, text)[1:])
    else:
        def call(i):
            return [ditron.grouped_mm_all_to_all([i["h"]], [down], i["offsets"], i["row_index"],
                                                 False, i["in_splits"], i["out_splits"],
                                                 group_name, world, text)]
    return call


def timed_ms(fn, inputs, args) -> float:
    return bench_on(args.device, fn, [(i,) for i in inputs], args.iters, args.reps)


def kernel_profile(fn, inputs, calls: int) -> dict:
    """Device ms per call by kind and the longest kernels (e2e_llama.device_profile) over
    `calls` calls of fn, taking the input sets in turn, on every rank (the calls exchange
    rows); rank 0's."""
    from benchmarks.e2e_llama import Timer, device_profile

    turns = itertools.cycle(inputs)
    return device_profile(lambda: fn(next(turns)), calls, Timer("cuda"))


def profile_note(times: dict) -> str:
    """The profile as a table note: busy and idle ms per call, then the longest kernels."""
    top = "; ".join(f"{name[:40]} {ms:.3f}" for name, _, ms in times["top"][:5])
    return f"busy {times['busy']:.3f}, idle {times['idle']:.3f} ms/call: {top}"


def run(args, group) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.device == "cpu":
        dtype = torch.float32  # CPU grouped GEMMs: float32
    world, rows = dist.get_world_size(), []
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    for model in args.models.split(","):
        layer = LAYERS[model]
        weights = layer_weights(layer, device, dtype)
        for tokens in (int(t) for t in args.tokens.split(",")):
            inputs = [ep_inputs(layer, tokens, world, group, device, dtype, gen) for _ in range(2)]
            for stage, op in STAGES.items():
                nccl = nccl_contender(stage, weights, group)
                ref = nccl(inputs[0])
                nccl_ms = timed_ms(nccl, inputs, args)
                profiles = {}
                if args.profile and args.device == "cuda":
                    profiles["nccl"] = kernel_profile(nccl, inputs, args.profile)
                for label in args.plans.split(","):
                    fused = fused_contender(stage, weights, group.group_name, world,
                                            plan_text(op, layer, label, dtype, world))
                    before = served_count()
                    error, err, ms = "", math.nan, math.nan
                    try:
                        err = max_over_ranks(max(rel_err(o, r) for o, r in zip(fused(inputs[0]),
                                                                               ref)))
                        served = max_over_ranks(served_count() - before) > 0
                        if err > MAX_REL_ERR:
                            error = f"relative error {err:.2e}"
                        elif served:
                            ms = timed_ms(fused, inputs, args)
                            if profiles:
                                profiles["fused"] = kernel_profile(fused, inputs, args.profile)
                    except Exception as exc:  # noqa: BLE001 - the row says what failed
                        error, served = f"{type(exc).__name__}: {exc}".splitlines()[0], False
                    rows.append(dict(model=layer.name, experts_per_rank=layer.experts,
                                     hidden=layer.hidden, inter=layer.inter, top_k=layer.top_k,
                                     tokens=tokens, rows=tokens * layer.top_k, stage=stage,
                                     plan=label, nccl_ms=nccl_ms, fused_ms=ms, served=served,
                                     rel_err=err, error=error, profiles=dict(profiles)))
                    profiles.pop("fused", None)
                    if dist.get_rank() == 0:
                        print(f"{layer.name} T={tokens} {stage} {label}: nccl {nccl_ms:.3f} ms, "
                              f"fused {ms:.3f} ms, served {served}, rel err {err:.1e} {error}",
                              flush=True)
    return rows


def report(rows: list[dict], args, argv) -> None:
    meta = ranks_meta("bench_moe_ep.py", argv, args.device)
    world, device = meta["world"], meta["device"]
    head = ["model", "experts per rank", "hidden", "inter", "top-k", "tokens per rank", "rows",
            "stage", "plan", "NCCL + grouped_mm ms", "fused ms", "fused / NCCL", "rel err",
            "note"]
    lines = [f"# MoE expert parallelism on {world} ranks ({device})", "",
             f"- command: `{meta['command']}`", f"- torch {meta['torch']}, {meta['date']}", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        note = r["error"] or ("" if r["served"] else "not served: the reference ran")
        note += "".join(f" {who}: {profile_note(times)}." for who, times in r["profiles"].items())
        lines.append("| " + " | ".join(str(c) for c in (
            r["model"], r["experts_per_rank"], r["hidden"], r["inter"], r["top_k"], r["tokens"],
            r["rows"], r["stage"], r["plan"], f"{r['nccl_ms']:.3f}",
            "-" if math.isnan(r["fused_ms"]) else f"{r['fused_ms']:.3f}",
            "-" if math.isnan(r["fused_ms"]) else f"{r['fused_ms'] / r['nccl_ms']:.2f}",
            f"{r['rel_err']:.1e}", note)) + " |")
    write_tables(args.out, meta, rows, lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    init_group(args.device, launched=True)
    torch.manual_seed(0)  # the weights: the same on every rank, each rank its own experts' copy
    rows = run(args, dist.group.WORLD)
    if dist.get_rank() == 0:
        report(rows, args, argv)
    close_group(args.device)


if __name__ == "__main__":
    main()
