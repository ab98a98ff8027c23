"""FP8 tensor parallelism on several ranks: ditron's fp8 ops (all_gather_scaled_mm,
scaled_mm_reduce_scatter) with the plans DITRON_PLAN=fused gives them, beside NCCL +
torch._scaled_mm and PyTorch's async TP fp8 ops (symm_mem.fused_all_gather_scaled_matmul,
fused_scaled_matmul_reduce_scatter), at the float8 sites of a Llama training step at TP = the
world size (benchmarks/llama_sites.py; lm_head stays bf16 in torchao's recipe and is left out):
what the scheduler needs to choose the fp8 plans per site (it chooses them only where the
float8 training step was measured end to end: policy.FP8_CHOSEN_WORLD).

    torchrun --nproc-per-node 2 benchmarks/bench_fp8_tp.py --out benchmarks/results/fp8_tp_h200x2
    torchrun --nproc-per-node 2 benchmarks/bench_fp8_tp.py --device cpu --tiny --out /tmp/fp8_tp

Operands as torchao's float8 training step has them: tensorwise scales, bf16 outputs; the
forward's gathers and scatters e4m3 with fast accumulation, the backward's output-gradient
gathers e5m2 without; the backward's input gradients of gate/up and q/k/v are sums of 2 and 3
_scaled_mm products (each term's own K) reduce-scattered as one op (async TP has no such op: "-").
Per site, on the same random inputs (two sets alternated):
  nccl        all-gather of the float8 shard (its bytes), then _scaled_mm per weight; or the
              _scaled_mm products summed, then the reduce-scatter of the bf16 result;
  async_tp    PyTorch's fused fp8 op (failures are reported, not fatal);
  ditron      the ditron op with its fused plan, its output checked against nccl's first and
              timed only where the fused path served the call (on CPU the reference runs).
Timing: bench_fused.bench_on (CUDA events after a sync of every rank, the median of --reps, the
maximum over ranks; the host's clock on CPU). Writes <out>.json ({meta, rows}) and <out>.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._symmetric_memory  # noqa: E402, F401 - defines async TP's fp8 ops

from benchmarks.bench_fp8_parity import (  # noqa: E402
    BF16,
    E4M3,
    operand_kind,
    rel_err,
    served_count,
)
from benchmarks.bench_fused import (  # noqa: E402
    bench_on,
    max_over_ranks,
    ranks_meta,
    write_tables,
)
from benchmarks.bench_moe import close_group, init_group  # noqa: E402
from benchmarks.llama_sites import sites  # noqa: E402
from ditron_inductor import ops  # noqa: E402, F401 - torch.ops.ditron.*
from ditron_inductor.scheduler.decide import plan_for  # noqa: E402
from ditron_inductor.scheduler.task import (  # noqa: E402
    ALL_GATHER_MATMUL,
    ALL_GATHER_SCALED_MM,
    SCALED_MM_REDUCE_SCATTER,
)

MAX_REL_ERR = 2e-2  # the same float8 products, in bf16, summed in another order


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/fp8_tp")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--model", default="8b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="the tiny model, few tokens (smoke run)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.model, args.tokens, args.iters, args.reps = "tiny", 64, 2, 2
    return args


def fp8_sites(model: str, world: int, tokens: int) -> list:
    """The training step's sites that torchao's float8 recipe runs in float8."""
    return [s for s in sites(model, world, "train", tokens) if "lm_head" not in s.name]


def random_fp8(gen, device, *shape, dtype=E4M3):
    return (torch.randn(*shape, generator=gen) * 4).to(device).to(dtype)


def random_scale(gen, device):
    """A tensorwise scale."""
    return (torch.rand((), generator=gen) + 0.5).to(device)


def gather_contenders(site, world: int, group_name: str, device, gen):
    """(inputs, {contender: fn}, ditron's plan) of an all-gather site: this rank's rows of A."""
    task = site.task
    a_dtype, fast = operand_kind(site)
    rows, k = task.m // world, task.k
    inputs = [(random_fp8(gen, device, rows, k, dtype=a_dtype), random_scale(gen, device),
               [random_fp8(gen, device, n, k).t() for n in task.ns],
               [random_scale(gen, device) for _ in task.ns]) for _ in range(2)]
    c10d = torch.ops._c10d_functional

    def nccl(a, s_a, ws, s_ws):
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(
            a.view(torch.uint8), world, group_name)).view(a.dtype)  # the float8 bytes
        return [torch._scaled_mm(gathered, w, s_a, s, out_dtype=BF16, use_fast_accum=fast)
                for w, s in zip(ws, s_ws)]

    def async_tp(a, s_a, ws, s_ws):
        return torch.ops.symm_mem.fused_all_gather_scaled_matmul(
            a, ws, s_a, s_ws, 0, group_name, [None] * len(ws), [None] * len(ws),
            [BF16] * len(ws), [fast] * len(ws))[1]

    plan = plan_for(fp8_task(task, ALL_GATHER_SCALED_MM, a_dtype, fast))

    def ditron(a, s_a, ws, s_ws):
        return torch.ops.ditron.all_gather_scaled_mm(a, s_a, ws, s_ws, [None] * len(ws), BF16,
                                                     fast, 0, group_name, world,
                                                     plan.encode())[1:]
    return inputs, {"nccl": nccl, "async_tp": async_tp, "ditron": ditron}, plan


def scatter_contenders(site, world: int, group_name: str, device, gen):
    """(inputs, {contender: fn}, ditron's plan) of a reduce-scatter site: A [M, K] and B
    [K, N] per term (the rank's K), the bf16 sum scattered by rows."""
    task = site.task
    a_dtype, fast = operand_kind(site)
    term_ks = site.term_ks or (task.k,)
    n = task.ns[0]
    inputs = [([random_fp8(gen, device, task.m, k, dtype=a_dtype) for k in term_ks],
               [random_fp8(gen, device, n, k).t() for k in term_ks],
               [random_scale(gen, device) for _ in term_ks],
               [random_scale(gen, device) for _ in term_ks]) for _ in range(2)]
    c10d = torch.ops._c10d_functional

    def products(a_s, b_s, s_as, s_bs):
        out = None
        for a, b, s_a, s_b in zip(a_s, b_s, s_as, s_bs):
            p = torch._scaled_mm(a, b, s_a, s_b, out_dtype=BF16, use_fast_accum=fast)
            out = p if out is None else out + p
        return out

    def nccl(*operands):
        return [c10d.wait_tensor(c10d.reduce_scatter_tensor(products(*operands), "sum", world,
                                                            group_name))]

    def async_tp(a_s, b_s, s_as, s_bs):
        if len(a_s) > 1:
            raise NotImplementedError("no async TP op for a sum of products")
        return [torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
            a_s[0], b_s[0], s_as[0], s_bs[0], "sum", 0, 0, group_name, [task.m, n], None, None,
            BF16, fast)]

    plan = plan_for(fp8_task(task, SCALED_MM_REDUCE_SCATTER, a_dtype, fast))

    def ditron(a_s, b_s, s_as, s_bs):
        return [torch.ops.ditron.scaled_mm_reduce_scatter(a_s, b_s, s_as, s_bs, None, BF16, fast,
                                                          [], 0, "sum", group_name, world,
                                                          plan.encode())]
    return inputs, {"nccl": nccl, "async_tp": async_tp, "ditron": ditron}, plan


def fp8_task(task, op: str, a_dtype, fast: bool):
    return dataclasses.replace(task, op=op, dtype=a_dtype, out_dtype=BF16, scales="tensorwise",
                               fast_accum=fast, dim=0)


def measure(site, world: int, group_name: str, args, gen) -> dict:
    gather = site.task.op == ALL_GATHER_MATMUL
    build = gather_contenders if gather else scatter_contenders
    inputs, fns, plan = build(site, world, group_name, torch.device(args.device), gen)
    op = ALL_GATHER_SCALED_MM if gather else SCALED_MM_REDUCE_SCATTER
    ref = fns["nccl"](*inputs[0])
    row = dict(site=site.name, M=site.task.m, K=site.task.k, N=list(site.task.ns),
               terms=len(site.term_ks) or 1, plan=plan.describe(), ms={}, rel_err={}, notes={})
    for name, fn in fns.items():
        if name == "async_tp" and args.device != "cuda":
            row["notes"][name] = "CUDA only"
            continue
        try:
            if name != "nccl":
                before = served_count(op)
                err = max_over_ranks(max(rel_err(o, r) for o, r in zip(fn(*inputs[0]), ref)))
                row["rel_err"][name] = err
                if err > MAX_REL_ERR:
                    row["notes"][name] = f"relative error {err:.2e}"
                    continue
                if name == "ditron" and not max_over_ranks(served_count(op) - before) > 0:
                    row["notes"][name] = "not served: the reference ran"
                    continue
            row["ms"][name] = bench_on(args.device, fn, inputs, args.iters, args.reps)
        except Exception as exc:  # noqa: BLE001 - a contender that fails is reported
            row["notes"][name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    if dist.get_rank() == 0:
        print(f"{site.name:28s} {row['ms']} {row['notes']}", flush=True)
    return row


def report(rows: list[dict], args, argv) -> None:
    meta = ranks_meta("bench_fp8_tp.py", argv, args.device, model=args.model,
                      tokens=args.tokens)
    world, device = meta["world"], meta["device"]
    head = ["site", "M", "K", "N", "NCCL + _scaled_mm ms", "async TP ms", "ditron ms",
            "ditron / NCCL", "ditron / async TP", "ditron plan", "notes"]
    lines = [f"# FP8 TP on {world} ranks ({device}): Llama-{args.model} training sites, "
             f"{args.tokens} tokens", "", f"- command: `{meta['command']}`",
             f"- torch {meta['torch']}, {meta['date']}", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        ms = r["ms"]

        def cell(name):
            return f"{ms[name]:.3f}" if name in ms else "-"

        def ratio(other):
            if "ditron" in ms and other in ms:
                return f"{ms['ditron'] / ms[other]:.2f}"
            return "-"
        notes = "; ".join(f"{k}: {v}" for k, v in r["notes"].items())
        lines.append("| " + " | ".join([r["site"], str(r["M"]), str(r["K"]),
                                        ",".join(map(str, r["N"])), cell("nccl"),
                                        cell("async_tp"), cell("ditron"), ratio("nccl"),
                                        ratio("async_tp"), r["plan"], notes or "-"]) + " |")
    write_tables(args.out, meta, rows, lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    init_group(args.device, launched=True)
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(2000 + dist.get_rank())
    rows = [measure(site, world, dist.group.WORLD.group_name, args, gen)
            for site in fp8_sites(args.model, world, args.tokens)]
    if dist.get_rank() == 0:
        report(rows, args, argv)
    close_group(args.device)


if __name__ == "__main__":
    main()
