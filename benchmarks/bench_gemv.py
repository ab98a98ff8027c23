"""Decode GEMMs on one GPU: the decode GEMM template (templates/gemv.py) beside cuBLAS.

At each linear layer of a Llama decode step (per-rank shapes at a TP degree) and a few batch
rows: `a @ W.t()` by cuBLAS (torch.mm, what Inductor calls) and by the template at each launch
config, under CUDA graphs (how decode steps are served). The weights rotate over enough copies
that they come from HBM, not L2, as in a model whose layers each have their own. Printed: ms per
call, the weight bytes per second it reaches, and the best config per shape.

    torchrun --nproc-per-node 1 benchmarks/bench_gemv.py --out benchmarks/results/gemv_h200x1
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_fused import bench_graph, write_tables  # noqa: E402
from benchmarks.bench_moe import close_group, init_group  # noqa: E402
from benchmarks.llama_sites import MODELS  # noqa: E402
from ditron_inductor.runtime.gemv import GemvConfig, config_fits, decode_mm  # noqa: E402
from ditron_inductor.scheduler.decode_gemm import gemv_applies  # noqa: E402

def layer_shapes(model: str, tp: int) -> list[tuple[str, int, int]]:
    """(linear, K, N) of one rank at TP degree tp (column-parallel N, row-parallel K split)."""
    m = MODELS[model]
    h = m.hidden
    return [("q", h, m.heads * m.head_dim // tp), ("k/v", h, m.kv_heads * m.head_dim // tp),
            ("o", m.heads * m.head_dim // tp, h), ("gate/up", h, m.intermediate // tp),
            ("down", m.intermediate // tp, h), ("lm_head", h, m.vocab // tp)]


def configs(spec: str) -> list[GemvConfig]:
    if spec == "default":
        return [GemvConfig()]
    ns, ks, ws = ([int(x) for x in part.split(",")] for part in spec.split(":"))
    return [GemvConfig(n, k, w) for n, k, w in itertools.product(ns, ks, ws)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="8b")
    p.add_argument("--tp", default="1,2")
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--configs", default="8,16,32:256,512,1024:4,8",
                   help="BLOCK_N list:BLOCK_K list:num_warps list, or 'default'")
    p.add_argument("--rotate-mb", type=int, default=512, help="weight copies' total size")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="")
    args = p.parse_args()
    init_group("cuda", "RANK" in os.environ)
    dtype = getattr(torch, args.dtype)
    cands = configs(args.configs)
    rows_out = []
    for model, tp, (name, K, N) in ((m, int(t), s) for m in args.models.split(",")
                                    for t in args.tp.split(",")
                                    for s in layer_shapes(m, int(t))):
        weight_bytes = K * N * dtype.itemsize
        copies = max(1, min(64, args.rotate_mb * 2 ** 20 // weight_bytes))
        ws = [torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5 for _ in range(copies)]
        for M in (int(r) for r in args.rows.split(",")):
            a = torch.randn(M, K, device="cuda", dtype=dtype)
            inputs = [(a, w.t()) for w in ws]
            assert gemv_applies(a, ws[0].t()) is None
            cublas = bench_graph(torch.mm, inputs, args.iters, args.reps)
            ref = torch.mm(a.float(), ws[0].t().float())
            timed = []
            for cfg in (c for c in cands if config_fits(c, M)):
                out = decode_mm(a, ws[0].t(), cfg)
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                ms = bench_graph(lambda x, b, cfg=cfg: decode_mm(x, b, cfg), inputs, args.iters,
                                 args.reps)
                timed.append((ms, cfg, err))
            best_ms, best, best_err = min(timed, key=lambda t: t[0])
            row = dict(model=model, tp=tp, linear=name, M=M, K=K, N=N,
                       weight_mb=weight_bytes / 2 ** 20, cublas_ms=cublas, gemv_ms=best_ms,
                       ratio=best_ms / cublas, best=best.__dict__, rel_err=best_err,
                       cublas_tb_s=weight_bytes / cublas / 1e9,
                       gemv_tb_s=weight_bytes / best_ms / 1e9,
                       configs=[dict(ms=ms, err=e, **c.__dict__) for ms, c, e in timed])
            rows_out.append(row)
            print(f"{model} TP {tp} {name:8s} M {M:2d} K {K:5d} N {N:6d}: cuBLAS {cublas:.4f} ms "
                  f"({row['cublas_tb_s']:.2f} TB/s), gemv {best_ms:.4f} ms "
                  f"({row['gemv_tb_s']:.2f} TB/s) {best} ratio {row['ratio']:.3f} "
                  f"err {best_err:.1e}", flush=True)
        del ws
    meta = dict(command="torchrun --nproc-per-node 1 benchmarks/bench_gemv.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
                device=torch.cuda.get_device_name(), torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"))
    lines = [f"# Decode GEMM vs cuBLAS ({meta['device']})", "",
             f"- command: `{meta['command']}`", f"- {meta['date']}; torch {meta['torch']}; CUDA "
             "graphs, weights rotating over copies (from HBM); ratio = gemv / cuBLAS", "",
             "| model | TP | linear | M | K | N | cuBLAS ms | TB/s | gemv ms | TB/s | ratio | "
             "best config | rel err |", "| --- " * 13 + "|"]
    for r in rows_out:
        b = r["best"]
        lines.append(f"| {r['model']} | {r['tp']} | {r['linear']} | {r['M']} | {r['K']} | "
                     f"{r['N']} | {r['cublas_ms']:.4f} | {r['cublas_tb_s']:.2f} | "
                     f"{r['gemv_ms']:.4f} | {r['gemv_tb_s']:.2f} | {r['ratio']:.3f} | "
                     f"{b['block_n']}x{b['block_k']} w{b['num_warps']} | {r['rel_err']:.1e} |")
    if args.out:
        write_tables(args.out, meta, rows_out, lines)
    else:
        print("\n".join(lines))
    close_group("cuda")


if __name__ == "__main__":
    main()
