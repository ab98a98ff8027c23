"""Calibrate the scheduler on this machine: its evidence measured here, the same on every rank,
cached where scheduler/calibration.py reads it first (the project's architecture notes, "Evidence
and calibration": the phases, the timing, the file; the shipped tables are exports of such runs).

    torchrun --nproc-per-node W -m ditron_inductor.calibrate --sites llama-8b [--budget 5]
    python -m ditron_inductor.calibrate --show                    # what the cache holds

--sites: llama-8b, llama-70b, tiny (`llama_sites` at TP --tp, default W; training at each of
--tokens), or a saved TORCH_LOGS=ditron log. --device cpu: a test over gloo, reference plans.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import ops
from .scheduler import calibration, evidence
from .scheduler.candidates import CANDIDATES, candidate_plan
from .scheduler.choose import fused_plan
from .scheduler.decide import with_options
from .scheduler.plan import COPY_ENGINE, REFERENCE_PLAN, family
from .scheduler.policy import COPY_ENGINE_MAX_WORLD, copy_engine_chunks, copy_engine_serves
from .scheduler.task import (ALL_GATHER_MATMUL, ALL_REDUCE_PATTERNS, GROUPED_MM_ALL_REDUCE,
                             GROUPED_MM_ALL_REDUCE_PATTERNS, GROUPED_MM_ALL_REDUCE_RMSNORM,
                             MATMUL_ALL_GATHER, MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM,
                             MATMUL_REDUCE_SCATTER, Task)

COARSE, FINE = (3, 3), (10, 5)  # (calls timed together, repetitions)
SIZES = [1 << s for s in range(16, 27, 2)]  # the link's messages: 64 KiB to 64 MiB
SPIN_CYCLES = 20_000_000  # ~10 ms: the device spins while the host queues the timed calls
AG_RS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER)
# the ops whose candidates are timed on every rank beside NCCL + cuBLAS (the measured rows)
MEASURED_OPS = AG_RS + (MATMUL_ALL_GATHER,)
NORMED = (MATMUL_ALL_REDUCE_RMSNORM, GROUPED_MM_ALL_REDUCE_RMSNORM)
_LINE = re.compile(r"(\w+) M=(\d+)(?: K=(\d+))? N=([\d,]+) (\w+) world=(\d+) group=")


class Site(NamedTuple):
    name: str
    task: Task
    term_ks: tuple = ()  # a sum of products: each term's K
    transposed: bool = True  # the weights as a forward graph holds them ([N, K] transposed)
    graphs: bool = False  # replayed from a CUDA graph


Llama = collections.namedtuple("Llama", "hidden intermediate heads kv_heads vocab head_dim",
                               defaults=(128256, 128))
LLAMA = {"8b": Llama(4096, 14336, 32, 8), "70b": Llama(8192, 28672, 64, 8),
         "tiny": Llama(64, 128, 4, 2, 256, 16)}  # Llama-3's, and one for tests


def _task(op: str, world: int, m: int, k: int, ns: tuple, dim: int = 0, terms: int = 1,
          dtype=torch.bfloat16) -> Task:
    return Task(op, "0", world, m, k, ns, dtype, "cuda", dim, m,
                None if op in (ALL_GATHER_MATMUL, MATMUL_ALL_GATHER) else "sum", terms=terms)


def llama_sites(model: str, world: int, workload: str, tokens: int,
                graphs: bool = False) -> list[Site]:
    """Llama's collective + matmul sites at TP `world`, `tokens` rows, as the pass finds them:
    "train" (sequence parallel, the backward's too), else plain TP (o's and down's all-reduce
    + norm; launched eagerly, lm_head's gathered logits). A backward site multiplies by the
    weight, a forward one by its transpose."""
    d = LLAMA[model]
    h, q, kv, mlp = d.hidden, d.hidden // world, d.kv_heads * d.head_dim // world, \
        d.intermediate // world
    ag, rs, arn = AG_RS + (MATMUL_ALL_REDUCE_RMSNORM,)

    def task(op, k, ns, terms=1):
        return _task(op, world, tokens, k, ns, int(op != ag and workload == "train"), terms)
    found = [("q/k/v gather", task(ag, h, (q, kv, kv))), ("o scatter", task(rs, q, (h,))),
             ("gate/up gather", task(ag, h, (mlp, mlp))), ("down scatter", task(rs, mlp, (h,))),
             ("lm_head gather", task(ag, h, (d.vocab // world,))),
             ("lm_head input-grad scatter", task(rs, d.vocab // world, (h,))),
             ("down output-grad gather", task(ag, h, (mlp,))),
             ("gate/up input-grad scatter", task(rs, 2 * mlp, (h,), 2), (mlp, mlp)),
             ("o output-grad gather", task(ag, h, (q,))),
             ("q/k/v input-grad scatter", task(rs, q + 2 * kv, (h,), 3), (q, kv, kv)),
             ] if workload == "train" else [("o all-reduce + norm", task(arn, q, (h,))),
                                            ("down all-reduce + norm", task(arn, mlp, (h,)))]
    if workload == "prefill" and not graphs:  # the logits gathered along the vocabulary
        found.append(("lm_head logits gather",
                      _task(MATMUL_ALL_GATHER, world, tokens, h, (d.vocab // world,), 2)))
    return [Site(name, t, *(ks or [()]), "grad" not in name, graphs) for name, t, *ks in found]


def experts_site(hidden: int, world: int, workload: str, tokens: int,
                 graphs: bool = False) -> Site:
    """The all-reduce of an MoE model's experts' output under a TP plan, `hidden` wide
    (Mixtral-8x7B's is Llama-3-8B's 4096): with the norm after it, alone in training (the
    forward's site where backward saves the sum, the backward's)."""
    op = GROUPED_MM_ALL_REDUCE if workload == "train" else GROUPED_MM_ALL_REDUCE_RMSNORM
    return Site("experts all-reduce" + ("" if workload == "train" else " + norm"),
                _task(op, world, tokens, 1, (hidden,)), graphs=graphs)


def sites_of(spec: str, tp: int, tokens: list[int]) -> list[Site]:
    """--sites: a saved log's candidates, or a Llama's at TP `tp` (and the experts' all-reduce
    of its width): training at each of `tokens`, prefill eagerly and from CUDA graphs, decode
    from CUDA graphs."""
    if os.path.isfile(spec):  # a saved ditron log: each distinct candidate's line
        found = {}
        for line in open(spec):
            m = _LINE.search(line)
            if m and m[1] in (*MEASURED_OPS, *ALL_REDUCE_PATTERNS):
                op, rows, k = m[1], int(m[2]), int(m[3] or 1)  # no K: no product
                ns = tuple(map(int, m[4].split(",")))
                dim = re.search(r" dim=(\d+)", line)
                terms = int((re.search(r", (\d+) matmul products summed", line) or [0, 1])[1])
                task = _task(op, int(m[6]), rows, k, ns, int(dim[1]) if dim else 0, terms,
                             getattr(torch, m[5]))
                found[task] = Site(line[:m.start()].rstrip(": ").rsplit(": ", 1)[-1], task,
                                   (k // terms,) * terms if terms > 1 else (),
                                   "backward" not in line)
        return list(found.values())
    model, tiny = spec.removeprefix("llama-"), spec == "tiny"
    runs = [("train", t, False) for t in tokens]
    for rows in (32,) if tiny else (1024, 2048, 4096, 8192, 16384):
        runs += [("prefill", rows, False), ("prefill", rows, True)]
    runs += [("decode", rows, True) for rows in (() if tiny else (1, 16, 64, 256))]
    hidden = LLAMA[model].hidden  # and an MoE model's experts of Llama's width
    return [s for workload, rows, graphs in runs
            for s in llama_sites(model, tp, workload, rows, graphs)
            + [experts_site(hidden, tp, workload, rows, graphs)]]


# ----------------------------------------------------------------------------------- timing
def _device() -> str:
    return "cpu" if dist.get_backend() == "gloo" else "cuda"


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _all(flag: bool) -> bool:
    """Whether every rank says so (each rank's clock reads the budget: act on them all)."""
    return _max(0.0 if flag else 1.0) == 0.0


def _ms(fn, inputs, setting, graph=False) -> float:
    """Median ms per call of `fn` over alternating inputs, the slowest rank's: device time on
    CUDA (the calls queued while the device spins, or replayed from a CUDA graph)."""
    calls, reps = setting
    for x in inputs:
        fn(*x)

    def step():
        for i in range(calls):
            fn(*inputs[i % len(inputs)])
    if graph:
        try:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                step()
        except Exception:  # noqa: BLE001 - a plan not captured is not timed (every rank alike)
            return _max(math.nan)
        step = captured.replay
    times = []
    for _ in range(reps):
        dist.barrier()
        if _device() == "cpu":
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3 / calls)
            continue
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if not graph:
            torch.cuda._sleep(SPIN_CYCLES)
        begin.record()
        step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / calls)
    return _max(statistics.median(times))


_started = [0.0]


def _bar(phase: str, done: int, total: int) -> None:
    if dist.get_rank() == 0:
        filled = 20 * done // max(total, 1)
        print(f"\r{phase:<6} [{'#' * filled}{'.' * (20 - filled)}] {done}/{total} "
              f"{time.time() - _started[0]:.0f} s", end="\n" if done == total else "",
              flush=True, file=sys.stderr)


# -------------------------------------------------------------------- what a site computes
def _calls(site: Site, group: str, world: int):
    """(inputs, fused(plan text) -> fn, the unfused fn), each fn the site's op on one input set,
    returning what is compared (the products, the scattered sum, the normalised rows)."""
    task, dev, op = site.task, _device(), site.task.op
    dtype = task.dtype if dev == "cuda" else torch.float32  # gloo: timings meaningless anyway
    m, k, ns, terms = task.m, task.k, task.ns, list(site.term_ks) or [task.k]

    def one_set():
        ws = [(torch.randn(n, k, device=dev, dtype=dtype).t() if site.transposed else
               torch.randn(k, n, device=dev, dtype=dtype)) / k ** 0.5 for n in ns]
        a = torch.randn(m // world if op == ALL_GATHER_MATMUL else m,
                        ns[0] if op in GROUPED_MM_ALL_REDUCE_PATTERNS else k,  # what is reduced
                        device=dev, dtype=dtype)
        return (a, ws, torch.randn(m, ns[0], device=dev, dtype=dtype),
                torch.rand(ns[0], device=dev, dtype=dtype) + 0.5)

    def args(a, ws, residual, weight):
        if op == ALL_GATHER_MATMUL:
            return a, ws, [None] * len(ws), 0
        if op == MATMUL_ALL_GATHER:  # [1, m, n] gathered on its last dim, or rows on dim 0
            return (a, ws[0], None, [1, m, ns[0]], 2) if task.dim else (a, ws[0], None, [], 0)
        if op == MATMUL_REDUCE_SCATTER:
            return list(a.split(terms, dim=1)), list(ws[0].split(terms)), None, [], 0, "sum"
        if op == MATMUL_ALL_REDUCE:
            return [a], ws[:1], None, [], "sum"
        if op == GROUPED_MM_ALL_REDUCE:
            return a, "sum"
        if op == GROUPED_MM_ALL_REDUCE_RMSNORM:
            return a, residual, weight, 1e-5, False, "sum"
        return a, ws[0], None, [], residual, weight, 1e-5, False, "sum"

    def fused(text):
        def fn(*x):
            out = getattr(ops, op)(*args(*x), group, world, text)
            return (torch.cat([o.flatten() for o in out[1:]]) if op == ALL_GATHER_MATMUL
                    else out[1] if op in NORMED else out)
        return fn
    # NCCL + cuBLAS: the op's reference; a norm's epilogue as Inductor compiles it (on CUDA)
    # (the grouped-GEMM op's: the reduced tensor, at world size 1 itself, + residual)
    unfused = (fused(REFERENCE_PLAN.encode()) if op not in NORMED else
               lambda a, ws, residual, weight: _norm()(
                   a, ws[0] if op == MATMUL_ALL_REDUCE_RMSNORM else None, residual, weight))
    return [one_set() for _ in range(2)], fused, unfused


def _residual_norm(a, b, residual, weight):
    return ops.rms_norm_reference((a if b is None else a @ b) + residual, weight, 1e-5, False)


@functools.cache
def _norm():
    return torch.compile(_residual_norm, dynamic=True) if _device() == "cuda" else _residual_norm


def _world1_plans(site: Site) -> dict:
    """{plan family: plan text}: what the scheduler may choose at the site."""
    task = site.task
    if task.op in MEASURED_OPS:
        plans = [candidate_plan(task, label) for label in CANDIDATES[task.op]]
    else:
        plans = [fused_plan(task)]
        if task.world_size <= COPY_ENGINE_MAX_WORLD and copy_engine_serves(task):
            plans.append(fused_plan(task, dict(algo=COPY_ENGINE, chunks=copy_engine_chunks(
                task.m, task.n_total, site.graphs))))
    return {family(p): with_options(p).encode() for p in reversed(plans)}  # each family's first


def _measure(site: Site, texts: dict, group: str, world: int, setting) -> dict:
    """{label: ms} of NCCL + cuBLAS and each plan text, NaN where an output was wrong."""
    inputs, fused, unfused = _calls(site, group, world)
    graph, ref = site.graphs and _device() == "cuda", unfused(*inputs[0])
    out = {evidence.NCCL_CUBLAS: _ms(unfused, inputs, setting, graph)}
    for label, text in texts.items():
        fn, served = fused(text), _served()
        try:
            err = ((fn(*inputs[0]).double() - ref.double()).norm() / ref.double().norm()).item()
        except Exception:  # noqa: BLE001 - a plan that fails is not timed
            err = math.nan
        ok = err < 2e-2 and (_device() == "cpu" or _served() > served)  # not its reference
        out[label] = _ms(fn, inputs, setting, graph) if _all(ok) else math.nan
    return out


def _served() -> int:
    """Calls the fused paths served so far (a plan that declines a call runs its reference)."""
    if _device() == "cpu":
        return 0
    from .runtime import all_gather, all_reduce, matmul_all_gather, reduce_scatter

    return sum(sum(module.stats.values()) for module in (all_gather, all_reduce,
                                                          matmul_all_gather, reduce_scatter))


def _timed(phase: str, rows: list, group: str, world: int, budget_s: float) -> list[dict]:
    """Every (site, texts) timed briefly, then those nearest their decision (fastest fused over
    NCCL + cuBLAS) at length, while the budget lasts."""
    results = []
    for i, (site, texts) in enumerate(rows):
        ok = _all(time.time() < budget_s)
        results.append(_measure(site, texts, group, world, COARSE) if ok else {})
        _bar(phase, i + 1, len(rows))

    def margin(i):
        ms = dict(results[i])
        base = ms.pop(evidence.NCCL_CUBLAS, math.nan)
        return abs(math.log(base / min(ms.values()))) if ms and min(ms.values()) > 0 else 9.0
    for i in sorted(range(len(rows)), key=margin):
        if not results[i] or not _all(time.time() < budget_s):
            break
        results[i] = _measure(*rows[i], group, world, FINE)
    return results


def _local_bandwidths(rows: int = 8192, n: int = 4096, slots: int = 4) -> dict:
    """link.json's constants of one GPU's own memory, in GB/s: copy_gbps, a rank-major reorder's
    copy as Inductor compiles it (bytes read + written), and reduce_gbps, the reduce-scatter's sum
    of `slots` received partials (reduce_slots_kernel, bytes read)."""
    from .runtime.kernel_launch import cdiv, launch
    from .templates.reduce import reduce_slots_kernel

    x = torch.randn(slots, rows, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=x.dtype)
    numel = rows * n
    rank_major = torch.compile(lambda t: t.view(-1, 2, n).transpose(0, 1).contiguous())

    def reorder():
        rank_major(x)

    def reduce():
        launch(reduce_slots_kernel, (cdiv(numel, 4096),), x, out, numel, numel, slots, 1.0,
               BLOCK=4096, num_warps=8)
    nbytes = x.numel() * x.element_size()
    return dict(copy_gbps=round(2 * nbytes / _ms(reorder, [()], FINE) / 1e6),
                reduce_gbps=round(nbytes / _ms(reduce, [()], FINE) / 1e6))


def _link(world: int) -> tuple[dict, dict]:
    """link.json's NCCL constants at `world`, fitted, and the points they were fitted to."""
    c10d, group, points = torch.ops._c10d_functional, dist.group.WORLD.group_name, {}
    sizes = SIZES if _device() == "cuda" else SIZES[:3]
    for i, size in enumerate(sizes):
        x = torch.randn(size // 2 // world, device=_device(), dtype=torch.bfloat16)
        big = torch.randn(size // 2, device=_device(), dtype=torch.bfloat16)
        for name, moved, fn in (
                ("all_gather", size, lambda: c10d.all_gather_into_tensor(x, world, group)),
                ("reduce_scatter", size, lambda: c10d.reduce_scatter_tensor(big, "sum", world,
                                                                            group)),
                ("all_reduce", 2 * (world - 1) / world * size,
                 lambda: c10d.all_reduce(big, "sum", group))):
            points.setdefault(name, []).append(
                (moved, _ms(lambda: c10d.wait_tensor(fn()), [()], COARSE)))
        _bar("link", i + 1, len(sizes))
    fit = {name: statistics.linear_regression(*zip(*p)) for name, p in points.items()}
    gbps = {name: 1 / max(f.slope, 1e-12) / 1e6 for name, f in fit.items()}
    return dict(nccl_ag_gbps=gbps["all_gather"], nccl_rs_gbps=gbps["reduce_scatter"],
                nccl_ar_busbw_gbps=gbps["all_reduce"],
                nccl_latency_ms=max(fit["all_reduce"].intercept, 0.0)), points


def calibrate(sites: list[Site], args) -> dict:
    """Measures, then (local rank 0) merges the rows into this machine's file."""
    world = dist.get_world_size()
    _started[0] = time.time()
    budget_s = _started[0] + 60 * args.budget
    source = dict(machine=calibration.machine()["gpu"], date=datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), command=f"torchrun "
        f"--nproc-per-node {world} -m ditron_inductor.calibrate {' '.join(args.argv)}")
    new: dict = dict(machine=calibration.machine(), sources=[dict(source, world=world)], link={},
                     link_points={})
    if world > 1:
        new["link"][str(world)], new["link_points"][str(world)] = _link(world)
    rows = [(s, _world1_plans(s)) for s in sites]
    own = dist.new_subgroups(1)[0].group_name  # every rank on its own GPU: world-1 compute
    w1 = []
    for (site, _), ms in zip(rows, _timed("world1", rows, own, 1, budget_s)):
        t, base = site.task, ms.pop(evidence.NCCL_CUBLAS, math.nan)
        mode = "graph" if site.graphs and _device() == "cuda" else "eager"
        w1 += [[t.op, label, mode, t.m, t.k, t.n_total, round(v, 4), round(base, 4)]
               for label, v in ms.items() if math.isfinite(v)]
    rates = [2 * r[3] * r[4] * r[5] / r[7] / 1e9 for r in w1 if r[0] in AG_RS and r[3] >= 1024]
    if rates:  # TFLOP/s of the unfused GEMMs at the sites: the link model's GEMM rate
        new["link"]["1"] = dict(cublas_tflops=round(statistics.median(rates), 1))
    if _device() == "cuda":
        new["link"].setdefault("1", {}).update(_local_bandwidths())
    new["world1_compute"] = dict(sources=[source], rows=w1)
    fused = [(s, {label: with_options(candidate_plan(s.task, label)).encode()
                  for label in CANDIDATES[s.task.op]})
             for s in sites if s.task.op in MEASURED_OPS and s.task.world_size == world > 1]
    timed = _timed("fused", fused, dist.group.WORLD.group_name, world, budget_s)
    new["measured_plans"] = dict(sources=[source], rows=[dict(
        op=s.task.op, world=world, dtype=str(s.task.dtype).removeprefix("torch."), m=s.task.m,
        k=s.task.k, n=s.task.n_total, site=s.name, terms=s.task.terms, source=0,
        ms={label: round(v, 4) for label, v in ms.items() if math.isfinite(v)})
        for (s, _), ms in zip(fused, timed) if ms])
    if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
        path = calibration.calibration_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, merge(json.loads(path.read_text()) if path.exists() else {}, new))
        print(f"{len(w1)} world-1 rows, {len(new['measured_plans']['rows'])} measured rows, "
              f"link constants of {sorted(new['link'])} rank(s) -> {path}", file=sys.stderr)
    dist.barrier()
    evidence.clear_caches()
    return new


# ------------------------------------------------------------------------------- the file
def merge(old: dict, new: dict) -> dict:
    """`new`'s run over `old`'s: its rows replace those of the same key, its sources appended."""
    out = {**old, **new, "sources": old.get("sources", []) + new.get("sources", [])}
    for part in ("link", "link_points"):
        out[part] = {**old.get(part, {}), **new.get(part, {})}
    for table in ("world1_compute", "measured_plans"):
        before, after = old.get(table, {}), new.get(table, {})
        shift, rows = len(before.get("sources", [])), {}
        for r in before.get("rows", []) + [dict(r, source=r["source"] + shift) if isinstance(
                r, dict) else r for r in after.get("rows", [])]:
            rows[tuple(r[:6]) if isinstance(r, list) else tuple(
                r[f] for f in ("op", "world", "dtype", "m", "k", "n"))] = r
        out[table] = {**before, **after, "rows": list(rows.values()),
                      "sources": before.get("sources", []) + after.get("sources", [])}
    return out


def _write(path, data: dict) -> None:
    """Human-readable JSON (a row a line), replaced whole: a reader never sees half a file."""
    text = re.sub(r"\[\s+([^][{}]*?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]",
                  json.dumps(data, indent=1))
    path.with_name(path.name + ".tmp").write_text(text + "\n")
    os.replace(path.with_name(path.name + ".tmp"), path)


def show() -> None:
    mine = calibration.calibration_path()
    print(f"calibration cache: {calibration.cache_dir()}")
    for path in sorted(calibration.cache_dir().glob("*.json")):
        data = json.loads(path.read_text())
        print(f"{path.name}{'  (this machine)' if path == mine else ''}\n  machine: "
              + ", ".join(f"{k}={v}" for k, v in data["machine"].items()))
        for s in data["sources"]:
            print(f"  run {s['date']} on {s['world']} rank(s): {s['command']}")
        measured = data["measured_plans"]["rows"]
        print(f"  world-1 compute rows: {len(data['world1_compute']['rows'])}; measured rows: "
              f"{len(measured)} (world sizes {sorted({r['world'] for r in measured})})")
        for world, constants in sorted(data["link"].items()):
            print(f"  link constants at {world} rank(s): "
                  + ", ".join(f"{k}={v:.4g}" for k, v in constants.items()))
    own = "this machine's calibration, then " if mine.exists() else "no calibration, "
    shipped = ("the shipped tables" if calibration.card_matches() else
               f"no shipped table (measured on {'/'.join(calibration.SHIPPED_CARDS)})")
    print(f"{calibration.machine()['gpu']}: the scheduler reads {own}{shipped}, then the link model")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", default="llama-8b", help="llama-8b, llama-70b, tiny, or a log")
    ap.add_argument("--tp", type=int, default=0, help="the named sites' TP degree (default W)")
    ap.add_argument("--tokens", default=[8192], help="the training sites' rows: 4096,8192,...",
                    type=lambda text: [int(t) for t in text.split(",")])
    ap.add_argument("--budget", type=float, default=5.0, help="minutes (coarse to fine)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--show", action="store_true", help="what the cache holds")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.show:
        return show()
    started = not dist.is_initialized()
    if started and args.device == "cuda":
        torch.cuda.set_device(local := int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    elif started:
        dist.init_process_group("gloo", **({} if "RANK" in os.environ else dict(
            store=dist.HashStore(), rank=0, world_size=1)))
    calibrate(sites_of(args.sites, args.tp or dist.get_world_size(), args.tokens), args)
    if started:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
