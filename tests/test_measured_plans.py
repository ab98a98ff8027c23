"""The AG/RS plans measured on several ranks (scheduler/evidence.py): which measured row stands
for a task, the decision taken from it, the link model where none does, and the table exported
from calibrations (benchmarks/calibration_check.py --export: the calibration makes the shipped
table)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import calibration_check
from ditron_inductor.scheduler import calibration, choose, evidence, link_model, ranking
from ditron_inductor.scheduler.task import ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, Task


def _run(rows, date="2026-11-26 02:55 UTC", terms=1):
    """A calibration's file (ditron_inductor.calibrate) with these measured (op, M, K, N,
    {label: ms}, NCCL + cuBLAS ms) rows on 2 ranks, each timed as `terms` products."""
    source = {"machine": "NVIDIA H200", "date": date, "command": "torchrun ..."}
    return {"machine": {}, "sources": [source], "world1_compute": {"sources": [], "rows": []},
            "measured_plans": {"sources": [source], "rows": [
                {"op": op, "world": 2, "dtype": "bfloat16", "m": m, "k": k, "n": n, "site": None,
                 "terms": terms, "source": 0, "ms": {**plans, "nccl_cublas": nccl}}
                for op, m, k, n, plans, nccl in rows]}}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Installs the measured table exported from the given calibrations, in turn, in place of
    the package's (and no calibration of this machine); the package's own afterwards."""
    def install(*runs):
        (tmp_path / "measured_plans.json").unlink(missing_ok=True)
        for i, run in enumerate(runs):
            monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache{i}"))
            evidence.clear_caches()
            calibration.calibration_path().parent.mkdir(parents=True, exist_ok=True)
            calibration.calibration_path().write_text(json.dumps(run))
            calibration_check.export(str(tmp_path))
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "none"))
        monkeypatch.setattr(evidence, "MEASURED_PLANS", tmp_path / "measured_plans.json")
        evidence.clear_caches()
        return json.loads((tmp_path / "measured_plans.json").read_text())
    yield install
    monkeypatch.undo()
    evidence.clear_caches()


def _task(op, m, k, n, world=2, **more) -> Task:
    return Task(op=op, group_name="0", world_size=world, m=m, k=k, ns=(n,), dtype=torch.bfloat16,
                device_type="cuda", dim_size=m,
                reduce_op=None if op == ALL_GATHER_MATMUL else "sum", **more)


AG, RS = ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER
# a label that names no candidate (tri_sm16_128x256: one since deleted) is never taken
GATE_UP = (AG, 8192, 4096, 14336, {"tri_tma_128x256": 1.522, "cublas_1_3_4": 1.489,
                                   "tri_sm16_128x256": 1.0}, 1.432)
DOWN_GRAD = (AG, 8192, 4096, 7168, {"tri_tma_128x256": 0.859, "cublas_1_2_5": 0.807}, 0.831)


def test_the_export_keeps_rows_and_a_later_calibration_replaces_a_row(table):
    data = table(_run([GATE_UP, DOWN_GRAD]),
                 _run([(*GATE_UP[:4], {"cublas_1_3_4": 1.2}, 1.432)], date="later"))
    assert [s["date"] for s in data["sources"]] == ["2026-11-26 02:55 UTC", "later"]
    assert "what" in data
    rows = {(r["m"], r["k"], r["n"]): r for r in data["rows"]}
    assert len(rows) == 2
    # the later calibration's row, its source the later one
    assert rows[(8192, 4096, 14336)]["ms"] == {"cublas_1_3_4": 1.2, "nccl_cublas": 1.432}
    assert rows[(8192, 4096, 14336)]["source"] == 1
    assert rows[(8192, 4096, 7168)]["ms"] == {"tri_tma_128x256": 0.859, "cublas_1_2_5": 0.807,
                                              "nccl_cublas": 0.831}


def test_a_measured_shape_stands_for_near_tasks_only(table):
    table(_run([GATE_UP]))
    bf16 = torch.bfloat16
    assert evidence.nearest_measured(AG, 2, bf16, 8192, 4096, 14336).shape == (8192, 4096, 14336)
    # each dim within 1.25x: near; one beyond: not; another world size, op or dtype: not
    assert evidence.nearest_measured(AG, 2, bf16, 10240, 3584, 12288) is not None
    assert evidence.nearest_measured(AG, 2, bf16, 8192, 4096, 7168) is None
    assert evidence.nearest_measured(AG, 4, bf16, 8192, 4096, 14336) is None
    assert evidence.nearest_measured(RS, 2, bf16, 8192, 4096, 14336) is None
    assert evidence.nearest_measured(AG, 2, torch.float16, 8192, 4096, 14336) is None


def test_the_scheduler_takes_the_fastest_measured_plan_or_nccl(table):
    table(_run([GATE_UP, DOWN_GRAD]))
    # gate/up: every fused candidate slower than NCCL + cuBLAS (a column that names no
    # candidate is not taken): the graph keeps NCCL + cuBLAS
    plan, why = choose.choose_device_plan(_task(*GATE_UP[:4]))
    assert plan is None
    assert why.startswith("no measured gain: measured on 2 ranks at 8192x4096x14336 (NVIDIA H200, "
                          "2026-11-26 02:55 UTC): NCCL+cuBLAS 1.432 ms, fastest "
                          "fused cublas_1_3_4 1.489 ms")
    # down's output gradient: the cuBLAS-group plan, 1.03x NCCL's time (>= MEASURED_MIN_GAIN)
    plan, why = choose.choose_device_plan(_task(*DOWN_GRAD[:4]))
    assert (plan.label, plan.predicted_ms) == ("cublas_1_2_5", (("nccl_cublas", 0.831),
                                                               ("fused", 0.807)))
    assert why.startswith("fused plan cublas_1_2_5: measured on 2 ranks")
    # DITRON_PLAN=fused where NCCL won: the fastest measured fused plan
    assert choose.fused_plan(_task(*GATE_UP[:4])).label == "cublas_1_3_4"
    # a gain below MEASURED_MIN_GAIN (1.5%) is not taken
    table(_run([(RS, 8192, 64128, 4096, {"cublas_triton_reduce": 6.2}, 6.293)]))
    assert choose.choose_device_plan(_task(RS, 8192, 64128, 4096))[0] is None


def test_a_sum_of_products_adds_the_rewrite_costs_to_each_side(table):
    table(_run([(RS, 8192, 14336, 4096, {"cublas_triton_reduce": 1.444}, 1.558)]))
    task = _task(RS, 8192, 14336, 4096, terms=2, copy_elems=58720256)
    copy_ms, sum_ms = link_model.rewrite_costs(task, evidence.link(2))
    assert copy_ms > 0 and sum_ms > 0
    decision = ranking.measured_decision(task)
    assert decision.fused_ms == pytest.approx(1.444 + copy_ms)
    assert decision.unfused_ms == pytest.approx(1.558 + sum_ms)


def test_a_row_timed_as_the_sum_holds_its_accumulation_and_add(table):
    """The calibration times a sum site by its terms (Site.term_ks): the fused time holds the
    op's accumulation and NCCL + cuBLAS's the graph's add, so neither is added again; the
    rewrite's copies still are."""
    data = table(_run([(RS, 8192, 14336, 4096, {"cublas_triton_reduce": 1.444}, 1.558)],
                      terms=2))
    assert data["rows"][0]["terms"] == 2
    task = _task(RS, 8192, 14336, 4096, terms=2, copy_elems=1 << 20)
    copy_only = link_model.rewrite_costs(
        _task(RS, 8192, 14336, 4096, copy_elems=1 << 20), evidence.link(2))[0]
    assert 0 < copy_only < link_model.rewrite_costs(task, evidence.link(2))[0]
    decision = ranking.measured_decision(task)
    assert decision.fused_ms == pytest.approx(1.444 + copy_only)
    assert decision.unfused_ms == pytest.approx(1.558)


def test_where_no_row_is_near_the_link_model_decides(table):
    table(_run([GATE_UP]))
    task = _task(AG, 8192, 4096, 28672)  # N twice gate/up's: no measured row stands for it
    assert ranking.measured_decision(task) is None
    plan, why = choose.choose_device_plan(task)
    assert why.startswith("fused plan tri_tma_128x256: predicted")


def test_bench_fused_times_the_llama_sites_with_their_weights():
    """bench_fused.py --sites: the training step's sites keyed as the table's (M, K, N) rows (N the
    weights' summed width), each timed with its weights as the graph holds them (q/k/v's three,
    a forward site's the Linear weight's transpose, a backward site's the weight), a sum of
    products with its terms' K."""
    from benchmarks.bench_fused import llama_site_shapes

    shapes = llama_site_shapes("8b", 2, 8192)
    assert [(shape, site.name) for shape, site in shapes[AG]][:2] == [
        ((8192, 4096, 3072), "q/k/v gather"), ((8192, 4096, 14336), "gate/up gather")]
    qkv = dict((site.name, site) for _, site in shapes[AG])["q/k/v gather"].weights("cpu",
                                                                                  torch.float32)
    assert [(tuple(w.shape), w.stride()) for w in qkv] == [
        ((4096, 2048), (1, 4096)), ((4096, 512), (1, 4096)), ((4096, 512), (1, 4096))]
    grad = dict((site.name, site) for _, site in shapes[AG])["o output-grad gather"]
    assert [w.stride() for w in grad.weights("cpu", torch.float32)] == [(2048, 1)]
    # a sum of products: K the terms' together, each term's K with the site
    assert ((8192, 14336, 4096), "gate/up input-grad scatter", (7168, 7168)) in [
        (shape, site.name, site.term_ks) for shape, site in shapes[RS]]
    assert (len(shapes[AG]), len(shapes[RS])) == (5, 5)
