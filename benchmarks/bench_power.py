"""SM clock and board power while one contender runs alone for a few seconds: whether a GEMM
alone runs at the GPU's power limit, and runs faster after NCCL's low-power intervals.

Why: at the Llama-3-8B gate/up gather on 2x H200 NCCL + cuBLAS took 1.432 ms where the GEMM
alone took 1.417 and the all-gather alone 0.188 (benchmarks/results/fused_h200x2_llama8b_sites.md):
the two do not add up, and a fused plan that runs them side by side cannot win there. If the GEMM
alone is power-limited, its clock is lower than inside NCCL + cuBLAS, and a fused plan's overlap
buys less than the link model says.

    torchrun --nproc-per-node 2 benchmarks/bench_power.py --out benchmarks/results/power_h200x2

Per contender (the GEMM alone, the all-gather alone, NCCL + cuBLAS, and each of --plans, ditron's
all_gather_matmul with that AG candidate), at [M, K] gathered @ [K, N] on every local GPU: warm
up, then calls back to back for --seconds while `nvidia-smi` samples this rank's GPU every 100 ms
(it reads clocks and power, changes nothing); the median SM clock (MHz) and power (W) over the
window, and the time per call over it (CUDA events, the maximum over ranks). Rank 0's samples
are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_fused import _timed_reps, plan_text, ranks_meta, write_tables  # noqa: E402
from benchmarks.bench_moe import close_group, init_group  # noqa: E402
from ditron_inductor.scheduler.candidates import CANDIDATES  # noqa: E402

SAMPLE_MS = 100
QUERY = "clocks.sm,power.draw"


def parse_samples(text: str) -> dict:
    """`nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits` lines ->
    {"sm_mhz", "power_w", "samples"}: the medians (lines that do not parse, as "[N/A]", are
    left out)."""
    clocks, watts = [], []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            clock, power = float(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            continue
        clocks.append(clock)
        watts.append(power)
    if not clocks:
        return {"sm_mhz": float("nan"), "power_w": float("nan"), "samples": 0}
    return {"sm_mhz": statistics.median(clocks), "power_w": statistics.median(watts),
            "samples": len(clocks)}


BATCH = 50  # calls queued between host syncs (the queue stays short, the gaps few)


def timed_calls(fn, calls: int) -> float:
    """Device ms per call over `calls` calls after a sync of every rank, the slowest rank's."""
    def enqueue():
        for i in range(calls):
            fn()
            if (i + 1) % BATCH == 0:
                torch.cuda.current_stream().synchronize()
    return _timed_reps(enqueue, calls, reps=1)[0]


def sampled(fn, seconds: float, gpu: int) -> dict:
    """About `seconds` of calls of fn back to back while nvidia-smi samples GPU `gpu`: the clock
    and power medians, and the device ms per call. Every rank makes the same number of calls
    (each holds collectives the others wait on): the count comes from a probe's time, the
    slowest rank's."""
    calls = max(BATCH, round(seconds * 1e3 / timed_calls(fn, BATCH) / BATCH) * BATCH)
    try:
        sampler = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i",
             str(gpu), f"--loop-ms={SAMPLE_MS}"], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True)
        time.sleep(0.3)  # nvidia-smi's first sample
    except FileNotFoundError:  # no nvidia-smi: times only
        sampler = None
    ms = timed_calls(fn, calls)
    out = ""
    if sampler is not None:
        sampler.terminate()
        out, _ = sampler.communicate(timeout=10)
    return {**parse_samples(out), "calls": calls, "ms": ms}


def contenders(args, world: int, group_name: str) -> dict:
    (m, k, n), dtype = args.shape, torch.bfloat16
    shard = torch.randn(m // world, k, device="cuda", dtype=dtype)
    full = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
    c10d = torch.ops._c10d_functional

    def gather():
        return c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world, group_name))

    fns = {"gemm_only": lambda: full @ w, "comm_only": gather,
           "nccl_cublas": lambda: gather() @ w}
    for label in filter(None, args.plans.split(",")):
        text = plan_text("all_gather_matmul", world, (m, k, n),
                         CANDIDATES["all_gather_matmul"][label].params)
        fns[label] = (lambda text=text: torch.ops.ditron.all_gather_matmul(
            shard, [w], [None], 0, group_name, world, text))
    return fns


def shape_arg(text: str) -> tuple[int, int, int]:
    """"8192,4096,7168" -> (8192, 4096, 7168)."""
    m, k, n = (int(dim) for dim in text.split(","))
    return m, k, n


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/power")
    # not --m/--k/--n: torchrun takes a script's option that abbreviates one of its own
    # (--n: --nnodes, --nproc-per-node, ...) as its own and stops
    ap.add_argument("--shape", type=shape_arg, default=(8192, 4096, 14336),
                    help="M,K,N: rows gathered (B x S), K, N; default: gate/up at Llama-3-8B TP 2")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--plans", default="cublas_1_3_4,tri_tma_128x256",
                    help="ditron AG candidates (labels of candidates.CANDIDATES)")
    args = ap.parse_args(argv)
    m, k, n = args.shape
    init_group("cuda", launched=True)
    import ditron_inductor.ops  # noqa: F401 - torch.ops.ditron.*

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    group_name = dist.group.WORLD.group_name
    world = dist.get_world_size()
    rows = []
    for name, fn in contenders(args, world, group_name).items():
        for _ in range(5):
            fn()
        row = {"contender": name, **sampled(fn, args.seconds, rank)}
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        meta = ranks_meta("bench_power.py", argv, "cuda", m=m, k=k, n=n)
        head = ["contender", "ms per call", "SM clock MHz (median)", "power W (median)",
                "samples", "calls"]
        lines = [f"# Clock and power per contender on {world} ranks ({meta['device']}): "
                 f"all-gather [{m}, {k}] @ [{k}, {n}]", "",
                 f"- command: `{meta['command']}`", f"- torch {meta['torch']}, {meta['date']}",
                 "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        lines += [f"| {r['contender']} | {r['ms']:.3f} | {r['sm_mhz']:.0f} | {r['power_w']:.0f} | "
                  f"{r['samples']} | {r['calls']} |" for r in rows]
        write_tables(args.out, meta, rows, lines)
    close_group("cuda")


if __name__ == "__main__":
    main()
