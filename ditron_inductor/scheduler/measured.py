"""World-1 compute costs, measured: what a fused plan costs on one GPU when there is nothing to
communicate, beside the unfused compute it replaces (cuBLAS + Inductor's epilogue kernels).

`benchmarks/bench_compute_parity.py --table` writes world1_compute.json beside this module from
its run (the source file, the card and the date are in it); the cost model adds the
communication of its link model to both sides (cost_model.all_reduce_costs). A fused plan whose
compute is slower than the unfused path's spends the communication it hides on it, and the
table is how the scheduler sees that.

The table is static data in the package: every rank reads the same, so the decisions it feeds
stay the same on every rank whatever GPU or load each one has.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from typing import NamedTuple, Optional

TABLE = pathlib.Path(__file__).with_name("world1_compute.json")
# A measured shape stands for a task's when each of M, K and N is within this factor of it.
MAX_FACTOR = 2.0
# Below this many rows a call's time is latency (launches, waits), not work: not scaled.
SCALED_FROM_M = 1024


class Costs(NamedTuple):
    fused_ms: float
    unfused_ms: float
    measured: tuple[int, int, int]  # the (M, K, N) measured that stands for the task's


@functools.cache
def _table() -> dict:
    """{(op, plan family, mode): [(M, K, N, fused ms, unfused ms), ...]}, and the source."""
    if not TABLE.exists():
        return {"rows": {}, "source": "no table"}
    data = json.loads(TABLE.read_text())
    rows: dict = {}
    for op, family, mode, m, k, n, fused, unfused in data["rows"]:
        rows.setdefault((op, family, mode), []).append((m, k, n, fused, unfused))
    return {"rows": rows, "source": f"{data['source']} ({data['card']}, {data['date']})"}


def source() -> str:
    return _table()["source"]


def world1_costs(op: str, family: str, cuda_graphs: bool, m: int, k: int,
                 n: int) -> Optional[Costs]:
    """The measured costs of a call of `op` with a plan of `family` at [m, k] @ [k, n], launched
    eagerly or replayed from a CUDA graph: the nearest measured shape (each dim within
    MAX_FACTOR), scaled by the work from SCALED_FROM_M rows; None where none is that near."""
    mode = "graph" if cuda_graphs else "eager"
    best = None
    for rm, rk, rn, fused, unfused in _table()["rows"].get((op, family, mode), ()):
        logs = [abs(math.log(a / b)) for a, b in ((m, rm), (k, rk), (n, rn))]
        if max(logs) <= math.log(MAX_FACTOR) and (best is None or sum(logs) < best[0]):
            best = (sum(logs), (rm, rk, rn), fused, unfused)
    if best is None:
        return None
    _, (rm, rk, rn), fused, unfused = best
    scale = (m * k * n) / (rm * rk * rn) if min(m, rm) >= SCALED_FROM_M else 1.0
    return Costs(fused * scale, unfused * scale, (rm, rk, rn))
