"""The MoE exchange's put kernel (templates/moe_routes.put_rows_kernel) at each launch config,
one GPU, W ranks emulated by buffers on it, beside `copy_` of the same bytes.

Rank 0 sends `rows` bf16 rows of `width` to random receivers, each of which publishes its
expert-major routes (moe_routes.publish, random experts); every config is checked (each
received row where the reference puts it, each tile's count) and then timed (CUDA events inside
triton.testing.do_bench, median). `default` is what runtime/moe_routes.put_rows launches.

    python benchmarks/bench_put_rows.py --rows 256,1024,4096,16384 --widths 4096,7168
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ditron_inductor.runtime import moe_routes  # noqa: E402

EXPERTS, BLOCK_M = 2, 64
DEFAULT = moe_routes.PUT_CONFIG


def addresses(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device="cuda")


class Exchange:
    """Rank 0's rows, every receiver's published table, its reference rows and tile counts."""

    def __init__(self, world: int, rows: int, width: int, gen: torch.Generator):
        dst = torch.randint(0, world, (rows,), generator=gen).sort().values
        self.splits = torch.bincount(dst, minlength=world).tolist()
        self.x = torch.randn(rows, width, generator=gen).to("cuda", torch.bfloat16)
        tiles = moe_routes.max_tiles(rows, EXPERTS, BLOCK_M)
        self.tables, self.refs, self.expects, start = [], [], [], 0
        for q, n in enumerate(self.splits):
            expert = torch.randint(0, EXPERTS, (n,), generator=gen)
            row_index = torch.argsort(expert, stable=True).cuda()
            offsets = torch.cumsum(torch.bincount(expert, minlength=EXPERTS), 0).to(
                "cuda", torch.int32)
            table = torch.zeros(moe_routes.table_words(world, rows), dtype=torch.int32,
                                device="cuda")
            expect = torch.zeros(tiles, dtype=torch.int32, device="cuda")
            moe_routes.publish(table, [n] + [0] * (world - 1),
                               self.splits if q == 0 else [0] * world, row_index, offsets,
                               BLOCK_M, expect)
            self.tables.append(table)
            self.refs.append(self.x[start:start + n][row_index])
            self.expects.append(expect)
            start += n
        self.recv = [torch.zeros_like(self.x) for _ in range(world)]
        self.counts = [torch.zeros(tiles, dtype=torch.int32, device="cuda") for _ in range(world)]
        self.addrs = addresses(self.tables), addresses(self.recv), addresses(self.counts)

    def put(self, config: tuple[int, int, int]) -> None:
        moe_routes.put_rows(self.x, *self.addrs, 0, len(self.splits), self.x.shape[0],
                            expert_major=True, config=config)

    def checked(self, config) -> bool:
        for t in self.recv + self.counts:
            t.zero_()
        self.put(config)
        torch.cuda.synchronize()
        return all(torch.equal(r[:n], ref) for r, n, ref in zip(self.recv, self.splits, self.refs)) \
            and all(torch.equal(c, e) for c, e in zip(self.counts, self.expects))


def configs(spec: str) -> list[tuple[int, int, int]]:
    """"default", or rows per program list:columns a step list:warps list."""
    if spec == "default":
        return [DEFAULT]
    rs, ks, ws = ([int(v) for v in part.split(",")] for part in spec.split(":"))
    found = [c for c in itertools.product(rs, ks, ws) if 32 * c[2] <= c[0] * c[1] <= 16384]
    return found + [DEFAULT] * (DEFAULT not in found)


def main() -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--rows", default="256,1024,4096,16384")
    p.add_argument("--widths", default="4096,7168")
    p.add_argument("--configs", default="1,2,4,8,16:128,256,512,1024,2048,4096:1,2,4,8")
    p.add_argument("--out", default="")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    cands = configs(args.configs)
    lines, ratios = [], {c: [] for c in cands}
    for rows, width in itertools.product(*([int(v) for v in s.split(",")]
                                           for s in (args.rows, args.widths))):
        ex = Exchange(args.world, rows, width, gen)
        dst = torch.empty_like(ex.x)
        copy_ms = do_bench(lambda: dst.copy_(ex.x), warmup=25, rep=100, return_mode="median")
        timed = {}
        for c in cands:
            if not ex.checked(c):
                raise SystemExit(f"put_rows_kernel {c} at {rows} x {width}: wrong rows or counts")
            timed[c] = do_bench(lambda: ex.put(c), warmup=25, rep=100, return_mode="median")
            ratios[c].append(timed[c] / copy_ms)
        best = min(timed, key=timed.get)
        gbs = 2 * ex.x.numel() * ex.x.element_size() / 1e6  # bytes read + written, / 1e9 * 1e3
        lines.append(f"| {rows} | {width} | {copy_ms * 1e3:.1f} | {timed[DEFAULT] * 1e3:.1f} "
                     f"({gbs / timed[DEFAULT]:.0f} GB/s) | {timed[DEFAULT] / copy_ms:.2f} | "
                     f"{timed[best] * 1e3:.1f} {best} | {timed[best] / copy_ms:.2f} |")
    geomean = {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in ratios.items()}
    ranked = sorted(geomean, key=geomean.get)[:8]
    text = [f"# put_rows_kernel launch configs, W {args.world} emulated on one GPU "
            f"({torch.cuda.get_device_name()})", "",
            f"- command: `python benchmarks/bench_put_rows.py {' '.join(sys.argv[1:])}`",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch "
            f"{torch.__version__}",
            f"- config: (rows per program, columns a step, warps); default {DEFAULT}; us: "
            "median of do_bench; / copy: the time over copy_ of the same bytes", "",
            "| rows | width | copy_ us | default us | default / copy | best us (config) | "
            "best / copy |", "| --- | --- | --- | --- | --- | --- | --- |", *lines, "",
            "| config | geomean / copy | worst / copy |", "| --- | --- | --- |",
            *(f"| {c} | {geomean[c]:.2f} | {max(ratios[c]):.2f} |"
              for c in ranked + [DEFAULT] * (DEFAULT not in ranked))]
    print("\n".join(text))
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
