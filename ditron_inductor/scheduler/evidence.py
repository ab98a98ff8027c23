"""The measured evidence the scheduler decides from, each table with its provenance (machine,
date, command), read in this order: this machine's calibration (scheduler/calibration.py);
the shipped tables in evidence/ (link.json's link constants per world size, world1_compute.json's
compute at world size 1, measured_plans.json's AG/RS candidates), exports of calibrations, where
the card is one they were measured on (SHIPPED_CARDS); the link model, its margin wider on a card
of neither (choose.py).
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from typing import NamedTuple, Optional

from . import calibration

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


def _nearest(rows, shape_of, shape, near: float):
    """The first of the rows whose (M, K, N) is nearest to `shape` by the sum of |log| ratios,
    each dim within a factor `near` of it; None where none is that near."""
    best, best_distance = None, math.inf
    for row in rows:
        logs = [abs(math.log(a / b)) for a, b in zip(shape, shape_of(row))]
        if max(logs) <= math.log(near) and sum(logs) < best_distance:
            best, best_distance = row, sum(logs)
    return best


def _tables(path: pathlib.Path) -> list[tuple[dict, str]]:
    """(table, source) in the order read: this machine's calibration's, the shipped one."""
    calibration.calibrated()
    own = calibration.local().data.get(path.stem)
    shipped = _read(path) if calibration.card_matches() else None
    return [(t, src) for t, src in ((own, calibration.CALIBRATION), (shipped, "")) if t]


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
    """The link constants measured at calibrated_world(world), under those this machine's
    calibration measured (its GEMM rate, its link at `world`)."""
    own = calibration.local().data.get("link", {})
    shipped = link_calibrations()[calibrated_world(world)]
    return {**shipped, **own.get("1", {}), **own.get(str(world), {})} if own else shipped


def link_source(world: int) -> str:
    """Where link(world)'s bandwidths come from, for the log."""
    if str(world) in calibration.local().data.get("link", {}):
        return f"link model, {calibration.CALIBRATION} at {world} ranks"
    return f"link model, shipped constants of {calibrated_world(world)} ranks"


def link_measured(world: int) -> bool:
    """Whether the link model's constants at `world` were measured on this card."""
    own = calibration.local().data.get("link", {})
    return calibration.calibrated() and (calibration.card_matches() or str(world) in own)


# ------------------------------------------------------------------- world-1 compute table
class Costs(NamedTuple):
    fused_ms: float
    unfused_ms: float
    measured: tuple[int, int, int]  # the (M, K, N) measured that stands for the task's
    source: str = ""  # calibration.CALIBRATION, or "" for the shipped table


@functools.cache
def _world1() -> list[tuple[dict, str]]:
    """Per table in reading order: {(op, plan family, mode): [((M, K, N), fused ms, unfused ms),
    ...]}, and its source."""
    out = []
    for data, source in _tables(WORLD1_COMPUTE):
        rows: dict = {}
        for op, family, mode, m, k, n, fused, unfused, *_ in data.get("rows", ()):
            rows.setdefault((op, family, mode), []).append(((m, k, n), fused, unfused))
        names = "; ".join(dict.fromkeys(_provenance(s) for s in data.get("sources", ())))
        out.append((rows, f"{source}, {names}" if source else names))
    return out


def world1_source() -> str:
    return "; ".join(source for _, source in _world1()) or "no table"


def world1_costs(op: str, family: str, cuda_graphs: bool, m: int, k: int,
                 n: int) -> Optional[Costs]:
    """The measured costs of a call of `op` with a plan of `family` at [m, k] @ [k, n], launched
    eagerly or replayed from a CUDA graph: the nearest measured shape (each dim within
    WORLD1_NEAR), scaled by the work from SCALED_FROM_M rows; None where none is that near."""
    mode = "graph" if cuda_graphs else "eager"
    for rows, source in _world1():
        best = _nearest(rows.get((op, family, mode), ()), lambda row: row[0], (m, k, n),
                        WORLD1_NEAR)
        if best is not None:
            (rm, rk, rn), fused, unfused = best
            scale = (m * k * n) / (rm * rk * rn) if min(m, rm) >= SCALED_FROM_M else 1.0
            return Costs(fused * scale, unfused * scale, (rm, rk, rn),
                         calibration.CALIBRATION if source.startswith(calibration.CALIBRATION) else "")
    return None


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
def _measured_rows() -> list[dict]:
    """Per table in reading order: {(op, world, dtype name): [Measured, ...]}."""
    out = []
    for data, own in _tables(MEASURED_PLANS):
        rows: dict = {}
        for row in data.get("rows", ()):
            source = _provenance(data["sources"][row["source"]])
            rows.setdefault((row["op"], row["world"], row["dtype"]), []).append(Measured(
                (row["m"], row["k"], row["n"]), row["ms"], f"{own}, {source}" if own else source,
                row.get("terms", 1)))
        out.append(rows)
    return out


def nearest_measured(op: str, world: int, dtype, m: int, k: int, n: int) -> Optional[Measured]:
    """The measured row of `op` on `world` ranks in `dtype` nearest to [m, k] @ [k, n], each dim
    within MEASURED_NEAR of it, from the first table that has one, or None."""
    for rows in _measured_rows():
        best = _nearest(rows.get((op, world, str(dtype).removeprefix("torch.")), ()),
                        lambda row: row.shape, (m, k, n), MEASURED_NEAR)
        if best is not None:
            return best
    return None


def clear_caches() -> None:
    """Read the files again (tests that point the paths elsewhere; a new calibration), and agree
    on them anew."""
    calibration.clear_caches()
    for cached in (link_calibrations, _world1, _measured_rows):
        cached.cache_clear()
