"""What one small step between two kernels costs the device, as the fused MoE ops queue them
(one GPU): a host-to-device copy of a few route words from pageable or pinned memory (how
runtime/moe_routes.publish_splits sends them), the same words as a Triton kernel's arguments, a
stream write of one word (runtime/driver.write, the READY signal) and a one-program kernel.

    python benchmarks/bench_stream_steps.py [--words 24] [--iters 200] [--reps 7]

Each contender queues --iters times [a 1 MB add, the step] while the device spins (so the host's
launch gaps do not count), CUDA events around them, the median of --reps; `none` (the add alone)
is the base, and each step's cost is its time less the base's, per step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_fused import spin_device  # noqa: E402
from ditron_inductor.runtime import driver  # noqa: E402


@triton.jit
def _store_words(dst, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15,
                 w16, w17, w18, w19, w20, w21, w22, w23, N: tl.constexpr):
    i = tl.arange(0, 32)
    v = tl.zeros([32], dtype=tl.int32)
    v = tl.where(i == 0, w0, v)
    v = tl.where(i == 1, w1, v)
    v = tl.where(i == 2, w2, v)
    v = tl.where(i == 3, w3, v)
    v = tl.where(i == 4, w4, v)
    v = tl.where(i == 5, w5, v)
    v = tl.where(i == 6, w6, v)
    v = tl.where(i == 7, w7, v)
    v = tl.where(i == 8, w8, v)
    v = tl.where(i == 9, w9, v)
    v = tl.where(i == 10, w10, v)
    v = tl.where(i == 11, w11, v)
    v = tl.where(i == 12, w12, v)
    v = tl.where(i == 13, w13, v)
    v = tl.where(i == 14, w14, v)
    v = tl.where(i == 15, w15, v)
    v = tl.where(i == 16, w16, v)
    v = tl.where(i == 17, w17, v)
    v = tl.where(i == 18, w18, v)
    v = tl.where(i == 19, w19, v)
    v = tl.where(i == 20, w20, v)
    v = tl.where(i == 21, w21, v)
    v = tl.where(i == 22, w22, v)
    v = tl.where(i == 23, w23, v)
    tl.store(dst + i, v, mask=i < N)


@triton.jit
def _one_program(dst):
    tl.store(dst, tl.load(dst) + 1)


def contenders(words: int) -> dict:
    a = torch.randn(1 << 18, device="cuda")
    table = torch.zeros(64, dtype=torch.int32, device="cuda")
    pinned = torch.zeros(words, dtype=torch.int32, pin_memory=True)
    stream = torch.cuda.current_stream().cuda_stream
    values = list(range(words)) + [0] * (24 - words)

    def add():
        a.add_(1.0)

    def pageable():
        table[:words].copy_(torch.tensor(values[:words], dtype=torch.int32), non_blocking=True)

    def pinned_copy():
        table[:words].copy_(pinned, non_blocking=True)

    def kernel_args():
        _store_words[(1,)](table, *values, N=words)

    def stream_write():
        driver.write(stream, table.data_ptr(), 7)

    def one_program():
        _one_program[(1,)](table)

    steps = {"none": None, "h2d pageable": pageable, "h2d pinned": pinned_copy,
             "kernel args": kernel_args, "stream write": stream_write,
             "one-program kernel": one_program}

    def call(step):
        def run():
            add()
            if step is not None:
                step()
        return run

    return {name: call(step) for name, step in steps.items()}


def timed(fns: dict, iters: int, reps: int) -> dict:
    for fn in fns.values():
        for _ in range(5):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            spin_device(20.0)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / iters)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--words", type=int, default=24, help="route words (at most 24)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    us = timed(contenders(min(args.words, 24)), args.iters, args.reps)
    base = us["none"]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# A step between two kernels ({torch.cuda.get_device_name()}, {date}, torch "
          f"{torch.__version__}; `python benchmarks/bench_stream_steps.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`)\n")
    print("| step | us per [add, step] | step us |\n| --- | --- | --- |")
    for name, t in us.items():
        print(f"| {name} | {t:.2f} | {t - base:+.2f} |")


if __name__ == "__main__":
    main()
