"""benchmarks/e2e_moe.py's CPU smoke run on 2 gloo ranks: the training step of the tiny MoE model
(tests/moe_ep.py's) against Inductor with the combine alone fused; the ditron contender with its
MoE ops in the graphs (the combine of the forward and of the backward), its reference path on CPU
(no fused call), and its loss and gradients equal to Inductor's bit for bit (on CPU the ops'
reference runs the ATen kernels Inductor's graph calls).
Left out to keep the suite short, each compiled elsewhere: `ditron` (the scheduler deciding)
compiles on CPU the same graphs as `ditron_fused`; the tiny model with every MoE op fused is
test_moe_gloo.py's model check; transformers' Mixtral under ditron's exchange (--hf), whose model
is tests/hf_moe_ep.py's, is test_transformers_ep.py's."""

from __future__ import annotations

import json

import pytest

from tests import run_benchmark_on_cpu_ranks

COMBINE = "grouped_mm_all_to_all"


@pytest.mark.slow
def test_e2e_moe_runs_its_contenders_on_two_cpu_ranks(tmp_path):
    contenders = ["inductor", "ditron_fused_combine"]
    run_benchmark_on_cpu_ranks("e2e_moe.py", "--tiny", "--out", str(tmp_path / "e2e_moe"),
                               "--contenders", ",".join(contenders))
    result = json.loads((tmp_path / "e2e_moe.json").read_text())
    assert result["meta"]["world"] == 2
    (row,) = result["rows"]
    assert row["notes"] == {}
    assert set(row["ms"]) == set(contenders)
    assert all(ms > 0 for ms in row["ms"].values()), row["ms"]
    assert {c: sorted(ops) for c, ops in row["ditron_ops"].items()} == {
        "inductor": [], "ditron_fused_combine": [COMBINE, COMBINE]}
    assert set(row["fused_calls"].values()) == {0}
    assert row["declined"] == {c: {} for c in contenders}  # no fused path on CPU
    assert row["diff"] == {c: 0.0 for c in contenders[1:]}
    table = (tmp_path / "e2e_moe.md").read_text()
    assert "| 8 | 1 | 16 |" in table and "ditron_fused_combine 2" in table
