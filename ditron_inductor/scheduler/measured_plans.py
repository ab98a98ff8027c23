"""AG+GEMM and GEMM+RS plans measured on several ranks: every candidate's time at a shape and
world size beside NCCL + cuBLAS's, from a `benchmarks/bench_fused.py` run on the GPU machines.

`python benchmarks/measured_plans_table.py RUN.json ...` writes measured_plans.json beside this
module (the run's command, card, date and timing with each row: device time, the device spinning
while the host queues the timed calls, as a device-bound training step runs them). Where a task's
op, world size and dtype have a measured shape near its own (each of M, K and N within
NEAR_FACTOR), the scheduler takes the plan that ran fastest there instead of the link model's
prediction: the model's constants were fitted at 4 and 8 ranks, and at 2 it chose the persistent
Triton all-gather at shapes where it measured slower than the cuBLAS-group plans and than NCCL +
cuBLAS (benchmarks/results/fused_h200x2_llama8b_sites.md).

Static data in the package, like the world-1 table: every rank reads the same rows, so the
decisions stay the same on every rank.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from typing import NamedTuple, Optional

TABLE = pathlib.Path(__file__).with_name("measured_plans.json")
NEAR_FACTOR = 1.25  # a measured shape stands for a task's when M, K and N are each this near
NCCL_CUBLAS = "nccl_cublas"  # the unfused contender's key among a row's times


class Measured(NamedTuple):
    """A measured row: {label: ms} over the fused candidates and NCCL_CUBLAS; `terms`: the matmul
    products the row's op summed (1: one matmul over the whole K)."""

    shape: tuple[int, int, int]
    ms: dict
    source: str
    terms: int = 1

    def fastest(self, labels) -> Optional[str]:
        """The fastest of `labels` measured here (a fused candidate), or None."""
        timed = [label for label in labels if math.isfinite(self.ms.get(label, math.nan))]
        return min(timed, key=self.ms.get, default=None)


@functools.cache
def _rows() -> dict:
    """{(op, world, dtype name): [Measured, ...]}."""
    if not TABLE.exists():
        return {}
    data = json.loads(TABLE.read_text())
    rows: dict = {}
    for row in data["rows"]:
        source = data["sources"][row["source"]]
        rows.setdefault((row["op"], row["world"], row["dtype"]), []).append(
            Measured((row["m"], row["k"], row["n"]), row["ms"],
                     f"{source['file']}: {source['card']}, {source['date']}",
                     row.get("terms", 1)))
    return rows


def nearest(op: str, world: int, dtype, m: int, k: int, n: int) -> Optional[Measured]:
    """The measured row of `op` on `world` ranks in `dtype` nearest to [m, k] @ [k, n], each dim
    within NEAR_FACTOR of it, or None."""
    best, best_distance = None, math.inf
    for row in _rows().get((op, world, str(dtype).removeprefix("torch.")), ()):
        logs = [abs(math.log(a / b)) for a, b in zip((m, k, n), row.shape)]
        if max(logs) <= math.log(NEAR_FACTOR) and sum(logs) < best_distance:
            best, best_distance = row, sum(logs)
    return best
