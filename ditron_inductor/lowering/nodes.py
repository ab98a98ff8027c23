"""What a node of the post-grad FX graph is, for the finders and the rewrite."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.fx import Node

aten = torch.ops.aten

RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
VIEWS = RESHAPES + (
    aten.permute.default, aten.t.default, aten.transpose.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
    aten.slice.Tensor, aten.select.int, aten.alias.default,
)


def is_call(node: object, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def fake(node: Node):
    """The node's value as tracing left it: a fake tensor, a SymInt, a list of them."""
    return node.meta["val"]


def output_among_inputs(outputs: set[Node], starts: Iterable[Node]) -> Optional[Node]:
    """The first of `outputs` that `starts` are computed from (themselves included), or None:
    one op computing all of `outputs` cannot take such an input (it would be a cycle)."""
    stack, seen = list(starts), set()
    while stack:
        n = stack.pop()
        if n in outputs:
            return n
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return None
