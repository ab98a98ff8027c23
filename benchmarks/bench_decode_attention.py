"""Decode attention on one GPU: the decode attention template (templates/decode_attention.py) beside
SDPA as Inductor runs a Hugging Face decode step.

Per batch size, at Llama's per-rank decode shapes (query heads and key/value heads at a TP
degree, head size 128, a static cache of `--keys` keys with a decode step's mask): SDPA on the
repeated keys and values (`repeat_kv`'s copy included, what Inductor runs without the packing),
SDPA on the packed query rows (the packing alone), and the template at each keys-per-run, under
CUDA graphs. The caches rotate over enough copies (one per layer) that they come from HBM.

    torchrun --nproc-per-node 1 benchmarks/bench_decode_attention.py --out /tmp/w/decode_attention
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_fused import bench_graph, write_tables  # noqa: E402
from benchmarks.bench_moe import close_group, init_group  # noqa: E402
from ditron_inductor.runtime import decode_attention as template  # noqa: E402


def repeated_sdpa(q, k, v, mask, n):
    b, kv, length, d = k.shape
    k = k[:, :, None].expand(b, kv, n, length, d).reshape(b, kv * n, length, d)
    v = v[:, :, None].expand(b, kv, n, length, d).reshape(b, kv * n, length, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--keys", type=int, default=1152)
    p.add_argument("--split-keys", default="auto,64,128,256,512")
    p.add_argument("--rotate-mb", type=int, default=1024, help="caches' total size")
    p.add_argument("--iters", type=int, default=32)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="")
    args = p.parse_args()
    init_group("cuda", "RANK" in os.environ)
    dtype, d, L = torch.bfloat16, args.head_dim, args.keys
    heads, kv = args.heads // args.tp, args.kv_heads // args.tp
    n = heads // kv
    rows_out = []
    for batch in (int(b) for b in args.batches.split(",")):
        cache_bytes = 2 * batch * kv * L * d * dtype.itemsize
        copies = max(2, min(64, args.rotate_mb * 2 ** 20 // cache_bytes))
        mask = (torch.arange(L, device="cuda") < L - 100)[None, None, None, :].expand(
            batch, 1, 1, L)
        q = torch.randn(batch, heads, 1, d, device="cuda", dtype=dtype)
        caches = [(torch.randn(batch, kv, L, d, device="cuda", dtype=dtype),
                   torch.randn(batch, kv, L, d, device="cuda", dtype=dtype)) for _ in range(copies)]
        packed_q = q.reshape(batch, kv, n, d)
        packed_mask = mask.expand(batch, 1, n, L).contiguous()
        ref = repeated_sdpa(q.float(), caches[0][0].float(), caches[0][1].float(), mask, n)
        timed = {"SDPA, repeated k/v": bench_graph(
            lambda k, v: repeated_sdpa(q, k, v, mask, n), caches, args.iters, args.reps),
                 "SDPA, packed rows": bench_graph(
            lambda k, v: F.scaled_dot_product_attention(packed_q, k, v, attn_mask=packed_mask),
            caches, args.iters, args.reps)}
        errors = {}
        for split in args.split_keys.split(","):
            keys = None if split == "auto" else int(split)
            name = f"template, {split} keys per run"
            run = (lambda k, v, keys=keys:  # noqa: E731
                   template.decode_attention(packed_q, k, v, packed_mask, d ** -0.5, keys))
            out = run(*caches[0]).reshape(batch, heads, 1, d)
            errors[name] = (out.float() - ref).abs().max().item()
            timed[name] = bench_graph(run, caches, args.iters, args.reps)
        base = timed["SDPA, repeated k/v"]
        for name, ms in timed.items():
            rows_out.append(dict(batch=batch, contender=name, ms=ms, vs_repeated=ms / base,
                                 tb_s=cache_bytes / ms / 1e9, max_err=errors.get(name)))
            print(f"B {batch:3d} {name:32s} {ms:.4f} ms ({cache_bytes / ms / 1e9:.2f} TB/s of "
                  f"cache) {ms / base:.3f}x", flush=True)
        del caches
    meta = dict(command="torchrun --nproc-per-node 1 benchmarks/bench_decode_attention.py " +
                " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
                device=torch.cuda.get_device_name(), torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"))
    lines = [f"# Decode attention vs SDPA ({meta['device']})", "",
             f"- command: `{meta['command']}`",
             f"- {meta['date']}; torch {meta['torch']}; bf16, {heads} query heads / {kv} key/value "
             f"heads per rank (TP {args.tp}), head size {d}, {L} keys, one query per head, a "
             "decode step's mask; CUDA graphs, caches rotating over copies (from HBM); TB/s of "
             "keys and values read once", "",
             "| B | contender | ms | TB/s | vs SDPA repeated | max abs err |", "| --- " * 6 + "|"]
    for r in rows_out:
        err = "" if r["max_err"] is None else f"{r['max_err']:.1e}"
        lines.append(f"| {r['batch']} | {r['contender']} | {r['ms']:.4f} | {r['tb_s']:.2f} | "
                     f"{r['vs_repeated']:.3f} | {err} |")
    if args.out:
        write_tables(args.out, meta, rows_out, lines)
    close_group("cuda")


if __name__ == "__main__":
    main()
