"""Host time of one call of each fused op, next to what Inductor would launch instead.

    torchrun --nproc-per-node W benchmarks/bench_host_time.py [--calls 200] [--profile LABEL]

Eager training and prefill launch every op from Python: a fused op pays off only if the host
work it adds per call (plan lookup, group lookup, context, driver calls, launches) stays below
what it saves on the GPU. This program measures that host work alone: each call is timed on the
host from entry to return with the GPU idle before it (a synchronize after every call, outside
the timed span), so the GPU never pushes back. The contenders take turns, `--rounds` times, and
each reports the median over its `--calls` calls, in microseconds, the maximum over ranks.

Contenders per op, on the same inputs (bf16, random):
  nccl_cublas   functional collective + wait + mm (what the graph holds without ditron)
  torch_fused   PyTorch's symm-mem op (fused_all_gather_matmul / fused_matmul_reduce_scatter)
  ditron/<plan> torch.ops.ditron.<op> with that fused plan (as a compiled graph calls it)
  reference     torch.ops.ditron.<op> with the reference plan (the op's own Python layer)
A ditron row whose call fell back to the reference path is marked: its time is not the plan's.

Runs on any number of GPUs, one rank each (W = 1 included: the per-peer driver calls are then
absent, so the figures are a lower bound for larger W). `--profile LABEL[,LABEL]` prints cProfile's top
entries for those contenders, to show where the host time goes. A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import logging
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch
import torch.distributed as dist

import ditron_inductor.ops  # noqa: E402,F401 - registers torch.ops.ditron.*
from ditron_inductor.log_names import LOGGER_NAME  # noqa: E402
from ditron_inductor.scheduler.decide import plan_for  # noqa: E402
from ditron_inductor.scheduler.plan import REFERENCE_PLAN  # noqa: E402
from ditron_inductor.scheduler.task import Task  # noqa: E402

c10d = torch.ops._c10d_functional
ditron = torch.ops.ditron


def plan_text(op: str, world: int, m: int, k: int, n: int, **params) -> str:
    """The plan string a graph compiled for this op and shape carries, with these parameters."""
    task = Task(op=op, group_name="", world_size=world, m=m, k=k, ns=(n,), dtype=torch.bfloat16,
                device_type="cuda")
    return plan_for(task, **params).encode()


REFERENCE_TEXT = REFERENCE_PLAN.encode()


class FallbackCounter(logging.Handler):
    """Counts the op's 'could not serve this call' lines: a fused plan that fell back."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record):
        if "could not serve" in record.getMessage():
            self.count += 1


def host_samples(fn, calls: int) -> list[float]:
    """Host seconds of each of `calls` calls of fn(), the GPU idle before each call."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return times


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def cases(world: int, group: str, dev):
    """(op label, shape text, {contender: fn}) for each op."""
    bf16 = dict(dtype=torch.bfloat16, device=dev)
    k, n = 4096, 4096
    rows = 1024 // world * world

    # all-gather + matmul: each rank holds rows // world rows
    a_shard = torch.randn(rows // world, k, **bf16)
    w_ag = torch.randn(k, n, **bf16) / k ** 0.5
    ag = {
        "nccl_cublas": lambda: torch.mm(
            c10d.wait_tensor(c10d.all_gather_into_tensor(a_shard, world, group)), w_ag),
        "torch_fused": lambda: torch.ops.symm_mem.fused_all_gather_matmul(
            a_shard, [w_ag], gather_dim=0, group_name=group),
        "reference": lambda: ditron.all_gather_matmul(
            a_shard, [w_ag], [None], 0, group, world, REFERENCE_TEXT),
    }
    for label, params in (("cublas_each", dict(gemm="cublas", groups=[1] * 16)),
                          ("tri_tma_128x256", dict(gemm="triton", block_m=128,
                                                   block_n=256, block_k=64, group_m=8,
                                                   stages=3, warps=8))):
        text = plan_text("all_gather_matmul", world, rows, k, n, **params)
        ag[f"ditron/{label}"] = (lambda t: lambda: ditron.all_gather_matmul(
            a_shard, [w_ag], [None], 0, group, world, t))(text)
    yield "all_gather_matmul", f"M={rows} K={k} N={n}", ag

    # matmul + reduce-scatter
    a_rs = torch.randn(rows, k, **bf16)
    w_rs = torch.randn(k, n, **bf16) / k ** 0.5
    rs_text = plan_text("matmul_reduce_scatter", world, rows, k, n, gemm="cublas",
                        reduce="triton")
    rs = {
        "nccl_cublas": lambda: c10d.wait_tensor(
            c10d.reduce_scatter_tensor(torch.mm(a_rs, w_rs), "sum", world, group)),
        "torch_fused": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
            a_rs, w_rs, "sum", scatter_dim=0, group_name=group),
        "reference": lambda: ditron.matmul_reduce_scatter(
            [a_rs], [w_rs], None, [], 0, "sum", group, world, REFERENCE_TEXT),
        "ditron/cublas_triton_reduce": lambda: ditron.matmul_reduce_scatter(
            [a_rs], [w_rs], None, [], 0, "sum", group, world, rs_text),
    }
    yield "matmul_reduce_scatter", f"M={rows} K={k} N={n}", rs

    # matmul + all-reduce (+ residual + RMSNorm), decode and prefill sizes: each M with the plans
    # the scheduler picks there on 2-4 ranks (lamport) and on more (push)
    overlap = dict(algo="push", overlap=True, gemm="triton", chunks=16, progs=16, block=16384,
                   warps=32)
    copy_engine = [dict(algo="copy_engine", chunks=c) for c in (2, 4)]  # eager prefill, 2 ranks
    for m, plans in ((8, (dict(algo="push_all"), dict(algo="lamport_all"))),
                     (128, (dict(algo="push"), dict(algo="lamport"))),
                     (2048, (overlap, *copy_engine))):
        a_ar = torch.randn(m, k, **bf16)
        w_ar = torch.randn(k, n, **bf16) / k ** 0.5
        residual = torch.randn(m, n, **bf16)
        norm_w = torch.randn(n, **bf16)
        texts = {f"ditron/{p['algo']}{'_overlap' if p.get('overlap') else ''}"
                 f"{'_c%d' % p['chunks'] if p['algo'] == 'copy_engine' else ''}":
                 plan_text("matmul_all_reduce", world, m, k, n, **p) for p in plans}

        def nccl_norm(a=a_ar, w=w_ar, res=residual, nw=norm_w):
            h = c10d.wait_tensor(c10d.all_reduce(torch.mm(a, w), "sum", group)) + res
            h32 = h.float()
            return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype) * nw

        ar = {
            "nccl_cublas": (lambda a=a_ar, w=w_ar: c10d.wait_tensor(
                c10d.all_reduce(torch.mm(a, w), "sum", group))),
            "reference": (lambda a=a_ar, w=w_ar: ditron.matmul_all_reduce(
                [a], [w], None, [], "sum", group, world, REFERENCE_TEXT)),
        }
        arn = {
            "nccl_cublas": nccl_norm,
            "reference": (lambda a=a_ar, w=w_ar, res=residual, nw=norm_w:
                          ditron.matmul_all_reduce_rmsnorm(
                              a, w, None, [], res, nw, 1e-5, False, "sum", group, world,
                              REFERENCE_TEXT)),
        }
        for label, text in texts.items():
            ar[label] = (lambda a=a_ar, w=w_ar, t=text: ditron.matmul_all_reduce(
                [a], [w], None, [], "sum", group, world, t))
            arn[label] = (lambda a=a_ar, w=w_ar, res=residual, nw=norm_w, t=text:
                          ditron.matmul_all_reduce_rmsnorm(
                              a, w, None, [], res, nw, 1e-5, False, "sum", group, world, t))
        yield "matmul_all_reduce", f"M={m} K={k} N={n}", ar
        yield "matmul_all_reduce_rmsnorm", f"M={m} K={k} N={n}", arn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="timed calls per contender")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds they are cut into")
    parser.add_argument("--profile", default="",
                        help="cProfile these contenders (comma-separated, e.g. ditron/push)")
    parser.add_argument("--json", default="", help="write the rows here")
    parser.add_argument("--label", default="", help="a name for this code version in the table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host_time.py times the fused CUDA ops: it needs CUDA GPUs "
                 "(torchrun --nproc-per-node W benchmarks/bench_host_time.py)")

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group)
    except Exception:  # noqa: BLE001 - deprecated or absent: PyTorch's fused ops then fail alone
        pass
    fallbacks = FallbackCounter()
    logging.getLogger(LOGGER_NAME).addHandler(fallbacks)
    logging.getLogger(LOGGER_NAME).setLevel(logging.INFO)

    # Every contender in turn, `--rounds` times, so that drift of the host (clocks, other
    # processes) spreads over all of them alike; the median over all their calls.
    entries = [(op, shape, name, fn)
               for op, shape, contenders in cases(world, group, torch.device("cuda", local_rank))
               for name, fn in contenders.items()]
    samples: dict[int, list[float]] = {i: [] for i in range(len(entries))}
    fell_back: dict[int, bool] = {}
    for i, (op, shape, name, fn) in enumerate(entries):  # warm-up: compiles, contexts
        before = fallbacks.count
        try:
            host_samples(fn, 5)
        except Exception as e:  # noqa: BLE001 - a contender that fails is reported
            samples[i] = None
            if rank == 0:
                print(f"{op} {shape} {name}: FAILED {type(e).__name__}: {str(e)[:200]}")
        fell_back[i] = fallbacks.count > before
    for _ in range(args.rounds):
        for i, (_, _, _, fn) in enumerate(entries):
            if samples[i] is not None:
                samples[i] += host_samples(fn, max(1, args.calls // args.rounds))
    rows = []
    for i, (op, shape, name, fn) in enumerate(entries):
        us = statistics.median(samples[i]) * 1e6 if samples[i] else float("nan")
        rows.append(dict(op=op, shape=shape, contender=name, host_us=max_over_ranks(us),
                         fell_back=fell_back[i]))
        if name in args.profile.split(","):  # every rank calls it (a collective), 0 prints
            prof = cProfile.Profile()
            prof.enable()
            host_samples(fn, args.calls)
            prof.disable()
            if rank != 0:
                continue
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(30)
            print(f"--- cProfile of {op} {shape} {name}, {args.calls} calls ---")
            print(text.getvalue())
    if rank == 0:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        print(f"\nHost time per call, median us (max over ranks); world {world}, "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {stamp}"
              f"{', ' + args.label if args.label else ''}\n")
        print("| op | shape | contender | host us |")
        print("| --- | --- | --- | --- |")
        for r in rows:
            mark = " (fell back to reference)" if r["fell_back"] else ""
            print(f"| {r['op']} | {r['shape']} | {r['contender']} | {r['host_us']:.1f}{mark} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world=world, device=torch.cuda.get_device_name(),
                               torch=torch.__version__, date=stamp, label=args.label,
                               rows=rows), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
