"""Fused collective + matmul benchmark: one run on W GPUs, every contender measured side by side.

    torchrun --nproc-per-node 8 benchmarks/bench_fused.py --out benchmarks/results/<name>
    torchrun --nproc-per-node 2 benchmarks/bench_fused.py --sites 8b --tokens 8192 --no-mlp \
        --out benchmarks/results/<name>   # a Llama training step's sites

The scheduler's measured plans (scheduler/evidence/measured_plans.json) are not written from these
runs: the calibration times the same candidates at the same sites (ditron_inductor.calibrate's
fused phase: every AG/RS candidate beside NCCL + cuBLAS on all ranks, each checked first, the
slowest rank's median), and its export merges them into the shipped file:

    torchrun --nproc-per-node W -m ditron_inductor.calibrate --sites llama-8b --tokens 4096,8192,16384
    python -m benchmarks.calibration_check --export ditron_inductor/scheduler/evidence

This benchmark times what the calibration does not: PyTorch's fused ops, the GEMM and the
collective alone, fixed shapes (AG_SHAPES, RS_SHAPES), host times, and the compiled MLP.

Per shape (bf16 unless --dtype): NCCL + cuBLAS, PyTorch's fused symm-mem op
(torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter), ditron with the plan
the scheduler picks (and every candidate plan, its evidence), the GEMM alone, the collective
alone. Timing: random inputs (two sets, alternated), warm-up, CUDA events around `--iters` calls,
`--reps` repetitions; each rank takes the median over repetitions and the row reports the maximum
over ranks (the slowest rank bounds a collective). The device spins while the host queues the
timed calls (SPIN_MS), so the times are device time; --no-spin times the host's queueing too.
Then a sequence-parallel MLP through torch.compile with Inductor, Inductor + async TP, and
backend="ditron".

Writes <out>.json (rows {op, M, K, N, world, dtype, ms: {...}, plans: {...}}) and <out>.md.
"""

from __future__ import annotations

import argparse
import dataclasses
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

import torch
import torch.distributed as dist


AG_SHAPES = [(8192, 8192, 7168), (8192, 8192, 1280), (4096, 8192, 4096), (16384, 8192, 3584)]
RS_SHAPES = [(8192, 3584, 8192), (8192, 1024, 8192), (16384, 3584, 8192)]

from ditron_inductor.scheduler.candidates import CANDIDATES  # noqa: E402
from ditron_inductor.scheduler.plan import GemmTile  # noqa: E402


def init_ranks() -> tuple[int, int, str]:
    """This torchrun process's GPU, NCCL group and symmetric memory, and ditron's ops
    registered: (rank, world size, the world group's name)."""
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group_name)
    import ditron_inductor.ops  # noqa: F401
    import ditron_inductor.runtime  # noqa: F401

    return rank, dist.get_world_size(), group_name


def sync_all():
    torch.cuda.synchronize()
    t = torch.zeros(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()


HOST_MS = {}  # label -> host ms per call (enqueue time of the timed loop), for the last bench
# Eager timing: the device spins this long before the timed calls, so the host queues them all
# while it spins and the device then runs them back to back: their device time alone, as a
# device-bound training step sees it (the host's time per call is reported beside it, HOST_MS).
# 0 (--no-spin): the events bracket the host's queueing too, and a call whose host time passes
# its device time (the fused ops' driver calls: ~0.3 ms) is timed by its host.
SPIN_MS = 20.0


@functools.cache
def _cycles_per_ms() -> float:
    """What torch.cuda._sleep spins per ms on this GPU, measured once."""
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    torch.cuda._sleep(1_000_000)  # the clock up first
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def spin_device(ms: float) -> None:
    """Keep the current stream busy for about `ms` (the host runs on meanwhile)."""
    if ms > 0:
        torch.cuda._sleep(int(ms * _cycles_per_ms()))


def _timed_reps(enqueue, iters, reps, spin_ms=None):
    """`reps` repetitions of enqueue() (which queues `iters` calls), each timed by CUDA events
    after a sync of every rank, the device spinning `spin_ms` (default SPIN_MS) before the
    first event: (median device ms per call, median host ms per call to enqueue), each the
    maximum over ranks. A repetition where some rank's device reached the calls before its host
    had queued them all is dropped on every rank (the loop's collectives must match) and the
    next spins twice as long."""
    spin_ms = SPIN_MS if spin_ms is None else spin_ms
    times, host, tries = [], [], 0
    while len(times) < reps:
        sync_all()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spin_device(spin_ms)
        start.record()
        t0 = time.perf_counter()
        enqueue()
        host_ms = (time.perf_counter() - t0) * 1e3 / iters
        end.record()
        reached = torch.tensor([float(spin_ms > 0 and start.query())], device="cuda")
        end.synchronize()
        dist.all_reduce(reached, op=dist.ReduceOp.MAX)
        tries += 1
        if reached.item():
            if tries >= 3 * reps:
                raise RuntimeError(f"host-bound: {host_ms:.3f} ms per call to queue outlasted "
                                   "the device's spin, again and again")
            spin_ms *= 2
            continue
        times.append(start.elapsed_time(end) / iters)
        host.append(host_ms)
    t = torch.tensor([statistics.median(times), statistics.median(host)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), t[1].item()


def bench(fn, inputs, iters, reps, warmup=3, label=None):
    """Median ms per call on this rank, max over ranks. With a label, also the host time per call
    (time to enqueue the loop): a contender whose host time reaches its GPU time is host-bound."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])

    def enqueue():
        for i in range(iters):
            fn(*inputs[i % len(inputs)])
    ms, host_ms = _timed_reps(enqueue, iters, reps)
    if label:
        HOST_MS[label] = host_ms
    return ms


def max_over_ranks(value: float) -> float:
    """The largest of every rank's value; on this rank's GPU where the group is NCCL (no CPU
    collectives there)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_on(device: str, fn, inputs, iters, reps) -> float:
    """Median ms per call, the maximum over ranks: `bench` on CUDA; on CPU (the smoke runs over
    gloo) the host's clock around `iters` calls after a barrier."""
    if device == "cuda":
        return bench(fn, inputs, iters, reps)
    for args in inputs:
        fn(*args)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(iters):
            fn(*inputs[i % len(inputs)])
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    return max_over_ranks(statistics.median(times))


def ranks_meta(script: str, argv, device: str, **more) -> dict:
    """Where a multi-rank result file comes from: the command, the card, the world size, torch,
    the date (UTC)."""
    return dict(command=f"torchrun benchmarks/{script} " + " ".join(argv),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                world=dist.get_world_size(), torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(), **more)


def write_tables(out: str, meta: dict, rows: list, lines: list) -> None:
    """<out>.json ({meta, rows}) and <out>.md (the table's lines), the table printed."""
    with open(out + ".json", "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    with open(out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def bench_graph(fn, inputs, iters, reps, warmup=3):
    """Like `bench`, but `iters` calls captured once in a CUDA graph and the graph replayed: the
    GPU time without the host's launch gaps (how decode steps are served). Median ms per call on
    this rank, max over ranks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up: compiled kernels, contexts, NCCL setup
        for i in range(warmup):
            fn(*inputs[i % len(inputs)])
    torch.cuda.current_stream().wait_stream(side)
    sync_all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(*inputs[i % len(inputs)])
    graph.replay()
    ms, _ = _timed_reps(graph.replay, iters, reps, spin_ms=0)  # replays: no host time to hide
    del graph
    return ms


def safe(name, fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as e:  # noqa: BLE001 - a contender that fails is reported, not fatal
        if dist.get_rank() == 0:
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return float("nan")


def bench_contenders(nccl_cublas, torch_fused, gemm_only, comm_only, inputs, args) -> dict:
    """The baselines every fused op is compared with, timed alike in the same run."""
    return {
        "nccl_cublas": bench(nccl_cublas, inputs, args.iters, args.reps, label="nccl_cublas"),
        "torch_fused": safe("torch_fused", bench, torch_fused, inputs, args.iters, args.reps,
                            label="torch_fused"),
        "gemm_only": bench(gemm_only, inputs, args.iters, args.reps),
        "comm_only": bench(comm_only, inputs, args.iters, args.reps),
    }


def plan_text(op, world, shape, params):
    """The plan text a graph compiled for this op and shape carries, with these parameters (none:
    the scheduler's default for the shape)."""
    from ditron_inductor.scheduler.decide import plan_for
    from ditron_inductor.scheduler.task import Task

    M, K, N = shape
    task = Task(op=op, group_name="", world_size=world, m=M, k=K, ns=(N,), dtype=torch.bfloat16,
                device_type="cuda")
    return plan_for(task, **params).encode()


def check_close(name, out, ref):
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    t = torch.tensor([err], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t.item() > 2e-2 or not math.isfinite(t.item()):
        raise RuntimeError(f"{name}: relative error {t.item():.3e} against NCCL+cuBLAS")
    return t.item()


def bench_candidates(tag, candidates, ditron, pick, inputs, args, ditron_task_plan, plans):
    """Time every candidate plan (`ditron(params)`; `ditron(None)` is NCCL + cuBLAS), each first
    checked against NCCL + cuBLAS (`pick` takes the compared output), into `plans`; return the
    time of the scheduler's choice."""
    ref = pick(ditron(None)(*inputs[0]))
    for name, params in candidates.items():
        if (args.plans and name not in args.plans.split(",")
                and name != (ditron_task_plan[0] or {}).get("label")):
            continue

        def one(name=name, params=params):
            check_close(f"{tag} {name}", pick(ditron(params)(*inputs[0])), ref)
            return bench(ditron(params), inputs, args.iters, args.reps, label=name)
        plans[name] = safe(name, one)
    chosen, why = ditron_task_plan
    return (bench(ditron(None), inputs, args.iters, args.reps) if chosen is None
            else plans.get(chosen["label"], float("nan")))


def candidate_params(op: str) -> dict:
    """{label: plan parameters} of the op's candidates (scheduler/candidates.py)."""
    return {label: c.params for label, c in CANDIDATES[op].items()}


def run_ag(shape, dtype, group_name, world, args, ditron_task_plan, weights=None):
    """weights: () -> the right operands [K, N_i] as the site's graph holds them (a Site's
    weights: several, the Linear weight's transpose in a forward site), default one [K, N]."""
    M, K, N = shape
    rows = M // world
    dev = "cuda"
    if weights is None:
        def weights():
            return [torch.randn(K, N, device=dev, dtype=dtype) / K ** 0.5]
    inputs = [(torch.randn(rows, K, device=dev, dtype=dtype), weights()) for _ in range(2)]
    c10d = torch.ops._c10d_functional

    def nccl_cublas(a, ws):
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(a, world, group_name))
        return [g, *(g @ w for w in ws)]

    def torch_fused(a, ws):
        g, outs = torch.ops.symm_mem.fused_all_gather_matmul(a, ws, 0, group_name)
        return [g, *outs]

    def gemm_only(a, ws, _full=torch.randn(M, K, device=dev, dtype=dtype)):
        return [_full @ w for w in ws]

    def comm_only(a, ws):
        return c10d.wait_tensor(c10d.all_gather_into_tensor(a, world, group_name))

    def ditron(params):
        text = (plan_text("all_gather_matmul", world, shape, params) if params is not None
                else None)

        def f(a, ws):
            if text is None:
                return nccl_cublas(a, ws)
            return torch.ops.ditron.all_gather_matmul(a, ws, [None] * len(ws), 0, group_name,
                                                      world, text)
        return f

    ms = bench_contenders(nccl_cublas, torch_fused, gemm_only, comm_only, inputs, args)
    from ditron_inductor.runtime.launch import triton_gemm

    full = torch.randn(M, K, device=dev, dtype=dtype)
    outs = [torch.empty(M, w.shape[1], device=dev, dtype=dtype) for w in inputs[0][1]]
    plans = {}
    plans["triton_gemm_only"] = safe(
        "triton gemm", bench,
        lambda a, ws: [triton_gemm(full, w, None, o, GemmTile()) for w, o in zip(ws, outs)],
        inputs, args.iters, args.reps)
    ms["ditron"] = bench_candidates(f"AG {shape}", candidate_params("all_gather_matmul"), ditron,
                                    lambda out: torch.cat([o.flatten() for o in out[1:]]),
                                    inputs, args, ditron_task_plan, plans)
    return ms, plans


def run_rs(shape, dtype, group_name, world, args, ditron_task_plan, term_ks=(), weights=None):
    """Every candidate of the op is timed (each takes a sum's terms). term_ks: a sum of matmul
    products (the site's Site.term_ks), run as the graphs run it: each term's left operand
    contiguous on its own; ditron's op takes the terms, NCCL + cuBLAS sums the products with
    Inductor's add (one kernel); PyTorch's fused op, which takes one matmul, gets the operands
    concatenated along K (the concatenation not timed). weights: () -> [the right operand
    [K, N] as the site's graph holds it] (a Site's weights: a forward site's the Linear weight's
    transpose), default a contiguous one; the terms are its rows."""
    M, K, N = shape
    term_ks = tuple(term_ks) or (K,)
    dev = "cuda"

    def operands():
        a = [torch.randn(M, k, device=dev, dtype=dtype) for k in term_ks]
        whole = (weights()[0] if weights is not None
                 else torch.randn(K, N, device=dev, dtype=dtype) / K ** 0.5)
        b = list(whole.split(term_ks, dim=0))
        return a, b, torch.cat(a, dim=1), whole
    inputs = [operands() for _ in range(2)]
    c10d = torch.ops._c10d_functional
    add = torch.compile(lambda *products: sum(products[1:], products[0]))

    def products(a, b):
        return a[0] @ b[0] if len(a) == 1 else add(*(x @ w for x, w in zip(a, b)))

    def nccl_cublas(a, b, a_cat, b_cat):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(products(a, b), "sum", world,
                                                           group_name))

    def torch_fused(a, b, a_cat, b_cat):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a_cat, b_cat, "sum", 0, group_name)

    def gemm_only(a, b, a_cat, b_cat):
        return products(a, b)

    full = torch.randn(M, N, device=dev, dtype=dtype)

    def comm_only(a, b, a_cat, b_cat):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(full, "sum", world, group_name))

    def ditron(params):
        text = plan_text("matmul_reduce_scatter", world, shape, params) \
            if params is not None else None
        def f(a, b, a_cat, b_cat):
            if text is None:
                return nccl_cublas(a, b, a_cat, b_cat)
            return torch.ops.ditron.matmul_reduce_scatter(list(a), list(b), None, [], 0, "sum",
                                                          group_name, world, text)
        return f

    ms = bench_contenders(nccl_cublas, torch_fused, gemm_only, comm_only, inputs, args)
    plans = {}
    ms["ditron"] = bench_candidates(f"RS {shape} terms {term_ks}",
                                    candidate_params("matmul_reduce_scatter"), ditron,
                                    lambda out: out, inputs, args, ditron_task_plan, plans)
    return ms, plans


def scheduler_choice(op, shape, dtype, group_name, world, task=None):
    """The scheduler's plan for this shape (or for `task`, a site's own), as a candidate label
    (None: NCCL + cuBLAS)."""
    from ditron_inductor.scheduler.choose import choose_device_plan
    from ditron_inductor.scheduler.task import Task

    M, K, N = shape
    task = task or Task(op=op, group_name=group_name, world_size=world, m=M, k=K, ns=(N,),
                        dtype=dtype, device_type="cuda", dim=0, dim_size=M,
                        reduce_op="sum" if "reduce" in op else None)
    plan, why = choose_device_plan(task)
    if plan is None or plan.impl == "reference":
        return None, why
    return {"label": plan.label}, why


def llama_site_shapes(model: str, world: int, tokens: int) -> dict:
    """{op: [(shape, site)]}: the training step's sites at TP = world (benchmarks/llama_sites.py),
    each shape (M, K, N) with N the site's weights' summed width (the measured table's key); the
    site's weights are timed as its graph holds them (Site.weights: several for q/k/v and
    gate/up, a forward site's the Linear weight's transpose), a sum of products by its terms
    (Site.term_ks; K their sum). The scheduler's choice is taken on the site's own Task."""
    from benchmarks.llama_sites import sites

    found = {}
    for site in sites(model, world, "train", tokens):
        task = site.task
        found.setdefault(task.op, []).append(((task.m, task.k, sum(task.ns)), site))
    return found


def run_mlp(dtype, group_name, world, args):
    """Sequence-parallel MLP: all-gather -> W1 -> gelu -> W2 -> reduce-scatter, compiled 3 ways."""
    import torch._inductor.config as inductor_config
    import torch.distributed._functional_collectives as funcol
    import torch.distributed._symmetric_memory as symm_mem

    tokens, d, f = args.mlp_tokens, args.mlp_d, args.mlp_f
    w1 = torch.randn(d, f // world, device="cuda", dtype=dtype) / d ** 0.5
    w2 = torch.randn(f // world, d, device="cuda", dtype=dtype) / f ** 0.5

    def mlp(x):
        h = funcol.all_gather_tensor(x, 0, group_name)
        h = torch.nn.functional.gelu(h @ w1)
        return funcol.reduce_scatter_tensor(h @ w2, "sum", 0, group_name)

    inputs = [(torch.randn(tokens // world, d, device="cuda", dtype=dtype),) for _ in range(2)]
    res = {}
    torch._dynamo.reset()
    res["eager"] = bench(mlp, inputs, args.iters, args.reps)
    torch._dynamo.reset()
    res["inductor"] = safe("inductor", bench, torch.compile(mlp), inputs, args.iters, args.reps)
    torch._dynamo.reset()

    def async_tp():
        symm_mem.enable_symm_mem_for_group(group_name)
        with inductor_config.patch(_micro_pipeline_tp=True):
            fn = torch.compile(mlp)
            fn(*inputs[0])
        return bench(fn, inputs, args.iters, args.reps)
    res["inductor_async_tp"] = safe("async tp", async_tp)
    torch._dynamo.reset()

    def ditron():
        from ditron_inductor.backend import ditron_backend

        fn = torch.compile(mlp, backend=ditron_backend)
        ref = mlp(*inputs[0])
        check_close("SP MLP ditron", fn(*inputs[0]), ref)
        return bench(fn, inputs, args.iters, args.reps)
    res["ditron"] = safe("ditron", ditron)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/bench")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--scale", type=float, default=1.0, help="scale M of every shape (smoke runs)")
    ap.add_argument("--mlp-tokens", type=int, default=8192)
    ap.add_argument("--mlp-d", type=int, default=8192)
    ap.add_argument("--mlp-f", type=int, default=28672)
    ap.add_argument("--no-mlp", action="store_true")
    ap.add_argument("--ops", default="", help="only these ops, e.g. matmul_reduce_scatter")
    ap.add_argument("--plans", default="", help="only these candidate labels (and the "
                    "scheduler's choice), e.g. cublas_each,cublas_each_first_ready")
    ap.add_argument("--sites", default="", help="a Llama size (8b, 70b): its training step's "
                    "sites at TP = the world size instead of the fixed shapes")
    ap.add_argument("--tokens", type=int, default=8192, help="the sites' tokens (B x S)")
    ap.add_argument("--machine", default=os.environ.get("MACHINE_KIND", "unknown"))
    ap.add_argument("--no-spin", action="store_true",
                    help="time the host's queueing with the device (SPIN_MS says why not)")
    ap.add_argument("--from-json", help="no GPU: re-select each row's ditron plan with the current "
                    "scheduler from the candidates measured in that run, rewrite <out>.md/.json")
    args = ap.parse_args()
    if args.from_json:
        return reselect(args)
    global SPIN_MS
    if args.no_spin:
        SPIN_MS = 0.0
    rank, world, group_name = init_ranks()

    dtype = getattr(torch, args.dtype)
    rows = []
    t0 = time.time()
    site_shapes = llama_site_shapes(args.sites, world, args.tokens) if args.sites else {}
    for op, shapes, runner in (("all_gather_matmul", AG_SHAPES, run_ag),
                               ("matmul_reduce_scatter", RS_SHAPES, run_rs)):
        shapes = site_shapes.get(op, []) if args.sites else [(s, None) for s in shapes]
        for shape, site in shapes if not args.ops or op in args.ops.split(",") else ():
            shape = (int(shape[0] * args.scale) // (8 * world) * 8 * world, shape[1], shape[2])
            task = site and dataclasses.replace(site.task, m=shape[0], dim_size=shape[0],
                                                group_name=group_name, dtype=dtype)
            choice = scheduler_choice(op, shape, dtype, group_name, world, task)
            HOST_MS.clear()
            terms = dict(term_ks=site.term_ks) if site and site.term_ks else {}
            # a site's weights as its graph holds them (several; a forward site's transposed)
            held = (dict(weights=functools.partial(site.weights, "cuda", dtype)) if site
                    else {})
            ms, plans = runner(shape, dtype, group_name, world, args, choice, **terms, **held)
            layout = ({"ns": list(site.task.ns), "b_transposed": site.weights_transposed}
                      if site else {})
            row = {"op": op, "site": site and site.name, "M": shape[0], "K": shape[1],
                   "N": shape[2], **terms, **layout, "world": world,
                   "dtype": args.dtype, "ms": ms, "plans": plans, "host_ms": dict(HOST_MS),
                   "chosen": choice[0]["label"] if choice[0] else "nccl_cublas", "why": choice[1]}
            rows.append(row)
            if rank == 0:  # partial results survive a run cut short
                with open(args.out + ".partial.json", "w") as fh:
                    json.dump(rows, fh, indent=1)
                print(f"{op} {shape}: " + " ".join(f"{k}={v:.3f}" for k, v in ms.items())
                      + " | " + " ".join(f"{k}={v:.3f}" for k, v in plans.items())
                      + f" | chosen {row['chosen']} ({time.time() - t0:.0f}s) | host ms "
                      + " ".join(f"{k}={v:.3f}" for k, v in HOST_MS.items()), flush=True)
    if rank == 0 and not args.no_mlp:  # the table without the MLP first, in case the MLP fails
        write_results(rows, None, args, world, quiet=True)
    mlp = None if args.no_mlp else run_mlp(dtype, group_name, world, args)
    if rank == 0:
        write_results(rows, mlp, args, world)
    from ditron_inductor import runtime

    runtime.shutdown()
    dist.barrier()
    dist.destroy_process_group()


def reselect(args):
    """Offline: the scheduler (with its evidence as it is now) picks each row's plan; ditron's
    time is that candidate's time from the same run (NCCL+cuBLAS's when the scheduler leaves
    the graph alone)."""
    with open(args.from_json) as fh:
        data = json.load(fh)
    rows = data["rows"]
    for r in rows:
        choice, why = scheduler_choice(r["op"], (r["M"], r["K"], r["N"]),
                                       getattr(torch, r["dtype"]), "0", r["world"])
        r["chosen"] = choice["label"] if choice else "nccl_cublas"
        r["why"] = why
        r["ms"]["ditron"] = (r["plans"].get(r["chosen"], float("nan")) if choice
                             else r["ms"]["nccl_cublas"])
    meta = data["meta"]
    meta["reselected"] = ("plans re-selected offline by the scheduler from this run's "
                          "measured candidates: python benchmarks/bench_fused.py --from-json "
                          f"{args.from_json} --out {args.out}")
    args.machine = meta["machine"]
    write_results(rows, data.get("mlp"), args, rows[0]["world"], meta=meta)


def geomean(xs):
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def timing() -> str:
    """How this run timed the eager calls (SPIN_MS)."""
    if SPIN_MS:
        return (f"device time: the device spins {SPIN_MS:g} ms while the host queues the timed "
                "calls (the host's ms per call in the JSON's host_ms)")
    return "host and device: the events bracket the host's queueing (--no-spin)"


def write_results(rows, mlp, args, world, meta=None, quiet=False):
    if meta is None:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = (f"torchrun --nproc-per-node {world} benchmarks/bench_fused.py "
                   + " ".join(sys.argv[1:]))
        meta = {"command": command, "machine": args.machine, "date": date,
                "torch": torch.__version__, "triton": __import__("triton").__version__,
                "gpu": torch.cuda.get_device_name(), "timing": timing()}
    command, date = meta["command"], meta["date"]
    with open(args.out + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows, "mlp": mlp}, fh, indent=1)
    lines = [f"# Fused collective + matmul on {world} GPUs ({args.dtype})", "",
             f"- command: `{command}`", f"- machine: {args.machine} ({meta['gpu']}), torch "
             f"{meta['torch']}, triton {meta['triton']}", f"- date: {date}"]
    lines.append(f"- timing: {meta.get('timing', 'host and device (before the spin)')}")
    if meta.get("reselected"):
        lines.append(f"- {meta['reselected']}")
    lines += ["",
             "Median ms per call (max over ranks). Speedups are NCCL+cuBLAS / ditron and "
             "PyTorch fused / ditron; bound = max(GEMM alone, collective alone) / ditron.", "",
             "| op | M | K | N | NCCL+cuBLAS | PyTorch fused | ditron | GEMM alone | comm alone |"
             " vs NCCL | vs PyTorch | bound/ditron | plan |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    s1, s2, s3 = [], [], []
    for r in rows:
        m = r["ms"]
        a, b, c = m["nccl_cublas"] / m["ditron"], m["torch_fused"] / m["ditron"], \
            max(m["gemm_only"], m["comm_only"]) / m["ditron"]
        s1.append(a), s2.append(b), s3.append(c)
        lines.append(f"| {'AG+GEMM' if r['op'] == 'all_gather_matmul' else 'GEMM+RS'} | {r['M']} "
                     f"| {r['K']} | {r['N']} | {m['nccl_cublas']:.3f} | {m['torch_fused']:.3f} | "
                     f"{m['ditron']:.3f} | {m['gemm_only']:.3f} | {m['comm_only']:.3f} | {a:.2f}x "
                     f"| {b:.2f}x | {c:.2f} | {r['chosen']} |")
    lines += ["", f"Geometric mean: {geomean(s1):.3f}x over NCCL+cuBLAS, {geomean(s2):.3f}x over "
              f"PyTorch fused, ditron reaches {geomean(s3):.3f} of the max(GEMM, comm) bound.", "",
              "Every candidate plan (ms), the scheduler's evidence:", "",
              "| op | M | K | N | " + " | ".join(sorted({k for r in rows for k in r['plans']})) + " |"]
    keys = sorted({k for r in rows for k in r["plans"]})
    lines.append("| --- " * (4 + len(keys)) + "|")
    for r in rows:
        lines.append(f"| {r['op']} | {r['M']} | {r['K']} | {r['N']} | "
                     + " | ".join(f"{r['plans'].get(k, float('nan')):.3f}" for k in keys) + " |")
    if mlp:
        lines += ["", f"Sequence-parallel MLP (tokens {args.mlp_tokens}, d {args.mlp_d}, "
                  f"f {args.mlp_f}, TP {world}), ms per forward:", "",
                  "| eager | Inductor | Inductor + async TP | ditron |", "| --- | --- | --- | --- |",
                  f"| {mlp['eager']:.3f} | {mlp['inductor']:.3f} | {mlp['inductor_async_tp']:.3f} "
                  f"| {mlp['ditron']:.3f} |"]
    text = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as fh:
        fh.write(text)
    if not quiet:
        print(text, flush=True)


if __name__ == "__main__":
    main()
