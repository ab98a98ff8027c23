"""The ops' dispatch: fused implementation where it serves, reference where it does not, and
errors that name the problem."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from ditron_inductor import ops
from ditron_inductor.scheduler.plan import REFERENCE_PLAN, AllReducePlan
from ditron_inductor.scheduler.task import MATMUL_ALL_REDUCE, matmul_collective_task
from tests.fx_helpers import fake_group

FUSED_PLAN = AllReducePlan().encode()


def cuda_task(world_size=2):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    task = matmul_collective_task(MATMUL_ALL_REDUCE, a, b, None, [], 0, "sum", "0", world_size)
    return dataclasses.replace(task, device_type="cuda")


def task_builder(monkeypatch):
    """The all-reduce's Task, whatever the arguments (the tests' ops take (x, group, world))."""
    monkeypatch.setitem(ops._TASK_BUILDERS, ops.MATMUL_ALL_REDUCE, lambda *args: cuda_task())
    monkeypatch.setattr(ops, "_tasks", {})


def test_fused_impl_serves_when_it_can(monkeypatch):
    monkeypatch.setitem(ops._fused_impls, ops.MATMUL_ALL_REDUCE,
                        lambda task, plan, x, group, world: x + 1)
    task_builder(monkeypatch)
    with fake_group(2):
        out = ops._dispatch(ops.MATMUL_ALL_REDUCE, FUSED_PLAN, True,
                            lambda x, group, world: x * 10, torch.ones(2), "0", 2)
        assert out.tolist() == [2, 2]
        out = ops._dispatch(ops.MATMUL_ALL_REDUCE, FUSED_PLAN, False,
                            lambda x, group, world: x * 10, torch.ones(2), "0", 2)
        assert out.tolist() == [10, 10]  # not on CUDA: the reference


def test_fused_impl_that_cannot_serve_falls_back_to_reference(monkeypatch, caplog):
    seen = []
    monkeypatch.setitem(ops._fused_impls, ops.MATMUL_ALL_REDUCE,
                        lambda task, plan, x, group, world: seen.append(plan) or None)
    monkeypatch.setattr(ops, "_fallbacks_logged", set())
    task_builder(monkeypatch)
    with fake_group(2), caplog.at_level(logging.DEBUG, logger="ditron"):
        for _ in range(2):
            out = ops._dispatch(ops.MATMUL_ALL_REDUCE, FUSED_PLAN, True,
                                lambda x, group, world: x * 10, torch.ones(2), "0", 2)
    assert out.tolist() == [10, 10] and len(seen) == 2
    fallbacks = [r for r in caplog.records if "ran the reference path" in r.getMessage()]
    assert len(fallbacks) == 1  # said once, not per call


def test_group_of_another_size_is_named():
    with fake_group(4), pytest.raises(RuntimeError, match="'0' has 4 ranks, but the graph was "
                                                          "compiled for 2"):
        ops.check_group("0", 2)


def test_unknown_group_is_named():
    with fake_group(2), pytest.raises(RuntimeError, match="'missing' of a compiled graph is not "
                                                          "known in this process"):
        torch.ops.ditron.matmul_all_reduce([torch.randn(2, 2)], [torch.randn(2, 2)], None, [],
                                           "sum", "missing", 2, REFERENCE_PLAN.encode())


def test_fake_shapes_follow_the_collectives():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(2, 3, 16)
        outs = torch.ops.ditron.all_gather_matmul(a, [torch.empty(16, 5)], [None], 1, "0", 4, "")
        assert [tuple(o.shape) for o in outs] == [(2, 12, 16), (24, 5)]
        rs = torch.ops.ditron.matmul_reduce_scatter([torch.empty(24, 16)], [torch.empty(16, 8)],
                                                    None, [2, 12, 8], 1, "sum", "0", 4, "")
        assert tuple(rs.shape) == (2, 3, 8)
        ar = torch.ops.ditron.matmul_all_reduce([torch.empty(24, 16)], [torch.empty(16, 8)],
                                                None, [], "sum", "0", 4, "")
        assert tuple(ar.shape) == (24, 8)


def test_tasks_are_built_once_per_shape():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    args = ([b], None, [], "sum", "0", 2)
    first = ops.task_of(ops.MATMUL_ALL_REDUCE, [a], *args)
    assert ops.task_of(ops.MATMUL_ALL_REDUCE, [torch.randn(4, 8)], *args) is first
    other = ops.task_of(ops.MATMUL_ALL_REDUCE, [torch.randn(6, 8)], *args)
    assert (first.m, other.m) == (4, 6) and other.op == ops.MATMUL_ALL_REDUCE
    assert ops.task_of(ops.MATMUL_ALL_REDUCE, [a.half()], *args).dtype == torch.float16
    norm = ops.task_of(ops.MATMUL_ALL_REDUCE_RMSNORM, a, b, None, [], torch.randn(4, 3),
                       torch.ones(3), 1e-6, False, "sum", "0", 2)
    assert norm.op == ops.MATMUL_ALL_REDUCE_RMSNORM
    gathered = ops.task_of(ops.ALL_GATHER_MATMUL, a, [b, torch.randn(8, 5)], [None, None], 0,
                           "0", 2)
    assert (gathered.m, gathered.ns) == (8, (3, 5))
    scattered = ops.task_of(ops.MATMUL_REDUCE_SCATTER, [a], [b], None, [], 0, "avg", "0", 2)
    assert (scattered.op, scattered.reduce_op, scattered.dim_size, scattered.terms) == (
        ops.MATMUL_REDUCE_SCATTER, "avg", 4, 1)
    # a sum of two products: K counts both terms', nothing copied
    summed = ops.task_of(ops.MATMUL_REDUCE_SCATTER, [a, torch.randn(4, 5)],
                         [b, torch.randn(5, 3)], None, [], 0, "sum", "0", 2)
    assert (summed.k, summed.terms, summed.copy_elems) == (13, 2, 0)
    assert "2 matmul products summed" in summed.describe()


def test_the_norm_op_returns_the_reciprocal_rms_when_asked():
    a, b, residual, weight = (torch.randn(2, 3, 4).to(torch.bfloat16).view(6, 4),
                              torch.randn(4, 8).to(torch.bfloat16),
                              torch.randn(2, 3, 8).to(torch.bfloat16),
                              torch.randn(8).to(torch.bfloat16))
    args = (a, b, None, [2, 3, 8], residual, weight, 1e-6, False, "sum", "0", 1,
            REFERENCE_PLAN.encode())
    with fake_group(1):
        h, y = torch.ops.ditron.matmul_all_reduce_rmsnorm(*args)
        h3, y3, rstd = torch.ops.ditron.matmul_all_reduce_rmsnorm(*args, with_rstd=True)
    assert torch.equal(h3, h) and torch.equal(y3, y)
    h32 = h.float()  # as the unfused graph computes what backward saves
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 3, 1)
    assert torch.equal(rstd, torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(y, (h32 * rstd).to(torch.bfloat16) * weight)


def test_the_fused_norm_computes_the_reciprocal_rms_of_the_kernels_sum(monkeypatch):
    from ditron_inductor.runtime import all_reduce

    h, y = torch.randn(6, 8), torch.randn(6, 8)
    monkeypatch.setattr(all_reduce, "all_reduce_fused", lambda *args: (h, y))
    out = all_reduce.matmul_all_reduce_rmsnorm_fused(None, None, *[None] * 6, 1e-5, False,
                                                     "sum", "0", 2, with_rstd=True)
    assert out[:2] == [h, y] and torch.equal(out[2], ops.reciprocal_rms(h, 1e-5))
    monkeypatch.setattr(all_reduce, "all_reduce_fused", lambda *args: None)  # declined
    assert all_reduce.matmul_all_reduce_rmsnorm_fused(None, None, *[None] * 6, 1e-5, False,
                                                      "sum", "0", 2, with_rstd=True) is None
