"""Writes ditron_inductor/scheduler/measured_plans.json from bench_fused.py and bench_fp8_tp.py
runs: per row the op, world size, dtype, M, K, N and every candidate's median ms beside NCCL +
cuBLAS's (what the scheduler takes the fastest plan from at shapes near these:
scheduler/measured_plans.py).

    python benchmarks/measured_plans_table.py benchmarks/results/fused_h200x2_llama8b_sites.json \
        benchmarks/results/fp8_tp_h200x2.json

A later run's row replaces an earlier one's at the same (op, world, dtype, M, K, N).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ditron_inductor.scheduler.cost_model import (  # noqa: E402
    AG_CANDIDATES,
    FP8_LABEL,
    RS_CANDIDATES,
)
from ditron_inductor.scheduler.measured_plans import NCCL_CUBLAS, TABLE  # noqa: E402
from ditron_inductor.scheduler.task import (  # noqa: E402
    ALL_GATHER_SCALED_MM,
    SCALED_MM_REDUCE_SCATTER,
)

# a run's other columns (the GEMM alone) are not candidates
CANDIDATES = {*AG_CANDIDATES, *RS_CANDIDATES, FP8_LABEL}


def fp8_rows(run: dict) -> list[dict]:
    """A bench_fp8_tp.py run's rows as bench_fused.py's: the fp8 op and A's float8 dtype as the
    benchmark chose them per site (bench_fp8_parity.operand_kind), ditron's time as its one
    plan's (FP8_LABEL), NCCL + _scaled_mm's as NCCL_CUBLAS."""
    from benchmarks.bench_fp8_parity import operand_kind

    out = []
    for r in run["rows"]:
        a_dtype, _ = operand_kind(types.SimpleNamespace(name=r["site"]))
        out.append(dict(op=ALL_GATHER_SCALED_MM if "gather" in r["site"]
                        else SCALED_MM_REDUCE_SCATTER, world=run["meta"]["world"],
                        dtype=str(a_dtype).removeprefix("torch."), site=r["site"], M=r["M"],
                        K=r["K"], N=sum(r["N"]), ms={NCCL_CUBLAS: r["ms"].get("nccl", math.nan)},
                        plans={FP8_LABEL: r["ms"].get("ditron", math.nan)}))
    return out


def table(runs: list[tuple[str, dict]]) -> dict:
    """{"sources": [...], "rows": [...]} from (file name, bench_fused.py or bench_fp8_tp.py
    JSON) pairs."""
    sources, rows = [], {}
    for name, run in runs:
        meta = run["meta"]
        fp8 = "bench_fp8_tp.py" in meta["command"]
        date = meta["date"]
        if date[10:11] == "T":  # bench_fp8_tp.py's ISO time, as bench_fused.py writes it
            date = datetime.datetime.fromisoformat(date).strftime("%Y-%m-%d %H:%M UTC")
        sources.append(dict(file=name, card=meta.get("gpu") or meta["device"], date=date,
                            command=meta["command"]))
        for r in fp8_rows(run) if fp8 else run["rows"]:
            ms = {label: t for label, t in r["plans"].items()
                  if label in CANDIDATES and t is not None and math.isfinite(t)}
            if not math.isfinite(r["ms"][NCCL_CUBLAS]):
                continue  # nothing to compare with
            ms[NCCL_CUBLAS] = r["ms"][NCCL_CUBLAS]
            key = (r["op"], r["world"], r["dtype"], r["M"], r["K"], r["N"])
            rows[key] = dict(op=r["op"], world=r["world"], dtype=r["dtype"], m=r["M"], k=r["K"],
                             n=r["N"],
                             site=r.get("site"), ms={k: round(v, 4) for k, v in ms.items()},
                             source=len(sources) - 1)
    return {"sources": sources, "rows": list(rows.values())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_fused.py / bench_fp8_tp.py JSON files, "
                    "oldest first")
    ap.add_argument("--out", default=str(TABLE))
    args = ap.parse_args(argv)
    runs = [(pathlib.Path(p).name, json.loads(pathlib.Path(p).read_text())) for p in args.runs]
    data = table(runs)
    pathlib.Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"{os.path.relpath(args.out)}: {len(data['rows'])} rows from {len(runs)} run(s)")


if __name__ == "__main__":
    main()
