"""The pass on small traced graphs: each pattern it rewrites, and each shape it leaves alone."""

from __future__ import annotations

import unittest

import torch
import torch.nn.functional as F
from expecttest import TestCase

from ditron_inductor import config
from ditron_inductor.lowering.graph_pass import run_pass
from ditron_inductor.lowering.match import find_candidates
from tests.fx_helpers import (
    all_gather,
    all_reduce,
    fake_group,
    graph_text,
    reduce_scatter,
    trace,
)
from tests.test_logs import captured


def rewrite(gm, options=config.Options()):
    report = run_pass(gm.graph, options)
    gm.recompile()
    return report


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


class AllGatherMatmulTest(TestCase):
    def test_linear_with_bias_on_2d_activation(self):
        with fake_group(4) as g:
            gm = trace(lambda x, w, b: F.linear(all_gather(x, 0, g), w, b),
                       randn(8, 16), randn(32, 16), randn(32))
            report = rewrite(gm)
        self.assertTrue(report.candidates[0].fused)
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(w_1, [1, 0])
all_gather_matmul_default = all_gather_matmul(x_1, [permute], [b_1], 0, '0', 4, '{"impl": "reference"}')
getitem_1 = getitem(all_gather_matmul_default, 1)
return getitem_1
""")

    def test_sequence_parallel_shard_1_on_3d_activation(self):
        # Shard(1) of [B, S, H]: the gather puts ranks on dim 0, then split + cat moves them to
        # dim 1. With B > 1 the ranks' rows interleave in [B*S, H], so the op gathers the
        # shard's [B*S/W, H] rows rank-major (dim 0) and a permute puts the product's rows back
        # in [B, S] order; the product is the graph's output, which the permute copies.
        with fake_group(4) as g:
            gm = trace(lambda x, w: F.linear(all_gather(x, 1, g), w),
                       randn(2, 4, 16), randn(32, 16))
            report = rewrite(gm)
        self.assertEqual(report.candidates[0].task,
                         "all_gather_matmul M=32 K=16 N=32 float32 world=4 group=0 dim=1, "
                         "rank-major rows reordered in the graph, copies 1024 elements")
        self.assertExpectedInline(graph_text(gm), """\
reshape_default = reshape(x_1, [-1, 16])
permute = permute(w_1, [1, 0])
all_gather_matmul_default = all_gather_matmul(reshape_default, [permute], [None], 0, '0', 4, '{"impl": "reference"}')
getitem_5 = getitem(all_gather_matmul_default, 1)
reshape_default_3 = reshape(getitem_5, [4, 2, 4, 32])
permute_default_1 = permute(reshape_default_3, [1, 0, 2, 3])
reshape_default_4 = reshape(permute_default_1, [-1, 32])
view_1 = view(reshape_default_4, [2, 16, 32])
return view_1
""")

    def test_backward_slice_form_keeps_gathered_activation_for_weight_grad(self):
        # Backward graphs cut the gathered tensor with slices; the flattened activation also
        # feeds the weight gradient, so the op's gathered output takes over that use.
        def grad_like(dy, w):
            gathered = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_gather_into_tensor(dy, 2, "0"))
            chunks = [gathered[0:2], gathered[2:4]]
            a = torch.cat(chunks, 1).reshape(16, 8)
            return a @ w, a.t() @ a

        with fake_group(2):
            gm = trace(grad_like, randn(2, 4, 8), randn(8, 8))
            report = rewrite(gm)
        self.assertTrue(report.candidates[0].fused)
        self.assertExpectedInline(graph_text(gm), """\
reshape_default = reshape(dy_1, [-1, 8])
all_gather_matmul_default = all_gather_matmul(reshape_default, [w_1], [None], 0, '0', 2, '{"impl": "reference"}')
getitem_1 = getitem(all_gather_matmul_default, 1)
reshape_default_3 = reshape(getitem_1, [2, 2, 4, 8])
permute_default_1 = permute(reshape_default_3, [1, 0, 2, 3])
reshape_default_4 = reshape(permute_default_1, [-1, 8])
getitem = getitem(all_gather_matmul_default, 0)
reshape_default_1 = reshape(getitem, [2, 2, 4, 8])
permute_default = permute(reshape_default_1, [1, 0, 2, 3])
reshape_default_2 = reshape(permute_default, [2, 8, 8])
view = view(reshape_default_2, [16, 8])
permute = permute(view, [1, 0])
mm_1 = mm(permute, view)
return [reshape_default_4, mm_1]
""")

    def test_rows_permuted_into_pointwise_users_copy_nothing(self):
        # Inductor computes the permute inside the kernels that read it (the rotary embedding of
        # q and k, SiLU * up): the cost model counts no copy, and the log says so.
        def sp_mlp(x, w_gate, w_up):
            a = all_gather(x, 1, g)
            return F.silu(F.linear(a, w_gate)) * F.linear(a, w_up)

        with fake_group(2) as g:
            args = randn(2, 4, 16), randn(32, 16), randn(32, 16)
            report = rewrite(trace(sp_mlp, *args))
            match, = find_candidates(trace(sp_mlp, *args).graph)[0]
        self.assertEqual(report.candidates[0].task,
                         "all_gather_matmul M=16 K=16 N=32,32 float32 world=2 group=0 dim=1, "
                         "rank-major rows reordered in the graph")
        self.assertEqual(match.notes, [
            "gathered rank-major on dim 0, the rows permuted in the graph (dim 1 order): "
            "Inductor permutes mm, mm_1 within kernels it runs anyway and copies none"])

    def test_rows_permuted_into_a_reduction_copy_nothing_but_into_a_graph_output_copy(self):
        with fake_group(2) as g:
            reduced = rewrite(trace(lambda x, w: F.linear(all_gather(x, 1, g), w).amax(-1),
                                    randn(2, 4, 16), randn(32, 16)))
            returned = rewrite(trace(lambda x, w: F.linear(all_gather(x, 1, g), w),
                                     randn(2, 4, 16), randn(32, 16)))
        self.assertNotIn("copies", reduced.candidates[0].task)
        self.assertIn("copies 512 elements", returned.candidates[0].task)

    def test_sequence_parallel_batch_1_chain_of_reshapes(self):
        # DTensor's gather of Shard(1) on [1, S/W, H]: all-gather on dim 0 into [W, S/W, H], a
        # view to [1, S, H], another to [S, H]; the weight gradient reads the gathered matrix
        # transposed, which the op's gathered output serves, and the log says so.
        def sp_batch_1(x, w, dy):
            gathered = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_gather_into_tensor(x, 2, "0"))
            a = gathered.view(1, 8, 16).view(8, 16)
            return a @ w, a.t() @ dy

        with fake_group(2):
            gm = trace(sp_batch_1, randn(1, 4, 16), randn(16, 32), randn(8, 32))
            report = rewrite(gm)
            match, = find_candidates(trace(sp_batch_1, randn(1, 4, 16), randn(16, 32),
                                           randn(8, 32)).graph)[0]
        self.assertEqual([(c.task, c.fused) for c in report.candidates], [
            ("all_gather_matmul M=8 K=16 N=32 float32 world=2 group=0", True)])
        self.assertEqual(match.notes, ["mm_1 takes it transposed: it reads the gathered activation"])
        self.assertExpectedInline(graph_text(gm), """\
all_gather_matmul_default = all_gather_matmul(x_1, [w_1], [None], 0, '0', 2, '{"impl": "reference"}')
getitem_1 = getitem(all_gather_matmul_default, 1)
getitem = getitem(all_gather_matmul_default, 0)
view = view(getitem, [1, 8, 16])
view_1 = view(view, [8, 16])
permute = permute(view_1, [1, 0])
mm_1 = mm(permute, dy_1)
return [getitem_1, mm_1]
""")

    def test_one_gather_feeding_q_k_v_becomes_one_op(self):
        with fake_group(2) as g:
            def qkv(x, wq, wk, wv):
                a = all_gather(x, 0, g)
                return F.linear(a, wq), F.linear(a, wk), F.linear(a, wv)

            gm = trace(qkv, randn(3, 4, 16), randn(16, 16), randn(8, 16), randn(8, 16))
            report = rewrite(gm)
        self.assertEqual(len(report.candidates), 1)
        self.assertIn("N=16,8,8", report.candidates[0].task)
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(wq_1, [1, 0])
permute_1 = permute(wk_1, [1, 0])
permute_2 = permute(wv_1, [1, 0])
all_gather_matmul_default = all_gather_matmul(x_1, [permute, permute_1, permute_2], [None, None, None], 0, '0', 2, '{"impl": "reference"}')
getitem_3 = getitem(all_gather_matmul_default, 3)
getitem_2 = getitem(all_gather_matmul_default, 2)
view_3 = view(getitem_2, [6, 4, 8])
getitem_1 = getitem(all_gather_matmul_default, 1)
view_1 = view(getitem_1, [6, 4, 16])
view_5 = view(getitem_3, [6, 4, 8])
return [view_1, view_3, view_5]
""")

    def test_gathered_activation_as_right_operand_is_left_alone_with_the_reason(self):
        with fake_group(2) as g:
            gm = trace(lambda x, w: w @ all_gather(x, 0, g), randn(4, 8), randn(8, 8))
            report = rewrite(gm)
        self.assertEqual([(c.fused, c.reason) for c in report.candidates], [
            (False, "no matmul takes the gathered activation as its left operand "
                    "(mm takes it as its right operand)")])
        self.assertNotIn("ditron", graph_text(gm))


class MatmulCollectiveTest(TestCase):
    def test_reduce_scatter_through_a_chain_of_reshapes(self):
        with fake_group(2) as g:
            gm = trace(lambda x, w: reduce_scatter((x @ w).view(1, 8, 32).view(1, 8, 2, 16),
                                                   "sum", 1, g), randn(8, 16), randn(16, 32))
            rewrite(gm)
        self.assertExpectedInline(graph_text(gm), """\
matmul_reduce_scatter_default = matmul_reduce_scatter([x_1], [w_1], None, [1, 8, 2, 16], 1, 'sum', '0', 2, '{"impl": "reference"}')
return matmul_reduce_scatter_default
""")

    def test_reduce_scatter_of_a_sum_of_matmuls_takes_each_terms_operands(self):
        # The input gradient of q/k/v (or gate/up), which share their input: x1 @ w1 + x2 @ w2,
        # the op's terms as they are (no operands concatenated along K, nothing copied).
        with fake_group(2) as g:
            gm = trace(lambda x1, w1, x2, w2: reduce_scatter(x1 @ w1 + x2 @ w2, "sum", 0, g),
                       randn(8, 16), randn(16, 32), randn(8, 8), randn(8, 32))
            report = rewrite(gm)
        self.assertEqual([(c.task, c.fused) for c in report.candidates], [
            ("matmul_reduce_scatter M=8 K=24 N=32 float32 world=2 group=0 sum, 2 matmul "
             "products summed", True)])
        self.assertExpectedInline(graph_text(gm), """\
matmul_reduce_scatter_default = matmul_reduce_scatter([x1_1, x2_1], [w1_1, w2_1], None, [], 0, 'sum', '0', 2, '{"impl": "reference"}')
return matmul_reduce_scatter_default
""")

    def test_sum_of_matmuls_scattered_on_the_sequence_of_b_2(self):
        # The backward of sequence-parallel q/k/v: each term's left operand permuted to
        # rank-major rows (where its producer, here a pointwise op, can write it so), each a
        # term of the op; the op's [B*S/W, H] rows are this rank's [B, S/W, H].
        def qkv_grad(dq, wq, dk, wk):
            total = (F.gelu(dq) @ wq).view(2, 8, 16) + (dk @ wk).view(2, 8, 16)
            return reduce_scatter(total, "sum", 1, g)

        with fake_group(2) as g:
            gm = trace(qkv_grad, randn(16, 8), randn(8, 16), randn(16, 4), randn(4, 16))
            report = rewrite(gm)
        self.assertEqual(report.candidates[0].task,
                         "matmul_reduce_scatter M=16 K=12 N=16 float32 world=2 group=0 dim=1 sum, "
                         "rank-major rows reordered in the graph, 2 matmul products summed, "
                         "copies 64 elements")  # dk 16x4, which no kernel of the graph writes
        self.assertExpectedInline(graph_text(gm), """\
reshape_default_2 = reshape(dk_1, [2, 2, 4, 4])
permute_default_1 = permute(reshape_default_2, [1, 0, 2, 3])
reshape_default_3 = reshape(permute_default_1, [-1, 4])
mul = mul.Tensor(dq_1, 0.5)
mul_1 = mul.Tensor(dq_1, 0.7071067811865476)
erf = erf(mul_1)
add = add.Tensor(erf, 1)
mul_2 = mul.Tensor(mul, add)
reshape_default = reshape(mul_2, [2, 2, 4, 8])
permute_default = permute(reshape_default, [1, 0, 2, 3])
reshape_default_1 = reshape(permute_default, [-1, 8])
matmul_reduce_scatter_default = matmul_reduce_scatter([reshape_default_1, reshape_default_3], [wq_1, wk_1], None, [], 0, 'sum', '0', 2, '{"impl": "reference"}')
reshape_default_4 = reshape(matmul_reduce_scatter_default, [2, 4, 16])
return reshape_default_4
""")

    def test_sum_of_matmuls_of_which_one_adds_a_bias_is_left_alone_with_the_reason(self):
        with fake_group(2) as g:
            gm = trace(lambda x1, w1, x2, w2, b: reduce_scatter(
                torch.addmm(b, x1, w1) + x2 @ w2, "sum", 0, g),
                randn(8, 16), randn(16, 32), randn(8, 8), randn(8, 32), randn(32))
            before = graph_text(gm)
            report = rewrite(gm)
        self.assertEqual([(c.fused, c.reason) for c in report.candidates], [
            (False, "add sums matmuls (addmm + mm) of which one adds a bias")])
        self.assertEqual(graph_text(gm), before)

    def test_reduce_scatter_dim_0_sum(self):
        with fake_group(4) as g:
            gm = trace(lambda x, w: reduce_scatter(x @ w, "sum", 0, g), randn(8, 16), randn(16, 32))
            rewrite(gm)
        self.assertExpectedInline(graph_text(gm), """\
matmul_reduce_scatter_default = matmul_reduce_scatter([x_1], [w_1], None, [], 0, 'sum', '0', 4, '{"impl": "reference"}')
return matmul_reduce_scatter_default
""")

    def test_reduce_scatter_dim_1_of_3d_output_avg(self):
        with fake_group(2) as g:
            gm = trace(lambda x, w: reduce_scatter(F.linear(x, w), "avg", 1, g),
                       randn(2, 6, 16), randn(8, 16))
            report = rewrite(gm)
        self.assertIn("dim=1 avg", report.candidates[0].task)
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(w_1, [1, 0])
view = view(x_1, [12, 16])
reshape_default = reshape(view, [2, 2, 3, 16])
permute_default = permute(reshape_default, [1, 0, 2, 3])
reshape_default_1 = reshape(permute_default, [-1, 16])
matmul_reduce_scatter_default = matmul_reduce_scatter([reshape_default_1], [permute], None, [], 0, 'avg', '0', 2, '{"impl": "reference"}')
reshape_default_2 = reshape(matmul_reduce_scatter_default, [2, 3, 8])
return reshape_default_2
""")

    def test_all_reduce_of_3d_linear_with_bias(self):
        with fake_group(2) as g:
            gm = trace(lambda x, w, b: all_reduce(F.linear(x, w, b), "sum", g),
                       randn(2, 3, 16), randn(8, 16), randn(8))
            rewrite(gm)
        self.assertExpectedInline(graph_text(gm), """\
view = view(x_1, [6, 16])
permute = permute(w_1, [1, 0])
matmul_all_reduce_default = matmul_all_reduce([view], [permute], b_1, [2, 3, 8], 'sum', '0', 2, '{"impl": "reference"}')
return matmul_all_reduce_default
""")


def rmsnorm(h, w, weight_in_fp32=False, eps=1e-6):
    h32 = h.float()
    normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * w).to(h.dtype) if weight_in_fp32 else normed.to(h.dtype) * w


class AllReduceRmsNormTest(TestCase):
    """Tensor-parallel inference: row-parallel matmul, all-reduce, residual add, RMSNorm."""

    def trace_layer(self, layer, dtype=torch.bfloat16, residual=True):
        args = [randn(2, 3, 8), randn(16, 8)] + ([randn(2, 3, 16)] if residual else []) + [randn(16)]
        with fake_group(2) as g:
            gm = trace(lambda *a: layer(g, *a), *[t.to(dtype) for t in args])
            report = rewrite(gm)
        return gm, report

    def test_residual_and_norm_rounded_then_scaled(self):
        def layer(g, x, w, residual, norm_w):
            h = all_reduce(F.linear(x, w), "sum", g) + residual
            return h, rmsnorm(h, norm_w)

        gm, report = self.trace_layer(layer)
        self.assertIn("matmul_all_reduce_rmsnorm M=6 K=8 N=16 bfloat16", report.candidates[0].task)
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(arg1_1, [1, 0])
view = view(arg0_1, [6, 8])
matmul_all_reduce_rmsnorm_default = matmul_all_reduce_rmsnorm(view, permute, None, [2, 3, 16], arg2_1, arg3_1, 1e-06, False, 'sum', '0', 2, '{"impl": "reference"}')
getitem_1 = getitem(matmul_all_reduce_rmsnorm_default, 1)
getitem = getitem(matmul_all_reduce_rmsnorm_default, 0)
convert_element_type = prims.convert_element_type.default(view, torch.float32)
convert_element_type_1 = prims.convert_element_type.default(permute, torch.float32)
return [getitem, getitem_1]
""")

    def test_norm_scaled_in_fp32_without_residual(self):
        def layer(g, x, w, norm_w):
            return rmsnorm(all_reduce(F.linear(x, w), "sum", g), norm_w, weight_in_fp32=True)

        gm, _ = self.trace_layer(layer, residual=False)
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(arg1_1, [1, 0])
view = view(arg0_1, [6, 8])
matmul_all_reduce_rmsnorm_default = matmul_all_reduce_rmsnorm(view, permute, None, [2, 3, 16], None, arg2_1, 1e-06, True, 'sum', '0', 2, '{"impl": "reference"}')
getitem_1 = getitem(matmul_all_reduce_rmsnorm_default, 1)
getitem = getitem(matmul_all_reduce_rmsnorm_default, 0)
convert_element_type = prims.convert_element_type.default(view, torch.float32)
convert_element_type_1 = prims.convert_element_type.default(permute, torch.float32)
return getitem_1
""")

    def test_float32_norm(self):
        def layer(g, x, w, residual, norm_w):
            return rmsnorm(all_reduce(x @ w.t(), "sum", g) + residual, norm_w)

        gm, report = self.trace_layer(layer, dtype=torch.float32)
        self.assertIn("matmul_all_reduce_rmsnorm", report.candidates[0].task)
        self.assertIn("1e-06, True", graph_text(gm))  # in float32 the two roundings coincide

    def test_training_norm_returns_the_reciprocal_rms_backward_saves(self):
        def layer(g, x, w, residual, norm_w):  # a training forward: rstd is saved for backward
            h = all_reduce(F.linear(x, w), "sum", g) + residual
            h32 = h.float()
            rstd = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
            normed = h32 * rstd
            return h, normed.to(h.dtype) * norm_w, rstd, normed

        gm, report = self.trace_layer(layer)
        self.assertIn("matmul_all_reduce_rmsnorm M=6 K=8 N=16 bfloat16", report.candidates[0].task)
        # normed, also saved, is computed from the op's h and reciprocal RMS
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(arg1_1, [1, 0])
view = view(arg0_1, [6, 8])
matmul_all_reduce_rmsnorm_default = matmul_all_reduce_rmsnorm(view, permute, None, [2, 3, 16], arg2_1, arg3_1, 1e-06, False, 'sum', '0', 2, '{"impl": "reference"}')
getitem_2 = getitem(matmul_all_reduce_rmsnorm_default, 2)
getitem_1 = getitem(matmul_all_reduce_rmsnorm_default, 1)
getitem = getitem(matmul_all_reduce_rmsnorm_default, 0)
convert_element_type = prims.convert_element_type.default(view, torch.float32)
convert_element_type_1 = prims.convert_element_type.default(permute, torch.float32)
convert_element_type_2 = prims.convert_element_type.default(getitem, torch.float32)
mul = mul.Tensor(convert_element_type_2, getitem_2)
return [getitem, getitem_1, getitem_2, mul]
""")

    def test_norm_intermediate_used_elsewhere_keeps_only_the_all_reduce(self):
        def layer(g, x, w, residual, norm_w):
            h = all_reduce(F.linear(x, w), "sum", g) + residual
            h32 = h.float()
            variance = h32.pow(2).mean(-1, keepdim=True)
            return (h32 * torch.rsqrt(variance + 1e-6)).to(h.dtype) * norm_w, variance

        with captured() as lines:
            gm, report = self.trace_layer(layer)
        self.assertIn("matmul_all_reduce M=6", report.candidates[0].task)
        self.assertIn("rsqrt", graph_text(gm))
        self.assertTrue(lines[1].endswith(": the residual add and RMSNorm after it stay with "
                                          "Inductor: the norm's mean of squares (mean) is used "
                                          "elsewhere"), lines)


class GroupedMmAllReduceTest(TestCase):
    """The all-reduce of what grouped GEMMs computed (a TP MoE's experts): the GEMM and the
    weighted sum stay in the graph; the op reduces their result, with the norm after it."""

    def trace_experts(self, tail):
        def layer(g, x, w, offs, weight, order, *rest):
            y = torch._grouped_mm(x, w, offs=offs) * weight  # each row by its routing weight
            summed = y[order].reshape(-1, 2, 16).sum(1)  # token order, summed over the top-2
            return tail(all_reduce(summed, "sum", g), *rest)

        bf16 = torch.bfloat16
        args = (randn(8, 8), randn(2, 8, 16), torch.tensor([4, 8], dtype=torch.int32),
                randn(8, 1), torch.arange(8), randn(2, 2, 16), randn(16))
        with fake_group(2) as g:
            gm = trace(lambda *a: layer(g, *a), *[t.to(bf16) if t.is_floating_point() else t
                                                  for t in args])
            report = rewrite(gm)
        return gm, report

    def test_weighted_sum_reduced_then_viewed_takes_the_residual_and_norm(self):
        def tail(reduced, residual, norm_w):  # the MoE block views [tokens, hidden] as [b, s, h]
            h = reduced.view(2, 2, 16) + residual
            return h, rmsnorm(h, norm_w)

        gm, report = self.trace_experts(tail)
        self.assertEqual(report.candidates[0].task,
                         "grouped_mm_all_reduce_rmsnorm M=4 N=16 bfloat16 world=2 group=0 sum")
        self.assertExpectedInline(graph_text(gm), """\
_grouped_mm = _grouped_mm(arg0_1, arg1_1, arg2_1)
mul = mul.Tensor(_grouped_mm, arg3_1)
index = index.Tensor(mul, [arg4_1])
view = view(index, [-1, 2, 16])
sum_1 = sum.dim_IntList(view, [1])
reshape_default = reshape(sum_1, [2, 2, 16])
grouped_mm_all_reduce_rmsnorm_default = grouped_mm_all_reduce_rmsnorm(reshape_default, arg5_1, arg6_1, 1e-06, False, 'sum', '0', 2, '{"impl": "reference"}')
getitem_1 = getitem(grouped_mm_all_reduce_rmsnorm_default, 1)
getitem = getitem(grouped_mm_all_reduce_rmsnorm_default, 0)
return [getitem, getitem_1]
""")

    def test_reduced_sum_with_no_norm_after_it_is_the_bare_op(self):
        gm, report = self.trace_experts(lambda reduced, residual, norm_w: reduced * 2)
        self.assertEqual([c.op for c in report.candidates], ["grouped_mm_all_reduce"])
        self.assertIn("grouped_mm_all_reduce(sum_1, 'sum', '0', 2,", graph_text(gm))
        self.assertNotIn("all_reduce(sum_1, 'sum', '0')\n", graph_text(gm))

    def test_a_dense_matmul_before_the_weighted_sum_is_no_grouped_gemm(self):
        def fn(x, w, weight):
            return all_reduce((x @ w * weight).sum(0), "sum", g)

        with fake_group(2) as g:
            gm = trace(fn, randn(8, 8), randn(8, 8), randn(8, 1))
            report = rewrite(gm)
        self.assertEqual(report.candidates, ())
        self.assertEqual([(c.kind, c.reason) for c in report.left], [
            ("beside", "no ditron op for mm -> mul -> sum -> all_reduce (mm)")])


class ConsecutiveMatchesTest(TestCase):
    """A later match whose operand an earlier rewrite replaced must use the replacement."""

    def test_second_layer_residual_is_the_first_layers_sum(self):
        def two_layers(g, x, w1, w2, residual, n1, n2):
            h1 = all_reduce(F.linear(x, w1), "sum", g) + residual
            h2 = all_reduce(F.linear(rmsnorm(h1, n1), w2), "sum", g) + h1
            return rmsnorm(h2, n2)

        args = [randn(2, 3, 16), randn(16, 16), randn(16, 16), randn(2, 3, 16), randn(16),
                randn(16)]
        with fake_group(2) as g:
            gm = trace(lambda *a: two_layers(g, *a), *[t.to(torch.bfloat16) for t in args])
            report = rewrite(gm)
        self.assertEqual([c.fused for c in report.candidates], [True, True])
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(arg1_1, [1, 0])
view = view(arg0_1, [6, 16])
matmul_all_reduce_rmsnorm_default = matmul_all_reduce_rmsnorm(view, permute, None, [2, 3, 16], arg3_1, arg4_1, 1e-06, False, 'sum', '0', 2, '{"impl": "reference"}')
getitem_1 = getitem(matmul_all_reduce_rmsnorm_default, 1)
getitem = getitem(matmul_all_reduce_rmsnorm_default, 0)
convert_element_type = prims.convert_element_type.default(view, torch.float32)
convert_element_type_1 = prims.convert_element_type.default(permute, torch.float32)
permute_1 = permute(arg2_1, [1, 0])
view_2 = view(getitem_1, [6, 16])
matmul_all_reduce_rmsnorm_default_1 = matmul_all_reduce_rmsnorm(view_2, permute_1, None, [2, 3, 16], getitem, arg5_1, 1e-06, False, 'sum', '0', 2, '{"impl": "reference"}')
getitem_3 = getitem(matmul_all_reduce_rmsnorm_default_1, 1)
getitem_2 = getitem(matmul_all_reduce_rmsnorm_default_1, 0)
convert_element_type_4 = prims.convert_element_type.default(view_2, torch.float32)
convert_element_type_5 = prims.convert_element_type.default(permute_1, torch.float32)
return getitem_3
""")

    def test_matmul_fed_by_an_earlier_fused_matmul(self):
        def chain(g, x, w1, w2):
            return reduce_scatter(all_gather(x, 0, g) @ w1 @ w2, "sum", 0, g)

        with fake_group(2) as g:
            gm = trace(lambda *a: chain(g, *a), randn(4, 8), randn(8, 8), randn(8, 8))
            report = rewrite(gm)
        self.assertEqual([c.fused for c in report.candidates], [True, True])
        self.assertExpectedInline(graph_text(gm), """\
all_gather_matmul_default = all_gather_matmul(arg0_1, [arg1_1], [None], 0, '0', 2, '{"impl": "reference"}')
getitem_1 = getitem(all_gather_matmul_default, 1)
matmul_reduce_scatter_default = matmul_reduce_scatter([getitem_1], [arg2_1], None, [], 0, 'sum', '0', 2, '{"impl": "reference"}')
return matmul_reduce_scatter_default
""")


class MatmulAllGatherTest(TestCase):
    def test_column_parallel_output_gathered_on_the_last_dim(self):
        # lm_head's colwise_gather_output: [B, S, V/W] gathered on dim 0, split + cat to dim 2
        with fake_group(2) as g:
            gm = trace(lambda x, w: all_gather(F.linear(x, w).view(2, 4, 8), 2, g),
                       randn(8, 16), randn(8, 16))
            report = rewrite(gm)
        self.assertEqual([(c.task, c.fused) for c in report.candidates], [
            ("matmul_all_gather M=8 K=16 N=8 float32 world=2 group=0 dim=2", True)])
        self.assertEqual(report.left, ())
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(w_1, [1, 0])
matmul_all_gather_default = matmul_all_gather(x_1, permute, None, [2, 4, 8], 2, '0', 2, '{"impl": "reference"}')
return matmul_all_gather_default
""")

    def test_rows_gathered_with_bias(self):
        with fake_group(4) as g:
            gm = trace(lambda x, w, b: all_gather(F.linear(x, w, b), 0, g),
                       randn(6, 16), randn(8, 16), randn(8))
            report = rewrite(gm)
        self.assertTrue(report.candidates[0].fused)
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(w_1, [1, 0])
matmul_all_gather_default = matmul_all_gather(x_1, permute, b_1, [], 0, '0', 4, '{"impl": "reference"}')
return matmul_all_gather_default
""")

    def test_a_gathered_activation_that_feeds_a_matmul_goes_to_all_gather_matmul(self):
        with fake_group(2) as g:
            gm = trace(lambda x, w1, w2: all_gather(x @ w1, 0, g) @ w2,
                       randn(4, 8), randn(8, 8), randn(8, 8))
            report = rewrite(gm)
        self.assertEqual([c.op for c in report.candidates], ["all_gather_matmul"])

    def test_a_gathered_sum_of_products_is_left_with_the_fusion_no_op_does(self):
        with fake_group(2) as g:
            gm = trace(lambda x, y, w: all_gather(x @ w + y @ w, 0, g),
                       randn(4, 8), randn(4, 8), randn(8, 8))
            report = rewrite(gm)
        self.assertEqual(report.candidates, ())
        self.assertEqual([(c.kind, c.reason) for c in report.left], [
            ("beside", "no ditron op for mm -> add -> all_gather (mm)")])

    def test_product_used_elsewhere_or_raw_gather_used_elsewhere_is_left_with_why(self):
        def product_kept(x, w):
            y = x @ w
            return all_gather(y, 0, g), y.sum()

        def raw_kept(x, w):
            raw = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_gather_into_tensor(x @ w, 2, g.group_name))
            return torch.cat(raw.split(4), 1), raw.sum()

        for fn, reason in ((product_kept, "the matmul result mm is also used by sum"),
                           (raw_kept, "the raw all-gather output wait_tensor is also used by "
                                      "sum")):
            with fake_group(2) as g:
                gm = trace(fn, randn(4, 8), randn(8, 8))
                before = graph_text(gm)
                report = rewrite(gm)
            self.assertEqual(graph_text(gm), before)
            self.assertEqual([(c.op, c.fused) for c in report.candidates],
                             [("matmul_all_gather", False)])
            self.assertIn(reason, report.candidates[0].reason)


class LeftAloneTest(TestCase):
    """Shapes that match but must not be rewritten: the graph stays as it was, with a reason."""

    def assert_left_alone(self, fn, args, world_size, reason, options=config.Options()):
        with fake_group(world_size) as g:
            gm = trace(lambda *a: fn(g, *a), *args)
            before = graph_text(gm)
            report = rewrite(gm, options)
        self.assertEqual(graph_text(gm), before)
        self.assertEqual([c.fused for c in report.candidates], [False])
        self.assertIn(reason, report.candidates[0].reason)

    def test_world_size_1(self):
        self.assert_left_alone(lambda g, x, w: all_gather(x, 0, g) @ w,
                               (randn(4, 8), randn(8, 8)), 1, "world size 1")

    def test_unsupported_dtype(self):
        self.assert_left_alone(lambda g, x, w: all_reduce(x @ w, "sum", g),
                               (randn(4, 8, dtype=torch.float64), randn(8, 8, dtype=torch.float64)),
                               2, "dtype torch.float64 is not supported")

    def test_matmul_result_needed_elsewhere(self):
        def fn(g, x, w):
            y = x @ w
            return reduce_scatter(y, "sum", 0, g), y.sum()

        self.assert_left_alone(fn, (randn(4, 8), randn(8, 8)), 2,
                               "the matmul result mm is also used by sum")

    def test_raw_gather_output_needed_elsewhere(self):
        def fn(g, x, w):
            raw = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_gather_into_tensor(x, 2, g.group_name))
            a = torch.cat(raw.split(2), 1).reshape(-1, 8)
            return a @ w, raw.sum()

        self.assert_left_alone(fn, (randn(2, 3, 8), randn(8, 8)), 2,
                               "the raw all-gather output wait_tensor is also used by sum")

    def test_weight_computed_from_another_fused_matmul(self):
        def fn(g, x, w):
            a = all_gather(x, 0, g)
            h = a @ w
            return a @ h[:8]

        self.assert_left_alone(fn, (randn(4, 8), randn(8, 8)), 2,
                               "the weight of mm_1 is computed from mm")

    def test_disabled_pattern(self):
        self.assert_left_alone(lambda g, x, w: all_reduce(x @ w, "sum", g),
                               (randn(4, 8), randn(8, 8)), 2,
                               "pattern matmul_all_reduce is disabled",
                               config.Options(patterns=frozenset({"all_gather_matmul"})))

    def test_a_collective_with_no_matmul_names_what_computed_it_not_a_view(self):
        with fake_group(2) as g:
            gm = trace(lambda x: all_reduce((x * x).sum(-1).reshape(-1), "sum", g), randn(4, 8))
            report = rewrite(gm)
        self.assertEqual([(c.kind, c.reason) for c in report.left], [
            ("apart", "no matmul beside it (what it sends comes from sum)")])

    def test_the_experts_weighted_sum_before_a_collective_keeps_it_beside_their_matmul(self):
        # the EP combine's forward: masked rows, weighted, put in token order and summed over
        # the top-k, then exchanged: four computing nodes and a view from the experts' GEMM
        def fn(x, w, keep, weight, order):
            y = torch.where(keep, x @ w, 0.0) * weight
            return all_reduce(y[order].reshape(-1, 2, 8).sum(1), "sum", g)

        with fake_group(2) as g:
            gm = trace(fn, randn(8, 8), randn(8, 8), torch.ones(8, 1, dtype=torch.bool),
                       randn(8, 1), torch.arange(8))
            report = rewrite(gm)
        self.assertEqual([(c.kind, c.reason) for c in report.left], [
            ("beside", "no ditron op for mm -> where -> mul -> index -> sum -> all_reduce (mm)")])

    def test_matmul_between_gather_and_scatter_goes_to_the_first_match(self):
        with fake_group(2) as g:
            gm = trace(lambda x, w: reduce_scatter(all_gather(x, 0, g) @ w, "sum", 0, g),
                       randn(4, 8), randn(8, 8))
            report = rewrite(gm)
        self.assertEqual([c.fused for c in report.candidates], [True, False])
        self.assertIn("mm already belongs to an earlier ditron op", report.candidates[1].reason)


class DynamicShapeTest(TestCase):
    def test_symbolic_token_dim(self):
        def mlp(g, x, w1, w2):
            h = F.relu(F.linear(all_gather(x, 0, g), w1))
            return reduce_scatter(F.linear(h, w2), "sum", 0, g)

        with fake_group(2) as g:
            gm = make_fx_symbolic(lambda *a: mlp(g, *a), randn(6, 16), randn(32, 16),
                                  randn(16, 32))
            report = rewrite(gm)
        self.assertEqual([c.fused for c in report.candidates], [True, True])
        self.assertRegex(report.candidates[0].task, r"M=2\*s\d+ ")
        self.assertExpectedInline(graph_text(gm), """\
permute = permute(arg1_1, [1, 0])
all_gather_matmul_default = all_gather_matmul(arg0_1, [permute], [None], 0, '0', 2, '{"impl": "reference"}')
getitem_1 = getitem(all_gather_matmul_default, 1)
relu = relu(getitem_1)
permute_1 = permute(arg2_1, [1, 0])
matmul_reduce_scatter_default = matmul_reduce_scatter([relu], [permute_1], None, [], 0, 'sum', '0', 2, '{"impl": "reference"}')
return matmul_reduce_scatter_default
""")


def make_fx_symbolic(fn, *args):
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="symbolic", decomposition_table=select_decomp_table())(*args)


if __name__ == "__main__":
    unittest.main()
