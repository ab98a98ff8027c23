"""The cost of bounded flag waits at world size 1: each plan at the Llama sites with
ditron.wait_timeout_s auto (the default: the process group's timeout) beside the same plan
unbounded (0), timed in one process; and the device time of one stream wait, the bounded kernel
(launch.wait_geq) beside the driver's cuStreamWaitValue32, on a flag already set.

    torchrun --nproc-per-node 1 -m benchmarks.bench_wait_bound \
        --out benchmarks/results/wait_bound_cost_h200x1

Sites, inputs and timing are bench_compute_parity's (its --models, --tp, --workloads,
--*-tokens, --iters, --reps): the plan the scheduler picks for the site at its TP degree, or its
op's default fused plan where the scheduler keeps NCCL + cuBLAS, eager or replayed from a CUDA
graph as the site runs. At world size 1 the peer loops are empty: what the bound adds there is
the kernels' timed waits on their own flags (the all-reduce's, the Triton GEMM's chunk flags) and
the host's check; the stream waits before a peer's data are the second table, per wait.

Writes <out>.json ({meta, rows, stream_wait}) and <out>.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import socket
import sys
import time

from benchmarks import bench_compute_parity as parity  # noqa: E402 - keeps multicast off first

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ditron_inductor.scheduler.choose import choose_device_plan  # noqa: E402
from ditron_inductor.scheduler.decide import fused_plan, with_options  # noqa: E402
from ditron_inductor.config import Options  # noqa: E402


def plan_texts(task, cuda_graphs: bool) -> tuple[str, dict]:
    plan, _ = choose_device_plan(task, cuda_graphs=cuda_graphs)
    which = "chosen" if plan is not None else "default fused"
    plan = plan if plan is not None else fused_plan(task)
    return which, {with_options(plan, task, Options(wait_timeout_s=None)).encode(): "bounded",
                   with_options(plan, task, Options(wait_timeout_s=0.0)).encode(): "unbounded"}


def stream_wait_ms(group_name: str, waits: int = 200, reps: int = 7) -> dict:
    """Device ms per stream wait on a flag that is set: the bounded kernel and the driver's."""
    from ditron_inductor.runtime import launch
    from ditron_inductor.runtime.context import get_context
    from ditron_inductor.scheduler.plan import AllGatherPlan

    ctx = get_context("all_gather_matmul", group_name, "auto", 1 << 20)
    ctx.flags.words[ctx.READY] = 1 << 20
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream().cuda_stream
    out = {}
    for name, plan in (("bounded kernel", AllGatherPlan()),
                       ("cuStreamWaitValue32", AllGatherPlan(wait_timeout_s=0.0))):
        times = []
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(100_000_000)  # the host queues every wait before the device runs them
            start.record()
            t0 = time.perf_counter()
            for _ in range(waits):
                launch.wait_geq(ctx, plan, stream, ctx.READY, 1)
            host = (time.perf_counter() - t0) * 1e3 / waits
            end.record()
            queued = not end.query()  # else the device caught up with the host: host-bound
            torch.cuda.synchronize()
            times.append((start.elapsed_time(end) / waits, host, queued))
        out[name] = {"device_ms": sorted(t[0] for t in times[1:])[reps // 2],
                     "host_ms": sorted(t[1] for t in times[1:])[reps // 2],
                     "device_bound": all(t[2] for t in times[1:])}
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parity.parse_args(argv)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    torch.manual_seed(0)
    seen, rows = set(), []
    for model, site in parity.all_sites(args):
        key = (parity.shape_key(site), site.cuda_graphs)
        if key in seen:
            continue
        seen.add(key)
        which, texts = plan_texts(site.task, site.cuda_graphs)
        results = parity.measure(site, texts, group, args, site.cuda_graphs)
        mode = "graph" if site.cuda_graphs else "eager"
        by = {texts[k]: v for k, v in results.items() if k != "unfused"}
        b, u = by["bounded"], by["unbounded"]
        ok = b["served"] and u["served"]
        t = site.task
        row = {"model": model, "tp": t.world_size, "workload": site.workload, "site": site.name,
               "op": t.op, "M": t.m, "K": t.k, "N": list(t.ns), "mode": mode, "plan": which,
               "label": dataclasses.asdict(choose_device_plan(t, cuda_graphs=site.cuda_graphs)[0]
                                           or fused_plan(t)).get("label", ""),
               "unfused_ms": results["unfused"][mode],
               "unbounded_ms": u[mode] if ok else math.nan,
               "bounded_ms": b[mode] if ok else math.nan,
               "error": b["error"] or u["error"]}
        row["cost"] = (row["bounded_ms"] / row["unbounded_ms"] - 1) if ok else math.nan
        rows.append(row)
        print(f"{t.describe()} {mode} {which}: unbounded {row['unbounded_ms']:.4f} ms, bounded "
              f"{row['bounded_ms']:.4f} ms ({100 * row['cost']:+.2f}%) {row['error']}", flush=True)
    waits = stream_wait_ms(group)
    meta = {"command": "torchrun --nproc-per-node 1 -m benchmarks.bench_wait_bound " + " ".join(argv),
            "machine": os.environ.get("MACHINE_KIND", socket.gethostname()),
            "device": torch.cuda.get_device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__}
    with open(args.out + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows, "stream_wait_ms": waits}, fh, indent=1)
    lines = [f"# Bounded against unbounded flag waits, world size 1 ({meta['device']})", "",
             f"`{meta['command']}`, {meta['machine']}, {meta['date']}, torch {meta['torch']}. "
             "Device ms per call (median); cost = bounded / unbounded - 1.", "",
             "| site | op | M×K×N | mode | plan | unfused | unbounded | bounded | cost |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['workload']} {r['site']} | {r['op']} | {r['M']}×{r['K']}×"
                     f"{','.join(map(str, r['N']))} | {r['mode']} | {r['plan']} {r['label']} | "
                     f"{r['unfused_ms']:.4f} | {r['unbounded_ms']:.4f} | {r['bounded_ms']:.4f} | "
                     f"{100 * r['cost']:+.2f}% |")
    lines += ["", "One stream wait on a flag that is set (200 in a row, queued behind a sleep "
              "so that the device runs them back to back), us per wait:", "",
              "| wait | device | host (to queue it) | device-bound |", "| --- | --- | --- | --- |"]
    lines += [f"| {k} | {1e3 * v['device_ms']:.2f} | {1e3 * v['host_ms']:.2f} | "
              f"{v['device_bound']} |" for k, v in waits.items()]
    lines.append("")
    with open(args.out + ".md", "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines), flush=True)
    from ditron_inductor import runtime

    runtime.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
