"""FP8 compute parity at world size 1: the fp8 ops' fused plans (ditron.all_gather_scaled_mm,
scaled_mm_reduce_scatter) beside the torch._scaled_mm calls they replace, at the all-gather and
reduce-scatter sites of a Llama training step (scaled_mm_all_reduce has no fused plan: it runs as
_scaled_mm + NCCL).

    torchrun --nproc-per-node 1 benchmarks/bench_fp8_parity.py \
        --out benchmarks/results/fp8_parity_h100x1                  # one GPU
    python benchmarks/bench_fp8_parity.py --device cpu --tiny --out /tmp/fp8   # smoke run

At world size 1 the gather has no peer: what is left of the fused call is its compute (the
_scaled_mm of each group of chunks, here the one own chunk, read straight from the input) and its
local copies of the shard (into the symmetric buffer and the gathered output, on a side stream).
A plan slower than _scaled_mm here spends the communication it hides on slower compute.

Rows: the all-gather sites of benchmarks/llama_sites.py (workload "train", sequence parallel) at
--tp's per-rank shapes, as float8: A e4m3 (e5m2 for the backward's output-gradient gathers),
weights e4m3 column-major, tensorwise scales, bf16 output, use_fast_accum as torchao's forward
(True) and backward (False) call it; then the forward's o and down reduce-scatters (workload
"train"), e4m3 with fast accumulation, with the plan DITRON_PLAN=fused gives them (the
copy-engine RS plan with cuBLAS). At world size 1 the RS plan's GEMM writes its one slot and the
reduction copies it out. Per row:
  scaled_mm  torch._scaled_mm per weight (what the graph computes beside its all-gather)
  plan       torch.ops.ditron.all_gather_scaled_mm with each plan of PLANS (the plan
             DITRON_PLAN=fused gives the site)
  bf16_mm    torch.mm per weight in bf16, for scale (what fp8 saves)
Timing: bench_compute_parity.timed (random inputs alternated, warm-up, CUDA events around --iters
calls queued behind a device spin, the median of --reps repetitions). Each plan's output is
checked against _scaled_mm first (relative error), and a plan whose fused path did not serve the
call is reported as such (served = False), never as fused.

Writes <out>.json ({meta, rows}) and <out>.md (ratio = plan / scaled_mm).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_compute_parity import timed  # noqa: E402
from benchmarks.llama_sites import sites  # noqa: E402
from ditron_inductor.scheduler.decide import plan_for  # noqa: E402
from ditron_inductor.scheduler.task import (  # noqa: E402
    ALL_GATHER_MATMUL,
    ALL_GATHER_SCALED_MM,
    MATMUL_REDUCE_SCATTER,
    SCALED_MM_REDUCE_SCATTER,
)

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
# label -> plan parameters (AllGatherPlan's fields); {}: what DITRON_PLAN=fused gives the site
PLANS = {"fused": {}}


def rel_err(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


# op -> the runtime module whose stats count its fused calls
RUNTIMES = {ALL_GATHER_SCALED_MM: "all_gather", SCALED_MM_REDUCE_SCATTER: "reduce_scatter"}


def served_count(op: str = ALL_GATHER_SCALED_MM) -> int:
    runtime = sys.modules.get(f"ditron_inductor.runtime.{RUNTIMES[op]}")
    return runtime.stats[op] if runtime else 0


def operand_kind(site) -> tuple:
    """(A's float8 dtype, use_fast_accum) as torchao's float8 step calls _scaled_mm at the site:
    the backward's (output or input gradients) e5m2 without fast accumulation, else e4m3 with."""
    return (E5M2, False) if "grad" in site.name else (E4M3, True)


def measure(site, plans: dict, group_name: str, args) -> list[dict]:
    task = site.task
    a_dtype, fast = operand_kind(site)
    m, k = task.m, task.k
    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(0)

    def fp8(*shape, dtype=E4M3):
        return (torch.randn(*shape, generator=gen, device=dev) * 4).to(dtype)

    inputs = []
    for _ in range(2):  # two sets alternated: no call reads what the last left in cache
        ws = [fp8(n, k).t() for n in task.ns]
        scales = [torch.rand((), generator=gen, device=dev) + 0.5 for _ in range(1 + len(ws))]
        inputs.append((fp8(m, k, dtype=a_dtype), scales[0], ws, scales[1:]))

    def scaled_mm(a, s_a, ws, s_bs):
        return [torch._scaled_mm(a, w, s_a, s, out_dtype=BF16, use_fast_accum=fast)
                for w, s in zip(ws, s_bs)]

    def bf16_mm(a, s_a, ws, s_bs):
        return [torch.mm(a, w) for w in ws]

    fp8_task = dataclasses.replace(task, op=ALL_GATHER_SCALED_MM, world_size=1, dtype=a_dtype,
                                   out_dtype=BF16, scales="tensorwise", fast_accum=fast)
    base_ms, base_host = timed(scaled_mm, inputs, dev, args.iters, args.reps)
    bf16_inputs = [(a.to(BF16), s, [w.to(BF16) for w in ws], ss) for a, s, ws, ss in inputs]
    bf16_ms, _ = timed(bf16_mm, bf16_inputs, dev, args.iters, args.reps)
    rows = []
    for label, params in plans.items():
        plan = plan_for(fp8_task, **params)
        text = plan.encode()

        def fused(a, s_a, ws, s_bs, text=text):
            return torch.ops.ditron.all_gather_scaled_mm(
                a, s_a, ws, s_bs, [None] * len(ws), BF16, fast, 0, group_name, 1, text)

        before = served_count()
        outs = fused(*inputs[0])
        served = served_count() > before
        err = max(rel_err(o, r) for o, r in zip(outs[1:], scaled_mm(*inputs[0])))
        ms, host = timed(fused, inputs, dev, args.iters, args.reps)
        rows.append(dict(site=site.name, M=m, K=k, N=list(task.ns), a_dtype=str(a_dtype)[6:],
                         fast_accum=fast, plan=label, plan_text=plan.describe(), served=served,
                         rel_err=err, scaled_mm_ms=base_ms, fused_ms=ms, ratio=ms / base_ms,
                         bf16_mm_ms=bf16_ms, scaled_mm_host_ms=base_host, fused_host_ms=host))
        print(f"{site.name:28s} M={m} K={k} N={task.ns} {label:13s} served={served} "
              f"err={err:.1e} scaled_mm {base_ms:.3f} ms  fused {ms:.3f} ms  "
              f"ratio {ms / base_ms:.3f}  (bf16 mm {bf16_ms:.3f} ms)", flush=True)
    return rows


def measure_reduction(site, group_name: str, args) -> list[dict]:
    """One row: the fp8 reduce-scatter op's fused plan at world size 1 against _scaled_mm
    (forward: e4m3, fast accumulation)."""
    op = SCALED_MM_REDUCE_SCATTER
    task, dev = site.task, args.device
    (m, k), n = (task.m, task.k), task.ns[0]
    gen = torch.Generator(device=dev).manual_seed(0)

    def fp8(*shape):
        return (torch.randn(*shape, generator=gen, device=dev) * 4).to(E4M3)

    inputs = [(fp8(m, k), fp8(n, k).t(), torch.rand((), generator=gen, device=dev) + 0.5,
               torch.rand((), generator=gen, device=dev) + 0.5) for _ in range(2)]

    def scaled_mm(a, b, s_a, s_b):
        return torch._scaled_mm(a, b, s_a, s_b, out_dtype=BF16, use_fast_accum=True)

    def bf16_mm(a, b, s_a, s_b):
        return torch.mm(a, b)

    fp8_task = dataclasses.replace(task, op=op, world_size=1, dtype=E4M3, out_dtype=BF16,
                                   scales="tensorwise", fast_accum=True)
    plan = plan_for(fp8_task)
    text = plan.encode()

    def fused(a, b, s_a, s_b):  # its operands are lists of terms, one here
        return torch.ops.ditron.scaled_mm_reduce_scatter([a], [b], [s_a], [s_b], None, BF16, True,
                                                         [], 0, "sum", group_name, 1, text)

    base_ms, base_host = timed(scaled_mm, inputs, dev, args.iters, args.reps)
    bf16_inputs = [(a.to(BF16), b.to(BF16), s_a, s_b) for a, b, s_a, s_b in inputs]
    bf16_ms, _ = timed(bf16_mm, bf16_inputs, dev, args.iters, args.reps)
    before = served_count(op)
    out = fused(*inputs[0])
    served = served_count(op) > before
    err = rel_err(out, scaled_mm(*inputs[0]))
    ms, host = timed(fused, inputs, dev, args.iters, args.reps)
    name = site.name
    print(f"{name:28s} M={m} K={k} N={n} {plan.label:16s} served={served} err={err:.1e} "
          f"scaled_mm {base_ms:.3f} ms  fused {ms:.3f} ms  ratio {ms / base_ms:.3f}  "
          f"(bf16 mm {bf16_ms:.3f} ms)", flush=True)
    return [dict(site=name, M=m, K=k, N=[n], a_dtype="float8_e4m3fn", fast_accum=True,
                 plan="fused", plan_text=plan.describe(), served=served, rel_err=err,
                 scaled_mm_ms=base_ms, fused_ms=ms, ratio=ms / base_ms, bf16_mm_ms=bf16_ms,
                 scaled_mm_host_ms=base_host, fused_host_ms=host)]


def table(rows: list[dict], meta: dict) -> str:
    lines = [f"# FP8 compute parity at world size 1 ({meta['device_name']})", "",
             f"torch {meta['torch']}, {meta['date']}, Llama-3-{meta['model']} TP {meta['tp']} "
             f"training-step gathers and forward scatters, "
             f"{meta['tokens']} tokens; median ms per call; ratio = "
             "plan / _scaled_mm; served = the fused path ran (else the reference did)", "",
             "| site | M | K | N | A | plan | served | rel err | _scaled_mm | plan ms | ratio "
             "| bf16 mm |", "|" + " --- |" * 12]
    for r in rows:
        lines.append(f"| {r['site']} | {r['M']} | {r['K']} | {','.join(map(str, r['N']))} | "
                     f"{r['a_dtype']} | {r['plan']} | {r['served']} | {r['rel_err']:.1e} | "
                     f"{r['scaled_mm_ms']:.3f} | {r['fused_ms']:.3f} | {r['ratio']:.3f} | "
                     f"{r['bf16_mm_ms']:.3f} |")
    lines.append("")
    for kind in ("gather", "scatter"):  # one geometric mean per op
        fused = [r["ratio"] for r in rows
                 if r["plan"] == "fused" and r["served"] and kind in r["site"]]
        if fused:
            geo = math.exp(sum(math.log(x) for x in fused) / len(fused))
            lines.append(f"Geometric mean ratio of the served `fused` {kind} rows: {geo:.3f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="8b")
    p.add_argument("--tp", type=int, default=2, help="the TP degree whose per-rank shapes run")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny model, few tokens (smoke run)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.tiny:
        args.model, args.tokens, args.iters, args.reps = "tiny", 64, 2, 2
    if "RANK" not in os.environ:  # run without torchrun: one rank of our own
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    if args.device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo")
    group_name = dist.group.WORLD.group_name
    rows = []
    for site in sites(args.model, args.tp, "train", args.tokens):
        if site.task.op == ALL_GATHER_MATMUL:
            rows += measure(site, PLANS, group_name, args)
    for site in sites(args.model, args.tp, "train", args.tokens):  # the forward's scatters
        if site.task.op == MATMUL_REDUCE_SCATTER and site.name in ("o scatter", "down scatter"):
            rows += measure_reduction(site, group_name, args)
    meta = dict(model=args.model, tp=args.tp, tokens=args.tokens, torch=torch.__version__,
                date=datetime.date.today().isoformat(),
                device_name=(torch.cuda.get_device_name() if args.device == "cuda" else "cpu"))
    text = table(rows, meta)
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
        with open(args.out + ".md", "w") as fh:
            fh.write(text)
    if args.device == "cuda":
        from ditron_inductor import runtime

        runtime.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
