"""The collectives of a graph that no candidate holds, each with why: what the log says of them.

A finder that declines a collective returns an `Unmatched` with its reason instead of a match.
Where the collective reaches no matmul through the shapes the finders take, `no_matmul_served`
looks a few nodes further (upstream of what a collective reduces or gathers, downstream of what
it gathers or exchanges) for the nearest matmul, and names the kind of fusion that no ditron op
does ("no ditron op for all_reduce -> mm"); none there: "no matmul beside it".
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.fx import Graph, Node

from .nodes import fake

c10d = torch.ops._c10d_functional

# How far from a collective a matmul still counts as beside it, in nodes that compute (views,
# waits and copies are free): the weighted sum of the experts' rows that the TP plans and the EP
# combine put between them (mask, weight, rows in token order, sum) fits in this many.
_HOPS = 4

# The namespaces of the ops a post-grad graph holds of itself: named without theirs
_OWN = ("aten", "prims", "_c10d_functional")

# Short names of the collectives, as the log's reasons name them
_SHORT = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


@dataclasses.dataclass(frozen=True)
class Unmatched:
    """A collective no candidate holds; `beside_matmul`: a matmul is within reach of it, so it is
    a site the log lists at INFO."""

    collective: Node
    reason: str
    beside_matmul: bool = True


def is_collective(node: object) -> bool:
    """A functional collective (its wait_tensor is part of it, not one more)."""
    return (isinstance(node, Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "_c10d_functional"
            and node.target is not c10d.wait_tensor.default)


def collectives(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if is_collective(n)]


def op_name(node: Node) -> str:
    """`mm`, `_grouped_mm`, `transformers::grouped_mm_fallback`: the op a reason names."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
        return name if target.namespace in _OWN else f"{target.namespace}::{name}"
    return getattr(target, "__name__", str(target))


def short_name(collective: Node) -> str:
    name = op_name(collective)
    return _SHORT.get(name, name)


def is_matmul_like(node: object) -> bool:
    """Any matmul: aten's (mm, addmm, bmm, _scaled_mm, _grouped_mm, ...) or another library's op
    named so (transformers' grouped_mm_fallback)."""
    if not (isinstance(node, Node) and node.op == "call_function"):
        return False
    words = op_name(node).split("::")[-1].split("_")
    return any(w in ("mm", "addmm", "bmm", "baddbmm", "matmul", "gemm", "linear") for w in words)


def describe(collective: Node) -> str:
    """The log's name of a collective: op, the shape and dtype it sends, its group."""
    sent = collective.args[0]
    value = fake(sent) if isinstance(sent, Node) else None
    what = (f" [{', '.join(map(str, value.shape))}] {str(value.dtype).removeprefix('torch.')}"
            if isinstance(value, torch.Tensor) else "")
    group = next((a for a in reversed(collective.args) if isinstance(a, str)), "?")
    return f"{op_name(collective)}{what} group={group}"


# Nodes that move or convert values and compute nothing: a reason does not name them
_QUIET = ("view", "reshape", "_unsafe_view", "wait_tensor", "getitem", "permute", "t",
          "transpose", "clone", "alias", "unsqueeze", "squeeze", "expand", "split", "cat",
          "slice", "convert_element_type")
# What may lie between a collective and the matmul that takes its result: rows moved, not
# computed on (a norm between an all-reduce and the next layer's matmul makes it no neighbour)
_MOVES = _QUIET + ("index", "index_select", "gather", "index_put")


def nearest_matmul(start: Node, upstream: bool) -> Optional[list[Node]]:
    """The path from `start` (first) to the nearest matmul past at most _HOPS computing nodes
    (last), or None: upstream through any node's inputs (the weighted sum of the experts' rows
    before an all-reduce), downstream through the users that move rows. Collectives end a
    path."""
    if is_matmul_like(start):
        return [start]
    frontier, seen = [([start], _cost(start))], {start}
    while frontier:
        later = []
        for path, cost in frontier:
            nxt = path[-1].all_input_nodes if upstream else list(path[-1].users)
            for n in nxt:
                if n in seen or n.op != "call_function" or is_collective(n):
                    continue
                seen.add(n)
                if is_matmul_like(n):
                    return path + [n]
                if (upstream or op_name(n) in _MOVES) and cost + _cost(n) <= _HOPS:
                    later.append((path + [n], cost + _cost(n)))
        frontier = later
    return None


def _cost(node: Node) -> int:
    return int(op_name(node) not in _QUIET)


def _between(nodes: list[Node]) -> str:
    """The compute ops among `nodes`, in order: views, waits and copies say nothing."""
    ops = [op_name(n) for n in nodes if op_name(n) not in _QUIET]
    return "".join(f" -> {op}" for op in dict.fromkeys(ops))


def declined(collective: Node, reason: str, results: Optional[Node] = None) -> Unmatched:
    """A finder's decline for a reason of its own: beside a matmul where one produces what the
    collective sends or takes what it returns (`results`)."""
    sent = collective.args[0] if isinstance(collective.args[0], Node) else None
    near = ((sent is not None and nearest_matmul(sent, upstream=True) is not None)
            or (results is not None and nearest_matmul(results, upstream=False) is not None))
    return Unmatched(collective, reason, beside_matmul=near)


def no_matmul_served(collective: Node, results: Node, upstream: bool, downstream: bool,
                     why: str = "") -> Unmatched:
    """For a collective whose finder found no matmul it serves: the nearest matmul that produces
    what it sends (`upstream`) or takes what it returns (`results`, `downstream`), named as the
    fusion no ditron op does; else no matmul beside it. `why`: the finder's own detail."""
    coll = short_name(collective)
    detail = f" ({why})" if why else ""
    if upstream and isinstance(collective.args[0], Node):
        path = nearest_matmul(collective.args[0], upstream=True)
        if path is not None:
            mm = path[-1]
            return Unmatched(collective, f"no ditron op for {op_name(mm)}"
                             f"{_between(path[-2::-1])} -> {coll} ({mm.name}){detail}")
    if downstream:
        path = nearest_matmul(results, upstream=False)
        if path is not None:
            mm = path[-1]
            return Unmatched(collective, f"no ditron op for {coll}{_between(path[:-1])} -> "
                             f"{op_name(mm)} ({mm.name}){detail}")
    sent = _computed_from(collective.args[0])
    if not why and sent is not None:
        detail = f" (what it sends comes from {op_name(sent)})"
    return Unmatched(collective, f"no matmul beside it{detail}", beside_matmul=False)


def _computed_from(sent: object) -> Optional[Node]:
    """The op that computed what a collective sends, through the views and copies before it."""
    while (isinstance(sent, Node) and sent.op == "call_function" and op_name(sent) in _QUIET
           and sent.all_input_nodes):
        sent = sent.all_input_nodes[0]
    return sent if isinstance(sent, Node) and sent.op == "call_function" else None
