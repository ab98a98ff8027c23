"""Decode matmuls (a few rows: a decode step at a small batch) -> ditron.decode_mm, the decode
GEMM template.

Runs after the collective rewrites (which take the matmuls they fuse first; a fused all-reduce's
one-row GEMM takes the template through its plan), where the option `ditron.decode_gemm` is on;
which products qualify is scheduler/decode_gemm.py's `mm_not_rewritten`. With
`ditron.decode_gemm_groups`, the products of the same rows (q/k/v, gate/up) then become one
ditron.decode_mm_group call: one launch instead of two or three.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from .. import ops  # noqa: F401 - defines torch.ops.ditron.*, which the rewrite inserts
from ..scheduler.decode_gemm import mm_not_rewritten
from .nodes import RESHAPES, is_call, output_among_inputs


def rewrite_decode_mms(graph: Graph) -> list[str]:
    """Replace each qualifying `aten.mm` of `graph` by `ditron.decode_mm` (in place); the names
    of the nodes replaced."""
    replaced = []
    for node in list(graph.nodes):
        if not is_call(node, torch.ops.aten.mm.default):
            continue
        values = [a.meta.get("val") if isinstance(a, Node) else None for a in node.args]
        if not all(isinstance(v, torch.Tensor) for v in values) or mm_not_rewritten(*values):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.ditron.decode_mm.default, node.args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced.append(node.name)
    return replaced


def group_decode_mms(graph: Graph) -> list[list[str]]:
    """Replace (in place) the ditron.decode_mm calls of `graph` on the same rows (q/k/v, gate/up)
    by ditron.decode_mm_group, MAX_GROUP at most per call; the names of the calls, per group."""
    from ..runtime.gemv import MAX_GROUP
    from torch._inductor.pattern_matcher import stable_topological_sort

    by_rows: dict[tuple, list[Node]] = {}
    for node in graph.nodes:
        if is_call(node, torch.ops.ditron.decode_mm.default):
            by_rows.setdefault(_rows_source(node.args[0]), []).append(node)
    groups = []
    for members in by_rows.values():
        # a product whose weight is computed from another's output stays alone (no cycle)
        same_rows = set(members)
        members = [m for m in members if output_among_inputs(same_rows, [m.args[1]]) is None]
        for start in range(0, len(members) - 1, MAX_GROUP):
            group = members[start:start + MAX_GROUP]
            if len(group) < 2:
                continue
            with graph.inserting_before(group[0]):
                grouped = graph.call_function(torch.ops.ditron.decode_mm_group.default,
                                              (group[0].args[0], [m.args[1] for m in group]))
                grouped.meta["val"] = [m.meta.get("val") for m in group]
                products = [graph.call_function(operator.getitem, (grouped, index))
                            for index in range(len(group))]
            for member, product in zip(group, products):
                product.meta.update(member.meta)
                member.replace_all_uses_with(product)
                graph.erase_node(member)
            groups.append([m.name for m in group])
    if groups:  # a later member's weight may be defined after the first member
        stable_topological_sort(graph)
    return groups


def _rows_source(rows: Node) -> tuple:
    """(the node `rows` views, its shape): products whose rows are equal share it."""
    shape = tuple(rows.meta["val"].shape) if isinstance(rows.meta.get("val"), torch.Tensor) \
        else None
    while is_call(rows, *RESHAPES) and isinstance(rows.args[0], Node):
        rows = rows.args[0]
    return rows, shape
