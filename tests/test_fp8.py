"""FP8 tensor parallelism: torch._scaled_mm beside the collectives (issue 27).

The forms come from torchao's float8 training under Float8ColwiseParallel / Float8RowwiseParallel
(captured with TORCH_LOGS=post_grad_graphs on 2 gloo ranks, torch 2.13, torchao 0.18):
  forward, sequence parallel (Shard(1) of [B, S, H]), tensorwise scales:
    all_gather_into_tensor(x_fp8 e4m3) -> wait -> split(dim 0) -> view(uint8) each -> cat(dim 1)
      -> view(float8_e4m3fn) -> reshape [-1, K] -> _scaled_mm(a, w_t, 1/s_a, 1/s_w, None, None,
      bfloat16, True)
    _scaled_mm(...) -> reshape [B, S, N] -> split(dim 1) -> cat -> reduce_scatter_tensor(sum)
  forward, plain TP: _scaled_mm(...) -> reshape -> all_reduce(sum)
  backward: the same with e5m2 gradients and use_fast_accum left out (False); the weight
    gradients take the gathered gradient transposed (a clone), which the op's gathered output
    serves; torchao's rowwise recipe gathers bf16 and quantises after (no fp8 gather), and its
    backward scales _scaled_mm's product with a mul before the collective (not matched).
The gloo tests compare with eager float8 on one process (gloo cannot all-gather float8, so eager
torchao SP does not run there at all; the ditron ops gather the bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings

import pytest
import torch
from expecttest import TestCase

from ditron_inductor import config, ops
from ditron_inductor.lowering.graph_pass import run_pass
from ditron_inductor.scheduler import decide as decide_mod
from ditron_inductor.scheduler.decide import decide
from ditron_inductor.scheduler.plan import AllGatherPlan
from ditron_inductor.scheduler.task import (
    ALL_GATHER_SCALED_MM,
    SCALED_MM_ALL_REDUCE,
    SCALED_MM_REDUCE_SCATTER,
    all_gather_scaled_mm_task,
    scaled_mm_collective_task,
)
from tests.distributed import launched_once
from tests.host_ranks import HostContext, host_driver
from tests.fx_helpers import fake_group, graph_text, trace

c10d = torch.ops._c10d_functional
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")


def fp8(*shape, dtype=E4M3, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)


def col_major(w):
    """_scaled_mm's right operand [K, N] is column-major: a [N, K] weight transposed."""
    return w.t()


def scale(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) + 0.5


def rewrite(gm):
    # make_fx leaves an alias after each view(dtype), which Inductor removes before the pass
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.aten.alias.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    report = run_pass(gm.graph)
    gm.recompile()
    return report


def gather(x, world, group="0"):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group))


def torchao_sp_gather(x, world):
    """The gather on dim 1 of a float8 [B, S, H] as DTensor's redistribute writes it."""
    pieces = gather(x, world).split(x.shape[0])
    return torch.cat([p.view(torch.uint8) for p in pieces], 1).view(x.dtype)


# ------------------------------------------------------------------------------ FX, fake group


class ScaledMatmulPassTest(TestCase):
    def test_torchao_sequence_parallel_forward(self):
        # Float8ColwiseParallel(input_layouts=Shard(1)) -> Float8RowwiseParallel(Shard(1))
        def sp(x, w1, w2, s_x, s_w1, s_h, s_w2):
            a = torchao_sp_gather(x, 2).reshape(-1, 16)
            h = torch._scaled_mm(a, w1, s_x, s_w1, None, None, BF16, True).reshape(2, 8, 32)
            h8 = h.to(E4M3).reshape(16, 32)
            y = torch._scaled_mm(h8, w2, s_h, s_w2, None, None, BF16, True).reshape(2, 8, 16)
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(
                torch.cat(y.split(4, 1)), "sum", 2, "0"))

        with fake_group(2):
            gm = trace(sp, fp8(2, 4, 16), col_major(fp8(32, 16)), col_major(fp8(16, 32)),
                       *(scale(()) for _ in range(4)))
            report = rewrite(gm)
        self.assertEqual([c.task for c in report.candidates], [
            "all_gather_scaled_mm M=16 K=16 N=32 float8_e4m3fn tensorwise fast-accum -> "
            "bfloat16 world=2 group=0 dim=1, rank-major rows reordered in the graph",
            "scaled_mm_reduce_scatter M=16 K=32 N=16 float8_e4m3fn tensorwise fast-accum -> "
            "bfloat16 world=2 group=0 dim=1 sum, rank-major rows reordered in the graph"])
        self.assertTrue(all(c.fused for c in report.candidates))
        self.assertExpectedInline(graph_text(gm), """\
reshape_default = reshape(x_1, [-1, 16])
all_gather_scaled_mm_default = all_gather_scaled_mm(reshape_default, s_x_1, [w1_1], [s_w1_1], [None], torch.bfloat16, True, 0, '0', 2, '{"impl": "reference"}')
getitem_5 = getitem(all_gather_scaled_mm_default, 1)
reshape_default_3 = reshape(getitem_5, [2, 2, 4, 32])
permute_default_1 = permute(reshape_default_3, [1, 0, 2, 3])
reshape_default_4 = reshape(permute_default_1, [-1, 32])
view_4 = view(reshape_default_4, [2, 8, 32])
convert_element_type = prims.convert_element_type.default(view_4, torch.float8_e4m3fn)
view_5 = view(convert_element_type, [16, 32])
reshape_default_5 = reshape(view_5, [2, 2, 4, 32])
permute_default_2 = permute(reshape_default_5, [1, 0, 2, 3])
reshape_default_6 = reshape(permute_default_2, [-1, 32])
scaled_mm_reduce_scatter_default = scaled_mm_reduce_scatter([reshape_default_6], [w2_1], [s_h_1], [s_w2_1], None, torch.bfloat16, True, [], 0, 'sum', '0', 2, '{"impl": "reference"}')
reshape_default_7 = reshape(scaled_mm_reduce_scatter_default, [2, 4, 16])
return reshape_default_7
""")

    def test_torchao_tensor_parallel_all_reduce(self):
        # Float8RowwiseParallel, replicated output; the backward's e5m2 form, no fast accum
        def tp(h, w, s_h, s_w):
            y = torch._scaled_mm(h.reshape(16, 32), w, s_h, s_w, out_dtype=BF16)
            return c10d.wait_tensor(c10d.all_reduce(y.reshape(2, 8, 16), "sum", "0"))

        with fake_group(2):
            gm = trace(tp, fp8(2, 8, 32, dtype=E5M2), col_major(fp8(16, 32)), scale(()),
                       scale(()))
            report = rewrite(gm)
        self.assertEqual(report.candidates[0].task,
                         "scaled_mm_all_reduce M=16 K=32 N=16 float8_e5m2 tensorwise -> bfloat16 "
                         "world=2 group=0 sum")
        self.assertExpectedInline(graph_text(gm), """\
view = view(h_1, [16, 32])
scaled_mm_all_reduce_default = scaled_mm_all_reduce(view, w_1, s_h_1, s_w_1, None, torch.bfloat16, False, [2, 8, 16], 'sum', '0', 2, '{"impl": "reference"}')
return scaled_mm_all_reduce_default
""")

    def test_rowwise_scales_gathered_with_the_rows_and_bias(self):
        # hand-written funcol code: the shard's rows and their scales gathered, then _scaled_mm
        def ag(x, s_x, w, s_w, b):
            return torch._scaled_mm(gather(x, 4), w, gather(s_x, 4), s_w, b, out_dtype=BF16)

        with fake_group(4):
            gm = trace(ag, fp8(8, 16), scale(8, 1), col_major(fp8(32, 16)), scale(1, 32),
                       torch.randn(32).to(BF16))
            report = rewrite(gm)
        self.assertEqual(report.candidates[0].task,
                         "all_gather_scaled_mm M=32 K=16 N=32 float8_e4m3fn rowwise -> bfloat16 "
                         "world=4 group=0")
        self.assertExpectedInline(graph_text(gm), """\
all_gather_scaled_mm_default = all_gather_scaled_mm(x_1, s_x_1, [w_1], [s_w_1], [b_1], torch.bfloat16, False, 0, '0', 4, '{"impl": "reference"}')
getitem_1 = getitem(all_gather_scaled_mm_default, 1)
return getitem_1
""")

    def test_rowwise_scale_of_a_reduce_scatter_permuted_with_its_rows(self):
        def rs(h, s_h, w, s_w):
            y = torch._scaled_mm(h, w, s_h, s_w, out_dtype=BF16).reshape(2, 8, 16)
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(
                torch.cat(y.split(4, 1)), "sum", 2, "0"))

        with fake_group(2):
            gm = trace(rs, fp8(16, 32), scale(16, 1), col_major(fp8(16, 32)), scale(1, 16))
            report = rewrite(gm)
        self.assertIn("rowwise", report.candidates[0].task)
        text = graph_text(gm)
        self.assertIn("scaled_mm_reduce_scatter([reshape_default_1], [w_1], [reshape_default_3], "
                      "[s_w_1]",
                      text)
        self.assertIn("reshape_default_2 = reshape(s_h_1, [2, 2, 4, 1])", text)

    def test_rowwise_scale_not_gathered_is_left_with_the_reason(self):
        def ag(x, w, s_a, s_w):  # a per-row scale computed after the gather: not the shard's
            return torch._scaled_mm(gather(x, 2), w, s_a, s_w, out_dtype=BF16)

        with fake_group(2):
            gm = trace(ag, fp8(8, 16), col_major(fp8(32, 16)), scale(16, 1), scale(1, 32))
            report = rewrite(gm)
        self.assertFalse(report.candidates[0].fused)
        self.assertEqual(report.candidates[0].reason,
                         "scale_a s_a_1 of _scaled_mm holds a scale per row, but is not the "
                         "all-gather on dim 0 of the shard's [8, 1] scales over group 0")

    def test_reduce_scatter_of_a_sum_of_scaled_products_takes_them_as_terms(self):
        # the input gradient of two layers that share their input, each product with its scales
        def rs(a1, w1, a2, w2, s1, s2, s3, s4):
            y = (torch._scaled_mm(a1, w1, s1, s2, out_dtype=BF16)
                 + torch._scaled_mm(a2, w2, s3, s4, out_dtype=BF16))
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", 2, "0"))

        with fake_group(2):
            gm = trace(rs, fp8(8, 16), col_major(fp8(16, 16)), fp8(8, 32),
                       col_major(fp8(16, 32)), *(scale(()) for _ in range(4)))
            report = rewrite(gm)
        self.assertEqual([c.task for c in report.candidates], [
            "scaled_mm_reduce_scatter M=8 K=48 N=16 float8_e4m3fn tensorwise -> bfloat16 world=2 "
            "group=0 sum, 2 _scaled_mm products summed"])
        self.assertTrue(report.candidates[0].fused, report.candidates[0].reason)
        self.assertExpectedInline(graph_text(gm), """\
scaled_mm_reduce_scatter_default = scaled_mm_reduce_scatter([a1_1, a2_1], [w1_1, w2_1], [s1_1, s3_1], [s2_1, s4_1], None, torch.bfloat16, False, [], 0, 'sum', '0', 2, '{"impl": "reference"}')
return scaled_mm_reduce_scatter_default
""")

    def test_all_reduce_of_a_sum_of_scaled_products_is_left_with_the_reason(self):
        def ar(a1, w1, a2, w2, s):
            y = (torch._scaled_mm(a1, w1, s, s, out_dtype=BF16)
                 + torch._scaled_mm(a2, w2, s, s, out_dtype=BF16))
            return c10d.wait_tensor(c10d.all_reduce(y, "sum", "0"))

        with fake_group(2):
            gm = trace(ar, fp8(8, 16), col_major(fp8(16, 16)), fp8(8, 16),
                       col_major(fp8(16, 16)), scale(()))
            report = rewrite(gm)
        self.assertEqual(report.candidates[0].reason,
                         "add sums _scaled_mm products (_scaled_mm + _scaled_mm_1): each has "
                         "scales of its own, and only the reduce-scatter op takes a sum of them")

    def test_a_sum_of_tensorwise_and_rowwise_products_is_left_with_the_reason(self):
        def rs(a1, w1, a2, w2, s, row_scale, col_scale):
            y = (torch._scaled_mm(a1, w1, s, s, out_dtype=BF16)
                 + torch._scaled_mm(a2, w2, row_scale, col_scale, out_dtype=BF16))
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", 2, "0"))

        with fake_group(2):
            gm = trace(rs, fp8(8, 16), col_major(fp8(16, 16)), fp8(8, 32),
                       col_major(fp8(16, 32)), scale(()), scale(8, 1), scale(1, 16))
            report = rewrite(gm)
        self.assertEqual(report.candidates[0].reason,
                         "add sums _scaled_mm products (_scaled_mm + _scaled_mm_1) scaled in "
                         "different ways")

    def test_symbolic_rows_rowwise(self):
        # dynamic token count: the rowwise scales' rows are symbolic, and no guard is taken
        from tests.test_lowering import make_fx_symbolic

        def mlp(x, s_x, w1, s_w1):
            return torch._scaled_mm(gather(x, 2), w1, gather(s_x, 2), s_w1, out_dtype=BF16)

        with fake_group(2):
            gm = make_fx_symbolic(mlp, fp8(6, 16), scale(6, 1), col_major(fp8(32, 16)),
                                  scale(1, 32))
            report = rewrite(gm)
        self.assertTrue(report.candidates[0].fused, report.candidates[0].reason)
        self.assertRegex(report.candidates[0].task, r"all_gather_scaled_mm M=2\*s\d+ .* rowwise")


@needs_torchao
def test_torchao_float8_tp_model_compiles_to_the_fp8_ops_forward_and_backward():
    """The captured torchao graphs themselves (fake process group: no data moves)."""
    with fake_group(2):
        reports = compile_torchao_mlp(sequence_parallel=True, fake=True)
    assert reports == {
        "forward": ["all_gather_scaled_mm", "scaled_mm_reduce_scatter"],
        "backward": ["all_gather_scaled_mm", "scaled_mm_reduce_scatter"]}


# ------------------------------------------------------------------ ops: inputs, fake shapes


def test_bad_inputs_are_named_before_any_collective():
    a, w, s = fp8(8, 16), col_major(fp8(32, 16)), scale(())
    with fake_group(2):
        cases = [
            (lambda: ops.scaled_mm_all_reduce(a.to(BF16), w, s, s, None, BF16, False, [], "sum",
                                              "0", 2, "{}"),
             "operands must be float8 (e4m3fn or e5m2), got torch.bfloat16"),
            (lambda: ops.scaled_mm_reduce_scatter([a], [col_major(fp8(32, 8))], [s], [s], None,
                                                  BF16, False, [], 0, "sum", "0", 2, "{}"),
             "a [8, 16] @ b [8, 32] is not a [M, K] @ [K, N] product"),
            (lambda: ops.scaled_mm_reduce_scatter([a, a], [w, w], [s], [s, s], None, BF16, False,
                                                  [], 0, "sum", "0", 2, "{}"),
             "2 a, 2 b, 1 scale_a and 2 scale_b: one of each per term"),
            (lambda: ops.scaled_mm_reduce_scatter([a, fp8(4, 16)], [w, w], [s, s], [s, s], None,
                                                  BF16, False, [], 0, "sum", "0", 2, "{}"),
             "the terms' products differ in shape ([(4, 32), (8, 32)])"),
            (lambda: ops.scaled_mm_all_reduce(a, w, scale(8, 2), s, None, BF16, False, [], "sum",
                                              "0", 2, "{}"),
             "scales [8, 2] and [] are neither tensorwise"),
            (lambda: ops.scaled_mm_all_reduce(a, w, s.double(), s, None, BF16, False, [], "sum",
                                              "0", 2, "{}"),
             "scales must be float32"),
            (lambda: ops.all_gather_scaled_mm(a, s, [w], [], [None], BF16, False, 0, "0", 2,
                                              "{}"),
             "1 weights, 0 scales_b and 1 biases"),
            (lambda: ops.all_gather_scaled_mm(fp8(2, 4, 16), scale(8, 1), [w], [scale(1, 32)],
                                              [None], BF16, False, 1, "0", 2, "{}"),
             "a rowwise scale_a is gathered on dim 0 with the rows, but gather_dim is 1"),
            (lambda: ops.all_gather_scaled_mm(a, s, [w], [s], [torch.zeros(3)], BF16, False, 0,
                                              "0", 2, "{}"),
             "bias [3] is not one value per column (32)"),
        ]
        for call, message in cases:
            with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")
                               .replace(")", r"\)")):
                call()


def test_fake_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, w = torch.empty(2, 4, 16, dtype=E4M3), torch.empty(16, 32, dtype=E4M3)
        s = torch.empty((), dtype=torch.float32)
        gathered, out = torch.ops.ditron.all_gather_scaled_mm(
            a, s, [w], [s], [None], BF16, True, 1, "0", 2, "{}")
        rs = torch.ops.ditron.scaled_mm_reduce_scatter(
            [a.reshape(8, 16)] * 2, [w] * 2, [s] * 2, [s] * 2, None, torch.float32, False,
            [2, 4, 32], 1, "sum", "0", 2, "{}")
        ar = torch.ops.ditron.scaled_mm_all_reduce(
            a.reshape(8, 16), w, s, s, None, None, False, [], "sum", "0", 2, "{}")
    assert (gathered.shape, gathered.dtype) == (torch.Size([2, 8, 16]), E4M3)
    assert (out.shape, out.dtype) == (torch.Size([16, 32]), BF16)
    assert (rs.shape, rs.dtype) == (torch.Size([2, 2, 32]), torch.float32)
    assert (ar.shape, ar.dtype) == (torch.Size([8, 32]), E4M3)  # out_dtype None: a's dtype


# ---------------------------------------------------------------------------------- scheduler


def cuda(task):
    return dataclasses.replace(task, device_type="cuda")


def fp8_tasks(rows: int = 4096):
    a, w = torch.empty(rows, 4096, dtype=E4M3), torch.empty(4096, 7168, dtype=E4M3)
    s = torch.empty(())
    return {
        ALL_GATHER_SCALED_MM: cuda(all_gather_scaled_mm_task(a, s, [w], [s], [None], BF16, True,
                                                             0, "0", 2)),
        SCALED_MM_REDUCE_SCATTER: cuda(scaled_mm_collective_task(
            SCALED_MM_REDUCE_SCATTER, a, w, s, s, None, BF16, True, [], 0, "sum", "0", 2)),
        SCALED_MM_ALL_REDUCE: cuda(scaled_mm_collective_task(
            SCALED_MM_ALL_REDUCE, a, w, s, s, None, BF16, True, [], 0, "sum", "0", 2)),
    }


MEASURED = ("chosen on 2 ranks from M 8192, launched eagerly, where the float8 training step "
            "measured faster fused")
KEEP = ("the graph keeps the collective + _scaled_mm (DITRON_PLAN=reference runs the op's "
        "reference), DITRON_PLAN=fused that plan")
# the fp8 all-reduce has no fused kernel: every decision leaves it to _scaled_mm + NCCL
FP8_ALL_REDUCE_KEPT = "no fused fp8 all-reduce kernel"


def test_on_cuda_fp8_plans_outside_what_was_measured_are_not_chosen_and_the_log_says_why():
    # M 4096 on 2 ranks (the all-gather's 2 x 2048 gathered rows, the reduce-scatter's 2048
    # rows): below the measured M
    with fake_group(2):
        decisions = {op: decide(t) for op, t in fp8_tasks(rows=2048).items()}
    assert not any(d.fuse for d in decisions.values())
    reasons = {op: d.reason for op, d in decisions.items()}
    assert FP8_ALL_REDUCE_KEPT in reasons.pop(SCALED_MM_ALL_REDUCE)
    assert reasons == {
        ALL_GATHER_SCALED_MM: "the fp8 plan (cublas_scaled_mm: _scaled_mm per group of gathered "
                              f"chunks) is {MEASURED}: {KEEP}",
        SCALED_MM_REDUCE_SCATTER: "the fp8 plan (cublas_scaled_mm: _scaled_mm per rank's rows, "
                                  f"each pushed by the copy engine) is {MEASURED}: "
                                  f"{KEEP}"}


def test_on_cuda_fp8_gather_and_scatter_plans_are_chosen_where_measured(monkeypatch):
    """2 ranks, M 8192 (the float8 Llama step's rows), eager launch: the all-gather's and the
    reduce-scatter's fused plans, as DITRON_PLAN=fused gives them; not on 4 ranks, not under
    CUDA graphs, not where a rank's rows are not one block; never the all-reduce's."""
    from ditron_inductor.scheduler import decide as decide_module

    tasks = fp8_tasks(rows=8192)  # the all-gather's shard: 2 x 8192 gathered rows
    with fake_group(2):
        chosen = {op: decide(t) for op, t in tasks.items()}
    assert {op: (d.fuse, d.plan.describe() if d.fuse else None)
            for op, d in chosen.items()} == {
        ALL_GATHER_SCALED_MM: (True, "fused cublas_scaled_mm gemm=cublas groups=1,1"),
        SCALED_MM_REDUCE_SCATTER: (True, "fused cublas_scaled_mm reduce=triton"),
        SCALED_MM_ALL_REDUCE: (False, None)}
    assert chosen[ALL_GATHER_SCALED_MM].reason == (
        f"fused plan cublas_scaled_mm (_scaled_mm per group of gathered chunks): {MEASURED}")
    rs = tasks[SCALED_MM_REDUCE_SCATTER]
    with fake_group(4):
        assert not decide(dataclasses.replace(rs, world_size=4)).fuse
    with fake_group(2):
        assert not decide(dataclasses.replace(rs, rank_chunks_contiguous=False)).fuse
        # reduce-overhead
        monkeypatch.setattr(decide_module, "replayed_in_cuda_graph", lambda *options: True)
        assert not any(decide(t).fuse for t in tasks.values())


def test_forced_plans_for_fp8():
    tasks = fp8_tasks()
    with fake_group(2):
        forced = {op: decide(t, config.Options(force_plan="fused")) for op, t in tasks.items()}
        reference = {op: decide(t, config.Options(force_plan="reference"))
                     for op, t in tasks.items()}
    ag = forced[ALL_GATHER_SCALED_MM]
    assert ag.fuse and isinstance(ag.plan, AllGatherPlan) and ag.plan.gemm == "cublas"
    # the fp8 all-reduce has no fused plan to force: NCCL + _scaled_mm, with the reason
    ar = forced.pop(SCALED_MM_ALL_REDUCE)
    assert not ar.fuse and FP8_ALL_REDUCE_KEPT in ar.reason
    assert {op: d.plan.describe() for op, d in forced.items()} == {
        ALL_GATHER_SCALED_MM: "fused cublas_scaled_mm gemm=cublas groups=1,1",
        # the copy-engine plan with cuBLAS (gemm="cublas" is the family's default)
        SCALED_MM_REDUCE_SCATTER: "fused cublas_scaled_mm reduce=triton"}
    assert all(d.fuse and d.plan.impl == "reference" for d in reference.values())


def test_fp8_patterns_can_be_turned_off():
    with fake_group(2):
        d = decide(fp8_tasks()[ALL_GATHER_SCALED_MM],
                   config.Options(patterns=frozenset({"all_gather_matmul"})))
    assert d.reason == ("pattern all_gather_scaled_mm is disabled (ditron.patterns / "
                        "DITRON_PATTERNS)")


# ------------------------------------------------------- runtime on CPU: GEMM object, declines


def test_scaled_gemm_slices_a_rowwise_scale_a_with_the_rows(monkeypatch):
    """Scaled.matmul_into: a rowwise scale_a's rows first_row.. go with A's rows, scale_b whole
    (the real CPU _scaled_mm, row chunk by row chunk, equals the whole product); the plain
    matmul_into never calls _scaled_mm."""
    pytest.importorskip("triton")
    from ditron_inductor.runtime.launch import matmul_into
    from ditron_inductor.runtime.scaled import Scaled

    a, b = fp8(12, 32), col_major(fp8(16, 32))
    s_a, s_b = scale(12, 1, seed=1), scale(1, 16, seed=2)
    want = ops._scaled_mm(a, b, s_a, s_b, None, BF16, False)
    calls, real = [], torch._scaled_mm

    def spy(a_, b_, scale_a, scale_b, **kw):
        calls.append((a_.shape[0], scale_a.flatten().tolist(), scale_b is gemm.scale_b))
        return real(a_, b_, scale_a, scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    # a layout Inductor may give a rowwise scale_b: [1, N] with a stride that is not 1
    gemm = Scaled.of(s_a, s_b.t().contiguous().t(), None, BF16, False)
    out = torch.full((12, 16), float("nan"), dtype=BF16)
    for lo, hi in ((0, 5), (5, 12)):
        matmul_into(a[lo:hi], b, None, out[lo:hi], scaled=gemm, first_row=lo)
    assert torch.equal(out, want)
    assert calls == [(5, s_a[:5].flatten().tolist(), True), (7, s_a[5:].flatten().tolist(), True)]
    one = Scaled.of(scale(()), scale(()), torch.float16, E4M3, True)
    matmul_into(a[4:8], b, None, out16 := torch.empty(4, 16, dtype=torch.float16), scaled=one,
                first_row=4)
    assert calls[-1][1] == [one.scale_a.item()] and out16.dtype == torch.float16
    calls.clear()
    matmul_into(a.float(), b.float(), None, torch.empty(12, 16))  # bf16 / fp32: plain mm
    assert calls == []


def scaled_rs_args(a, b, s_a, s_b, out_dtype=BF16, bias=None, world=2):
    return ([a], [b], [s_a], [s_b], bias, out_dtype, False, [], 0, "sum", "0", world)


@pytest.fixture
def no_protocol(monkeypatch):
    """Every first protocol step of the reduce-scatter runtime fails the test."""
    pytest.importorskip("triton")
    from ditron_inductor.runtime import reduce_scatter

    def touched(*args, **kwargs):
        raise AssertionError("a declined call touched the protocol")

    monkeypatch.setattr(reduce_scatter, "get_context", touched)
    monkeypatch.setattr(reduce_scatter, "current_stream", touched)
    monkeypatch.setattr(reduce_scatter, "matmul_into", touched)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return reduce_scatter


def test_fp8_scatter_declines_before_any_protocol_step(no_protocol, caplog):
    """An fp8 output, rowwise with fp16, shapes _scaled_mm cannot take, a bias of another dtype,
    CPU tensors: each declined with its reason, before any context, stream or GEMM."""
    import logging

    from ditron_inductor.log_names import LOGGER_NAME
    from ditron_inductor.scheduler.decide import plan_for

    reduce_scatter = no_protocol
    rs_task = fp8_tasks()[SCALED_MM_REDUCE_SCATTER]
    a, b, t = fp8(64, 32), col_major(fp8(48, 32)), scale(())
    rowwise = (scale(64, 1), scale(1, 48))
    cases = [
        (reduce_scatter.scaled_mm_reduce_scatter_fused, plan_for(rs_task),
         scaled_rs_args(a, b, t, t, out_dtype=None),
         "fp8: output dtype torch.float8_e4m3fn (the fused partials and sums are bf16 or fp16)"),
        (reduce_scatter.scaled_mm_reduce_scatter_fused, plan_for(rs_task),
         scaled_rs_args(a, b, *rowwise, out_dtype=torch.float16),
         "fp8: rowwise scales with a bf16 output only"),
        (reduce_scatter.scaled_mm_reduce_scatter_fused, plan_for(rs_task),
         scaled_rs_args(fp8(64, 24), col_major(fp8(48, 24)), t, t),
         "fp8: K=24, N=48 and layouts _scaled_mm cannot take"),
        (reduce_scatter.scaled_mm_reduce_scatter_fused, plan_for(rs_task),
         scaled_rs_args(a, b, *rowwise), "fp8: operands not on CUDA"),
        (reduce_scatter.scaled_mm_reduce_scatter_fused, plan_for(rs_task),
         scaled_rs_args(a, b, t, t, bias=torch.zeros(48)), "fp8: bias shape/dtype"),
    ]
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    for fused, plan, args, reason in cases:
        caplog.clear()
        assert fused(rs_task, plan, *args) is None
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 1 and messages[0].startswith(f"fused path declined: {reason}"), (
            plan.describe(), messages)


def test_fp8_all_gather_declines_what_scaled_mm_rejects_before_any_protocol_step(monkeypatch,
                                                                                  caplog):
    """The all-gather's fp8 plan checks each weight's GEMM as the scatter does (Scaled.declines): a _scaled_mm that failed after my shard was signalled to the peers would
    leave them waiting."""
    import logging

    pytest.importorskip("triton")
    from ditron_inductor.log_names import LOGGER_NAME
    from ditron_inductor.runtime import all_gather
    from ditron_inductor.scheduler.decide import plan_for

    def touched(*args, **kwargs):
        raise AssertionError("a declined call touched the protocol")

    for name in ("get_context", "current_stream", "matmul_into"):
        monkeypatch.setattr(all_gather, name, touched)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    task = fp8_tasks()[ALL_GATHER_SCALED_MM]
    plan = plan_for(task)
    t = scale(())
    cases = [  # (shard, weights, reason)
        (fp8(16, 32), [col_major(fp8(40, 32)), col_major(fp8(48, 32))],
         "fp8: K=32, N=40 and layouts _scaled_mm cannot take"),  # the first weight's N
        (fp8(16, 32), [fp8(32, 48)], "fp8: K=32, N=48 and layouts"),  # B row-major
        (fp8(16, 32), [col_major(fp8(48, 32))], "fp8: operands not on CUDA"),
    ]
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    for shard, weights, reason in cases:
        caplog.clear()
        out = all_gather.all_gather_scaled_mm_fused(
            task, plan, shard, t, weights, [t] * len(weights), [None] * len(weights), BF16,
            False, 0, "0", 2)
        messages = [r.getMessage() for r in caplog.records]
        assert out is None and len(messages) == 1 and messages[0].startswith(
            f"fused path declined: {reason}"), messages


@pytest.mark.parametrize("terms", [1, 2])
def test_fp8_reduce_scatter_copy_engine_plan_on_emulated_ranks(monkeypatch, terms):
    """The copy-engine plan's data path with the Scaled GEMM, on 2 ranks emulated in host
    memory (run 1, 0, 1: each rank's slots are filled by the other's earlier run): each rank
    pushes _scaled_mm of the peer's rows (rowwise scale_a sliced alike) in bf16 into the peer's
    slot and sums its own; every rank's output is the sum of the ranks' products' rows. With 2
    terms (ScaledSum), each rank's product is the sum of its terms' (the second's K differs)."""
    pytest.importorskip("triton")
    from ditron_inductor.runtime import reduce_scatter
    from ditron_inductor.runtime.scaled import Scaled, ScaledSum
    from ditron_inductor.scheduler.decide import plan_for

    world, m, k, n = 2, 32, 32, 16
    ins = [(fp8(m, k, seed=10 + q), col_major(fp8(n, k, seed=20 + q)), scale(m, 1, seed=30 + q),
            scale(1, n, seed=40 + q)) for q in range(world)]
    second = [(fp8(m, 2 * k, seed=50 + q), col_major(fp8(n, 2 * k, seed=60 + q)),
               scale(m, 1, seed=70 + q), scale(1, n, seed=80 + q)) for q in range(world)]
    products = [sum((ops._scaled_mm(a, b, s_a, s_b, None, BF16, False)
                     for a, b, s_a, s_b in terms_q[:terms]), torch.zeros(m, n, dtype=BF16))
                for terms_q in zip(ins, second)]
    ctxs = [HostContext(world, r, world * (m // world) * n * 2) for r in range(world)]
    for c in ctxs:
        c.connect(ctxs)
    host_driver(reduce_scatter, monkeypatch)
    monkeypatch.setattr(reduce_scatter, "wait_geq", lambda *a: None)
    a, b, s_a, s_b = ins[0]
    task = scaled_mm_collective_task(SCALED_MM_REDUCE_SCATTER, a, b, s_a, s_b, None, BF16, False,
                                     [], 0, "sum", "0", world)
    plan = plan_for(task, reduce="torch")  # torch.sum reduces the slots (no Triton launch)
    outs = {}
    served = reduce_scatter.stats["scaled_mm_reduce_scatter"]
    for r in (1, 0, 1):
        monkeypatch.setattr(reduce_scatter, "get_context", lambda *args, r=r: ctxs[r])
        a, b, s_a, s_b = ins[r]
        gemm = Scaled.of(s_a, s_b, BF16, a.dtype, False)
        if terms == 2:
            a2, b2, s_a2, s_b2 = second[r]
            gemm = ScaledSum(gemm, ((a2, b2, Scaled.of(s_a2, s_b2, BF16, a2.dtype, False)),))
        outs[r] = reduce_scatter._reduce_scatter(task, plan, a, b, None, [], 0, "sum", "0",
                                                 world, gemm)
    assert reduce_scatter.stats["scaled_mm_reduce_scatter"] == served + 3
    rows = m // world
    for r in range(world):
        want = torch.stack([p[r * rows:(r + 1) * rows] for p in products]).sum(0)
        assert outs[r].dtype == BF16 and torch.equal(outs[r], want), r


# ------------------------------------------------------------------------- gloo, 2 CPU ranks


def compile_torchao_mlp(sequence_parallel: bool, fake: bool = False, rank: int = 0,
                        world: int = 2, seed: int = 0):
    """A torchao float8 (tensorwise) MLP, w1 colwise and w2 rowwise parallel, compiled with
    ditron: {graph kind: ditron ops} (fake) or the errors against eager float8 on one process."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    from ditron_inductor.lowering import graph_pass

    def mlp():
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(),
                          nn.Linear(64, 32, bias=False)).to(BF16)
        convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        return m

    mesh = init_device_mesh("cpu", (world,))
    sp = dict(input_layouts=Shard(1)), dict(output_layouts=Shard(1))
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(BF16)
    dy = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2)).to(BF16)
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world) if sequence_parallel else slice(None)

    def run_tp(backend: str):
        """(output, input grad, w1's full grad, {graph kind: ditron ops}) of the TP model."""
        tp = mlp()
        parallelize_module(tp, mesh, {
            "0": Float8ColwiseParallel(**(sp[0] if sequence_parallel else {})),
            "2": Float8RowwiseParallel(**(sp[1] if sequence_parallel else {}))})
        start = len(graph_pass.reports)
        x_tp = x[:, rows].clone().requires_grad_(True)
        y = torch.compile(tp, backend=backend, dynamic=False)(x_tp)
        y.backward(dy[:, rows])
        ops_by_graph = {r.graph.split()[-1]: sorted(c.op for c in r.candidates if c.fused)
                        for r in list(graph_pass.reports)[start:]}
        return y, x_tp.grad, tp[0].weight.grad.full_tensor(), ops_by_graph

    y, dx, dw1, ops_by_graph = run_tp("ditron")
    if fake:
        return ops_by_graph
    ref = mlp()
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    # eager float8 on one process: two float8 roundings of the same values, bf16 sums in another
    # order; Inductor's own graph (where gloo runs it: no float8 all-gather) the same math
    wants = [("eager", (y_ref[:, rows], x_ref.grad[:, rows], ref[0].weight.grad), 0.05)]
    if not sequence_parallel:
        wants.append(("inductor", run_tp("inductor")[:3], 0.02))
    errors = []
    for who, want, tol in wants:
        for what, got, w in zip(("output", "grad x", "grad w1"), (y, dx, dw1), want):
            try:
                torch.testing.assert_close(got.float(), w.float(), rtol=tol, atol=tol)
            except AssertionError as e:
                errors.append(f"{what} vs {who}: {e}")
    return {"errors": errors, "ops": ops_by_graph}


def _funcol_checks(rank: int, world: int) -> dict:
    """Hand-written functional-collective fp8 code, rowwise and tensorwise, compiled with
    ditron against eager (whose float8 gathers move the bytes) and plain Inductor where gloo
    can run Inductor's graph (no float8 all-gather)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from ditron_inductor.lowering import graph_pass

    g = dist.group.WORLD

    def eager_gather(x):
        if x.dtype in (E4M3, E5M2):
            return funcol.all_gather_tensor(x.view(torch.uint8), 0, g).view(x.dtype)
        return funcol.all_gather_tensor(x, 0, g)

    def ag_rowwise(x, s_x, w, s_w, b, gather=None):
        gather = gather or (lambda t: funcol.all_gather_tensor(t, 0, g))
        return torch._scaled_mm(gather(x), w, gather(s_x), s_w, b, out_dtype=BF16)

    def rs_rowwise(h, s_h, w, s_w):
        y = torch._scaled_mm(h, w, s_h, s_w, out_dtype=BF16).reshape(2, 8, 16)
        return funcol.reduce_scatter_tensor(y, "sum", 1, g)

    def rs_sum_tensorwise(h, s_h, w, s_w, h2, s_h2, w3, s_w3):  # q/k/v's input gradient
        y = (torch._scaled_mm(h, w, s_h, s_w, out_dtype=BF16)
             + torch._scaled_mm(h2, w3, s_h2, s_w3, out_dtype=BF16))
        return funcol.reduce_scatter_tensor(y.reshape(2, 8, 16), "sum", 1, g)

    def ar_tensorwise(h, s_h, w, s_w):
        y = torch._scaled_mm(h, w, s_h, s_w, out_dtype=BF16, use_fast_accum=True)
        return funcol.all_reduce(y.reshape(2, 8, 16), "sum", g)

    x, s_x = fp8(8, 16, seed=10 + rank), scale(8, 1, seed=20 + rank)
    w, s_w, b = col_major(fp8(32, 16, seed=3)), scale(1, 32, seed=4), torch.randn(32).to(BF16)
    h, s_h = fp8(16, 32, seed=30 + rank), scale(16, 1, seed=40 + rank)
    w2, s_w2 = col_major(fp8(16, 32, seed=5)), scale(1, 16, seed=6)
    t_h, t_w = scale((), seed=50 + rank), scale((), seed=7)
    cases = {
        "ag_rowwise": (ag_rowwise, (x, s_x, w, s_w, b), functools.partial(
            ag_rowwise, gather=eager_gather)),
        "rs_rowwise": (rs_rowwise, (h, s_h, w2, s_w2), rs_rowwise),
        "ar_tensorwise": (ar_tensorwise, (h, t_h, w2, t_w), ar_tensorwise),
        "rs_sum_tensorwise": (rs_sum_tensorwise, (
            h, t_h, w2, t_w, fp8(16, 48, seed=60 + rank), scale((), seed=70 + rank),
            col_major(fp8(16, 48, seed=8)), scale((), seed=9)), rs_sum_tensorwise),
    }
    results = {}
    for name, (fn, args, eager) in cases.items():
        start = len(graph_pass.reports)
        got = torch.compile(fn, backend="ditron", dynamic=False)(*args)
        want = [eager(*args)]
        if name != "ag_rowwise":  # Inductor's own graph, where gloo runs it
            want.append(torch.compile(fn, backend="inductor", dynamic=False)(*args))
        errors = []
        for i, w_ in enumerate(want):
            try:  # the same float8 products: only the bf16 sums' order differs
                torch.testing.assert_close(got.float(), w_.float(), rtol=0.02, atol=0.02)
            except AssertionError as e:
                errors.append(f"{['eager', 'inductor'][i]}: {e}")
        results[name] = {"errors": errors, "reports": [
            (c.op, c.fused, c.reason) for r in list(graph_pass.reports)[start:]
            for c in r.candidates]}
    return results


def gloo_ranks(rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore")
    out = {"funcol": _funcol_checks(rank, world)}
    if HAS_TORCHAO:
        out["torchao_tp"] = compile_torchao_mlp(False, rank=rank, world=world)
        out["torchao_sp"] = compile_torchao_mlp(True, rank=rank, world=world)
    return out


ranks = launched_once("tests.test_fp8:gloo_ranks", 2, timeout_s=300,
                      env={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"})


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ag_rowwise", "rs_rowwise", "ar_tensorwise",
                                  "rs_sum_tensorwise"])
def test_gloo_funcol_fp8_matches_eager_and_inductor(case):
    for rank, result in enumerate(ranks()):
        got = result["funcol"][case]
        assert got["errors"] == [], f"rank {rank}: {got['errors']}"
        assert [(op, fused) for op, fused, _ in got["reports"]] == [
            ({"ag_rowwise": ALL_GATHER_SCALED_MM, "rs_rowwise": SCALED_MM_REDUCE_SCATTER,
              "ar_tensorwise": SCALED_MM_ALL_REDUCE,
              "rs_sum_tensorwise": SCALED_MM_REDUCE_SCATTER}[case], True)], got["reports"]


@pytest.mark.slow
@needs_torchao
@pytest.mark.parametrize("mode,expected", [
    ("torchao_tp", {"forward": ["scaled_mm_all_reduce"], "backward": ["scaled_mm_all_reduce"]}),
    ("torchao_sp", {"forward": ["all_gather_scaled_mm", "scaled_mm_reduce_scatter"],
                    "backward": ["all_gather_scaled_mm", "scaled_mm_reduce_scatter"]}),
])
def test_gloo_torchao_float8_tp_forward_and_gradients_match_eager_float8(mode, expected):
    for rank, result in enumerate(ranks()):
        assert result[mode]["errors"] == [], f"rank {rank}: {result[mode]['errors']}"
        assert result[mode]["ops"] == expected


@pytest.mark.slow
def test_gloo_ranks_decide_alike():
    """Every rank's candidates, decisions and reasons are the same (the protocol agrees)."""
    first, *others = ranks()
    for other in others:
        assert {k: v["reports"] for k, v in other["funcol"].items()} == {
            k: v["reports"] for k, v in first["funcol"].items()}
        for mode in ("torchao_tp", "torchao_sp"):
            assert other.get(mode, {}).get("ops") == first.get(mode, {}).get("ops")
