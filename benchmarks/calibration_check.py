"""This machine's calibration beside the shipped tables: each site's decision from both, and the
calibration's rows written into the shipped tables' files (the same measurements make both).

    python -m benchmarks.calibration_check --sites llama-8b --tp 2      # decisions, compared
    python -m benchmarks.calibration_check --export ditron_inductor/scheduler/evidence

Decisions: the scheduler's choice at every site of ditron_inductor.calibrate's --sites (the
training step's AG/RS sites at --tokens, prefill's and decode's all-reduce + norm sites, each
launched eagerly or from a CUDA graph as the site is), first with the evidence in the order the
scheduler reads it (this machine's calibration, then the shipped tables), then with the shipped
tables alone; each site that differs is printed with both reasons, whose figures (measured and
predicted ms of fused and NCCL + cuBLAS, and their source) say why. --export merges the
calibration's world-1 compute and measured AG/RS rows into world1_compute.json and
measured_plans.json in that directory: its rows replace those of the same key, its runs are
added to their sources (the link constants stay in link.json, by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ditron_inductor import calibrate  # noqa: E402
from ditron_inductor.scheduler import evidence  # noqa: E402
from ditron_inductor.scheduler.choose import choose_device_plan  # noqa: E402


def decisions(sites) -> int:
    """Prints each site's decision from this machine's evidence and from the shipped tables
    alone; returns how many differ."""
    mine = [choose_device_plan(s.task, s.graphs) for s in sites]
    home = os.environ.get("XDG_CACHE_HOME")
    with tempfile.TemporaryDirectory() as empty:  # no calibration: the shipped tables alone
        os.environ["XDG_CACHE_HOME"] = empty
        evidence.clear_caches()
        shipped = [choose_device_plan(s.task, s.graphs) for s in sites]
    os.environ.pop("XDG_CACHE_HOME") if home is None else os.environ.update(XDG_CACHE_HOME=home)
    evidence.clear_caches()
    differ = 0
    for site, (plan, why), (plan0, why0) in zip(sites, mine, shipped):
        same = (plan and plan.label) == (plan0 and plan0.label)
        differ += not same
        mode = "CUDA graph" if site.graphs else "eager"
        print(f"{'same' if same else 'DIFFERS'}: {site.name}, {site.task.describe()}, {mode}\n"
              f"  here:    {why}" + ("" if same else f"\n  shipped: {why0}"))
    print(f"{len(sites)} sites: {len(sites) - differ} decided as from the shipped tables alone, "
          f"{differ} otherwise (both reasons above)")
    return differ


def export(directory: str) -> None:
    data = json.loads(evidence.calibration_path().read_text())
    for table in ("world1_compute", "measured_plans"):
        path = pathlib.Path(directory) / f"{table}.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        merged = calibrate.merge({table: old}, {table: data[table]})[table]
        calibrate._write(path, {"what": old.get("what", "written from a calibration"), **merged})
        print(f"{path}: {len(merged['rows'])} rows, {len(merged['sources'])} sources")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", default="llama-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--export", default="", help="merge the calibration into this directory's "
                    "shipped tables instead")
    args = ap.parse_args(argv)
    if args.export:
        return export(args.export)
    print(f"evidence: {evidence.calibration_path()}"
          f"{'' if evidence.calibration_path().exists() else ' (none)'}")
    decisions(calibrate.sites_of(args.sites, args.tp, args.tokens))


if __name__ == "__main__":
    main()
