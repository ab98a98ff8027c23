"""The measured evidence the scheduler decides from: data files in evidence/, each with its
provenance (machine, date, command).

- link.json: the link model's constants, one calibration per world size measured;
- world1_compute.json: a fused plan's compute on one GPU beside the unfused compute it replaces;
- measured_plans.json: every AG/RS candidate timed at a shape and world size beside NCCL + cuBLAS.

The files ship in the package: every rank reads the same rows, so the decisions they feed are
the same on every rank whatever GPU or load each one has.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from typing import NamedTuple, Optional

DIRECTORY = pathlib.Path(__file__).with_name("evidence")
LINK = DIRECTORY / "link.json"
WORLD1_COMPUTE = DIRECTORY / "world1_compute.json"
MEASURED_PLANS = DIRECTORY / "measured_plans.json"
NCCL_CUBLAS = "nccl_cublas"  # the unfused contender's key among a measured row's times
# A world-1 row stands for a task's shape when each of M, K and N is within this factor of it;
# a measured AG/RS row, within MEASURED_NEAR (closer: those rows decide a plan outright).
WORLD1_NEAR, MEASURED_NEAR = 2.0, 1.25
# Below this many rows a call's time is latency (launches, waits), not work: not scaled.
SCALED_FROM_M = 1024


def _read(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _provenance(source: dict) -> str:
    return f"{source['machine']}, {source['date']}"


def _log_distance(shape, other, near: float) -> Optional[float]:
    """Sum of |log| ratios of two (M, K, N), or None where a dim is not within `near`."""
    logs = [abs(math.log(a / b)) for a, b in zip(shape, other)]
    return sum(logs) if max(logs) <= math.log(near) else None


# ---------------------------------------------------------------------------- the link model
@functools.cache
def link_calibrations() -> dict[int, dict]:
    """{world size measured: constants}, each calibration over its base's."""
    calibrations: dict[int, dict] = {}
    for entry in _read(LINK).get("calibrations", ()):
        base = calibrations.get(entry.get("base"), {})
        calibrations[entry["world"]] = {**base, **entry["constants"]}
    return calibrations


def calibrated_world(world: int) -> int:
    """The world size measured nearest to `world` (the larger on a tie)."""
    return min(link_calibrations(), key=lambda w: (abs(w - world), -w))


def link(world: int) -> dict:
    """The link constants measured at calibrated_world(world)."""
    return link_calibrations()[calibrated_world(world)]


# ------------------------------------------------------------------- world-1 compute table
class Costs(NamedTuple):
    fused_ms: float
    unfused_ms: float
    measured: tuple[int, int, int]  # the (M, K, N) measured that stands for the task's


@functools.cache
def _world1() -> tuple[dict, str]:
    """{(op, plan family, mode): [((M, K, N), fused ms, unfused ms), ...]}, and its source."""
    data = _read(WORLD1_COMPUTE)
    rows: dict = {}
    for op, family, mode, m, k, n, fused, unfused in data.get("rows", ()):
        rows.setdefault((op, family, mode), []).append(((m, k, n), fused, unfused))
    sources = data.get("sources", ())
    return rows, "; ".join(dict.fromkeys(_provenance(s) for s in sources)) or "no table"


def world1_source() -> str:
    return _world1()[1]


def world1_costs(op: str, family: str, cuda_graphs: bool, m: int, k: int,
                 n: int) -> Optional[Costs]:
    """The measured costs of a call of `op` with a plan of `family` at [m, k] @ [k, n], launched
    eagerly or replayed from a CUDA graph: the nearest measured shape (each dim within
    WORLD1_NEAR), scaled by the work from SCALED_FROM_M rows; None where none is that near."""
    mode = "graph" if cuda_graphs else "eager"
    best = None
    for shape, fused, unfused in _world1()[0].get((op, family, mode), ()):
        distance = _log_distance((m, k, n), shape, WORLD1_NEAR)
        if distance is not None and (best is None or distance < best[0]):
            best = (distance, shape, fused, unfused)
    if best is None:
        return None
    _, (rm, rk, rn), fused, unfused = best
    scale = (m * k * n) / (rm * rk * rn) if min(m, rm) >= SCALED_FROM_M else 1.0
    return Costs(fused * scale, unfused * scale, (rm, rk, rn))


# --------------------------------------------------------------- AG/RS plans, measured
class Measured(NamedTuple):
    """A measured row: {label: ms} over the fused candidates and NCCL_CUBLAS; `terms`: the matmul
    products the row's op summed (1: one matmul over the whole K)."""

    shape: tuple[int, int, int]
    ms: dict
    source: str
    terms: int = 1

    def fastest(self, labels) -> Optional[str]:
        """The fastest of `labels` measured here, or None."""
        timed = [label for label in labels if math.isfinite(self.ms.get(label, math.nan))]
        return min(timed, key=self.ms.get, default=None)


@functools.cache
def _measured_rows() -> dict:
    """{(op, world, dtype name): [Measured, ...]}."""
    data = _read(MEASURED_PLANS)
    rows: dict = {}
    for row in data.get("rows", ()):
        source = _provenance(data["sources"][row["source"]])
        rows.setdefault((row["op"], row["world"], row["dtype"]), []).append(
            Measured((row["m"], row["k"], row["n"]), row["ms"], source, row.get("terms", 1)))
    return rows


def nearest_measured(op: str, world: int, dtype, m: int, k: int, n: int) -> Optional[Measured]:
    """The measured row of `op` on `world` ranks in `dtype` nearest to [m, k] @ [k, n], each dim
    within MEASURED_NEAR of it, or None."""
    best, best_distance = None, math.inf
    for row in _measured_rows().get((op, world, str(dtype).removeprefix("torch.")), ()):
        distance = _log_distance((m, k, n), row.shape, MEASURED_NEAR)
        if distance is not None and distance < best_distance:
            best, best_distance = row, distance
    return best


def clear_caches() -> None:
    """Read the files again (tests that point the paths elsewhere)."""
    for cached in (link_calibrations, _world1, _measured_rows):
        cached.cache_clear()
