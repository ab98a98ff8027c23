"""What a node of the post-grad FX graph is, for the finders and the rewrite."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch.fx import Node

aten = torch.ops.aten

RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
VIEWS = RESHAPES + (
    aten.permute.default, aten.t.default, aten.transpose.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
    aten.slice.Tensor, aten.select.int, aten.alias.default,
)

# Each matmul's arguments in schema order, by what they are to the ops (addmm's `self` is the
# bias); only _scaled_mm's optional ones may come as keywords, under these names.
_MATMUL_ARGS = {
    aten.mm.default: ("a", "weight"),
    aten.addmm.default: ("bias", "a", "weight"),
    aten._scaled_mm.default: ("a", "weight", "scale_a", "scale_b", "bias", "scale_result",
                              "out_dtype", "use_fast_accum"),
}


def matmul_arg(node: Node, name: str):
    """A matmul call's argument `name`: None where the call has none (mm's bias, its scales)."""
    names = _MATMUL_ARGS[node.target]
    if name not in names:
        return None
    i = names.index(name)
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def call_arg(node: Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


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


def weight_from_output(matmuls: list, inputs: Callable) -> Optional[str]:
    """Why one op cannot compute every matmul of `matmuls` (each with a `node`): the inputs of
    one (`inputs(matmul)`, None for none) computed from another's output, a cycle; or None."""
    outputs = {m.node for m in matmuls}
    for m in matmuls:
        found = output_among_inputs(outputs, [n for n in inputs(m) if n is not None])
        if found is not None:
            return f"the weight of {m.node.name} is computed from {found.name}"
    return None


def summands(total: object) -> tuple[list[object], list[Node]]:
    """What `total` adds up (itself where it is no add of two nodes) and the adds, outermost
    first."""
    adds, terms, stack = [], [], [total]
    while stack:
        n = stack.pop(0)
        if is_call(n, aten.add.Tensor) and len(n.args) == 2 and not n.kwargs and all(
                isinstance(a, Node) for a in n.args):
            adds.append(n)
            stack[:0] = list(n.args)
        else:
            terms.append(n)
    return terms, adds
