"""Writes the scheduler's measured AG/RS plans (ditron_inductor/scheduler/evidence/
measured_plans.json) from bench_fused.py runs: per row the op, world size, dtype, M, K, N and
every candidate's median ms beside NCCL + cuBLAS's (what the scheduler takes the fastest plan
from at shapes near these: scheduler/evidence.py, nearest_measured).

    python benchmarks/measured_plans_table.py benchmarks/results/<run>.json [...]

A later run's row replaces an earlier one's at the same (op, world, dtype, M, K, N). Columns
that are no candidate of the op (the GEMM alone, candidates since deleted) are left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ditron_inductor.scheduler.candidates import CANDIDATES  # noqa: E402
from ditron_inductor.scheduler.evidence import MEASURED_PLANS, NCCL_CUBLAS  # noqa: E402

WHAT = ("AG+GEMM and GEMM+RS: every choosable candidate's ms per call (the slowest rank's "
        "median) at a shape and world size beside NCCL + cuBLAS's; written by "
        "benchmarks/measured_plans_table.py from benchmarks/bench_fused.py runs. Columns of "
        "candidates since deleted are dropped.")


def table(runs: list[tuple[str, dict]]) -> dict:
    """{"what": ..., "sources": [...], "rows": [...]} from (file name, bench_fused JSON) pairs."""
    sources, rows = [], {}
    for _, run in runs:
        meta = run["meta"]
        sources.append(dict(machine=meta["gpu"], date=meta["date"], command=meta["command"],
                            timing=meta.get("timing", "host and device (before the spin)")))
        for r in run["rows"]:
            labels = CANDIDATES.get(r["op"], {})
            ms = {label: t for label, t in r["plans"].items()
                  if label in labels and t is not None and math.isfinite(t)}
            ms[NCCL_CUBLAS] = r["ms"][NCCL_CUBLAS]
            key = (r["op"], r["world"], r["dtype"], r["M"], r["K"], r["N"])
            rows[key] = dict(op=r["op"], world=r["world"], dtype=r["dtype"], m=r["M"], k=r["K"],
                             n=r["N"],
                             site=r.get("site"), ms={k: round(v, 4) for k, v in ms.items()},
                             source=len(sources) - 1)
            if len(r.get("term_ks") or ()) > 1:  # timed as a sum of products (bench_fused)
                rows[key]["terms"] = len(r["term_ks"])
    return {"what": WHAT, "sources": sources, "rows": list(rows.values())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_fused.py JSON files, oldest first")
    ap.add_argument("--out", default=str(MEASURED_PLANS))
    args = ap.parse_args(argv)
    runs = [(pathlib.Path(p).name, json.loads(pathlib.Path(p).read_text())) for p in args.runs]
    data = table(runs)
    pathlib.Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"{os.path.relpath(args.out)}: {len(data['rows'])} rows from {len(runs)} run(s)")


if __name__ == "__main__":
    main()
