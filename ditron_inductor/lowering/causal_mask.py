"""Attention masks that say "causal" in a tensor: `is_causal=True` instead.

Under torch.compile (torch < 2.14) Hugging Face builds every SDPA mask as a tensor from `arange`s
(dynamo reads `torch.compiler.is_exporting()` as True), and a mask rules out the flash kernels.
Such a mask depends on no graph input, so this pass, on the dynamo graph before AOTAutograd,
evaluates it once at compile time: a causal mask becomes `is_causal=True`, one that masks nothing
goes. Any other mask stays, with the reason in the log, and so does one whose value is not
certain (it depends on an input, draws random numbers, or shares its computation with a tensor
changed in place) or that is too large to evaluate.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

from ..log_names import LOGGER_NAME
from .nodes import call_arg

log = logging.getLogger(LOGGER_NAME)

SDPA = (torch._C._nn.scaled_dot_product_attention,
        torch.nn.functional.scaled_dot_product_attention)
# SDPA's positional parameters: (query, key, value, attn_mask, dropout_p, is_causal, ...)
MASK_ARG, CAUSAL_ARG = 3, 5
# Elements a mask may have to be evaluated at compile time (a bool each: 256 MiB).
MAX_MASK_ELEMENTS = 1 << 28

CAUSAL, NO_MASK = "causal", "no mask"


@dataclasses.dataclass(frozen=True)
class MaskSite:
    node: str  # the SDPA call
    mask_shape: tuple[int, ...]
    became: Optional[str]  # CAUSAL or NO_MASK when rewritten
    reason: str

    def describe(self) -> str:
        shape = "x".join(map(str, self.mask_shape)) or "?"
        if self.became == CAUSAL:
            return f"attention {self.node}: mask [{shape}] is causal -> is_causal=True, no mask"
        if self.became == NO_MASK:
            return f"attention {self.node}: mask [{shape}] masks nothing -> no mask"
        return f"attention {self.node}: mask [{shape}] kept: {self.reason}"


def rewrite_causal_masks(gm: GraphModule) -> list[MaskSite]:
    """Rewrite (in place) the SDPA calls of `gm` whose constant mask is causal or empty; a
    MaskSite per call with a mask."""
    calls = [(node, call_arg(node, MASK_ARG, "attn_mask")) for node in gm.graph.nodes
             if node.op == "call_function" and node.target in SDPA
             and not call_arg(node, CAUSAL_ARG, "is_causal")]
    verdicts: dict[tuple, tuple[Optional[str], str]] = {}  # the layers share one mask
    sites = []
    for sdpa, mask in calls:
        if not isinstance(mask, Node):
            continue
        shape = tuple(example_shape(mask) or ())
        query = example_shape(call_arg(sdpa, 0, "query"))
        key = example_shape(call_arg(sdpa, 1, "key"))
        scores = (query[-2], key[-2]) if query and key else ()
        if not scores or not shape:
            became, reason = None, "the shapes of query, key or mask are not known"
        elif not all(isinstance(d, int) for d in (*shape, *scores)):
            became, reason = None, "dynamic shapes"
        else:
            if (mask, scores) not in verdicts:
                verdicts[mask, scores] = _verdict(gm, mask, shape, scores)
            became, reason = verdicts[mask, scores]
        if became is not None:
            _replace(sdpa, became)
        sites.append(MaskSite(sdpa.name, shape, became, reason))
    if any(site.became for site in sites):
        for mask in {mask for _, mask in calls if isinstance(mask, Node)}:
            _erase_unused(gm, mask)
        gm.graph.lint()
        gm.recompile()
    return sites


def _verdict(gm: GraphModule, mask: Node, shape: tuple, scores: tuple) -> tuple[Optional[str],
                                                                                str]:
    """(CAUSAL, NO_MASK or None, and why None) for a mask over `scores` (queries, keys)."""
    above = _ancestors(mask)
    inputs = sorted(n.name for n in above if n.op == "placeholder")
    if inputs:
        return None, f"it depends on the graph input(s) {', '.join(inputs)}"
    if (random := next((n.name for n in above if _draws_random(n)), None)) is not None:
        return None, f"it draws random numbers ({random})"
    if (mutated := _mutated_after(gm, set(above))) is not None:
        return None, f"{mutated} changes a tensor its computation reads, in place"
    if math.prod(shape) > MAX_MASK_ELEMENTS:
        return None, (f"{math.prod(shape)} elements, over the {MAX_MASK_ELEMENTS} this pass "
                      f"evaluates at compile time")
    try:
        value = _evaluate(gm, above)
    except Exception as e:  # noqa: BLE001 - an op the evaluation cannot run: keep the mask
        return None, f"could not evaluate it at compile time ({type(e).__name__}: {e})"
    became = classify(value, *scores)
    return became, "" if became else "neither causal nor empty"


def classify(mask: torch.Tensor, queries: int, keys: int) -> Optional[str]:
    """CAUSAL, NO_MASK or None: what `mask` (boolean: True attends; or float: added to the
    scores, 0 or -inf) does to `queries` x `keys` scores, broadcast as SDPA broadcasts it."""
    if mask.dtype == torch.bool:
        attends = mask
    elif mask.is_floating_point() and bool(((mask == 0) | (mask == -math.inf)).all()):
        attends = mask == 0
    else:
        return None
    if bool(attends.all()):
        return NO_MASK
    causal = torch.ones(queries, keys, dtype=torch.bool, device=attends.device).tril()
    return CAUSAL if bool((attends == causal).all()) else None


def set_call_arg(node: Node, index: int, name: str, value: Any) -> None:
    """Where the call passes the argument: positionally, else as a keyword."""
    if len(node.args) > index:
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def traced_value(node: Node) -> Any:
    """The node's traced value: dynamo's example_value, or val."""
    return node.meta.get("example_value", node.meta.get("val"))


def example_shape(value: Any) -> Optional[list]:
    meta = traced_value(value) if isinstance(value, Node) else None
    return list(meta.shape) if isinstance(meta, torch.Tensor) else None


def _ancestors(node: Node) -> list[Node]:
    """`node` and every node it reads, directly or not, in graph order."""
    seen, stack = {node}, [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return [n for n in node.graph.nodes if n in seen]


def _mutates(node: Node) -> bool:
    """Whether `node` may change one of its inputs in place (the dynamo graph is not
    functional): `x.add_(...)`, `x &= ...`, `x[i] = ...`, `out=`, `inplace=True`."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in IN_PLACE_METHODS or node.target in IN_PLACE_OPERATORS:  # x &= y
        return True
    if getattr(node.target, "__module__", None) in ("operator", "_operator"):
        return False  # operator.and_ is `a & b`, not in place
    name = _target_name(node)  # x.add_(y), torch.relu_(x)
    in_place_name = name.endswith("_") and not name.startswith("__")
    return in_place_name or "out" in node.kwargs or node.kwargs.get("inplace") is True


IN_PLACE_OPERATORS = frozenset(getattr(operator, name) for name in (
    "iadd", "iand", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "ior", "ipow", "irshift",
    "isub", "itruediv", "ixor", "setitem"))
IN_PLACE_METHODS = frozenset(f"__{op.__name__}__" for op in IN_PLACE_OPERATORS)


def _mutated_after(gm: GraphModule, above: set[Node]) -> Optional[str]:
    """A node that may change in place a tensor computed from the mask's computation (`above`):
    evaluating `above` alone would miss that change."""
    reached = set(above)
    for node in gm.graph.nodes:
        if node not in reached and any(p in reached for p in node.all_input_nodes):
            reached.add(node)
        if node in reached and _mutates(node):
            return node.name
    return None


RANDOM_NAMES = ("rand", "bernoulli", "multinomial", "normal", "poisson", "dropout", "uniform",
                "exponential", "cauchy", "geometric")


def _draws_random(node: Node) -> bool:
    name = _target_name(node).lower()
    return any(r in name for r in RANDOM_NAMES)


def _target_name(node: Node) -> str:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name if isinstance(name, str) else ""


def _evaluate(gm: GraphModule, above: list[Node]) -> torch.Tensor:
    """The mask's value: `above`, its computation (no graph input), run on real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    values: dict[Node, Any] = {}
    with unset_fake_temporarily(), torch.no_grad():
        for node in above:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
            if node.op == "call_function":
                values[node] = node.target(*args, **kwargs)
            elif node.op == "call_method":
                values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.op == "get_attr":
                values[node] = operator.attrgetter(node.target)(gm)
            else:
                raise TypeError(f"{node.op} node {node.name}")
    value = values[above[-1]]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"the mask is a {type(value).__name__}")
    return value


def _replace(sdpa: Node, became: str) -> None:
    set_call_arg(sdpa, MASK_ARG, "attn_mask", None)
    if became == CAUSAL:
        set_call_arg(sdpa, CAUSAL_ARG, "is_causal", True)


def _erase_unused(gm: GraphModule, mask: Node) -> None:
    """The mask's computation, where nothing else reads it (other SDPA calls may share it)."""
    for node in reversed(_ancestors(mask)):
        if not node.users and node.op in ("call_function", "call_method"):
            gm.graph.erase_node(node)
