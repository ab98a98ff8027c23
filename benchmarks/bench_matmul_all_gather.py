"""The GEMM + all-gather of its output (ditron.matmul_all_gather) beside cuBLAS + NCCL, on W GPUs.

    torchrun --nproc-per-node W benchmarks/bench_matmul_all_gather.py --out <name>
    torchrun --nproc-per-node 1 benchmarks/bench_matmul_all_gather.py --tp 2,4,8 --out <name>

Sites: lm_head of Llama-3-8B (K 4096, vocabulary 128256) and Phi-3-mini's qkv_proj and
gate_up_proj (K 3072, N 9216 and 16384), whose outputs transformers' TP plans gather
(colwise_gather_output), at --tokens rows; each rank's shapes those of TP --tp (default: the
world size), its output [1, tokens, N/TP] gathered along the last dim. On one GPU (world 1) the
peer loops are empty: what is left is the fused plan's local work (its GEMM in row chunks and the
concatenation) beside the unfused GEMM and the graph's copy (the split + cat); the gather itself
needs several GPUs.

Per row (bf16; random inputs, two sets alternated, warm-up, CUDA events around --iters calls, the
median of --reps repetitions, the slowest rank's): `cublas` the GEMM alone; `nccl_cublas` the
unfused graph (the GEMM, NCCL's all-gather, the split + cat to the last dim); `fused_cC` the op
with C row chunks (the output checked against the unfused one first; a call the fused path did
not serve is reported, never timed as fused). hidden: the share of the unfused graph's time
beyond the GEMM that the best fused plan saves (W > 1).

Writes <out>.json ({meta, rows}) and <out>.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_fused import bench, init_ranks, ranks_meta, write_tables  # noqa: E402

SITES = {"llama8b.lm_head": (4096, 128256), "phi3mini.qkv_proj": (3072, 9216),
         "phi3mini.gate_up_proj": (3072, 16384)}
c10d = torch.ops._c10d_functional


def _rows(args, world: int, group_name: str) -> list[dict]:
    from ditron_inductor.ops import matmul_all_gather_reference
    from ditron_inductor.runtime.matmul_all_gather import stats
    from ditron_inductor.scheduler.decide import plan_for
    from ditron_inductor.scheduler.task import MATMUL_ALL_GATHER, matmul_collective_task

    rows = []
    for site, (k, vocab) in SITES.items():
        for tp in args.tp or [world]:
            for m in args.tokens:
                n = vocab // tp
                gen = torch.Generator(device="cuda").manual_seed(dist.get_rank())
                inputs = [(torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16),
                           torch.randn(k, n, generator=gen, device="cuda",
                                       dtype=torch.bfloat16) / k ** 0.5) for _ in range(2)]
                shape = [1, m, n]

                def unfused(a, b):
                    y = (a @ b).view(shape)
                    g = c10d.wait_tensor(c10d.all_gather_into_tensor(y, world, group_name))
                    return torch.cat(g.chunk(world, dim=0), dim=2)

                ms = {"cublas": bench(torch.mm, inputs, args.iters, args.reps),
                      "nccl_cublas": bench(unfused, inputs, args.iters, args.reps)}
                notes = []
                task = matmul_collective_task(MATMUL_ALL_GATHER, *inputs[0], None, shape, 2, None,
                                              group_name, world)
                for chunks in args.chunks:
                    plan = plan_for(task, chunks=chunks).encode()

                    def fused(a, b, plan=plan):
                        return torch.ops.ditron.matmul_all_gather(a, b, None, shape, 2,
                                                                  group_name, world, plan)
                    served = stats[MATMUL_ALL_GATHER]
                    out = fused(*inputs[0])
                    ref = matmul_all_gather_reference(*inputs[0], None, shape, 2, group_name,
                                                      world)
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    label = f"fused_c{chunks}"
                    if stats[MATMUL_ALL_GATHER] == served or err > 2e-2:
                        why = "declined" if err <= 2e-2 else f"error {err:.1e}"
                        notes.append(f"{label}: {why}")
                        continue
                    ms[label] = bench(fused, inputs, args.iters, args.reps)
                rows.append(dict(site=site, tp=tp, world=world, M=m, K=k, N=n, ms=ms,
                                 notes=notes))
                del inputs
                torch.cuda.empty_cache()
    return rows


def _table(rows: list[dict], chunks: list[int]) -> list[str]:
    fused = [f"fused_c{c}" for c in chunks]
    lines = ["| site | TP | world | M | K | N/TP | cublas ms | nccl_cublas ms | "
             + " | ".join(f"{f} ms" for f in fused) + " | best / nccl_cublas | hidden |",
             "| --- " * (9 + len(fused)) + "|"]
    for r in rows:
        ms = r["ms"]
        best = min((ms[f] for f in fused if f in ms), default=None)
        ratio = f"{best / ms['nccl_cublas']:.3f}" if best else "-"
        exposed = ms["nccl_cublas"] - ms["cublas"]
        hidden = (f"{(ms['nccl_cublas'] - best) / exposed:.2f}"
                  if best and r["world"] > 1 and exposed > 0 else "-")
        lines.append(f"| {r['site']} | {r['tp']} | {r['world']} | {r['M']} | {r['K']} | {r['N']} | "
                     f"{ms['cublas']:.3f} | {ms['nccl_cublas']:.3f} | "
                     + " | ".join(f"{ms[f]:.3f}" if f in ms else "-" for f in fused)
                     + f" | {ratio} | {hidden} |")
        lines += [f"  {n}" for n in r["notes"]]
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[2048, 8192])
    p.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    _, world, group_name = init_ranks()
    rows = _rows(args, world, group_name)
    if dist.get_rank() == 0:
        meta = ranks_meta("bench_matmul_all_gather.py", argv or sys.argv[1:], "cuda",
                          machine=os.environ.get("MACHINE_KIND", ""))
        title = (f"# GEMM + all-gather of its output ({meta['device']} x{world}, "
                 f"{meta['date'][:16].replace('T', ' ')} UTC, torch {meta['torch']}; "
                 f"`{meta['command']}`)")
        write_tables(args.out, meta, rows, [title, ""] + _table(rows, args.chunks))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
