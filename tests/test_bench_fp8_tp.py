"""benchmarks/bench_fp8_tp.py's CPU smoke run on 2 gloo ranks: a row per float8 site of the
training step (lm_head left out), NCCL + _scaled_mm timed, ditron's op equal to it (on CPU its
reference runs, and the row says so instead of timing it as fused), async TP CUDA only."""

from __future__ import annotations

import json

from tests import run_benchmark_on_cpu_ranks


def test_fp8_tp_benchmark_runs_on_two_cpu_ranks(tmp_path):
    run_benchmark_on_cpu_ranks("bench_fp8_tp.py", "--tiny", "--out", str(tmp_path / "fp8_tp"))
    result = json.loads((tmp_path / "fp8_tp.json").read_text())
    assert result["meta"]["world"] == 2
    rows = {r["site"]: r for r in result["rows"]}
    assert set(rows) == {"q/k/v gather", "o scatter", "gate/up gather", "down scatter",
                         "down output-grad gather", "gate/up input-grad scatter",
                         "o output-grad gather", "q/k/v input-grad scatter"}
    assert (rows["gate/up input-grad scatter"]["terms"], rows["o scatter"]["terms"]) == (2, 1)
    for r in rows.values():
        assert set(r["ms"]) == {"nccl"} and r["ms"]["nccl"] > 0, r
        assert r["notes"] == {"async_tp": "CUDA only", "ditron": "not served: the reference ran"}
        assert r["rel_err"]["ditron"] < 1e-6, r  # the op's reference: the same products
    assert "| gate/up input-grad scatter | 64 | 128 | 64 |" in (tmp_path / "fp8_tp.md").read_text()
