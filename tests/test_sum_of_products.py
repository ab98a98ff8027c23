"""The fused reduce-scatter and all-reduce of a sum of matmul products (the input gradient of
layers that share their input: gate/up, q/k/v), which take each term's operands as they are
(runtime/launch.MatmulSum): the copy-engine reduce-scatter's data path on ranks emulated in host
memory, odd shapes, against the sum of the terms' products; the plans that cannot take terms
decline before any protocol step."""

from __future__ import annotations

import logging

import pytest
import torch

from ditron_inductor.log_names import LOGGER_NAME
from ditron_inductor.scheduler.decide import plan_for
from ditron_inductor.scheduler.task import (MATMUL_ALL_REDUCE, MATMUL_REDUCE_SCATTER,
                                            matmul_terms_task)
from tests.host_ranks import HostContext, host_driver
from tests.host_ranks import random_terms as _terms

BF16 = torch.bfloat16


@pytest.mark.parametrize("ks", [(24,), (24, 40), (40, 8, 24)])
def test_reduce_scatter_of_a_sum_on_emulated_ranks(monkeypatch, ks):
    """Two ranks run 1, 0, 1 (each one's slots filled by the other's earlier run): every rank's
    rows of the output are the sum over ranks of its terms' products, as the reference sums
    them (each product rounded to bf16: within bf16's rounding of the accumulated sum)."""
    pytest.importorskip("triton")
    from ditron_inductor.runtime import reduce_scatter

    world, rows, n = 2, 37, 24
    ranks = _terms(world, rows, ks, n, seed=len(ks))
    products = [sum((a.float() @ b.float() for a, b in zip(*terms)), torch.zeros(1))
                for terms in ranks]
    ctxs = [HostContext(world, r, world * rows * n * 2) for r in range(world)]
    for c in ctxs:
        c.connect(ctxs)
    host_driver(reduce_scatter, monkeypatch)
    monkeypatch.setattr(reduce_scatter, "wait_geq", lambda *a: None)
    a, b = ranks[0]
    task = matmul_terms_task(MATMUL_REDUCE_SCATTER, a, b, None, [], 0, "sum", "0", world)
    assert (task.terms, task.k, task.copy_elems) == (len(ks), sum(ks), 0)
    plan = plan_for(task, reduce="torch")  # torch.sum reduces the slots (no Triton launch)
    served = reduce_scatter.stats["matmul_reduce_scatter"]
    outs = {}
    for r in (1, 0, 1):
        monkeypatch.setattr(reduce_scatter, "get_context", lambda *args, r=r: ctxs[r])
        outs[r] = reduce_scatter.matmul_reduce_scatter_fused(task, plan, *ranks[r], None, [], 0,
                                                             "sum", "0", world)
    assert reduce_scatter.stats["matmul_reduce_scatter"] == served + 3
    for r in range(world):
        want = sum(p[r * rows:(r + 1) * rows] for p in products)
        assert outs[r].dtype == BF16 and outs[r].shape == (rows, n)
        torch.testing.assert_close(outs[r].float(), want, atol=0.05, rtol=0.02)


def _declined(caplog, call) -> str:
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    assert call() is None
    messages = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("fused path declined")]
    assert len(messages) == 1, messages
    return messages[0]


def test_plans_that_take_one_term_decline_a_sum(caplog):
    """The Triton GEMMs (the reduce-scatter's tile program and SM pull, the all-reduce's
    persistent GEMM beside push) take one term: a sum declines before the protocol starts
    (nothing queued, no context), alike on every rank; so do terms of different dtypes."""
    pytest.importorskip("triton")
    from ditron_inductor.runtime import all_reduce, reduce_scatter

    (a, b), _ = _terms(2, 8, (16, 32), 24, seed=0)
    rs = matmul_terms_task(MATMUL_REDUCE_SCATTER, a, b, None, [], 0, "sum", "0", 2)
    why = _declined(caplog, lambda: reduce_scatter.matmul_reduce_scatter_fused(
        rs, plan_for(rs, reduce="torch"), [a[0], a[1].half()], b, None, [], 0, "sum", "0", 2))
    assert "dtype, rank or shape of the operands" in why
    ar = matmul_terms_task(MATMUL_ALL_REDUCE, a, b, None, [], 0, "sum", "0", 2)
    overlap = plan_for(ar, algo="push", overlap=True, gemm="triton", chunks=4, progs=16)
    why = _declined(caplog, lambda: all_reduce.matmul_all_reduce_fused(
        ar, overlap, a, b, None, [], "sum", "0", 2))
    assert "the persistent Triton GEMM beside push takes one term" in why


def test_the_scheduler_gives_a_sum_the_cublas_plans():
    """Every reduce-scatter candidate takes a sum's terms (cuBLAS accumulates them); the
    all-reduce takes a cuBLAS GEMM, not the persistent Triton one (one term)."""
    from ditron_inductor.scheduler.candidates import candidates_for
    from ditron_inductor.scheduler.choose import fused_plan

    rs = matmul_terms_task(MATMUL_REDUCE_SCATTER, [torch.empty(8192, 7168, dtype=BF16)] * 2,
                           [torch.empty(7168, 4096, dtype=BF16)] * 2, None, [], 0, "sum", "0", 2)
    assert set(candidates_for(rs)) == {"cublas_triton_reduce", "cublas"}
    assert fused_plan(rs).label == "cublas_triton_reduce"
    ar = matmul_terms_task(MATMUL_ALL_REDUCE, [torch.empty(4096, 1024, dtype=BF16)] * 2,
                           [torch.empty(1024, 8192, dtype=BF16)] * 2, None, [], 0, "sum", "0", 2)
    assert fused_plan(ar).gemm == "cublas"


def test_the_rmsnorm_op_still_concatenates_a_sum():
    """The RMSNorm op takes one left operand: a sum's terms concatenated along K (the rewrite's
    copy, counted), no accumulation read charged, its plans not restricted to cuBLAS."""
    import dataclasses

    from ditron_inductor.scheduler.evidence import link
    from ditron_inductor.scheduler.link_model import rewrite_costs
    from ditron_inductor.scheduler.task import MATMUL_ALL_REDUCE_RMSNORM, matmul_collective_task

    a, b = torch.empty(4096, 2048, dtype=BF16), torch.empty(2048, 4096, dtype=BF16)
    one = matmul_collective_task(MATMUL_ALL_REDUCE_RMSNORM, a, b, None, [], 0, "sum", "0", 2)
    norm = dataclasses.replace(one, terms=2)
    summed = dataclasses.replace(one, op=MATMUL_ALL_REDUCE, terms=2)
    assert not norm.sums_terms and summed.sums_terms
    assert "2 matmuls concatenated along K" in norm.describe()
    assert "2 matmul products summed" in summed.describe()
    assert rewrite_costs(norm, link(2))[0] == 0.0 < rewrite_costs(summed, link(2))[0]
