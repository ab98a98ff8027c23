"""The MoE patterns on traced graphs: the expert-parallel layer's training step (forward and
backward) as one graph, each shape the pass rewrites, and each it leaves alone with the reason.

The graphs hold what Dynamo and AOTAutograd leave: static shapes, the split sizes unbacked
SymInts read back with `.tolist()` (`fx_helpers.trace_data_dependent`); `test_moe_gloo.py`
compiles the same layer for real.
"""

from __future__ import annotations

import unittest
import unittest.mock

import torch
import torch.nn.functional as F
from expecttest import TestCase

from ditron_inductor import config
from ditron_inductor.lowering.graph_pass import run_pass
from tests.fx_helpers import all_to_all, fake_group, graph_text, trace_data_dependent
from tests.moe_ep import EXPERTS_LOOP, ExpertParallelMoE

BF16 = torch.bfloat16
# the lines of a graph that an MoE rewrite touches
MOE_NODES = ("all_to_all", "wait_tensor", "grouped_mm", "index")


def rewrite(gm, options=None):
    report = run_pass(gm.graph, options or config.Options())
    gm.recompile()
    return report


def moe_lines(gm) -> str:
    """The graph's calls of MOE_NODES ops, one a line."""
    lines = [line for line in graph_text(gm).splitlines() if " = " in line]
    return "".join(line + "\n" for line in lines
                   if any(op in line.split(" = ", 1)[1].split("(")[0] for op in MOE_NODES))


def randn(*shape, dtype=BF16):
    return torch.randn(*shape).to(dtype)


def trace_training_step(g, experts_form, dtype):
    """The layer's forward and backward, one graph (the gradients of its input and weights)."""
    torch.manual_seed(0)
    moe = ExpertParallelMoE(16, 32, 4, 2, g, experts_form).to(dtype)
    names = [n for n, _ in moe.named_parameters()]

    def step(x, dy, *params):
        params = [p.requires_grad_() for p in params]
        out = torch.func.functional_call(moe, dict(zip(names, params)), (x.requires_grad_(),))
        return torch.autograd.grad(out, [x] + params, dy)

    return trace_data_dependent(step, randn(8, 16, dtype=dtype), randn(8, 16, dtype=dtype),
                                *[p.detach() for p in moe.parameters()])


def trace_inference(g, dtype):
    """The layer's forward alone, no gradient: nothing saves the dispatched rows."""
    torch.manual_seed(0)
    moe = ExpertParallelMoE(16, 32, 4, 2, g, "grouped_mm").to(dtype)
    names = [n for n, _ in moe.named_parameters()]

    def forward(x, *params):
        with torch.no_grad():
            return torch.func.functional_call(moe, dict(zip(names, params)), (x,))

    return trace_data_dependent(forward, randn(8, 16, dtype=dtype),
                                *[p.detach() for p in moe.parameters()])


def fused_dispatch_plans(gm) -> list:
    """The plans the graph's all_to_all_grouped_mm nodes carry."""
    from ditron_inductor.scheduler.plan import decode

    return [decode(n.args[-1]) for n in gm.graph.nodes
            if n.target is torch.ops.ditron.all_to_all_grouped_mm.default]


class TrainingStepTest(TestCase):
    def test_the_dispatch_stores_its_rows_only_where_the_graph_reads_them(self):
        # CPU tensors take the reference plan: decide the MoE ops fused, as on CUDA
        from ditron_inductor.lowering import graph_pass
        from ditron_inductor.scheduler.decide import Decision
        from ditron_inductor.scheduler.plan import GroupedMmPlan

        with unittest.mock.patch.object(graph_pass, "_decide", lambda *_: Decision(
                True, "fused for the test", GroupedMmPlan())), fake_group(2) as g:
            inference, training = trace_inference(g, BF16), trace_training_step(
                g, "grouped_mm", BF16)
            rewrite(inference)
            rewrite(training)
        self.assertEqual([p.rows for p in fused_dispatch_plans(inference)], [False])
        # the forward's rows feed the weight gradients, the backward's the down projection's
        self.assertEqual([p.rows for p in fused_dispatch_plans(training)], [True, True])

    def test_dispatch_and_combine_forward_and_backward_become_four_ops(self):
        with fake_group(2) as g:
            gm = trace_training_step(g, "grouped_mm", BF16)
            before = moe_lines(gm)
            report = rewrite(gm)
        self.assertEqual([(c.task, c.fused) for c in report.candidates], [
            ("all_to_all_grouped_mm M=u2 + u3 K=16 N=32,32 bfloat16 world=2 group=0 experts=2 "
             "tokens=16, rows permuted", True),
            ("grouped_mm_all_to_all M=u2 + u3 K=32 N=16 bfloat16 world=2 group=0 experts=2 "
             "tokens=u0 + u1, rows permuted", True),
            # backward: the output gradient dispatched to the down projection's input gradient
            ("all_to_all_grouped_mm M=u2 + u3 K=16 N=32 bfloat16 world=2 group=0 experts=2 "
             "tokens=16, rows permuted", True),
            # the input gradients of gate and up, summed, sent back
            ("grouped_mm_all_to_all M=u2 + u3 K=64 N=16 bfloat16 world=2 group=0 experts=2 "
             "tokens=u0 + u1, rows permuted, 2 grouped GEMMs summed", True)])
        # The exchange of counts stays; the tokens' four all-to-alls go into the ops.
        self.assertExpectedInline(before, """\
all_to_all_single = all_to_all_single(scatter_add, [2, 2], [2, 2], '0')
wait_tensor = wait_tensor(all_to_all_single)
index = index.Tensor(arg0_1, [div_1])
all_to_all_single_1 = all_to_all_single(index, [_local_scalar_dense_2, _local_scalar_dense_3], [_local_scalar_dense, _local_scalar_dense_1], '0')
wait_tensor_1 = wait_tensor(all_to_all_single_1)
index_1 = index.Tensor(repeat, [repeat_interleave])
index_2 = index.Tensor(wait_tensor_1, [getitem_9])
_grouped_mm = _grouped_mm(index_2, permute_1, cumsum)
_grouped_mm_1 = _grouped_mm(index_2, permute_2, cumsum)
_grouped_mm_2 = _grouped_mm(mul, permute_3, cumsum)
index_put = index_put(empty, [getitem_9], _grouped_mm_2)
all_to_all_single_2 = all_to_all_single(index_put, [_local_scalar_dense, _local_scalar_dense_1], [_local_scalar_dense_2, _local_scalar_dense_3], '0')
wait_tensor_2 = wait_tensor(all_to_all_single_2)
index_put_1 = index_put(empty_1, [getitem_3], wait_tensor_2)
index_3 = index.Tensor(view_5, [getitem_3])
all_to_all_single_3 = all_to_all_single(index_3, [_local_scalar_dense_2, _local_scalar_dense_3], [_local_scalar_dense, _local_scalar_dense_1], '0')
wait_tensor_3 = wait_tensor(all_to_all_single_3)
index_4 = index.Tensor(wait_tensor_3, [getitem_9])
_grouped_mm_3 = _grouped_mm(permute_4, mul, cumsum)
_grouped_mm_4 = _grouped_mm(index_4, permute_6, cumsum)
_grouped_mm_5 = _grouped_mm(permute_8, index_2, cumsum)
_grouped_mm_6 = _grouped_mm(mul_8, permute_10, cumsum)
_grouped_mm_7 = _grouped_mm(permute_12, index_2, cumsum)
_grouped_mm_8 = _grouped_mm(convert_element_type_9, permute_14, cumsum)
index_put_2 = index_put(full_2, [getitem_9], add_4, True)
all_to_all_single_4 = all_to_all_single(index_put_2, [_local_scalar_dense, _local_scalar_dense_1], [_local_scalar_dense_2, _local_scalar_dense_3], '0')
wait_tensor_4 = wait_tensor(all_to_all_single_4)
index_put_3 = index_put(full_3, [div_1], wait_tensor_4, True)
""")
        # The weight gradients (2-d x 2-d grouped GEMMs) read the rows the ops return.
        self.assertExpectedInline(moe_lines(gm), """\
all_to_all_single = all_to_all_single(scatter_add, [2, 2], [2, 2], '0')
wait_tensor = wait_tensor(all_to_all_single)
index = index.Tensor(arg0_1, [div_1])
index_1 = index.Tensor(repeat, [repeat_interleave])
all_to_all_grouped_mm_default = all_to_all_grouped_mm(index, [_local_scalar_dense_2, _local_scalar_dense_3], [_local_scalar_dense, _local_scalar_dense_1], getitem_9, [permute_1, permute_2], cumsum, '0', 2, '{"impl": "reference"}')
grouped_mm_all_to_all_default = grouped_mm_all_to_all([mul], [permute_3], cumsum, getitem_9, False, [_local_scalar_dense, _local_scalar_dense_1], [_local_scalar_dense_2, _local_scalar_dense_3], '0', 2, '{"impl": "reference"}')
index_put_1 = index_put(empty_1, [getitem_3], grouped_mm_all_to_all_default)
index_3 = index.Tensor(view_5, [getitem_3])
all_to_all_grouped_mm_default_1 = all_to_all_grouped_mm(index_3, [_local_scalar_dense_2, _local_scalar_dense_3], [_local_scalar_dense, _local_scalar_dense_1], getitem_9, [permute_6], cumsum, '0', 2, '{"impl": "reference"}')
_grouped_mm_3 = _grouped_mm(permute_4, mul, cumsum)
_grouped_mm_5 = _grouped_mm(permute_8, getitem_10, cumsum)
_grouped_mm_7 = _grouped_mm(permute_12, getitem_10, cumsum)
grouped_mm_all_to_all_default_1 = grouped_mm_all_to_all([mul_8, convert_element_type_9], [permute_10, permute_14], cumsum, getitem_9, True, [_local_scalar_dense, _local_scalar_dense_1], [_local_scalar_dense_2, _local_scalar_dense_3], '0', 2, '{"impl": "reference"}')
index_put_3 = index_put(full_3, [div_1], grouped_mm_all_to_all_default_1, True)
""")

    def test_experts_in_a_loop_of_matmuls_are_left_with_the_reason(self):
        with fake_group(2) as g:
            gm = trace_training_step(g, EXPERTS_LOOP, torch.float32)
            before = graph_text(gm)
            report = rewrite(gm)
        self.assertEqual(graph_text(gm), before)
        self.assertEqual([(c.op, c.fused) for c in report.candidates], [
            ("all_to_all_grouped_mm", False), ("grouped_mm_all_to_all", False),
            ("all_to_all_grouped_mm", False), ("grouped_mm_all_to_all", False)])
        reasons = [c.reason for c in report.candidates]
        self.assertRegex(reasons[0], r"^the experts multiply 2 pieces of index_2 in a loop of "
                                     r"matmuls \(mm_1, mm_2, mm_4, mm_5\): only "
                                     r"torch._grouped_mm is matched$")
        self.assertRegex(reasons[1], r"^the experts' outputs mm_3, mm_6 come from a loop of "
                                     r"matmuls, concatenated by cat: only torch._grouped_mm")
        self.assertIn("in a loop of matmuls", reasons[2])  # backward: slices of the rows


def exchange(x, splits, g):
    """x's rows all-to-all'd, the same split sizes both ways."""
    return all_to_all(x, splits, splits, g)


def rows_to_send(splits, y, index):
    """y's rows put in the order of index into zeros as long as the all-to-all sends."""
    return torch.zeros(sum(splits), y.shape[1], dtype=y.dtype).index_put((index,), y)


def grouped_mm(rows, w, offsets):
    return torch._grouped_mm(rows, w.transpose(-2, -1), offs=offsets)


def dispatch_args():
    """x, counts, row index, offsets, gate and up weights [experts, N, K]"""
    return (randn(8, 16), torch.tensor([4, 4]), torch.arange(8), torch.tensor([3, 8],
            dtype=torch.int32), randn(2, 32, 16), randn(2, 32, 16))


def combine_args():
    """h, counts, row index, offsets, down weight [experts, N, K]"""
    return (randn(8, 32), torch.tensor([4, 4]), torch.arange(8), torch.tensor([3, 8],
            dtype=torch.int32), randn(2, 16, 32))


class ShapesTest(TestCase):
    def trace(self, fn, args, world_size=2, options=None):
        with fake_group(world_size) as g:
            gm = trace_data_dependent(lambda *a: fn(g, *a), *args)
            before = graph_text(gm)
            report = rewrite(gm, options)
        return gm, before, report

    def test_one_expert_per_rank_needs_no_row_index(self):
        def dispatch(g, x, counts, offsets, w):
            return grouped_mm(exchange(x, counts.tolist(), g), w, offsets)

        gm, _, report = self.trace(dispatch, (randn(8, 16), torch.tensor([4, 4]),
                                              torch.tensor([8], dtype=torch.int32),
                                              randn(1, 32, 16)))
        self.assertEqual(report.candidates[0].task,
                         "all_to_all_grouped_mm M=u0 + u1 K=16 N=32 bfloat16 world=2 group=0 "
                         "experts=1 tokens=8")
        self.assertExpectedInline(moe_lines(gm), """\
all_to_all_grouped_mm_default = all_to_all_grouped_mm(arg0_1, [_local_scalar_dense, _local_scalar_dense_1], [_local_scalar_dense, _local_scalar_dense_1], None, [permute], arg2_1, '0', 2, '{"impl": "reference"}')
""")

    def test_split_sizes_known_after_a_graph_break(self):
        # Without capture_scalar_outputs Dynamo breaks the graph at .tolist(): the next graph
        # holds the sizes as constants, per rank and per routing.
        def combine(g, h, index, offsets, w):
            y = grouped_mm(h, w, offsets)
            rows = torch.zeros(8, 16, dtype=BF16).index_put((index,), y, accumulate=True)
            return all_to_all(rows, [3, 5], [6, 2], g)

        gm, _, report = self.trace(combine, combine_args()[:1] + combine_args()[2:])
        self.assertEqual(report.candidates[0].task,
                         "grouped_mm_all_to_all M=8 K=32 N=16 bfloat16 world=2 group=0 experts=2 "
                         "tokens=8, rows permuted")
        self.assertExpectedInline(moe_lines(gm), """\
grouped_mm_all_to_all_default = grouped_mm_all_to_all([arg0_1], [permute], arg2_1, arg1_1, True, [3, 5], [6, 2], '0', 2, '{"impl": "reference"}')
""")

    def assert_left_alone(self, fn, args, reason, options=None):
        gm, before, report = self.trace(fn, args, options=options)
        self.assertEqual(graph_text(gm), before)
        self.assertEqual([(c.fused, c.reason) for c in report.candidates], [(False, reason)])

    def test_received_rows_used_in_arrival_order(self):
        def dispatch(g, x, counts, index, offsets, w1, w3):
            received = exchange(x, counts.tolist(), g)
            return grouped_mm(received[index], w1, offsets), received.sum()

        self.assert_left_alone(dispatch, dispatch_args(), "the received rows wait_tensor are "
                               "also used in arrival order by sum_1")

    def test_gate_and_up_with_different_offsets(self):
        def dispatch(g, x, counts, index, offsets, w1, w3):
            rows = exchange(x, counts.tolist(), g)[index]
            return grouped_mm(rows, w1, offsets) * grouped_mm(rows, w3, offsets.flip(0))

        self.assert_left_alone(dispatch, dispatch_args(), "the grouped GEMMs _grouped_mm, "
                               "_grouped_mm_1 take different offsets")

    def test_expert_output_used_beside_the_combine(self):
        def combine(g, h, counts, index, offsets, w):
            splits, y = counts.tolist(), grouped_mm(h, w, offsets)
            return exchange(rows_to_send(splits, y, index), splits, g), y.sum()

        self.assert_left_alone(combine, combine_args(), "the grouped GEMM result _grouped_mm is "
                               "also used by sum_1")

    def test_rows_put_into_a_buffer_that_holds_data(self):
        def combine(g, h, counts, index, offsets, w):
            rows = h[:, :16].clone().index_put((index,), grouped_mm(h, w, offsets))
            return exchange(rows, counts.tolist(), g)

        self.assert_left_alone(combine, combine_args(), "index_put puts the rows into clone, "
                               "not into a buffer of zeros")

    def test_disabled_pattern(self):
        def dispatch(g, x, counts, index, offsets, w1, w3):
            return grouped_mm(exchange(x, counts.tolist(), g)[index], w1, offsets)

        patterns = config.Options().patterns - {"all_to_all_grouped_mm"}
        self.assert_left_alone(dispatch, dispatch_args(), "pattern all_to_all_grouped_mm is "
                               "disabled (ditron.patterns / DITRON_PATTERNS)",
                               config.Options(patterns=patterns))

    def test_all_to_all_between_grouped_gemms_goes_to_the_combine(self):
        def chain(g, h, counts, index, offsets, w):
            received = exchange(grouped_mm(h, w, offsets), counts.tolist(), g)
            return grouped_mm(received, w.transpose(-2, -1), offsets)

        gm, _, report = self.trace(chain, combine_args())
        self.assertEqual([(c.op, c.fused, c.reason) for c in report.candidates], [
            ("grouped_mm_all_to_all", True, "reference plan (decomposed collective + matmul)"),
            ("all_to_all_grouped_mm", False,
             "all_to_all_single already belongs to an earlier ditron op")])
        self.assertExpectedInline(moe_lines(gm), """\
grouped_mm_all_to_all_default = grouped_mm_all_to_all([arg0_1], [permute], arg3_1, None, False, [_local_scalar_dense, _local_scalar_dense_1], [_local_scalar_dense, _local_scalar_dense_1], '0', 2, '{"impl": "reference"}')
_grouped_mm_1 = _grouped_mm(grouped_mm_all_to_all_default, permute_2, arg3_1)
""")

    def test_exchange_of_counts_is_no_candidate(self):
        def counts_only(g, x, counts, index, offsets, w1, w3):
            return F.relu(exchange(counts.float(), counts.tolist(), g))

        _, _, report = self.trace(counts_only, dispatch_args())
        self.assertEqual(report.candidates, ())


if __name__ == "__main__":
    unittest.main()
