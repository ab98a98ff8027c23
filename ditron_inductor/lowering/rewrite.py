"""Rewrite a match into one ditron op call.

The op goes right after the last of its inputs; its outputs take over the uses of the nodes they
replace, and what of the old subgraph nothing uses any more is erased. The pass sorts the graph
once at the end: a later weight may have put the op after a user of an earlier matmul.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import ops  # noqa: F401 - defines torch.ops.ditron.*, which the rewrite inserts
from .graph_edit import erase_unused, insert_call, insert_getitem
from .grouped_all_reduce import GroupedMmAllReduceMatch
from .match import AllGatherMatmulMatch, MatmulCollectiveMatch
from .norm import RmsNormTail
from .nodes import fake
from .reorder import SWAP_FIRST_TWO, RowOrder
from ..scheduler.task import MATMUL_ALL_GATHER, REDUCE_SCATTER_PATTERNS

aten = torch.ops.aten
ditron = torch.ops.ditron


def rewrite_all_gather_matmul(graph: Graph, match: AllGatherMatmulMatch, plan: str) -> Node:
    order = match.row_order
    shard, gather_dim = match.a_shard, match.gather_dim
    k = shard.meta["val"].shape[-1]
    if order is not None:  # rank-major rows: a gather on dim 0 of the shard's matrix
        shard, gather_dim = insert_call(graph, aten.reshape.default, (shard, [-1, k])), 0
    weights, biases = [m.weight for m in match.matmuls], [m.bias for m in match.matmuls]
    group = (gather_dim, match.group_name, match.world_size, plan)
    if match.scaled:
        first = match.matmuls[0]
        op = insert_call(graph, ditron.all_gather_scaled_mm.default, (
            shard, match.scale_a, weights, [m.scale_b for m in match.matmuls], biases,
            first.out_dtype, first.use_fast_accum, *group))
    else:
        op = insert_call(graph, ditron.all_gather_matmul.default, (shard, weights, biases, *group))
    outputs = [insert_getitem(graph, op, i) for i in range(1 + len(match.matmuls))]
    gathered = outputs[:1]  # the gathered activation, and the nodes that make it
    if order is not None:
        gathered = _from_rank_major(graph, outputs[0], order, k, match.gathered_sizes) + gathered
        outputs = [gathered[0]] + [
            _from_rank_major(graph, out, order, mm.node.meta["val"].shape[-1])[0]
            for mm, out in zip(match.matmuls, outputs[1:])]
    match.gathered.replace_all_uses_with(outputs[0])
    for mm, out in zip(match.matmuls, outputs[1:]):
        mm.node.replace_all_uses_with(out)
    inner = match.chunk_cat.inner if match.chunk_cat else []
    erase_unused(graph, [m.node for m in match.matmuls] + match.views[::-1]
                  + gathered + [match.gathered] + inner[::-1] + [match.wait, match.gather]
                  + match.scale_gather)
    return op


def _swap_row_blocks(graph: Graph, node: Node, blocks: list, sizes: list) -> list[Node]:
    """`node` viewed as 4-d `blocks`, its first two dims swapped, reshaped to `sizes`: the nodes
    inserted, the result first."""
    view = insert_call(graph, aten.reshape.default, (node, blocks))
    permute = insert_call(graph, aten.permute.default, (view, SWAP_FIRST_TWO))
    return [insert_call(graph, aten.reshape.default, (permute, sizes)), permute, view]


def _from_rank_major(graph: Graph, node: Node, order: RowOrder, cols: int,
                     sizes: Optional[list] = None) -> list[Node]:
    """`node`'s rank-major rows in the graph's order, reshaped to `sizes` (default: a matrix);
    the nodes inserted, the result first."""
    return _swap_row_blocks(graph, node, order.rank_major_view(cols), sizes or [-1, cols])


def _to_rank_major(graph: Graph, node: Node, order: RowOrder) -> Node:
    """The rows of the matrix `node`, in the graph's order, rank-major."""
    cols = node.meta["val"].shape[-1]
    return _swap_row_blocks(graph, node, order.graph_order_view(cols), [-1, cols])[0]


def rewrite_matmul_collective(graph: Graph, match: MatmulCollectiveMatch, plan: str) -> Node:
    if match.op == MATMUL_ALL_GATHER:
        return _rewrite_matmul_all_gather(graph, match, plan)
    norm, order, mm = match.norm, match.row_order, match.matmul
    lefts = [m.a for m in match.matmuls]
    if order is not None:  # each term's before any concatenation, so its producer can write it so
        lefts = [_to_rank_major(graph, a, order) for a in lefts]
    if mm.scaled:  # a, b, scale_a, scale_b: one per term (the scaled reduce-scatter's lists)
        terms = (lefts, [m.weight for m in match.matmuls],
                 [_scale_a(graph, m.scale_a, order) for m in match.matmuls],
                 [m.scale_b for m in match.matmuls])
        if match.op not in REDUCE_SCATTER_PATTERNS:
            terms = tuple(t[0] for t in terms)
        operands = (*terms, mm.bias, mm.out_dtype, mm.use_fast_accum)
    elif norm is not None:
        operands = (*_concatenated_operands(graph, lefts, match), mm.bias)
    else:
        operands = (lefts, [m.weight for m in match.matmuls], mm.bias)
    if match.op in REDUCE_SCATTER_PATTERNS:
        target = (ditron.scaled_mm_reduce_scatter if mm.scaled
                  else ditron.matmul_reduce_scatter).default
        extra = ([], 0) if order is not None else (match.out_shape, match.dim)
    elif norm is not None:
        target = ditron.matmul_all_reduce_rmsnorm.default
        extra = (match.out_shape, norm.residual, norm.weight, norm.eps, norm.weight_in_fp32)
    else:
        target = (ditron.scaled_mm_all_reduce if mm.scaled else ditron.matmul_all_reduce).default
        extra = (match.out_shape,)
    args = (*operands, *extra, match.reduce_op, match.group_name, match.world_size, plan)
    op, tail = _insert_op(graph, target, args, norm)
    if norm is None and order is not None:  # this rank's rows, rank-major: the piece's order
        match.wait.replace_all_uses_with(
            insert_call(graph, aten.reshape.default, (op, match.scattered_sizes)))
    elif norm is None:
        match.wait.replace_all_uses_with(op)
    inner = match.chunk_cat.inner[::-1] if match.chunk_cat else []
    erase_unused(graph, tail + [match.wait, match.collective]
                  + ([match.chunk_cat.cat] if match.chunk_cat else []) + inner
                  + match.views + [m.node for m in match.matmuls])
    return op


def _insert_op(graph: Graph, target, args: tuple, norm: Optional[RmsNormTail]
               ) -> tuple[Node, list[Node]]:
    """The op's call; with an all-reduce's norm tail, its outputs take over the tail's uses (h,
    y, and the reciprocal RMS where backward saves it). Returns the op and the replaced tail
    nodes after the collective, users first."""
    with_rstd = norm is not None and norm.with_rstd
    op = insert_call(graph, target, args, {"with_rstd": True} if with_rstd else None)
    if norm is None:
        return op, []
    outputs = [insert_getitem(graph, op, i) for i in range(3 if with_rstd else 2)]
    norm.h.replace_all_uses_with(outputs[0])
    norm.out.replace_all_uses_with(outputs[1])
    if with_rstd:  # what else uses the norm's nodes (backward) reads the op's
        norm.rsqrt.replace_all_uses_with(outputs[2])
    return op, [norm.out] + norm.inner[::-1] + [norm.h]


def rewrite_grouped_mm_all_reduce(graph: Graph, match: GroupedMmAllReduceMatch,
                                  plan: str) -> Node:
    norm, view = match.norm, match.view
    group = (match.reduce_op, match.group_name, match.world_size, plan)
    x = match.reduced
    if view is not None:  # the op's input viewed as the graph views the sum
        x = insert_call(graph, aten.reshape.default, (x, list(view.args[1])))
    if norm is None:
        op, tail = _insert_op(graph, ditron.grouped_mm_all_reduce.default, (x, *group), None)
        (view or match.wait).replace_all_uses_with(op)
    else:
        op, tail = _insert_op(graph, ditron.grouped_mm_all_reduce_rmsnorm.default, (
            x, norm.residual, norm.weight, norm.eps, norm.weight_in_fp32, *group), norm)
    erase_unused(graph, tail + ([view] if view is not None else []) + [match.wait,
                                                                        match.collective])
    return op


def _rewrite_matmul_all_gather(graph: Graph, match: MatmulCollectiveMatch, plan: str) -> Node:
    mm = match.matmul
    op = insert_call(graph, ditron.matmul_all_gather.default, (
        mm.a, mm.weight, mm.bias, match.out_shape, match.dim, match.group_name,
        match.world_size, plan))
    match.gathered.replace_all_uses_with(op)
    inner = match.chunk_cat.inner[::-1] if match.chunk_cat else []
    erase_unused(graph, ([match.chunk_cat.cat] if match.chunk_cat else []) + inner
                  + [match.wait, match.collective] + match.views + [mm.node])
    return op


def _scale_a(graph: Graph, scale_a: Node, order: Optional[RowOrder]) -> Node:
    """A rowwise scale_a (one per row of a) permuted with a's rows; a tensorwise one as it is."""
    if order is None or statically_known_true(fake(scale_a).numel() == 1):
        return scale_a
    return _to_rank_major(graph, scale_a, order)


def _concatenated_operands(graph: Graph, lefts: list[Node], match: MatmulCollectiveMatch
                           ) -> tuple[Node, Node]:
    """The RMSNorm op's operands: the matmul's, or a sum's terms' (`lefts`, rows as the op takes
    them) concatenated along K."""
    if len(lefts) == 1:
        return lefts[0], match.matmul.weight
    return (insert_call(graph, aten.cat.default, (lefts, 1)),
            insert_call(graph, aten.cat.default, ([m.weight for m in match.matmuls], 0)))
