"""The reduce-scatter that pulls and accumulates (ReduceScatterPlan.accumulate: every rank pulls
its rows of the peers' partials by the copy engine and cuBLAS adds its own product onto them):
its data path on ranks emulated in host memory, odd shapes, 2 and 3 ranks, one and several row
chunks, a sum of products, bias and avg, against the sum over ranks; the flags it leaves; what
it declines; and that the scheduler takes it only where it was measured."""

from __future__ import annotations

import pytest
import torch

from ditron_inductor.scheduler.decide import plan_for
from ditron_inductor.scheduler.task import MATMUL_REDUCE_SCATTER, matmul_terms_task
from tests.host_ranks import HostContext, host_driver, random_terms

BF16 = torch.bfloat16


def _run_on_host_ranks(monkeypatch, world, rows, ks, n, chunks, bias=None, reduce_op="sum",
                       waits=None, ctxs=None):
    """Every rank's call, twice over with the same epoch (the emulated ranks run one after the
    other: in the first pass a rank may pull a peer's slots before the peer filled them, in the
    second every slot holds this epoch's partials): (the second pass's outputs, the contexts,
    the inputs). waits: a list that gets (rank, flag word, value) of every wait queued; ctxs:
    contexts from an earlier run to go on with (their buffers as big), else new ones."""
    pytest.importorskip("triton")
    from ditron_inductor.runtime import reduce_scatter

    ranks = random_terms(world, rows, ks, n, seed=world * 100 + rows + len(ks))
    if ctxs is None:
        ctxs = [HostContext(world, r, 2 * world * rows * n * 2) for r in range(world)]
        for c in ctxs:
            c.connect(ctxs)
    host_driver(reduce_scatter, monkeypatch)
    monkeypatch.setattr(reduce_scatter, "wait_geq", lambda ctx, plan, stream, idx, value: (
        waits.append((ctx.rank, idx, value)) if waits is not None else None))
    a, b = ranks[0]
    task = matmul_terms_task(MATMUL_REDUCE_SCATTER, a, b, bias, [], 0, reduce_op, "0", world)
    plan = plan_for(task, gemm="cublas", accumulate=True, chunks=chunks)
    served = reduce_scatter.stats["matmul_reduce_scatter"]
    outs = {}
    start = [(c.epoch, c.announced) for c in ctxs]
    for _ in range(2):
        for r in range(world):
            ctxs[r].epoch, ctxs[r].announced = start[r]
            monkeypatch.setattr(reduce_scatter, "get_context", lambda *args, r=r: ctxs[r])
            outs[r] = reduce_scatter.matmul_reduce_scatter_fused(task, plan, *ranks[r], bias, [],
                                                                 0, reduce_op, "0", world)
    assert reduce_scatter.stats["matmul_reduce_scatter"] == served + 2 * world
    return outs, ctxs, ranks


@pytest.mark.parametrize("world, rows, ks, chunks", [
    (2, 38, (24,), 2),       # two chunks of 19 rows
    (2, 37, (40, 8), 4),     # 37 rows: one chunk; a sum of two products
    (3, 12, (16, 24, 8), 4),  # three ranks: the pulled partials summed in staging slots
    (2, 1, (8,), 2),          # one row per rank
])
def test_every_rank_gets_the_sum_of_its_rows(monkeypatch, world, rows, ks, chunks):
    n = 24
    outs, _, ranks = _run_on_host_ranks(monkeypatch, world, rows, ks, n, chunks)
    products = [sum((a.float() @ b.float() for a, b in zip(*terms)), torch.zeros(1))
                for terms in ranks]
    for r in range(world):
        want = sum(p[r * rows:(r + 1) * rows] for p in products)
        assert outs[r].dtype == BF16 and outs[r].shape == (rows, n)
        torch.testing.assert_close(outs[r].float(), want, atol=0.05, rtol=0.02)


def test_bias_once_per_rank_and_avg(monkeypatch):
    """As the reference: each rank's product carries the bias, and avg divides the sum by W."""
    world, rows, n = 2, 16, 8
    bias = torch.linspace(-1, 1, n).to(BF16)
    outs, _, ranks = _run_on_host_ranks(monkeypatch, world, rows, (32,), n, 2, bias=bias,
                                        reduce_op="avg")
    for r in range(world):
        want = sum(a[0].float()[r * rows:(r + 1) * rows] @ b[0].float() + bias.float()
                   for a, b in ranks) / world
        torch.testing.assert_close(outs[r].float(), want, atol=0.05, rtol=0.02)


def test_the_flags_announce_each_chunk_and_release_the_buffers(monkeypatch):
    """The first call, 2 chunks: each rank waits for each peer's chunk s at READY >= s + 1 = 1, 2
    (what the peer writes as it announces them) and, at epoch 1, for no DONE (e - 2 < 0); after
    it, its READY word of each peer holds 2 (the last chunk announced) and its DONE word of each
    peer 1 (it pulled their buffers)."""
    world, waits = 3, []
    _, ctxs, _ = _run_on_host_ranks(monkeypatch, world, 8, (16,), 8, 2, waits=waits)
    for ctx in ctxs:
        peers = [q for q in range(world) if q != ctx.rank]
        for q in peers:
            assert ctx.flag_words[ctx.READY + q].item() == 2
            assert ctx.flag_words[ctx.DONE + q].item() == 1
        mine = sorted((idx, value) for rank, idx, value in waits if rank == ctx.rank)
        assert mine == sorted([(ctx.DONE + q, -1) for q in peers] * 2
                              + [(ctx.READY + q, v) for q in peers for v in (1, 2)] * 2)


def test_a_call_of_fewer_chunks_after_more_waits_for_its_own(monkeypatch):
    """Calls that cut different numbers of chunks share a context (the GPU test found a call of 2
    chunks after one of 4 pulling before its data was there, when READY was epoch x chunks):
    every wait of the later call is above every value the earlier one wrote, and its numbers
    are right."""
    world, rows, n = 2, 16, 8
    _, ctxs, _ = _run_on_host_ranks(monkeypatch, world, rows, (16,), n, 4)
    written = max(c.flag_words[c.READY + q].item() for c in ctxs for q in range(world))
    assert written == 4
    waits = []
    outs, _, ranks = _run_on_host_ranks(monkeypatch, world, rows, (8,), n, 2, waits=waits,
                                        ctxs=ctxs)
    ready = [value for _, idx, value in waits if idx < world]
    assert ready and min(ready) > written
    for r in range(world):
        want = sum(a[0].float()[r * rows:(r + 1) * rows] @ b[0].float() for a, b in ranks)
        torch.testing.assert_close(outs[r].float(), want, atol=0.05, rtol=0.02)


def test_accumulate_chunks_divide_the_rows():
    from ditron_inductor.runtime.reduce_scatter import accumulate_chunks

    assert [accumulate_chunks(rows, 4) for rows in (4096, 38, 37, 2, 1)] == [4, 2, 1, 2, 1]


def test_float8_declines_it(caplog):
    """_scaled_mm accumulates into nothing: the float8 op declines the plan before any
    protocol step."""
    pytest.importorskip("triton")
    import logging

    from ditron_inductor.log_names import LOGGER_NAME
    from ditron_inductor.runtime import reduce_scatter

    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    a = torch.zeros(8, 16).to(torch.float8_e4m3fn)
    b = torch.zeros(16, 8).to(torch.float8_e4m3fn)
    scale = torch.ones(())
    task = matmul_terms_task(MATMUL_REDUCE_SCATTER, [a.to(BF16)], [b.to(BF16)], None, [], 0,
                             "sum", "0", 2)
    plan = plan_for(task, gemm="cublas", accumulate=True, chunks=2)
    assert reduce_scatter.scaled_mm_reduce_scatter_fused(
        task, plan, [a], [b], [scale], [scale], None, BF16, False, [], 0, "sum", "0", 2) is None
    assert any("_scaled_mm accumulates into nothing" in r.getMessage() for r in caplog.records)


def test_taken_only_where_measured(tmp_path, monkeypatch):
    """The link model has no term for the pulls: it never picks the plan; a measured row where it
    ran fastest does, for one matmul and for a sum of products (it takes the terms), unless the
    option skips it."""
    import json

    from benchmarks import measured_plans_table
    from ditron_inductor.scheduler import cost_model, measured_plans

    def task(terms):
        a = [torch.empty(8192, 2048 // terms, dtype=BF16)] * terms
        b = [torch.empty(2048 // terms, 4096, dtype=BF16)] * terms
        return matmul_terms_task(MATMUL_REDUCE_SCATTER, a, b, None, [], 0, "sum", "0", 2)

    assert "cublas_accumulate" in cost_model.candidates_for(task(2))
    assert "cublas_accumulate" in cost_model.unvalidated(2)
    monkeypatch.setattr(cost_model.config, "measured_plans", False)
    assert not cost_model.fused_plan(task(1)).accumulate
    monkeypatch.setattr(cost_model.config, "measured_plans", True)
    run = {"meta": {"gpu": "NVIDIA H200", "date": "d", "command": "c"},
           "rows": [{"op": MATMUL_REDUCE_SCATTER, "world": 2, "dtype": "bfloat16", "M": 8192,
                     "K": 2048, "N": 4096, "site": None, "ms": {"nccl_cublas": 0.354},
                     "plans": {"cublas_triton_reduce": 0.236, "cublas_accumulate": 0.2}}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    measured_plans_table.main([str(tmp_path / "run.json"), "--out", str(tmp_path / "t.json")])
    monkeypatch.setattr(measured_plans, "TABLE", tmp_path / "t.json")
    measured_plans._rows.cache_clear()
    try:
        for terms in (1, 2):
            plan, why = cost_model.choose_device_plan(task(terms))
            assert plan.accumulate and plan.label == "cublas_accumulate", why
        # ditron.skip_plans: the next fastest measured there
        monkeypatch.setattr(cost_model.config, "skip_plans", frozenset({"cublas_accumulate"}))
        assert cost_model.choose_device_plan(task(2))[0].label == "cublas_triton_reduce"
    finally:
        measured_plans._rows.cache_clear()
