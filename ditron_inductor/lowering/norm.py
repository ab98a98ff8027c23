"""The residual add and RMSNorm that follow a row-parallel all-reduce in tensor-parallel
models, as Llama-style models produce them after decomposition:

    h   = wait_tensor(all_reduce(...)) [+ residual]
    h32 = convert_element_type(h, float32)          (absent when h is float32)
    n   = h32 * rsqrt(mean(pow(h32, 2), [-1], keepdim=True) + eps)
    y   = convert_element_type(n, h.dtype) * weight                  (Hugging Face rounding)
       or convert_element_type(n * weight, h.dtype)                  (F.rms_norm rounding)

Anything else after the all-reduce is no tail: the all-reduce is matched on its own. In a
training graph the forward also returns what the norm's backward saves: the reciprocal RMS
(rsqrt) and, as the partitioner chooses, h32, n or its rounding. The op returns the
reciprocal RMS where anything else uses it; the others stay in the graph, pointwise from the
op's h and reciprocal RMS. A tail has a `problem` where the all-reduced sum itself is used
elsewhere (the op returns it only with the residual added) or the mean of squares is (the op
would leave that reduction to be computed again).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.fx import Node

from .nodes import is_call

aten = torch.ops.aten
prims = torch.ops.prims


@dataclasses.dataclass
class RmsNormTail:
    """residual and weight are read when asked: an earlier rewrite may have replaced them."""

    reduced: Node  # the all-reduce's result (its wait_tensor)
    residual_add: Optional[Node]  # h = reduced + residual; None: h is the reduced sum itself
    h: Node
    out: Node  # y, the normalised output
    scale: Node  # the mul by the norm weight
    scaled: Node  # what `scale` multiplies by the weight
    eps: float
    weight_in_fp32: bool
    inner: list[Node]  # the nodes between h and out, in graph order
    rsqrt: Node  # the reciprocal RMS, rsqrt(mean(h32^2) + eps)
    problem: Optional[str] = None  # why the op cannot take the tail

    @property
    def used_elsewhere(self) -> list[Node]:
        """The nodes of the tail that nodes outside it use (backward's saved values)."""
        tail = set(self.inner) | {self.out}
        return [n for n in self.inner if any(u not in tail for u in n.users)]

    @property
    def reduction(self) -> list[Node]:
        """pow, mean, + eps: the mean of squares under the rsqrt."""
        i = self.inner.index(self.rsqrt)
        return self.inner[i - 3:i]

    @property
    def with_rstd(self) -> bool:
        """Whether the op must return the reciprocal RMS: a node that stays uses it."""
        after_rsqrt = self.inner[self.inner.index(self.rsqrt):]
        return any(n in after_rsqrt for n in self.used_elsewhere)

    @property
    def residual(self) -> Optional[Node]:
        if self.residual_add is None:
            return None
        return _other_operand(self.residual_add, self.reduced)

    @property
    def weight(self) -> Node:
        return _other_operand(self.scale, self.scaled)


def _names(nodes: list[Node]) -> str:
    """Nodes by name; the output node as what it is to a training forward."""
    return ", ".join("the graph's outputs (returned or saved for backward)" if n.op == "output"
                     else n.name for n in nodes)


def _user(node: Node, *targets) -> Optional[Node]:
    """The first user of `node` that calls one of `targets` (others may use it too)."""
    return next((u for u in node.users if is_call(u, *targets)), None)


def _other_operand(binary: Node, one: Node) -> Optional[object]:
    a, b = binary.args[:2]
    return b if a is one else a if b is one else None


def _to_dtype(node: Node, dtype: torch.dtype) -> bool:
    return is_call(node, prims.convert_element_type.default) and node.args[1] == dtype


def find_residual_add(reduced: Node) -> Optional[Node]:
    """`reduced + residual` (of equal shape), where the reduced sum has such a use."""
    add = _user(reduced, aten.add.Tensor)
    if add is None or add.kwargs or len(add.args) != 2:
        return None
    residual = _other_operand(add, reduced)
    if not isinstance(residual, Node) or residual is reduced:
        return None
    if residual.meta["val"].shape != reduced.meta["val"].shape:
        return None
    return add


def attach_rmsnorm_tail(match, reduced: Node, norm_op: str) -> None:
    """An all-reduce match takes the tail after `reduced` (its op becomes `norm_op`), or notes
    why the tail stays with Inductor."""
    norm = find_rmsnorm_tail(reduced)
    if norm is not None and norm.problem:
        match.notes.append(f"the residual add and RMSNorm after it stay with Inductor: "
                           f"{norm.problem}")
    elif norm is not None:
        match.norm, match.op = norm, norm_op


def find_rmsnorm_tail(reduced: Node) -> Optional[RmsNormTail]:
    residual_add = find_residual_add(reduced)
    h = residual_add if residual_add is not None else reduced
    dtype = h.meta["val"].dtype
    ndim = h.meta["val"].dim()
    for start in h.users:
        h32 = start if _to_dtype(start, torch.float32) else h if dtype == torch.float32 else None
        if h32 is None:
            continue
        tail = _norm_from(h, h32, dtype, ndim)
        if tail is not None:
            tail = RmsNormTail(reduced, residual_add, h, *tail)
            reduction = [n for n in tail.used_elsewhere if n in tail.reduction]
            others = [u for u in reduced.users if u is not residual_add]
            if residual_add is not None and others:  # the op returns the sum plus the residual
                tail.problem = (f"the all-reduced sum {reduced.name} is also used by "
                                f"{_names(others)}, and the op returns it only with the "
                                "residual added")
            elif reduction:
                tail.problem = f"the norm's mean of squares ({_names(reduction)}) is used elsewhere"
            return tail
    return None


def _norm_from(h: Node, h32: Node, dtype: torch.dtype, ndim: int):
    """(out, scale, scaled, eps, weight_in_fp32, inner, rsqrt) for the norm of h32, or None."""
    square = next((u for u in h32.users
                   if is_call(u, aten.pow.Tensor_Scalar) and u.args[1] == 2), None)
    if square is None:
        return None
    mean = _user(square, aten.mean.dim)
    if mean is None or [d % ndim for d in mean.args[1]] != [ndim - 1] or mean.args[2:3] != (True,):
        return None
    plus_eps = _user(mean, aten.add.Tensor, aten.add.Scalar)
    eps = plus_eps.args[1] if plus_eps is not None else None
    if not isinstance(eps, float):
        return None
    rsqrt = _user(plus_eps, aten.rsqrt.default)
    normed = rsqrt and next((u for u in rsqrt.users if is_call(u, aten.mul.Tensor)
                             and _other_operand(u, rsqrt) is h32), None)
    if normed is None:
        return None
    inner = ([h32] if h32 is not h else []) + [square, mean, plus_eps, rsqrt, normed]
    for after in normed.users:
        found = _weight_from(h, normed, after, dtype)
        if found is not None:
            out, scale, scaled, weight_in_fp32, rounded = found
            return out, scale, scaled, eps, weight_in_fp32, inner + rounded, rsqrt
    return None


def _weight_from(h: Node, normed: Node, after: Node, dtype: torch.dtype):
    """(out, scale, scaled, weight_in_fp32, [the node between normed and out]) where `after`
    applies the norm weight to `normed` (rounding to h's dtype before or after), or None."""
    if is_call(after, aten.mul.Tensor):  # weight applied in float32, then rounded (or all float32)
        scale, scaled, weight_in_fp32, out, between = after, normed, True, after, []
        if dtype != torch.float32:
            out = _user(after, prims.convert_element_type.default)
            if out is None or not _to_dtype(out, dtype):
                return None
            between = [after]
    elif _to_dtype(after, dtype):  # rounded to h's dtype first, then the weight
        out = _user(after, aten.mul.Tensor)
        if out is None:
            return None
        scale, scaled, weight_in_fp32, between = out, after, False, [after]
    else:
        return None
    weight = _other_operand(scale, scaled)
    if not isinstance(weight, Node) or weight.meta["val"].dim() != 1:
        return None
    if weight.meta["val"].shape[0] != h.meta["val"].shape[-1]:
        return None
    return out, scale, scaled, weight_in_fp32, between
