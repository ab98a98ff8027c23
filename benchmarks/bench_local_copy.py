"""How fast one GPU copies the tensors that the rewrite reorders or concatenates around a fused op
(the cost model's `copy_gbps`: GB/s of bytes read + written). One GPU, no communication:

    python benchmarks/bench_local_copy.py [--reps 20] [--json PATH] [--only ag_local]

Copies, bf16, each as eager torch and as the kernel Inductor generates for it (torch.compile):
  rank_major  [B, S, H] -> rows in rank-major order ([B, W, S/W, H] -> [W, B, S/W, H]), the
              reorder of a B > 1 sequence-parallel gather or scatter (lowering/reorder.py)
  concat_k    two [M, K] operands -> [M, 2K] and two [K, N] -> [2K, N], the sum of two products
              rewritten as one matmul over K-concatenated operands
  ag_local    the all-gather's two local copies of my shard [rows, K] (into my symmetric buffer
              and my rows of the gathered A): two copy-engine API memcpys (the runtime before
              session 46) beside transfer.copy_twice_kernel (read once) at a few launch configs
              (programs per SM, BLOCK words, warps); GB/s counts what each moves (4x / 3x the
              shard)
Timing: CUDA events around --iters calls after a warm-up, the median of --reps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def rank_major(x: torch.Tensor, world: int) -> torch.Tensor:
    b, s, h = x.shape
    return x.view(b, world, s // world, h).transpose(0, 1).contiguous()


def concat_k(a0, a1, b0, b1):
    return torch.cat([a0, a1], dim=1), torch.cat([b0, b1], dim=0)


def cases(world: int):
    """(name, shape, fn, inputs, bytes read + written)."""
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    for b, s, h in ((2, 8192, 4096), (4, 4096, 4096), (2, 8192, 14336)):
        x = torch.randn(b, s, h, **bf16)
        yield "rank_major", f"B {b} S {s} H {h} W {world}", lambda x=x: rank_major(x, world), \
            2 * x.numel() * x.element_size()
    for m, k, n in ((8192, 4096, 4096), (16384, 2048, 4096), (8192, 7168, 4096)):
        a0, a1 = torch.randn(m, k, **bf16), torch.randn(m, k, **bf16)
        b0, b1 = torch.randn(k, n, **bf16), torch.randn(k, n, **bf16)
        moved = 2 * 2 * (a0.numel() + b0.numel()) * a0.element_size()
        yield "concat_k", f"M {m} K {k} N {n}", \
            lambda t=(a0, a1, b0, b1): concat_k(*t), moved


# (programs per SM, BLOCK, num_warps) of copy_twice_kernel; the runtime's is all_gather's
COPY_TWICE_CONFIGS = ((1, 4096, 8), (2, 4096, 8), (4, 4096, 8), (2, 2048, 4), (2, 8192, 8),
                      (4, 2048, 4), (8, 1024, 4))


def ag_local_cases(k: int = 4096):
    """The all-gather's local copies: (name, shape, fn, bytes moved) per way of doing them."""
    from ditron_inductor.runtime import driver
    from ditron_inductor.runtime.all_gather import COPY_TWICE_META, COPY_TWICE_PROGRAMS_PER_SM
    from ditron_inductor.templates.transfer import copy_twice_kernel

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    runtime = (COPY_TWICE_PROGRAMS_PER_SM, COPY_TWICE_META["BLOCK"], COPY_TWICE_META["num_warps"])
    for rows in (1024, 2048, 4096, 8192):
        src = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        buffer, gathered = torch.empty_like(src), src.new_empty(2 * rows, k)
        nbytes = src.numel() * src.element_size()
        shape = f"rows {rows} K {k} ({nbytes >> 20} MB)"

        def memcpys(src=src, buffer=buffer, gathered=gathered, nbytes=nbytes):
            stream = torch.cuda.current_stream().cuda_stream
            driver.memcpy(buffer.data_ptr(), src.data_ptr(), nbytes, stream)
            driver.memcpy(gathered.data_ptr() + nbytes, src.data_ptr(), nbytes, stream)
        yield "ag_local", shape, "two memcpys", memcpys, 4 * nbytes
        words = nbytes // 4
        args = (src.view(-1).view(torch.int32), buffer.view(-1).view(torch.int32),
                gathered.view(-1).view(torch.int32)[words:], words)
        for per_sm, block, warps in COPY_TWICE_CONFIGS:
            def twice(per_sm=per_sm, block=block, warps=warps, args=args):
                copy_twice_kernel[(per_sm * sms,)](*args, BLOCK=block, num_warps=warps)
            label = f"copy_twice {per_sm}/SM B{block} w{warps}"
            yield "ag_local", shape, label + (" (runtime)" if (per_sm, block, warps) == runtime
                                              else ""), twice, 3 * nbytes
        twice()
        assert torch.equal(buffer, src) and torch.equal(gathered[rows:], src)


def timed(fn, iters: int, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--only", choices=("ag_local",), default=None,
                   help="only the all-gather's local copies")
    args = p.parse_args()
    rows = []
    for name, shape, how, fn, moved in ag_local_cases():
        ms = timed(fn, args.iters, args.reps)
        rows.append(dict(copy=name, shape=shape, how=how, ms=ms, gbps=moved / ms / 1e6))
    for name, shape, fn, moved in ([] if args.only else cases(args.world)):
        compiled = torch.compile(fn, dynamic=False)
        for how, f in (("eager", fn), ("inductor", compiled)):
            ms = timed(f, args.iters, args.reps)
            rows.append(dict(copy=name, shape=shape, how=how, ms=ms, gbps=moved / ms / 1e6))
    print(f"\n## Local copies, {torch.cuda.get_device_name()}, GB/s of bytes read + written\n")
    print("| copy | shape | how | ms | GB/s |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['copy']} | {r['shape']} | {r['how']} | {r['ms']:.3f} | {r['gbps']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
