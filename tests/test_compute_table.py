"""The world-1 compute table (scheduler/evidence.py) and the all-reduce decisions it feeds: what a
fused plan's compute costs beside the unfused path's, measured, plus the link model's
communication; the AG/RS decisions' log lines that quote it; the table exported from calibrations
(benchmarks/calibration_check.py --export), and benchmarks/bench_compute_parity.py's run on CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from ditron_inductor.scheduler import evidence, link_model
from ditron_inductor.scheduler.calibration import calibration_path
from ditron_inductor.scheduler.choose import choose_device_plan, fused_plan
from ditron_inductor.scheduler.policy import MIN_GAIN
from ditron_inductor.scheduler.plan import (
    AllGatherPlan,
    AllReducePlan,
    ReduceScatterPlan,
    family,
)
from ditron_inductor.scheduler.task import MATMUL_ALL_REDUCE_RMSNORM, Task
from tests import REPO_ROOT

ARN = Task(op=MATMUL_ALL_REDUCE_RMSNORM, group_name="0", world_size=2, m=4096, k=7168,
           ns=(4096,), dtype=torch.bfloat16, device_type="cuda", reduce_op="sum")
OVERLAP = "push+overlap:triton"  # the prefill plan's family


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A world-1 table of the rows given (op, family, mode, M, K, N, fused ms, unfused ms) in
    place of the package's."""
    def use(rows):
        path = tmp_path / "world1_compute.json"
        path.write_text(json.dumps({"sources": [{"machine": "none", "date": "today",
                                                 "command": "test"}], "rows": rows}))
        monkeypatch.setattr(evidence, "WORLD1_COMPUTE", path)
        evidence.clear_caches()
    yield use
    monkeypatch.undo()
    evidence.clear_caches()


def test_plan_families():
    assert family(AllGatherPlan(gemm="triton")) == "triton"
    assert family(AllGatherPlan(gemm="cublas")) == "cublas"
    assert family(ReduceScatterPlan(reduce="triton")) == "cublas"
    assert family(AllReducePlan(algo="lamport")) == "lamport"
    assert family(AllReducePlan(algo="push", overlap=True, gemm="triton")) == OVERLAP
    assert family(AllReducePlan(algo="push", overlap=True)) == "push+overlap:cublas"


def test_nearest_measured_shape_stands_for_a_task(table):
    table([[MATMUL_ALL_REDUCE_RMSNORM, "push", "graph", 4096, 7168, 4096, 0.5, 0.4],
           [MATMUL_ALL_REDUCE_RMSNORM, "push", "graph", 16, 7168, 4096, 0.03, 0.02],
           [MATMUL_ALL_REDUCE_RMSNORM, "push", "eager", 4096, 7168, 4096, 0.9, 0.8]])
    costs = evidence.world1_costs
    assert costs(MATMUL_ALL_REDUCE_RMSNORM, "push", True, 4096, 7168, 4096) == (
        0.5, 0.4, (4096, 7168, 4096), "")
    assert costs(MATMUL_ALL_REDUCE_RMSNORM, "push", False, 4096, 7168, 4096)[:2] == (0.9, 0.8)
    # twice the rows: twice the work; at decode sizes latency, not work: as measured
    assert costs(MATMUL_ALL_REDUCE_RMSNORM, "push", True, 8192, 7168, 4096)[:2] == (1.0, 0.8)
    assert costs(MATMUL_ALL_REDUCE_RMSNORM, "push", True, 8, 7168, 4096)[:2] == (0.03, 0.02)
    # nothing within a factor 2 in every dim, another family or op: no measurement
    assert costs(MATMUL_ALL_REDUCE_RMSNORM, "push", True, 4096, 2048, 4096) is None
    assert costs(MATMUL_ALL_REDUCE_RMSNORM, "lamport", True, 4096, 7168, 4096) is None
    assert costs("matmul_all_reduce", "push", True, 4096, 7168, 4096) is None


def test_all_reduce_costs_add_the_link_model_to_the_measured_compute(table):
    table([[MATMUL_ALL_REDUCE_RMSNORM, OVERLAP, "graph", 4096, 7168, 4096, 0.40, 0.36]])
    plan = fused_plan(ARN)
    assert family(plan) == OVERLAP and plan.chunks == 16
    world1 = evidence.world1_costs(ARN.op, family(plan), True, 4096, 7168, 4096)
    c = evidence.link(2)
    costs = link_model.all_reduce_costs(ARN, plan, c, world1.fused_ms, world1.unfused_ms)
    ring = 2 * 1 / 2 * 4096 * 4096 * 2 / 1e9 / c["nccl_ar_busbw_gbps"] * 1e3
    assert costs.fused == pytest.approx(0.40 + ring / 16 + c["fused_latency_ms"])
    assert costs.unfused == pytest.approx(0.36 + ring + c["nccl_latency_ms"])
    assert evidence.world1_costs(ARN.op, family(plan), False, 4096, 7168, 4096) is None


def test_all_reduce_fused_only_where_predicted_faster(table):
    """The same site fused with a fast fused GEMM, kept with a slow one; either way the log's
    reason carries both predictions, compute measured and communication modelled."""
    table([[MATMUL_ALL_REDUCE_RMSNORM, "copy_engine", "graph", 4096, 7168, 4096, 0.40, 0.36]])
    plan, why = choose_device_plan(ARN, cuda_graphs=True)
    assert plan is not None and "predicted fused" in why and "NCCL + cuBLAS" in why
    predicted = dict(plan.predicted_ms)
    assert predicted["fused"] * MIN_GAIN <= predicted["nccl_cublas"]
    assert plan.describe().endswith(f"predicted nccl_cublas {predicted['nccl_cublas']:.3f} ms, "
                                    f"fused {predicted['fused']:.3f} ms")

    table([[MATMUL_ALL_REDUCE_RMSNORM, "copy_engine", "graph", 4096, 7168, 4096, 0.48, 0.36]])
    plan, why = choose_device_plan(ARN, cuda_graphs=True)
    assert plan is None and why.startswith("no predicted gain: predicted fused 0.")
    assert "compute 0.480 measured at world size 1" in why and "compute 0.360 measured" in why


def test_all_reduce_without_a_measurement_keeps_the_thresholds(table):
    table([])
    plan, why = choose_device_plan(ARN, cuda_graphs=True)
    assert plan is not None and "no world-1 measurement near this shape" in why


def test_the_package_table_is_well_formed():
    """Every row names a known op and family and has finite, positive times; the table says
    where it came from."""
    data = json.loads(evidence.WORLD1_COMPUTE.read_text())
    assert all(s["machine"] and s["date"] and ("bench_compute_parity.py" in s["command"] or
                                               "ditron_inductor.calibrate" in s["command"])
               for s in data["sources"]) and data["sources"]
    families = {"cublas", "triton", "push", "push_all", "lamport", "lamport_all",
                "push+overlap:triton", "push+overlap:cublas", "copy_engine"}
    for op, fam, mode, m, k, n, fused_ms, unfused_ms in data["rows"]:
        assert fam in families and mode in ("eager", "graph") and min(m, k, n) >= 1
        assert 0 < fused_ms < math.inf and 0 < unfused_ms < math.inf, (op, fam, m, k, n)


def test_the_table_is_exported_from_calibrations(tmp_path, monkeypatch):
    """The calibration's world-1 rows become the shipped table (calibration_check --export):
    one row per op, family, mode and shape, a later calibration's replacing an earlier one's,
    both runs' sources kept, and the scheduler reads it with its provenance."""
    from benchmarks import calibration_check

    def calibration(date, *rows):
        source = {"machine": "GPU", "date": date, "command": "torchrun ... calibrate"}
        return {"world1_compute": {"sources": [source], "rows": [
                    [MATMUL_ALL_REDUCE_RMSNORM, fam, "graph", 4096, 7168, 4096, ms, 0.36]
                    for fam, ms in rows]},
                "measured_plans": {"sources": [], "rows": []}}
    path = tmp_path / "world1_compute.json"
    for i, run in enumerate([calibration("now", (OVERLAP, 0.45), ("push", 0.42)),
                             calibration("later", (OVERLAP, 0.41))]):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache{i}"))
        evidence.clear_caches()
        calibration_path().parent.mkdir(parents=True)
        calibration_path().write_text(json.dumps(run))
        calibration_check.export(str(tmp_path))
    data = json.loads(path.read_text())
    assert sorted(data["rows"]) == [
        [MATMUL_ALL_REDUCE_RMSNORM, "push", "graph", 4096, 7168, 4096, 0.42, 0.36],
        [MATMUL_ALL_REDUCE_RMSNORM, OVERLAP, "graph", 4096, 7168, 4096, 0.41, 0.36]]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "none"))
    monkeypatch.setattr(evidence, "WORLD1_COMPUTE", path)
    evidence.clear_caches()
    try:
        assert evidence.world1_source() == "GPU, now; GPU, later"
        assert evidence.world1_costs(MATMUL_ALL_REDUCE_RMSNORM, OVERLAP, True, 4096, 7168,
                                     4096)[:2] == (0.41, 0.36)
    finally:
        monkeypatch.undo()
        evidence.clear_caches()


def test_benchmark_runs_on_cpu(tmp_path):
    """The program's CPU smoke run: a row for every site of the tiny model at TP 2 with the
    scheduler's decision (`none` and its reason where it keeps NCCL + cuBLAS), the unfused
    compute timed, and the plans' reference path said as such (no fused kernels on CPU)."""
    out = tmp_path / "parity"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks/bench_compute_parity.py"),
                           "--device", "cpu", "--tiny", "--variants", "none", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "parity.json").read_text())["rows"]
    from benchmarks.llama_sites import sites

    expected = {(w, s.name, "graph" if s.cuda_graphs else "eager")
                for w, tokens, graphs in (("train", 64, False), ("prefill", 32, False),
                                          ("prefill", 32, True), ("decode", 4, True))
                for s in sites("tiny", 2, w, tokens, graphs)}
    assert {(r["workload"], r["site"], r["mode"]) for r in rows} == expected
    for r in rows:
        assert r["plan"] in ("chosen", "none")
        assert (r["plan"] == "none") == (r["plan_text"] is None), r
        assert r["why"], r
        if r["mode"] == "eager":
            assert r["unfused_ms"] > 0
        assert not r["served"]  # no fused kernel on CPU: never timed as fused
    assert "| tiny | 2 | train | q/k/v gather |" in (tmp_path / "parity.md").read_text()


@pytest.mark.parametrize("model", ["8b", "70b"])
def test_llama_tp2_prefill_all_reduces_under_cuda_graphs(model):
    """The package's table, TP 2 under CUDA graphs: at S 1024 the push beside the
    Triton GEMM of down_proj's long K costs more compute than the all-reduce it hides, so the
    graph keeps NCCL + cuBLAS there, and o_proj's, with a short K, is fused; from S 2048 both
    take the copy-engine plan (cuBLAS on every SM), predicted faster from its measured
    compute."""
    from benchmarks.llama_sites import sites

    o_proj, down_proj = sites(model, 2, "prefill", 1024, cuda_graphs=True)
    plan, why = choose_device_plan(o_proj.task, cuda_graphs=True)
    assert plan is not None and family(plan) == OVERLAP, why
    plan, why = choose_device_plan(down_proj.task, cuda_graphs=True)
    assert plan is None and why.startswith("no predicted gain: predicted fused"), why
    for tokens in (2048, 4096):
        for site in sites(model, 2, "prefill", tokens, cuda_graphs=True):
            plan, why = choose_device_plan(site.task, cuda_graphs=True)
            assert plan is not None and plan.algo == "copy_engine", why
            predicted = dict(plan.predicted_ms)
            assert predicted["fused"] * MIN_GAIN <= predicted["nccl_cublas"], why


def test_all_gather_and_scatter_decisions_name_the_measured_world1_compute(table, monkeypatch):
    # the AG/RS decision is the link and GEMM model's (no measured row stands for the shape);
    # the log adds the plan family's compute measured at world size 1 where the table has a
    # shape near the task's
    monkeypatch.setattr(evidence, "nearest_measured", lambda *args: None)
    ag = Task(op="all_gather_matmul", group_name="0", world_size=2, m=8192, k=4096,
              ns=(2048, 512, 512), dtype=torch.bfloat16, device_type="cuda")
    table([])
    plan, why = choose_device_plan(ag)
    assert "measured" not in why
    table([["all_gather_matmul", family(plan), "eager", 8192, 4096, 3072, 0.344, 0.272]])
    plan_again, why_measured = choose_device_plan(ag)
    assert plan_again.label == plan.label  # the decision does not change
    assert why_measured == (why + "; compute measured at world size 1: fused 0.344 vs unfused "
                            "0.272 ms")
