"""The residual add and RMSNorm that follow a row-parallel all-reduce in tensor-parallel
inference, as Llama-style models produce them after decomposition:

    h   = wait_tensor(all_reduce(...)) [+ residual]
    h32 = convert_element_type(h, float32)          (absent when h is float32)
    n   = h32 * rsqrt(mean(pow(h32, 2), [-1], keepdim=True) + eps)
    y   = convert_element_type(n, h.dtype) * weight                  (Hugging Face rounding)
       or convert_element_type(n * weight, h.dtype)                  (F.rms_norm rounding)

Anything else after the all-reduce is no tail: the all-reduce is matched on its own.
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

    @property
    def residual(self) -> Optional[Node]:
        if self.residual_add is None:
            return None
        return _other_operand(self.residual_add, self.reduced)

    @property
    def weight(self) -> Node:
        return _other_operand(self.scale, self.scaled)


def _only_user(node: Node, *targets) -> Optional[Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 and is_call(users[0], *targets) else None


def _other_operand(binary: Node, one: Node) -> Optional[object]:
    a, b = binary.args[:2]
    return b if a is one else a if b is one else None


def _to_dtype(node: Node, dtype: torch.dtype) -> bool:
    return is_call(node, prims.convert_element_type.default) and node.args[1] == dtype


def find_residual_add(reduced: Node) -> Optional[Node]:
    """`reduced + residual` (of equal shape) when that is the reduced sum's only use."""
    add = _only_user(reduced, aten.add.Tensor)
    if add is None or add.kwargs or len(add.args) != 2:
        return None
    residual = _other_operand(add, reduced)
    if not isinstance(residual, Node) or residual is reduced:
        return None
    if residual.meta["val"].shape != reduced.meta["val"].shape:
        return None
    return add


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
            return RmsNormTail(reduced, residual_add, h, *tail)
    return None


def _norm_from(h: Node, h32: Node, dtype: torch.dtype, ndim: int):
    """(out, scale, scaled, eps, weight_in_fp32, inner) for the norm of h32, or None."""
    square = next((u for u in h32.users
                   if is_call(u, aten.pow.Tensor_Scalar) and u.args[1] == 2), None)
    normed = next((u for u in h32.users if is_call(u, aten.mul.Tensor)), None)
    if square is None or normed is None:
        return None
    mean = _only_user(square, aten.mean.dim)
    if mean is None or [d % ndim for d in mean.args[1]] != [ndim - 1] or mean.args[2:3] != (True,):
        return None
    plus_eps = _only_user(mean, aten.add.Tensor, aten.add.Scalar)
    eps = plus_eps.args[1] if plus_eps is not None else None
    if not isinstance(eps, float):
        return None
    rsqrt = _only_user(plus_eps, aten.rsqrt.default)
    if rsqrt is None or _other_operand(normed, h32) is not rsqrt or len(rsqrt.users) != 1:
        return None
    inner = ([h32] if h32 is not h else []) + [square, mean, plus_eps, rsqrt, normed]

    after = _only_user(normed, aten.mul.Tensor, prims.convert_element_type.default)
    if after is None:
        return None
    if is_call(after, aten.mul.Tensor):  # weight applied in float32, then rounded (or all float32)
        scale, scaled, weight_in_fp32 = after, normed, True
        out = after
        if dtype != torch.float32:
            out = _only_user(after, prims.convert_element_type.default)
            if out is None or not _to_dtype(out, dtype):
                return None
            inner.append(after)
    else:  # rounded to h's dtype first, then the weight
        if not _to_dtype(after, dtype):
            return None
        out = _only_user(after, aten.mul.Tensor)
        if out is None:
            return None
        scale, scaled, weight_in_fp32 = out, after, False
        inner.append(after)
    weight = _other_operand(scale, scaled)
    if not isinstance(weight, Node) or weight.meta["val"].dim() != 1:
        return None
    if weight.meta["val"].shape[0] != h.meta["val"].shape[-1]:
        return None
    if h32 is not h and len(h32.users) != 2:
        return None
    return out, scale, scaled, eps, weight_in_fp32, inner
