"""benchmarks/bench_moe.py's CPU smoke run: a row per (layer, tokens, stage, tile) with both
unfused contenders timed, and the fused plans said to have taken the reference path (no fused
kernels on CPU), never timed as fused."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tests import REPO_ROOT


def test_moe_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "moe"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks/bench_moe.py"),
                           "--device", "cpu", "--tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert {(r["tokens"], r["stage"], r["plan"]) for r in rows} == {
        (t, s, "16x32") for t in (16, 37) for s in ("gate+up", "down")}
    for r in rows:
        assert r["grouped_mm_ms"] > 0 and r["loop_ms"] > 0
        assert r["loop_rel_err"] < 2e-2  # the loop computes what torch._grouped_mm does
        assert r["rel_err"] < 2e-2 and not r["error"], r  # the reference path's output
        assert not r["served"] and math.isnan(r["fused_ms"])
    text = (tmp_path / "moe.md").read_text()
    assert "| tiny | 4 | 32 | 48 | 2 | 37 | 74 | down |" in text
