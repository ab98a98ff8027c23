"""benchmarks/e2e_moe.py's CPU smoke runs on 2 gloo ranks: the training step of the tiny MoE
model (tests/moe_ep.py's) against Inductor with the combine alone fused, and transformers'
Mixtral under its expert parallelism (--hf) with every MoE op fused; the ditron
contenders with their MoE ops in the graphs (the dispatch and the combine of the forward and of
the backward; the combine's alone where the patterns say so), their reference path on CPU (no
fused call), and their loss and gradients equal to Inductor's bit for bit (on CPU the ops'
reference runs the ATen kernels Inductor's graph calls).
On CPU `ditron` (the scheduler deciding) compiles the same graphs as `ditron_fused`, and the tiny
model's `ditron_fused` the same ops as test_moe_gloo.py's layer: they are left out to keep the
suite short."""

from __future__ import annotations

import json

import pytest

from tests import run_benchmark_on_cpu_ranks

DISPATCH, COMBINE = "all_to_all_grouped_mm", "grouped_mm_all_to_all"


@pytest.mark.slow
@pytest.mark.parametrize("hf", [None, "mixtral"])
def test_e2e_moe_runs_every_contender_on_two_cpu_ranks(tmp_path, hf):
    if hf:
        pytest.importorskip("transformers.distributed.expert_parallel")
    # --hf: ditron's exchange alone (tests/test_transformers_ep.py compares it with transformers')
    contenders = ["ditron_fused"] if hf else ["inductor", "ditron_fused_combine"]
    run_benchmark_on_cpu_ranks("e2e_moe.py", "--tiny", "--out", str(tmp_path / "e2e_moe"),
                               "--contenders", ",".join(contenders),
                               *(["--hf", hf] if hf else []))
    result = json.loads((tmp_path / "e2e_moe.json").read_text())
    assert result["meta"]["world"] == 2
    (row,) = result["rows"]
    assert row["notes"] == {}
    assert set(row["ms"]) == set(contenders)
    assert all(ms > 0 for ms in row["ms"].values()), row["ms"]
    both = sorted([DISPATCH, COMBINE] * 2)
    expected_ops = {"inductor": [], "inductor_transformers_ep": [], "ditron_fused": both,
                    "ditron_fused_combine": [COMBINE, COMBINE]}
    assert {c: sorted(ops) for c, ops in row["ditron_ops"].items()} == {
        c: expected_ops[c] for c in contenders}
    assert set(row["fused_calls"].values()) == {0}
    assert row["declined"] == {c: {} for c in contenders}  # no fused path on CPU
    assert row["diff"] == {c: 0.0 for c in contenders[1:]}
    if not hf:
        table = (tmp_path / "e2e_moe.md").read_text()
        assert "| 8 | 1 | 16 |" in table and "ditron_fused_combine 2" in table
