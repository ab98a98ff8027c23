"""The persistent Triton GEMM's tile programs at the sites where a chosen plan runs it, beside cuBLAS,
on one GPU: would a tile chosen per shape close its gap to cuBLAS?

    python benchmarks/bench_gemm_tiles.py --out benchmarks/results/<name>
    python benchmarks/bench_gemm_tiles.py --device cpu --tiny        # smoke run (interpreter)

Rows: the all-gather sites of the Llama-3-8B and -70B training step (benchmarks/llama_sites.py,
8192 tokens) at TP 2, 4 and 8 whose chosen plan is the persistent Triton GEMM
(runtime/launch.triton_gemm, templates/ag_gemm.py), at the gathered shape, without its chunk
waits; B as the model holds it (a forward site multiplies by the Linear weight's transpose, an
output-gradient gather by the weight). Columns: cuBLAS (`mm` per weight), then each tile of
TILES (ms for all the site's weights). Timing: CUDA events around --iters calls after a
warm-up, the median of --reps, the contenders in turn in each repetition.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_compute_parity import rel_err  # noqa: E402
from benchmarks.bench_rank_local_work import site_arguments, site_plans, timed  # noqa: E402
from ditron_inductor.runtime.launch import triton_gemm  # noqa: E402
from ditron_inductor.scheduler.plan import TRITON, GemmTile  # noqa: E402
from ditron_inductor.scheduler.task import ALL_GATHER_MATMUL  # noqa: E402

# label -> tile: the plans' tile first, then what a per-shape choice could take
TILES = {
    "128x256x64_s3_w8_g8": GemmTile(),
    "128x256x64_s3_w8_g4": GemmTile(group_m=4),
    "128x256x64_s3_w8_g16": GemmTile(group_m=16),
    "128x256x32_s5_w8_g8": GemmTile(block_k=32, stages=5),
    "128x128x64_s4_w8_g8": GemmTile(block_n=128, stages=4),
    "128x128x64_s5_w4_g8": GemmTile(block_n=128, stages=5, warps=4),
    "256x128x64_s3_w8_g8": GemmTile(block_m=256, block_n=128),
    "128x128x128_s3_w8_g8": GemmTile(block_n=128, block_k=128),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiles", default=",".join(TILES), help="comma-separated labels of TILES")
    return site_arguments(p, tp="2,4,8", models="8b,70b").parse_args(argv)


def triton_sites(args):
    """(model, TP, site) of every all-gather site whose chosen plan runs the Triton GEMM."""
    for model, world, site, plan, _ in site_plans(args):
        if site.task.op == ALL_GATHER_MATMUL and plan is not None and plan.gemm == TRITON:
            yield model, world, site


def run(args) -> list[dict]:
    rows = []
    # (the Triton interpreter computes tl.dot on bf16 wrongly: fp16 on CPU)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float16
    for model, world, site in triton_sites(args):
        t = site.task
        a = torch.randn(t.m, t.k, device=args.device, dtype=dtype)
        ws = site.weights(args.device, dtype)
        outs = [torch.empty(t.m, w.shape[1], device=args.device, dtype=dtype) for w in ws]
        ref = [a @ w for w in ws]

        progs = None if args.device == "cuda" else 4  # (the interpreter: a few programs)

        def tile_fn(tile):
            def fn():
                for w, out in zip(ws, outs):
                    triton_gemm(a, w, None, out, tile, num_progs=progs)
            return fn

        fns = {"cublas": lambda: [torch.mm(a, w, out=o) for w, o in zip(ws, outs)]}
        for label in args.tiles.split(","):
            tile = TILES[label]
            tile_fn(tile)()  # compile (a tile that cannot is reported, not timed)
            err = max(rel_err(o, r) for o, r in zip(outs, ref))
            if not err < 2e-2:
                raise SystemExit(f"{site.name} tile {label}: relative error {err:.3g}")
            fns[label] = tile_fn(tile)
        ms = timed(fns, args.device, args.iters, args.reps)
        row = dict(model=model, tp=world, site=site.name, M=t.m, K=t.k, N=list(t.ns),
                   b_transposed=site.weights_transposed, ms=ms)
        rows.append(row)
        print(row_line(row, list(fns)), flush=True)
    return rows


def row_line(row: dict, labels: list[str]) -> str:
    ms = row["ms"]
    triton = {k: v for k, v in ms.items() if k != "cublas"}
    best = min(triton, key=triton.get)
    default = next(iter(TILES))
    cells = [row["model"], str(row["tp"]), row["site"], str(row["M"]), str(row["K"]),
             ",".join(map(str, row["N"])), "t" if row["b_transposed"] else "n",
             *[f"{ms[k]:.3f}" for k in labels],
             f"{ms[default] / ms['cublas']:.3f}" if default in ms else "-",
             best, f"{ms[best] / ms['cublas']:.3f}"]
    return "| " + " | ".join(cells) + " |"


def report(rows: list[dict], argv) -> str:
    labels = list(rows[0]["ms"]) if rows else []
    head = ["model", "TP", "site", "M", "K", "N", "B", *labels, "plan's tile / cuBLAS", "best tile",
            "best / cuBLAS"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [f"# The persistent Triton GEMM's tiles beside cuBLAS ({device})", "",
             f"- command: `python benchmarks/bench_gemm_tiles.py {' '.join(argv)}`",
             f"- {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch "
             f"{torch.__version__}", "", "ms per call (all the site's weights); B: `t` the Linear "
             "weight's transpose, `n` the weight as it is", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += [row_line(r, labels) for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows = run(args)
    text = report(rows, argv)
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"argv": argv, "tiles": {k: dataclasses.asdict(v) for k, v in TILES.items()},
                       "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
