"""Rank 0's timeline of a fused all-gather + GEMM or GEMM + reduce-scatter: every kernel, copy and
stream operation of one call (torch profiler), with its stream, start and duration, per candidate
plan.

    torchrun --nproc-per-node 2 benchmarks/timeline_fused.py --ns 3072,14336 \
        --labels cublas_each,cublas_each_first_ready
    torchrun --nproc-per-node 2 benchmarks/timeline_fused.py --op matmul_reduce_scatter \
        --k 2048 --ns 4096 --labels cublas_triton_reduce

Three calls are queued while the device spins (as bench_fused.py times them) and the last third of
the profiled span is printed: the start of each activity in us from the first one there (e.g.
where the copy into the symmetric buffer runs beside the GEMM, and when the peer's pull and its
GEMM of my rows start after it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_fused import init_ranks, plan_text  # noqa: E402
from ditron_inductor.scheduler.candidates import CANDIDATES  # noqa: E402
from ditron_inductor.scheduler.task import ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER  # noqa: E402

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def last_call(trace_path: str, calls: int) -> list[str]:
    """The lines of the activities in the last 1/calls of the trace's device span."""
    events = [e for e in json.load(open(trace_path))["traceEvents"]
              if e.get("cat") in DEVICE_KINDS and "sleep" not in e["name"]]
    events.sort(key=lambda e: e["ts"])
    begin, end = events[0]["ts"], max(e["ts"] + e["dur"] for e in events)
    cut = end - (end - begin) / calls
    shown = [e for e in events if e["ts"] + e["dur"] > cut]
    first = min(e["ts"] for e in shown)
    return [f"  {e['ts'] - first:8.1f} +{e['dur']:7.1f} us  stream {e['args'].get('stream', '?'):>4}"
            f"  {e['name'][:70]}" for e in shown]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=(ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER),
                    default=ALL_GATHER_MATMUL)
    ap.add_argument("--m", type=int, default=8192, help="gathered rows, or the GEMM's before the "
                    "scatter")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--ns", default="3072,14336")
    ap.add_argument("--labels", default="cublas_each,cublas_each_first_ready",
                    help="labels of the op's candidates (scheduler/candidates.py)")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()

    rank, world, group_name = init_ranks()
    gather = args.op == ALL_GATHER_MATMUL
    for n in [int(x) for x in args.ns.split(",")]:
        a = torch.randn(args.m // world if gather else args.m, args.k, device="cuda",
                        dtype=torch.bfloat16)
        b = torch.randn(args.k, n, device="cuda", dtype=torch.bfloat16) / args.k ** 0.5
        for label in args.labels.split(","):
            params = CANDIDATES[args.op][label].params
            text = plan_text(args.op, world, (args.m, args.k, n), params)

            def call():
                if gather:
                    return torch.ops.ditron.all_gather_matmul(a, [b], [None], 0, group_name,
                                                              world, text)
                return torch.ops.ditron.matmul_reduce_scatter([a], [b], None, [], 0, "sum",
                                                              group_name, world, text)
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)  # the host queues the calls while the device spins
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    call()
                torch.cuda.synchronize()
            if rank == 0:
                path = f"/tmp/timeline_{args.op}_{n}_{label}.json"
                prof.export_chrome_trace(path)
                print(f"\n== {args.m}x{args.k}x{n} {label}, rank 0, the last of {args.calls} "
                      "calls:")
                print("\n".join(last_call(path, args.calls)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
