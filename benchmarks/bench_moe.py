"""MoE compute parity at world size 1: the fused MoE ops' grouped GEMM beside torch._grouped_mm
and a per-expert cuBLAS loop, at the expert layers of Mixtral-8x7B, Qwen3-30B-A3B and
DeepSeek-V3 (its routed experts as one rank of EP 8 holds them).

    torchrun --nproc-per-node 1 benchmarks/bench_moe.py --out benchmarks/results/moe_h100x1
    python benchmarks/bench_moe.py --device cpu --tiny --out /tmp/moe      # smoke run

At world size 1 the all-to-alls are the identity over ranks, leaving the experts' compute,
which a fused kernel must not make slower (at most ~2% over the unfused path):
  gate+up  (all_to_all_grouped_mm) rows = x[row_index] (the received rows, expert-major), then
           rows @ W_gate and rows @ W_up per expert [E, hidden, inter];
  down     (grouped_mm_all_to_all) y = h @ W_down per expert [E, inter, hidden], row j of y
           added into row token[j] of zeros [tokens, hidden] (each token sums its top-k rows).
Contenders, in the same run on the same inputs:
  grouped_mm  x[row_index] / index_put_(accumulate) around torch._grouped_mm (the ops'
              reference beside its collectives: what an EP layer runs without ditron);
  loop        the same around one cuBLAS mm per expert (the split sizes read on the host
              before the timed calls, as a layer that reads them back has them);
  fused:<tile> torch.ops.ditron.<op> with a GroupedMmPlan of that tile, decoded from the plan
              text as a compiled graph carries it; its output checked against grouped_mm first
              (relative error) and counted only where the fused path served the call.
Rows per rank: tokens x top-k (balanced expert parallelism: each rank receives as many rows as
it sends), routed uniformly at random (top-k distinct local experts per token).

Timing: bench_compute_parity.timed (two input sets alternated, warm-up, CUDA events around
--iters calls queued while the device spins, the median of --reps); a contender whose host
cannot queue its calls within the spin (the per-expert loop over 128 experts) is timed with
events around host and device together and marked host-bound. Writes <out>.json ({meta, rows})
and <out>.md.

World size 1 only; benchmarks/bench_moe_ep.py times several ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_compute_parity import rel_err, timed  # noqa: E402
from ditron_inductor import ops  # noqa: E402, F401 - torch.ops.ditron.*
from ditron_inductor.scheduler.decide import plan_for  # noqa: E402
from ditron_inductor.scheduler.task import (  # noqa: E402
    ALL_TO_ALL_GROUPED_MM,
    GROUPED_MM_ALL_TO_ALL,
    Task,
)


@dataclasses.dataclass(frozen=True)
class MoeLayer:
    name: str
    experts: int  # this rank's
    hidden: int
    inter: int  # the experts' intermediate size
    top_k: int
    note: str = ""


LAYERS = {
    "mixtral": MoeLayer("Mixtral-8x7B", 8, 4096, 14336, 2),
    "qwen3": MoeLayer("Qwen3-30B-A3B", 128, 2048, 768, 8),
    "deepseek": MoeLayer("DeepSeek-V3", 32, 7168, 2048, 8, "256 routed experts, EP 8 slice"),
    "tiny": MoeLayer("tiny", 4, 32, 48, 2),
}
# label -> GroupedMmPlan parameters (scheduler/plan.py); rows and weights through pointers
# unless the label says _tma (both through TMA descriptors) or _tma_b (the weights only)
_POINTERS = dict(tma_a=False, tma_b=False)
PLANS = {
    "128x128": dict(block_m=128, block_n=128, block_k=64, stages=3, warps=8, **_POINTERS),
    "128x256": dict(block_m=128, block_n=256, block_k=64, stages=3, warps=8, **_POINTERS),
    "64x128": dict(block_m=64, block_n=128, block_k=64, stages=4, warps=4, **_POINTERS),
    "128x128_tma": dict(block_m=128, block_n=128, block_k=64, stages=3, warps=8, tma_a=False,
                        tma_b=True),
    "128x256_tma_b": dict(block_m=128, block_n=256, block_k=64, stages=3, warps=8, tma_a=False,
                          tma_b=True),
    # GroupedMmPlan's defaults
    "default": {},
    # on several ranks: the dispatch's GEMMs always in Triton tiles that wait for their rows,
    # or always in torch._grouped_mm once every row landed
    "triton_dispatch": dict(library_rows=0, library_below_rows=0),
    "torch_dispatch": dict(dispatch_gemm="torch"),
    # the combine's GEMM in torch._grouped_mm (the put sends its rows by the send index),
    # beside the Triton dispatch or the library dispatch's rule
    "torch_combine": dict(library_rows=0, library_below_rows=0, combine_gemm="torch"),
    "torch_both": dict(dispatch_gemm="torch", combine_gemm="torch"),
    # the default tile at world size 1 (the dispatch gathers the rows first)
    "128x256_tma": dict(block_m=128, block_n=256, block_k=64, stages=3, warps=8, tma_b=True,
                        tma_a=True),
    "128x256_tma_s4": dict(block_m=128, block_n=256, block_k=64, stages=4, warps=8, tma_b=True,
                           tma_a=True),
    # half the rows a tile: less of a tile past an expert's last row where experts get few rows
    "64x256_tma": dict(block_m=64, block_n=256, block_k=64, stages=4, warps=4, tma_b=True,
                       tma_a=True),
    # the same tile for the combine, the dispatch's GEMMs in torch._grouped_mm
    "64x256_tma_torch_dispatch": dict(block_m=64, block_n=256, block_k=64, stages=4, warps=4,
                                      tma_b=True, tma_a=True, dispatch_gemm="torch"),
    "64x128_tma": dict(block_m=64, block_n=128, block_k=64, stages=4, warps=4, tma_b=True,
                       tma_a=True),
    "64x256_tma_w8": dict(block_m=64, block_n=256, block_k=64, stages=4, warps=8, tma_b=True,
                          tma_a=True),
    "128x128_tma_s4": dict(block_m=128, block_n=128, block_k=64, stages=4, warps=8, tma_b=True,
                           tma_a=True),
}
TINY_PLANS = {"16x32": dict(block_m=16, block_n=32, block_k=32, stages=2, warps=4)}
STAGES = ("gate+up", "down")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/moe")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="the tiny layer only (a smoke run)")
    ap.add_argument("--models", default="mixtral,qwen3,deepseek")
    ap.add_argument("--tokens", default="128,512,2048,8192,16384", help="tokens per rank")
    ap.add_argument("--plans", default="default,128x128",
                    help="fused tiles (PLANS labels; 'default': the plan's default tile)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.tiny:
        args.models, args.tokens, args.iters, args.reps = "tiny", "16,37", 2, 2
        args.plans = ",".join(TINY_PLANS)
    return args


def plan_text(op: str, layer: MoeLayer, label: str, dtype, world: int = 1) -> str:
    task = Task(op=op, group_name="", world_size=world, m=0, k=layer.hidden, ns=(layer.inter,),
                dtype=dtype, device_type="cuda", experts=layer.experts)
    return plan_for(task, label=label, **{**PLANS, **TINY_PLANS}[label]).encode()


def routed_inputs(layer: MoeLayer, tokens: int, device, dtype, gen):
    """One input set: x [tokens, hidden], each token's top-k distinct local experts, the pairs
    sorted by expert (row_index: the x row of each; token_of: its token, the combine's index),
    offsets, counts on the host, and the down projection's input h [rows, inter]."""
    scores = torch.rand(tokens, layer.experts, generator=gen, device="cpu")
    chosen = scores.topk(layer.top_k, dim=1).indices.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    counts = torch.bincount(chosen, minlength=layer.experts)
    rows = tokens * layer.top_k
    return dict(
        x=torch.randn(tokens, layer.hidden, device=device, dtype=dtype),
        row_index=(order // layer.top_k).to(device),
        offsets=torch.cumsum(counts, 0).to(torch.int32).to(device),
        counts=counts.tolist(),
        h=torch.randn(rows, layer.inter, device=device, dtype=dtype),
        tokens=tokens)


def layer_weights(layer: MoeLayer, device, dtype):
    """gate, up [E, inter, hidden] and down [E, hidden, inter] (nn.Linear's layout), as the
    layer passes them: transposed views [E, K, N]."""
    def w(n, k):
        return (torch.randn(layer.experts, n, k, device=device, dtype=dtype) / k ** 0.5)
    return [w(layer.inter, layer.hidden).transpose(-2, -1),
            w(layer.inter, layer.hidden).transpose(-2, -1),
            w(layer.hidden, layer.inter).transpose(-2, -1)]


def contenders(stage: str, weights, group_name: str):
    """{label: fn(inputs) -> output} of the stage's unfused forms, and fused(plan text) -> fn."""
    gate, up, down = weights
    ditron = torch.ops.ditron
    if stage == "gate+up":
        def grouped_mm(i):
            rows = i["x"][i["row_index"]]
            return [torch._grouped_mm(rows, w, offs=i["offsets"]) for w in (gate, up)]

        def loop(i):
            pieces = i["x"][i["row_index"]].split(i["counts"])
            return [torch.cat([p @ w[e] for e, p in enumerate(pieces)]) for w in (gate, up)]

        def fused(text):
            def call(i):
                t = i["tokens"]
                return ditron.all_to_all_grouped_mm(i["x"], [t], [t], i["row_index"],
                                                    [gate, up], i["offsets"], group_name, 1,
                                                    text)[1:]
            return call
    else:
        def grouped_mm(i):
            y = torch._grouped_mm(i["h"], down, offs=i["offsets"])
            return [y.new_zeros(i["tokens"], y.shape[1]).index_put_((i["row_index"],), y,
                                                                    accumulate=True)]

        def loop(i):
            pieces = i["h"].split(i["counts"])
            y = torch.cat([p @ down[e] for e, p in enumerate(pieces)])
            return [y.new_zeros(i["tokens"], y.shape[1]).index_put_((i["row_index"],), y,
                                                                    accumulate=True)]

        def fused(text):
            def call(i):
                t = i["tokens"]
                return [ditron.grouped_mm_all_to_all([i["h"]], [down], i["offsets"],
                                                     i["row_index"], True, [t], [t],
                                                     group_name, 1, text)]
            return call
    return {"grouped_mm": grouped_mm, "loop": loop}, fused


def served_count() -> int:
    runtime = sys.modules.get("ditron_inductor.runtime.moe")
    return sum(runtime.stats.values()) if runtime is not None else 0


def time_one(fn, inputs, args) -> tuple[float, str]:
    """(median ms per call, "" or "host-bound")."""
    try:
        return timed(lambda i: fn(i), [(i,) for i in inputs], args.device, args.iters,
                     args.reps)[0], ""
    except RuntimeError as exc:
        if "host-bound" not in str(exc):
            raise
    times = []
    for _ in range(args.reps):
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for it in range(args.iters):
            fn(inputs[it % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / args.iters)
    return statistics.median(times), "host-bound"


def flat(out) -> torch.Tensor:
    return torch.cat([o.flatten() for o in out])


def run(args, group_name: str) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    labels = [p for p in args.plans.split(",") if p]
    rows, t0 = [], time.time()
    for model in args.models.split(","):
        layer = LAYERS[model]
        weights = layer_weights(layer, args.device, dtype)
        for tokens in [int(t) for t in args.tokens.split(",") if t]:
            gen = torch.Generator().manual_seed(tokens)
            inputs = [routed_inputs(layer, tokens, args.device, dtype, gen) for _ in range(2)]
            for stage in STAGES:
                op = ALL_TO_ALL_GROUPED_MM if stage == "gate+up" else GROUPED_MM_ALL_TO_ALL
                unfused, fused = contenders(stage, weights, group_name)
                ref = flat(unfused["grouped_mm"](inputs[0]))
                base = {}
                for label, fn in unfused.items():
                    err = rel_err(flat(fn(inputs[0])), ref) if label != "grouped_mm" else 0.0
                    ms, note = time_one(fn, inputs, args)
                    base[label] = (ms, note, err)
                for label in labels:
                    text = plan_text(op, layer, label, dtype)
                    fn = fused(text)
                    row = dict(model=layer.name, experts=layer.experts, hidden=layer.hidden,
                               inter=layer.inter, top_k=layer.top_k, tokens=tokens,
                               rows=tokens * layer.top_k, stage=stage, op=op, plan=label,
                               plan_text=text, grouped_mm_ms=base["grouped_mm"][0],
                               loop_ms=base["loop"][0], loop_note=base["loop"][1],
                               loop_rel_err=base["loop"][2], fused_ms=math.nan, served=False,
                               rel_err=math.nan, error="")
                    try:
                        before = served_count()
                        row["rel_err"] = rel_err(flat(fn(inputs[0])), ref)
                        row["served"] = served_count() > before
                        if not row["rel_err"] < 2e-2:
                            raise RuntimeError(f"relative error {row['rel_err']:.2e} against "
                                               "torch._grouped_mm")
                        if row["served"]:
                            row["fused_ms"] = time_one(fn, inputs, args)[0]
                    except Exception as exc:  # noqa: BLE001 - reported in the row
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    row["vs_grouped_mm"] = row["fused_ms"] / row["grouped_mm_ms"]
                    row["vs_loop"] = row["fused_ms"] / row["loop_ms"]
                    rows.append(row)
                    if args.verbose:
                        print(f"  {row}", flush=True)
                best = min((r for r in rows[-len(labels):]), key=lambda r: (
                    r["fused_ms"] if math.isfinite(r["fused_ms"]) else math.inf))
                print(f"{layer.name} tokens={tokens} {stage}: grouped_mm "
                      f"{base['grouped_mm'][0]:.3f} ms, loop {base['loop'][0]:.3f} ms"
                      f"{' (host-bound)' if base['loop'][1] else ''}, best fused {best['plan']} "
                      f"{best['fused_ms']:.3f} ms {best['error'][:80]}"
                      f" ({time.time() - t0:.0f} s)", flush=True)
                with open(args.out + ".partial.json", "w") as fh:
                    json.dump(rows, fh)
    return rows


def _ms(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "-"


def table(rows: list[dict]) -> str:
    lines = ["| model | experts | hidden | inter | top-k | tokens | rows | stage | grouped_mm ms "
             "| loop ms | fused plan | fused ms | fused / grouped_mm | fused / loop | rel err |",
             "| --- " * 15 + "|"]
    for r in rows:
        note = r["error"][:50] or ("reference path" if not r["served"] else "")
        vs = _ms(r["vs_grouped_mm"]) if not note else note
        loop = _ms(r["loop_ms"]) + (" (host-bound)" if r["loop_note"] else "")
        lines.append(
            f"| {r['model']} | {r['experts']} | {r['hidden']} | {r['inter']} | {r['top_k']} "
            f"| {r['tokens']} | {r['rows']} | {r['stage']} | {_ms(r['grouped_mm_ms'])} | {loop} "
            f"| {r['plan']} | {_ms(r['fused_ms'])} | {vs} "
            f"| {_ms(r['vs_loop'])} | {r['rel_err']:.1e} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    lines = []
    for label in sorted({r["plan"] for r in rows}):
        ratios = [r["vs_grouped_mm"] for r in rows
                  if r["plan"] == label and math.isfinite(r["vs_grouped_mm"])]
        if ratios:
            g = math.exp(sum(map(math.log, ratios)) / len(ratios))
            lines.append(f"- fused {label}: geometric mean of fused / grouped_mm {g:.3f} over "
                         f"{len(ratios)} rows, {sum(x <= 1.02 for x in ratios)} within 1.02")
    best = {}
    for r in rows:
        if math.isfinite(r["vs_grouped_mm"]):
            key = (r["model"], r["tokens"], r["stage"])
            best[key] = min(best.get(key, math.inf), r["vs_grouped_mm"])
    if best:
        g = math.exp(sum(map(math.log, best.values())) / len(best))
        lines.append(f"- best fused tile per row: geometric mean {g:.3f} over {len(best)} rows, "
                     f"{sum(x <= 1.02 for x in best.values())} within 1.02 of torch._grouped_mm")
    return "\n".join(lines) or "- no fused row (no fused path on this device)"


def report(rows: list[dict], args, argv: list[str]) -> None:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    meta = {"command": "torchrun --nproc-per-node 1 benchmarks/bench_moe.py " + " ".join(argv),
            "device": device, "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    text = "\n".join([
        f"# MoE compute parity at world size 1 ({device})", "",
        f"- command: `{meta['command']}`",
        f"- {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, {args.dtype}", "",
        "The experts' compute of the MoE ops at world size 1 (the all-to-alls are the identity): "
        "gate+up = x[row_index] and two grouped GEMMs (all_to_all_grouped_mm), down = a grouped "
        "GEMM and the rows summed back into their tokens (grouped_mm_all_to_all, accumulate). "
        "Rows = tokens x top-k, routed uniformly at random; median ms per call; fused: the "
        "Triton grouped GEMM of templates/grouped_gemm.py with the tile named.", "",
        summary(rows), "", table(rows), ""])
    with open(args.out + ".md", "w") as fh:
        fh.write(text)
    with open(args.out + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(text, flush=True)


def init_group(device: str, launched: bool) -> None:
    """NCCL on this rank's GPU (torchrun's LOCAL_RANK); gloo on CPU, over torchrun's ranks
    (launched) or as a single rank of its own."""
    if device == "cuda":
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    elif launched:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def close_group(device: str) -> None:
    """ditron's runtime (symmetric memory) first, then the group."""
    if device == "cuda":
        from ditron_inductor import runtime

        runtime.shutdown()
    dist.destroy_process_group()


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    init_group(args.device, launched=False)
    if dist.get_world_size() != 1:
        raise SystemExit("bench_moe runs at world size 1 (torchrun --nproc-per-node 1); on "
                         "several ranks: benchmarks/bench_moe_ep.py")
    torch.manual_seed(0)
    rows = run(args, dist.group.WORLD.group_name)
    report(rows, args, argv)
    close_group(args.device)


if __name__ == "__main__":
    main()
