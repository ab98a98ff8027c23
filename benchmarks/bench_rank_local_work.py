"""What a TP-W rank computes in a fused plan when the transfers cost nothing, on one GPU.

    python benchmarks/bench_rank_local_work.py --tp 2,4 --out benchmarks/results/<name>
    python benchmarks/bench_rank_local_work.py --device cpu --tiny          # smoke run

The world-1 parity table (bench_compute_parity.py) runs each op at world size 1, where the
all-gather copies the whole input (W times a rank's shard) and no GEMM is cut into the ranks'
chunks: it is not what a rank of W computes. Here each training site of Llama-3-8B and -70B
(--models; benchmarks/llama_sites.py, 8192 tokens) at TP W runs the local work of the plan the scheduler
chooses there, with every peer's data taken as arrived (B as the model holds it, Site.weights):
  unfused    the GEMM over all M rows (cuBLAS per weight; a sum of products as Inductor computes
             it): what NCCL + cuBLAS computes
  gemms      the plan's GEMMs alone, as it cuts them (cuBLAS per chunk group, my rows first from
             the input; the persistent Triton GEMM over all rows; a sum's terms each its own
             cuBLAS call, accumulated)
  plan       + its local passes on the streams the plan puts them on: the all-gather's copy of
             my shard into the buffer the peers pull (main stream before the GEMM where the plan
             is ready_before_gemm) and into my rows of the gathered A (beside cuBLAS, on a stream
             of its own; before the Triton GEMM, as two copies where the runtime writes both in
             one kernel); the reduce-scatter's partials for the
             peers in a staging buffer and the reduction of the W slots of my rows
  no_buffer  (all-gather) the plan without the copy into the peers' buffer: what is left if the
             producer of A wrote my shard there itself
  two_gemms  (all-gather) cuBLAS on my rows, then on every peer's rows at once (groups 1, W-1),
             no copies: the fewest GEMM calls a plan that starts on my rows can make
The copy-engine transfers and the peers' flags are left out: their cost is what the W-GPU site
tables add to these rows. Timing as bench_fused: the device spinning while the host queues
--iters calls, CUDA events, the median of --reps, the contenders of a site in turn in each.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_compute_parity import _sum_of_products, compiled, rel_err  # noqa: E402
from benchmarks.bench_fused import spin_device  # noqa: E402
from benchmarks.llama_sites import sites  # noqa: E402
from ditron_inductor.runtime.all_gather import chunk_groups, chunk_runs  # noqa: E402
from ditron_inductor.runtime.launch import matmul_into  # noqa: E402
from ditron_inductor.scheduler.choose import choose_device_plan  # noqa: E402
from ditron_inductor.scheduler.plan import TRITON  # noqa: E402
from ditron_inductor.scheduler.task import ALL_GATHER_MATMUL  # noqa: E402


def site_arguments(p: argparse.ArgumentParser, tp: str, models: str) -> argparse.ArgumentParser:
    """The options of a one-GPU benchmark over the training step's sites (this one's and
    bench_gemm_tiles')."""
    p.add_argument("--tp", default=tp)
    p.add_argument("--models", default=models, help="comma-separated: 8b,70b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    p.add_argument("--out", help="write <out>.json and <out>.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    return site_arguments(p, tp="2,4", models="8b").parse_args(argv)


SPIN_MS = 1.0  # the device's spin before a repetition, doubled while the host falls behind


def timed(fns: dict, device: str, iters: int, reps: int) -> dict:
    """{name: median ms per call}: each repetition times every contender in turn (so a drift of
    the clock, e.g. the GEMMs' power limit setting in, reaches all alike), CUDA events around
    `iters` calls queued while the device spins (device time, as bench_fused times the sites:
    _one_rep); on CPU the host's clock."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_one_rep(fn, device, iters))
    return {name: statistics.median(t) for name, t in times.items()}


def host_ms(fns: dict, iters: int) -> dict:
    """{name: the host's ms per call to queue it} (the device running behind)."""
    out = {}
    for name, fn in fns.items():
        torch.cuda.synchronize()
        spin_device(8 * SPIN_MS)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out[name] = (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    return out


def _one_rep(fn, device: str, iters: int) -> float:
    """ms per call of one repetition. On CUDA the device spins while the host queues the calls;
    a repetition whose start the device reached before the host had queued them all timed the
    host (a contender of many small launches), so it is dropped and the spin doubled (as
    bench_fused's _timed_reps does)."""
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    spin = SPIN_MS
    for _ in range(8):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spin_device(spin)  # the host queues the calls meanwhile
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        host_bound = start.query()
        end.synchronize()
        if not host_bound:
            return start.elapsed_time(end) / iters
        spin *= 2
    raise RuntimeError(f"host-bound: the device reached the calls before the host had queued "
                       f"{iters} of them, even after a spin of {spin / 2:g} ms")


def all_gather_work(site, plan, device, dtype) -> tuple[dict, Callable[[], float]]:
    """({contender: fn}, check) of an all-gather site's local work at the plan's world size;
    check() runs the plan with the peers' rows arrived and returns its products' relative error
    against the unfused ones."""
    task = site.task
    W, r = task.world_size, 0
    rows, k = task.m // W, task.k
    a = torch.randn(task.m, k, device=device, dtype=dtype)
    mine = a[r * rows:(r + 1) * rows]
    ws = site.weights(device, dtype)
    outs = [torch.empty(task.m, n, device=device, dtype=dtype) for n in task.ns]
    buffer = torch.empty_like(mine)  # the symmetric buffer the peers pull from
    gathered = torch.empty_like(a)  # the peers' rows in it count as arrived
    side = torch.cuda.Stream() if device == "cuda" else None

    def cublas_groups(groups):
        for g in chunk_groups(task.ring_order(r), groups):
            for c0, c1 in chunk_runs(g):
                lo, hi = c0 * rows, (c1 + 1) * rows
                a_rows = mine if (c0, c1) == (r, r) else gathered[lo:hi]
                for w, out in zip(ws, outs):
                    matmul_into(a_rows, w, None, out[lo:hi])

    def gemms():
        if plan.gemm == TRITON:  # (on CPU, the smoke run: torch's)
            for w, out in zip(ws, outs):
                matmul_into(gathered, w, None, out, plan.tile if device == "cuda" else None)
        else:
            cublas_groups(plan.for_world(W).groups)

    def local(buffer_copy: bool):
        def run():
            beside = side is not None and plan.gemm != TRITON
            first = plan.ready_before_gemm or not beside
            if buffer_copy and first:
                buffer.copy_(mine)
            if beside:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    if buffer_copy and not first:
                        buffer.copy_(mine)
                    gathered[r * rows:(r + 1) * rows].copy_(mine)
            else:
                gathered[r * rows:(r + 1) * rows].copy_(mine)
            gemms()
            if beside:
                torch.cuda.current_stream().wait_stream(side)
        return run

    def check() -> float:
        gathered.copy_(a)
        for o in outs:
            o.fill_(float("nan"))
        local(True)()
        ref = torch.cat([(a @ w).flatten() for w in ws])
        return max(rel_err(torch.cat([o.flatten() for o in outs]), ref), rel_err(buffer, mine))

    return {"unfused": lambda: [a @ w for w in ws], "gemms": gemms, "plan": local(True),
            "no_buffer": local(False), "two_gemms": lambda: cublas_groups((1, W - 1))}, check


def reduce_scatter_work(site, plan, device, dtype) -> tuple[dict, Callable[[], float]]:
    """({contender: fn}, check) of a reduce-scatter site's local work at the plan's world size:
    the GEMM of each destination's rows (the peers' into a staging buffer, mine into my slot),
    then the reduction of my W slots (the peers' partials count as arrived); check() runs it
    with every peer's partial of my rows equal to mine (peers holding the same A) and returns
    the relative error of the sum against W times the unfused product's rows."""
    from ditron_inductor.runtime.kernel_launch import cdiv, launch
    from ditron_inductor.runtime.launch import MatmulSum
    from ditron_inductor.templates.reduce import reduce_slots_kernel

    task = site.task
    W, r = task.world_size, 0
    rows, n = task.m // W, task.ns[0]
    a = torch.randn(task.m, task.k, device=device, dtype=dtype)
    b = site.weights(device, dtype)[0]
    term_ks = site.term_ks or (task.k,)
    a_terms, b_terms = a.split(term_ks, dim=1), b.split(term_ks, dim=0)
    summed, why = MatmulSum.of(list(a_terms), list(b_terms))
    if why is not None:
        raise SystemExit(f"{site.name}: the fused plans decline its terms: {why}")
    staging = torch.empty(W - 1, rows, n, device=device, dtype=dtype)
    slots = torch.empty(W, rows, n, device=device, dtype=dtype)
    out = torch.empty(rows, n, device=device, dtype=dtype)

    def unfused():
        if len(term_ks) == 1:
            return a @ b
        return compiled(_sum_of_products)(list(zip(a_terms, b_terms)))

    def gemm(p, into):
        a_rows = a_terms[0][p * rows:(p + 1) * rows]
        if summed is not None:
            summed.matmul_into(a_rows, b_terms[0], None, into, p * rows)
        else:
            matmul_into(a_rows, b_terms[0], None, into)

    def gemms():
        for i, p in enumerate(task.ring_order(r)[1:]):
            gemm(p, staging[i])
        gemm(r, slots[r])

    def plan_work():
        gemms()
        if device == "cuda":
            count = rows * n
            launch(reduce_slots_kernel, (cdiv(count, 4096),), slots, out, count, count, W, 1.0,
                   BLOCK=4096, num_warps=8)
        else:
            torch.sum(slots, dim=0, out=out)

    def check() -> float:
        ref = unfused()[r * rows:(r + 1) * rows]
        slots.copy_(ref.expand(W, rows, n))
        out.fill_(float("nan"))
        plan_work()
        return rel_err(out, W * ref.double())

    return {"unfused": unfused, "gemms": gemms, "plan": plan_work}, check


def site_plans(args):
    """(model, TP, site, plan, why) of every training site of --models at each --tp, the plan
    the scheduler chooses for the full-size site (None: NCCL + cuBLAS); with --tiny the site
    at toy shapes."""
    for model, world in [(m, int(w)) for m in args.models.split(",")
                         for w in args.tp.split(",")]:
        for site in sites(model, world, "train", args.tokens):
            plan, why = choose_device_plan(site.task)
            yield model, world, tiny(site) if args.tiny else site, plan, why


def run(args) -> list[dict]:
    dtype = torch.bfloat16  # the runtime's GEMMs and sums take bf16 / fp16 (on CPU too)
    rows = []
    for model, world, site, plan, why in site_plans(args):
        row = dict(model=model, tp=world, site=site.name, op=site.task.op,
                   M=site.task.m, K=site.task.k, N=list(site.task.ns),
                   label=None if plan is None else plan.label, why=why)
        if plan is not None:
            work, check = (all_gather_work if site.task.op == ALL_GATHER_MATMUL
                           else reduce_scatter_work)(site, plan, args.device, dtype)
            row["rel_err"] = check()
            if not row["rel_err"] < 2e-2:
                raise SystemExit(f"{site.name} at TP {world}: the emulated plan computes "
                                 f"something else (relative error {row['rel_err']:.3g})")
            row.update(timed(work, args.device, args.iters, args.reps))
            if args.device == "cuda":
                row["host_ms"] = host_ms(work, args.iters)
        rows.append(row)
        print(row_line(row), flush=True)
    return rows


def tiny(site):
    """The site at toy sizes (each dim / 64, K and N kept divisible by the terms and the world)."""
    t = site.task
    term_ks = tuple(max(1, k // 64) for k in site.term_ks)
    k = sum(term_ks) if term_ks else max(8, t.k // 64)
    task = dataclasses.replace(t, m=t.world_size * 16, k=k,
                               ns=tuple(max(8, n // 64) for n in t.ns), dim_size=t.world_size * 16)
    return dataclasses.replace(site, task=task, term_ks=term_ks)


COLUMNS = ("unfused", "gemms", "plan", "no_buffer", "two_gemms")


def row_line(row: dict) -> str:
    cells = [row["model"], str(row["tp"]), row["site"], str(row["M"]), str(row["K"]),
             ",".join(map(str, row["N"])), row["label"] or "none (NCCL + cuBLAS)"]
    cells += [f"{row[c]:.3f}" if c in row else "-" for c in COLUMNS]
    cells += ([f"{row['gemms'] / row['unfused']:.3f}", f"{row['plan'] / row['unfused']:.3f}"]
              if "unfused" in row else ["-", "-"])
    return "| " + " | ".join(cells) + " |"


def layer_sums(rows: list[dict]) -> list[str]:
    """Per model and TP degree: the chosen plans' local work minus the unfused GEMMs', summed over
    a decoder layer's sites (and lm_head's apart), and what the all-gathers' copies into the
    peers' buffer add to it."""
    lines = []
    for key in sorted({(r["model"], r["tp"]) for r in rows}):
        timed_rows = [r for r in rows if (r["model"], r["tp"]) == key and "unfused" in r]
        layer = [r for r in timed_rows if not r["site"].startswith("lm_head")]
        head = [r for r in timed_rows if r["site"].startswith("lm_head")]
        lines.append(
            f"- {key[0]} TP {key[1]}: plan - unfused per decoder layer "
            f"{sum(r['plan'] - r['unfused'] for r in layer):+.3f} ms ({len(layer)} sites fused; "
            f"the buffer copies {sum(r['plan'] - r['no_buffer'] for r in layer if 'no_buffer' in r):+.3f}"
            f"), lm_head {sum(r['plan'] - r['unfused'] for r in head):+.3f} ms")
    return lines


def report(rows: list[dict], args, argv) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    head = ["model", "TP", "site", "M", "K", "N", "plan", *[f"{c} ms" for c in COLUMNS],
            "gemms / unfused", "plan / unfused"]
    lines = [f"# A TP-W rank's local work in the chosen plans, transfers free ({device})", "",
             f"- command: `python benchmarks/bench_rank_local_work.py {' '.join(argv)}`",
             f"- {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch "
             f"{torch.__version__}", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += [row_line(r) for r in rows]
    lines += ["", *layer_sums(rows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows = run(args)
    text = report(rows, args, argv)
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"argv": argv, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
