"""Rank-major rows: how the rewrite serves a gather or scatter whose ranks' chunks interleave.

A sequence-parallel `Shard(1)` of `[B, S, H]` with B > 1 cuts the `[B*S, H]` matrix into row
blocks (b, r, s), B per rank, where the fused kernels take a rank's chunk as one block. The op
then runs on rank-major rows (r, b, s), a gather or scatter on dim 0, and the graph permutes the
rows around it (view [W, P, Q, cols] <-> [P, W, Q, cols], P the leading rows, Q a rank's rows
per leading index). Safe: a row of a matmul product depends on the same row of its left operand
only. Inductor folds the permute into the kernel that reads it (pointwise, reduction, cat, a
reshape that copies anyway) or writes its input (a pointwise producer); elsewhere it is a copy,
which `folds_into_*` tell apart for the cost model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .nodes import RESHAPES, VIEWS, is_call

aten = torch.ops.aten


def static_sizes(sizes: Sequence) -> Optional[list[int]]:
    """`sizes` as a view's argument: ints, with one symbolic size as -1 (the view infers it);
    None when more than one is symbolic."""
    out = [int(s) if is_concrete_int(s) else -1 for s in sizes]
    return out if out.count(-1) <= 1 else None


@dataclasses.dataclass(frozen=True)
class RowOrder:
    """The permutation between the graph's rows (p, r, q) and the rank-major rows (r, p, q)."""

    world: int
    lead: int  # P (-1: symbolic, the view infers it)
    per_rank: int  # Q (-1: symbolic)

    @staticmethod
    def of(piece_shape: Sequence, dim: int, world: int) -> Optional["RowOrder"]:
        """For one rank's piece (the all-gather's shard, the reduce-scatter's result) cut along
        `dim`; None when both P and Q are symbolic or the last dim is (no view can say them)."""
        sizes = static_sizes([math.prod(piece_shape[:dim]), math.prod(piece_shape[dim:-1]),
                              piece_shape[-1]])
        if sizes is None or sizes[-1] < 0:
            return None
        return RowOrder(world, sizes[0], sizes[1])

    def rank_major_view(self, cols: int) -> list[int]:
        return [self.world, self.lead, self.per_rank, cols]

    def graph_order_view(self, cols: int) -> list[int]:
        return [self.lead, self.world, self.per_rank, cols]


# Reductions read their input through a loader, as pointwise ops do.
REDUCTIONS = (aten.sum.default, aten.sum.dim_IntList, aten.mean.dim, aten.amax.default,
              aten.amin.default, aten.var_mean.correction, aten.var.correction)
SWAP_FIRST_TWO = [1, 0, 2, 3]


def _pointwise(node: Node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def _copies_anyway(node: Node) -> bool:
    """A reshape of a tensor that is not contiguous: Inductor copies there in any case."""
    return is_call(node, *RESHAPES) and not node.args[0].meta["val"].is_contiguous()


def folds_into_users(node: Node) -> bool:
    """Whether every use of `node`, through views, reads it from a kernel that Inductor can
    give a permuted index (pointwise, a reduction, cat, a reshape that copies anyway)."""
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user.op != "call_function":
            return False  # a graph output is stored as it is
        if (_copies_anyway(user) or _pointwise(user)
                or is_call(user, aten.cat.default, *REDUCTIONS)):
            continue
        if is_call(user, *VIEWS):
            stack.extend(user.users)
            continue
        return False
    return True


def folds_into_producer(node: Node) -> bool:
    """Whether the kernel that computes `node` (through views) can write it permuted: a
    pointwise op that nothing else reads, or a reshape that copies anyway."""
    while is_call(node, *VIEWS):
        if _copies_anyway(node):
            return True
        node = node.args[0]
    return isinstance(node, Node) and _pointwise(node) and len(node.users) == 1
