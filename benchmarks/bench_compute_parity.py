"""Compute parity at world size 1: each fused plan beside the unfused compute it replaces.

    torchrun --nproc-per-node 1 benchmarks/bench_compute_parity.py \
        --out benchmarks/results/compute_parity_h100x1          # one GPU
    python benchmarks/bench_compute_parity.py --device cpu --tiny --out /tmp/parity   # smoke run

At world size 1 the fused ops' peer loops are empty: what is left of a call is the plan's compute
(its GEMM, on the SMs the plan gives it) and its local passes (the copies of my shard, the
reduction of my own slot, the copy-out and the norm). A plan that costs more here than the
unfused compute spends the communication it hides on a slower GEMM.

Rows: the collective + matmul sites of Llama-3-8B and -70B (benchmarks/llama_sites.py) at TP 2, 4
and 8: a training step (sequence parallel), prefill and decode (plain TP), each at the per-rank
shapes of its TP degree, run on this GPU. Per row:
  unfused   what the site's graph computes beside its collective without ditron: cuBLAS (`mm`)
            per weight; a sum of matmul products compiled by Inductor (cuBLAS + its add kernel);
            + residual and RMSNorm compiled by Inductor after cuBLAS (one fused kernel); a
            gathered product's split + cat (at world size 1 a copy of the product)
  plan      torch.ops.ditron.<op> with the plan the scheduler picks for the site at its TP
            degree ("chosen"; none where it keeps NCCL + cuBLAS), and each variant of --variants
            (calibration), decoded from the plan text as a compiled graph carries it; a sum's
            terms as the op takes them, and the elements the pass counted as copied
            (Task.copy_elems) copied in the timed call
Timing (METHOD.md): two sets of random inputs alternated, warm-up, CUDA events around --iters
calls, the median of --reps repetitions; eager (the calls queued while the device spins, so
their device time alone, as a device-bound training step sees it; the host's time to queue a
call is reported beside it), and replayed from a CUDA graph where the plan is captured (the
all-gather and copy-engine reduce-scatter plans are not: their epochs are host values). Each plan's output is checked against the unfused one first (relative error), and a
plan whose fused path did not serve the call (it took the reference path) is reported as such,
never timed as fused.

Writes <out>.json ({meta, rows: [{model, tp, workload, site, op, M, K, N, terms, plan, chosen,
mode, unfused_ms, fused_ms, ratio, unfused_host_ms, fused_host_ms, served, rel_err}]}) and <out>.md
(the table: ratio = fused / unfused; the geometric mean over the chosen plans' rows).

The scheduler's world-1 compute table (scheduler/evidence/world1_compute.json) is not written
here: the calibration measures its rows (each site's plan families the scheduler reads beside the
unfused compute, at world size 1), and its export merges them into the shipped file:

    torchrun --nproc-per-node 1 -m ditron_inductor.calibrate --sites llama-8b --tp 2   # 4, 8; 70b
    python -m benchmarks.calibration_check --export ditron_inductor/scheduler/evidence

This benchmark times what the calibration does not: the variants (--variants), every TP degree
of both models in one run, host times and errors per plan.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.llama_sites import Site, sites  # noqa: E402

from benchmarks.bench_all_reduce import EPS, EXTRA_PLANS  # noqa: E402
from benchmarks.bench_fused import _timed_reps, bench_graph  # noqa: E402
from ditron_inductor.scheduler.candidates import CANDIDATES, candidates_for  # noqa: E402
from ditron_inductor.scheduler.choose import choose_device_plan  # noqa: E402
from ditron_inductor.ops import rms_norm_reference  # noqa: E402
from ditron_inductor.scheduler.decide import plan_for, with_options  # noqa: E402
from ditron_inductor.scheduler.task import (  # noqa: E402
    ALL_GATHER_MATMUL,
    MATMUL_ALL_GATHER,
    MATMUL_ALL_REDUCE_RMSNORM,
    MATMUL_REDUCE_SCATTER,
)

# label -> plan parameters (scheduler/plan.py's fields), per op: the variants timed beside the
# chosen plans for calibration (--variants default), from the candidate tables
AG_CANDIDATES = {label: c.params for label, c in CANDIDATES[ALL_GATHER_MATMUL].items()}
RS_CANDIDATES = {label: c.params for label, c in CANDIDATES[MATMUL_REDUCE_SCATTER].items()}
VARIANTS = {
    ALL_GATHER_MATMUL: {
        **{label: AG_CANDIDATES[label] for label in ("tri_tma_128x256", "cublas_1_3_4")},
    },
    MATMUL_REDUCE_SCATTER: dict(RS_CANDIDATES),
    MATMUL_ALL_GATHER: {label: c.params for label, c in CANDIDATES[MATMUL_ALL_GATHER].items()},
    # push after the GEMM; the prefill plans: beside the persistent Triton GEMM, beside cuBLAS's
    # row chunks; lamport (decode)
    MATMUL_ALL_REDUCE_RMSNORM: {label: EXTRA_PLANS[label][0] for label in
                                ("push", "push_b8k", "push_b16k", "tri_c16_p16_b16k",
                                 "lap_c4_p16_b16k", "lamport", "lamport_b1024",
                                 "lamport_all_b1024", "all_b1024", "lamport_all_b1024_gemv",
                                 "all_b1024_gemv")},
}
# the variants a row of that many rows takes (the others do not apply: lamport is the decode
# kernel, the overlap plans the prefill ones)
APPLIES = {"lamport": lambda m: m <= 512,
           # the decode kernels with the blocks they had before they held whole rows
           "lamport_b1024": lambda m: 8 < m <= 128, "lamport_all_b1024": lambda m: m <= 8,
           "all_b1024": lambda m: m <= 8, "lamport_all_b1024_gemv": lambda m: m == 1,
           "all_b1024_gemv": lambda m: m == 1,
           **{label: lambda m: m >= 1024
              for label in ("push_b8k", "push_b16k", "tri_c16_p16_b16k", "lap_c4_p16_b16k")}}
DEFAULT_TOKENS = {"train": "8192", "prefill": "2048,4096,8192,16384", "decode": "1,16,64,256"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/compute_parity")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="the tiny model only (a smoke run)")
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--tp", default="2,4,8", help="TP degrees whose per-rank shapes are run")
    ap.add_argument("--workloads", default="train,prefill,decode")
    for workload, tokens in DEFAULT_TOKENS.items():
        ap.add_argument(f"--{workload}-tokens", default=tokens,
                        help=f"rows of the {workload} sites (comma-separated)")
    ap.add_argument("--variants", default="default",
                    help="'default' (VARIANTS), 'none', or comma-separated labels")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--verbose", action="store_true", help="a line per contender")
    args = ap.parse_args(argv)
    if args.tiny:
        args.models = "tiny"
        args.tp, args.iters, args.reps = "2", 2, 2
        args.train_tokens, args.prefill_tokens, args.decode_tokens = "64", "32", "4"
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# ----------------------------------------------------------------------------------- the rows


def all_sites(args) -> list[Site]:
    found = []
    for model in args.models.split(","):
        for tp in _ints(args.tp):
            for workload in args.workloads.split(","):
                for tokens in _ints(getattr(args, f"{workload}_tokens")):
                    modes = (False, True) if workload == "prefill" else (workload == "decode",)
                    for graphs in modes:
                        found += [(model, s) for s in sites(model, tp, workload, tokens, graphs)]
    return found


def shape_key(site: Site) -> tuple:
    """What the per-rank computation depends on: sites of several models, TP degrees and modes
    that share it are timed once."""
    t = site.task
    return (t.op, t.m, t.k, t.ns, site.term_ks, t.copy_elems)


def plans_of(task, cuda_graphs: bool, variants: str) -> dict:
    """{label: (plan text, the scheduler's reason)}: the scheduler's plan at the task's TP
    degree ("chosen"; "none", with no text, where it keeps NCCL + cuBLAS) and the variants that
    apply to the task."""
    plan, why = choose_device_plan(task, cuda_graphs=cuda_graphs)
    plans = ({"chosen": (with_options(plan, task=task).encode(), why)} if plan is not None
             else {"none": (None, why)})
    table = VARIANTS[task.op]
    wanted = (table if variants == "default" else {} if variants == "none"
              else {k: v for k, v in table.items() if k in variants.split(",")})
    serving = candidates_for(task) if task.op == MATMUL_REDUCE_SCATTER else None
    for label, params in wanted.items():
        if serving is not None and label not in serving:  # a sum of products: cuBLAS only
            continue
        if APPLIES.get(label, lambda m: True)(task.m):
            plans[label] = (plan_for(task, **params).encode(), None)
    return plans


# ------------------------------------------------------------------------------------- timing


def timed(fn, inputs, device: str, iters: int, reps: int, graph: bool = False) -> tuple:
    """(median device ms per call, host ms per call to queue it). Eager: CUDA events around
    `iters` calls that the host queued while the device spun (so the device runs them back to
    back: its time alone, which a training step's device-bound stream sees; the host's is
    reported apart: bench_fused's timing); graph=True: replays of one CUDA graph that captured
    them. On CPU the host's clock, both."""
    if device == "cuda" and graph:
        return bench_graph(fn, inputs, iters, reps), math.nan
    for i in range(3):
        fn(*inputs[i % len(inputs)])

    def enqueue():
        for i in range(iters):
            fn(*inputs[i % len(inputs)])

    if device == "cuda":
        return _timed_reps(enqueue, iters, reps)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        enqueue()
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    ms = statistics.median(times)
    return ms, ms  # on CPU the host's time is the time


def served_count() -> int:
    """Calls the fused implementations served so far (0 where the runtime is not loaded)."""
    runtime = sys.modules.get("ditron_inductor.runtime")
    if runtime is None:
        return 0
    from ditron_inductor.runtime import all_gather, all_reduce, matmul_all_gather, reduce_scatter

    return (sum(all_gather.stats.values()) + sum(all_reduce.stats.values())
            + reduce_scatter.stats["matmul_reduce_scatter"]
            + matmul_all_gather.stats["matmul_all_gather"])


def captured(fn, inputs) -> bool:
    """Whether a CUDA graph capture of one call runs the fused path (a plan whose epochs are host
    values declines under capture and takes the reference path)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*inputs[0])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    before = served_count()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*inputs[0])
    del graph
    return served_count() > before


def poison_free_memory(like: torch.Tensor, blocks: int = 4) -> None:
    """Free blocks of the caching allocator, the size of `like` and twice it, filled with NaN:
    an output a plan never writes then fails its check, instead of passing on the values a
    previous contender left in the memory it is given."""
    held = [torch.full((like.numel() * size,), math.nan, dtype=like.dtype, device=like.device)
            for size in (1, 2) for _ in range(blocks)]
    del held


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ the computations of a shape


def _residual_norm(a, b, residual, weight):
    h = a @ b + residual
    return h, rms_norm_reference(h, weight, EPS, False)


def _sum_of_products(parts):
    return sum(a @ b for a, b in parts)


@functools.cache
def compiled(fn):
    """fn compiled once (dynamic shapes): Inductor's kernels for the unfused epilogues."""
    return torch.compile(fn, dynamic=True)


def contenders(site: Site, group_name: str, device: str, dtype):
    """(inputs, unfused fn, fused(plan text) -> fn, pick): fns over one input set; pick(output)
    is what is compared (the gathered products, the scattered sum, the normalised rows)."""
    task = site.task
    m, k, ns = task.m, task.k, task.ns
    copied = task.copy_elems // m  # columns of `a` that the rewrite's copies amount to

    def one_set():
        a = torch.randn(m, k, device=device, dtype=dtype)
        ws = site.weights(device, dtype)  # as the site's graph holds them
        extra = dict(residual=torch.randn(m, ns[0], device=device, dtype=dtype),
                     weight=torch.rand(ns[0], device=device, dtype=dtype) + 0.5,
                     copies=torch.empty(m, copied, device=device, dtype=dtype))
        return a, ws, extra
    inputs = [one_set() for _ in range(2)]
    ops = torch.ops.ditron
    if task.op == ALL_GATHER_MATMUL:
        def unfused(a, ws, extra):
            return [a @ w for w in ws]

        def fused(text):
            return lambda a, ws, extra: ops.all_gather_matmul(
                a, ws, [None] * len(ws), 0, group_name, 1, text)[1:]

        def pick(out):
            return torch.cat([o.flatten() for o in out])
    elif task.op == MATMUL_REDUCE_SCATTER:
        def unfused(a, ws, extra):
            if not site.term_ks:
                return a @ ws[0]
            # the matmuls whose products the graph sums, each over its part of K
            return compiled(_sum_of_products)(list(zip(a.split(site.term_ks, dim=1),
                                                       ws[0].split(site.term_ks, dim=0))))

        def fused(text):
            def call(a, ws, extra):
                if copied:  # the rewrite's copies (reordered rows)
                    extra["copies"].copy_(a[:, :copied])
                if not site.term_ks:
                    return ops.matmul_reduce_scatter([a], [ws[0]], None, [], 0, "sum",
                                                     group_name, 1, text)
                # the terms of the sum, as the op takes them
                return ops.matmul_reduce_scatter(list(a.split(site.term_ks, dim=1)),
                                                 list(ws[0].split(site.term_ks, dim=0)), None,
                                                 [], 0, "sum", group_name, 1, text)
            return call

        def pick(out):
            return out
    elif task.op == MATMUL_ALL_GATHER:  # [1, m, n] gathered on its last dim
        def unfused(a, ws, extra):  # the graph's split + cat of one rank's piece: a copy
            return torch.cat([(a @ ws[0]).view(1, m, ns[0])], dim=2)

        def fused(text):
            return lambda a, ws, extra: ops.matmul_all_gather(a, ws[0], None, [1, m, ns[0]], 2,
                                                              group_name, 1, text)

        def pick(out):
            return out
    elif task.op == MATMUL_ALL_REDUCE_RMSNORM:
        def unfused(a, ws, extra):
            return compiled(_residual_norm)(a, ws[0], extra["residual"], extra["weight"])

        def fused(text):
            return lambda a, ws, extra: ops.matmul_all_reduce_rmsnorm(
                a, ws[0], None, [], extra["residual"], extra["weight"], EPS, False, "sum",
                group_name, 1, text)

        def pick(out):
            return out[1]
    else:
        raise ValueError(f"no contenders for {task.op}")
    return inputs, unfused, fused, pick


# ------------------------------------------------------------------------------------ measure


def measure(site: Site, texts: dict, group_name: str, args, graphs: bool) -> dict:
    """{"unfused" or plan text: {"eager": ms, "graph": ms, "served", "rel_err", "error"}} for one
    shape: the unfused compute and each plan (texts: plan text -> a label, for the log)."""
    dtype = getattr(torch, args.dtype)
    task = site.task
    inputs, unfused, fused, pick = contenders(site, group_name, args.device, dtype)
    ref = pick(unfused(*inputs[0]))
    out = {}
    for key, fn in [("unfused", unfused)] + [(text, fused(text)) for text in texts]:
        result = {"eager": math.nan, "graph": math.nan, "host": math.nan,
                  "served": key == "unfused", "rel_err": 0.0, "error": ""}
        try:
            if key != "unfused":
                before = served_count()
                poison_free_memory(ref)
                result["rel_err"] = rel_err(pick(fn(*inputs[0])), ref)
                result["served"] = served_count() > before
                if not result["rel_err"] < 2e-2:
                    raise RuntimeError(f"relative error {result['rel_err']:.2e} against unfused")
        except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, not fatal
            result["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            out[key] = result
            continue
        for mode in ("eager", "graph") if graphs and args.device == "cuda" else ("eager",):
            try:
                if mode == "eager":
                    result["eager"], result["host"] = timed(fn, inputs, args.device, args.iters,
                                                            args.reps)
                elif key == "unfused" or captured(fn, inputs):
                    result["graph"] = timed(fn, inputs, args.device, args.iters, args.reps,
                                            graph=True)[0]
                else:
                    result["error"] = "not captured (the plan declines CUDA-graph capture)"
            except Exception as exc:  # noqa: BLE001 - reported in the row, not fatal
                result["error"] = f"{mode}: {type(exc).__name__}: {str(exc)[:200]}"
        out[key] = result
        if args.verbose:
            print(f"  {task.describe()} {texts.get(key, key)[:40]}: {result}", flush=True)
    return out


def run(args, group_name: str) -> list[dict]:
    by_shape: dict = {}
    for model, site in all_sites(args):
        by_shape.setdefault(shape_key(site), []).append((model, site))
    rows, t0 = [], time.time()
    for i, (key, found) in enumerate(by_shape.items()):
        plans = {(model, site): plans_of(site.task, site.cuda_graphs, args.variants)
                 for model, site in found}
        texts = {text: label for p in plans.values() for label, (text, _) in p.items()
                 if text is not None}
        graphs = any(site.cuda_graphs for _, site in found)
        results = measure(found[0][1], texts, group_name, args, graphs)
        for (model, site), site_plans in plans.items():
            mode = "graph" if site.cuda_graphs else "eager"
            base = results["unfused"][mode]
            for label, (text, why) in site_plans.items():
                r = results.get(text, {})
                ms = r.get(mode, math.nan) if r.get("served") else math.nan
                t = site.task
                rows.append({
                    "model": model, "tp": t.world_size, "workload": site.workload,
                    "site": site.name, "op": t.op, "M": t.m, "K": t.k, "N": list(t.ns),
                    "terms": t.terms, "mode": mode, "plan": label, "chosen": label == "chosen",
                    "plan_text": text, "why": why,
                    "unfused_ms": base, "fused_ms": ms,
                    "unfused_host_ms": results["unfused"]["host"],
                    "fused_host_ms": r.get("host", math.nan),
                    "ratio": ms / base if base and math.isfinite(ms) else math.nan,
                    "served": r.get("served", False), "rel_err": r.get("rel_err"),
                    "error": r.get("error", "")})
        print(f"[{i + 1}/{len(by_shape)}] {found[0][1].task.describe()}: unfused "
              f"{results['unfused']['eager']:.3f} ms; "
              + ", ".join(f"{texts[k]} {v['eager']:.3f}/{v['graph']:.3f}"
                          + (f" ({v['error'][:60]})" if v["error"] else "")
                          for k, v in results.items() if k != "unfused")
              + f" ({time.time() - t0:.0f} s)", flush=True)
        with open(args.out + ".partial.json", "w") as fh:  # what a run stopped at its limit keeps
            json.dump(rows, fh)
    return rows


# ------------------------------------------------------------------------------------- report


def geomean(xs) -> float:
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def table(rows: list[dict]) -> str:
    lines = ["| model | TP | workload | site | M | K | N | mode | plan | unfused ms | fused ms "
             "| fused / unfused |", "| --- " * 12 + "|"]
    for r in rows:
        n = ",".join(str(x) for x in r["N"])
        ratio = f"{r['ratio']:.3f}" if math.isfinite(r["ratio"]) else (
            "not fused" if r["plan"] == "none" else r["error"][:50] or "reference path")
        fused = f"{r['fused_ms']:.3f}" if math.isfinite(r["fused_ms"]) else "-"
        lines.append(f"| {r['model']} | {r['tp']} | {r['workload']} | {r['site']} | {r['M']} "
                     f"| {r['K']} | {n} | {r['mode']} | {r['plan']} | {r['unfused_ms']:.3f} "
                     f"| {fused} | {ratio} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    chosen = [r for r in rows if r["chosen"]]
    over = [r for r in chosen if math.isfinite(r["ratio"]) and r["ratio"] > 1.02]
    lines = [f"Chosen plans: {len(chosen)} rows, geometric mean of fused / unfused "
             f"{geomean(r['ratio'] for r in chosen):.3f}, {len(over)} above 1.02."]
    for op in sorted({r["op"] for r in rows}):
        for plan in sorted({r["plan"] for r in rows if r["op"] == op} - {"none"}):
            sel = [r["ratio"] for r in rows if r["op"] == op and r["plan"] == plan]
            lines.append(f"- {op} {plan}: geometric mean {geomean(sel):.3f} over "
                         f"{sum(math.isfinite(x) for x in sel)} rows")
    return "\n".join(lines)


def report(rows: list[dict], args, argv: list[str]) -> dict:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    meta = {"command": "torchrun --nproc-per-node 1 benchmarks/bench_compute_parity.py "
                       + " ".join(argv),
            "device": device, "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    text = "\n".join([
        f"# Compute parity at world size 1 ({device})", "",
        f"- command: `{meta['command']}`", f"- {meta['date']}; torch {meta['torch']}, "
        f"triton {meta['triton']}", "",
        "Each fused plan at world size 1 beside the unfused compute it replaces (cuBLAS, "
        "Inductor's epilogue kernels), at the per-rank shapes of each site's TP degree; "
        "median ms per call; `chosen`: the scheduler's plan at that TP degree (`none`: it keeps "
        "NCCL + cuBLAS), other plans: calibration variants.", "", summary(rows), "",
        table(rows), ""])
    with open(args.out + ".md", "w") as fh:
        fh.write(text)
    with open(args.out + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(text, flush=True)
    return meta


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.device == "cuda":
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise SystemExit("bench_compute_parity runs at world size 1 (torchrun --nproc-per-node 1)")
    torch.manual_seed(0)
    rows = run(args, dist.group.WORLD.group_name)
    report(rows, args, argv)
    if args.device == "cuda":
        from ditron_inductor import runtime

        runtime.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
