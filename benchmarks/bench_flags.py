"""What one flag operation costs on the stream that issues it: the device time it adds between
two kernels, by how the fused ops could set or wait for a flag. Prints a table (us per operation,
median over reps, slowest rank).

    torchrun --nproc-per-node 2 benchmarks/bench_flags.py [--ops 100] [--reps 10]

A fused op's main stream runs such operations between the kernels of the critical path (the
all-gather's READY after its buffer copy, the reduce-scatter's DONE after its sum), so their
latency, not their size, is what they cost. Each row queues `--ops` times: a tiny kernel, then
the operation; minus the same chain without the operation, per operation.

  write local          cuStreamWriteValue32 on my own flag word
  wait satisfied       cuStreamWaitValue32 on my own flag word, already reached
  copy to peer         a local word = value, then a 4-byte cuMemcpyAsync of it to the peer's
                       flag word (how the plans reached a peer before session 54)
  write peer           cuStreamWriteValue32 straight on the peer's flag word (OpContext.signal
                       since session 54)
  event round trip     an event to a side stream and one back (a stream join, as the plans'
                       side streams join the main one)

Every rank checks that the words its peer wrote hold the last value (on each backend the run
finds: ditron's OpContext over nvshmem where importable, and over torch symmetric memory).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_copy import timed  # noqa: E402
from benchmarks.bench_fused import init_ranks  # noqa: E402
from ditron_inductor.runtime import driver  # noqa: E402
from ditron_inductor.runtime.context import get_context  # noqa: E402

SPIN_CYCLES = 10_000_000  # ~5 ms at 2 GHz: the host queues a whole chain behind it


def rows_for(backend: str, ops: int, reps: int) -> list[tuple[str, float]]:
    ctx = get_context("bench_flags", dist.group.WORLD.group_name, backend, 4096)
    rank, world = ctx.rank, ctx.world
    peer = (rank + 1) % world
    main = torch.cuda.current_stream().cuda_stream
    side = ctx.side.cuda_stream
    there, back = driver.event(), driver.event()
    spin = (torch.cuda.current_stream(), lambda: torch.cuda._sleep(SPIN_CYCLES))
    x = torch.zeros(4096, device="cuda")
    word = torch.zeros(1, dtype=torch.int32, device="cuda")  # the copy's source
    value = [0]

    def op(name):
        def run():
            value[0] += 1
            v = value[0]
            if name == "write local":
                driver.write(main, ctx.flag_addr(ctx.DONE + rank), v)
            elif name == "wait satisfied":
                driver.wait_geq(main, ctx.flag_addr(ctx.DONE + rank), 1)
            elif name == "copy to peer":
                driver.write(main, word.data_ptr(), v)
                driver.memcpy(ctx.peer_flag_addr(peer, ctx.READY + rank), word.data_ptr(), 4,
                              main)
            elif name == "write peer":
                driver.write(main, ctx.peer_flag_addr(peer, ctx.READY + rank), v)
            elif name == "event round trip":
                driver.record(there, main)
                driver.stream_wait(side, there)
                driver.record(back, side)
                driver.stream_wait(main, back)
        return run

    names = ("kernel only", "write local", "wait satisfied", "copy to peer", "write peer",
             "event round trip")
    driver.write(main, ctx.flag_addr(ctx.DONE + rank), 1)  # what "wait satisfied" waits for
    out = []
    for name in names:
        step = op(name)

        def chain():
            for _ in range(ops):
                x.add_(1)
                step()
        ms = timed(chain, [], reps, spin)
        if name in ("copy to peer", "write peer"):
            dist.barrier()
            torch.cuda.synchronize()
            dist.barrier()
            held = ctx.flags.local.view(torch.int32)[ctx.READY + (rank - 1) % world].item()
            assert held == value[0], f"{backend}, {name}: the peer's flag word holds {held}, " \
                                     f"not {value[0]}"
        out.append((name, ms))
    base = out[0][1]
    return [(name, (ms - base) * 1e3 / ops if name != "kernel only" else ms * 1e3 / ops)
            for name, ms in out]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    rank, world, group_name = init_ranks()
    from ditron_inductor.runtime.symm import choose_backend_name

    backends = sorted({choose_backend_name(group_name, "auto"), "torch"})
    table = {b: rows_for(b, args.ops, args.reps) for b in backends}
    if rank == 0:
        print(f"\nFlag operations on {world} ranks ({torch.cuda.get_device_name()}),"
              f" {args.ops} per chain: us each adds between two kernels (kernel only: us per "
              "kernel)\n")
        print("| operation | " + " | ".join(f"{b} us" for b in backends) + " |")
        print("| --- |" + " --- |" * len(backends))
        for i, (name, _) in enumerate(table[backends[0]]):
            print(f"| {name} | " + " | ".join(f"{table[b][i][1]:.2f}" for b in backends) + " |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
