"""benchmarks/e2e_moe.py's CPU smoke run on 2 gloo ranks: the tiny MoE model's training step
under every contender, the ditron ones with their MoE ops in the graphs (the dispatch and the
combine of the forward and of the backward; the combine's alone where the patterns say so),
their reference path on CPU (no fused call), and the loss and gradients equal to Inductor's bit
for bit (on CPU the ops' reference runs the ATen kernels Inductor's graph calls)."""

from __future__ import annotations

import json

from tests import run_benchmark_on_cpu_ranks

DISPATCH, COMBINE = "all_to_all_grouped_mm", "grouped_mm_all_to_all"


def test_e2e_moe_runs_every_contender_on_two_cpu_ranks(tmp_path):
    run_benchmark_on_cpu_ranks("e2e_moe.py", "--tiny", "--out", str(tmp_path / "e2e_moe"))
    result = json.loads((tmp_path / "e2e_moe.json").read_text())
    assert result["meta"]["world"] == 2
    (row,) = result["rows"]
    contenders = ["inductor", "ditron", "ditron_fused", "ditron_fused_combine"]
    assert row["notes"] == {}
    assert all(row["ms"][c] > 0 for c in contenders), row["ms"]
    both = sorted([DISPATCH, COMBINE] * 2)
    assert {c: sorted(ops) for c, ops in row["ditron_ops"].items()} == {
        "inductor": [], "ditron": both, "ditron_fused": both,
        "ditron_fused_combine": [COMBINE, COMBINE]}
    assert set(row["fused_calls"].values()) == {0}
    assert row["diff"] == {c: 0.0 for c in contenders[1:]}
    table = (tmp_path / "e2e_moe.md").read_text()
    assert "| tiny | 8 | 1 | 16 |" in table and "ditron 4, ditron_fused 4" in table
