"""benchmarks/bench_moe_ep.py's CPU smoke run on 2 gloo ranks: a row per (tokens, stage, tile),
the NCCL-form contender (all-to-all + torch._grouped_mm) timed and equal to the ops' reference
(which the fused ops run on CPU), the fused plans said to have taken the reference path, never
timed as fused."""

from __future__ import annotations

import json
import math

import pytest

from tests import run_benchmark_on_cpu_ranks


def test_moe_ep_benchmark_runs_on_two_cpu_ranks(tmp_path):
    run_benchmark_on_cpu_ranks("bench_moe_ep.py", "--tiny", "--out", str(tmp_path / "moe_ep"))
    result = json.loads((tmp_path / "moe_ep.json").read_text())
    assert result["meta"]["world"] == 2
    rows = result["rows"]
    assert {(r["tokens"], r["stage"], r["plan"]) for r in rows} == {
        (t, s, "16x32") for t in (16, 37) for s in ("gate+up", "down")}
    for r in rows:
        assert r["nccl_ms"] > 0 and not r["error"], r
        # the reference's all-to-alls and grouped GEMMs, in the same order as the contender's
        assert r["rel_err"] < 1e-6, r
        assert not r["served"] and math.isnan(r["fused_ms"])
    text = (tmp_path / "moe_ep.md").read_text()
    assert "| tiny | 4 | 32 | 48 | 2 | 37 | 74 | down | 16x32 |" in text
    assert "not served: the reference ran" in text


def test_moe_ep_benchmark_refuses_an_unknown_tile(capsys):
    from benchmarks import bench_moe_ep

    with pytest.raises(SystemExit):
        bench_moe_ep.parse_args(["--plans", "128x128,256x512"])
    assert "--plans: unknown tile(s) ['256x512']" in capsys.readouterr().err
    assert bench_moe_ep.parse_args(["--tiny"]).plans == "16x32"
