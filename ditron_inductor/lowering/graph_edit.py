"""Editing a post-grad graph, for every rewrite: calls inserted with their fake values."""

from __future__ import annotations

import contextlib
import operator
from typing import Optional, Sequence

from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.node import map_arg


def insert_call(graph: Graph, target, args: tuple, kwargs: Optional[dict] = None) -> Node:
    """A call of `target` right after the last of its inputs (or of the placeholders)."""
    inputs: list[Node] = []
    map_arg((args, kwargs or {}), inputs.append)
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = max(inputs + placeholders[-1:], key=order.__getitem__)
    with graph.inserting_after(last):
        node = graph.call_function(target, args, kwargs)
    refresh_value(node)
    return node


def refresh_value(node: Node) -> None:
    """The node's fake value, computed again from its inputs' (after a rewrite changed them)."""
    args, kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    fake_mode = detect_fake_mode([n.meta["val"] for n in node.all_input_nodes])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        node.meta["val"] = node.target(*args, **kwargs)


def insert_getitem(graph: Graph, op: Node, index: int) -> Node:
    with graph.inserting_after(op):
        node = graph.call_function(operator.getitem, (op, index))
    node.meta["val"] = op.meta["val"][index]
    return node


def erase_unused(graph: Graph, nodes: Sequence[Node]) -> None:
    """Erase, users first, the nodes of the old subgraph that nothing uses any more."""
    erased: set[Node] = set()
    for node in nodes:
        if node not in erased and not node.users:
            graph.erase_node(node)
            erased.add(node)
