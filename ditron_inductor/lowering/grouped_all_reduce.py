"""The all-reduce of what grouped GEMMs computed: the experts' weighted sum under a tensor-parallel
MoE plan (each rank holds a slice of every expert, transformers' `moe_tp_experts`) or an
inference EP that sums the experts' outputs by all-reduce, and in backward their input gradient:

    _grouped_mm / grouped_mm_fallback[_backward] [-> weight, rows in token order, sum, ...]
        -> all_reduce -> wait_tensor [-> reshape] [-> + residual -> RMSNorm]

The grouped GEMM and what lies between stay in the graph, as Inductor compiles them; the op takes
their result and reduces it on the all-reduce kernels, the residual add and RMSNorm after it in
the same kernels (the op takes the result as the reshape after the collective views it; the
runtime copies the result into the symmetric buffer where the GEMM of
matmul_all_reduce writes its product). An all-reduce whose nearest matmul upstream is no grouped
GEMM keeps the reason lowering/left.py gives it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch.fx import Node

from ..scheduler.task import (GROUPED_MM_ALL_REDUCE, GROUPED_MM_ALL_REDUCE_RMSNORM, Task,
                              grouped_mm_all_reduce_task)
from .left import nearest_matmul, op_name
from .nodes import RESHAPES, fake, is_call
from .norm import RmsNormTail, attach_rmsnorm_tail


@dataclasses.dataclass
class GroupedMmAllReduceMatch:
    op: str  # GROUPED_MM_ALL_REDUCE or GROUPED_MM_ALL_REDUCE_RMSNORM
    collective: Node
    wait: Node
    reduced: Node  # what the all-reduce sums: the op's input
    grouped_mm: Node  # the nearest grouped GEMM upstream of it
    reduce_op: str
    group_name: str
    world_size: int
    # the reshape of the reduced sum (the MoE block's [tokens, hidden] -> [batch, seq, hidden])
    # that the norm tail follows: the op takes its input so shaped
    view: Optional[Node] = None
    norm: Optional[RmsNormTail] = None
    problem: Optional[str] = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def task(self) -> Task:
        return grouped_mm_all_reduce_task(self.op, fake(self.view or self.reduced),
                                          self.reduce_op, self.group_name, self.world_size)

    def replaced_nodes(self) -> list[Node]:
        return [self.collective]


def is_grouped_mm(node: Node) -> bool:
    """aten's _grouped_mm or another library's grouped GEMM (transformers' fallback, forward
    and backward)."""
    return "grouped_mm" in op_name(node)


def find_grouped_mm_all_reduce(collective: Node, wait: Node, reduce_op: str, group_name: str,
                               world_size: int, patterns) -> Optional[GroupedMmAllReduceMatch]:
    """The match where the nearest matmul upstream of what `collective` sums is a grouped GEMM,
    else None; with the RMSNorm tail where that pattern is among `patterns`."""
    reduced = collective.args[0]
    path = nearest_matmul(reduced, upstream=True) if isinstance(reduced, Node) else None
    if path is None or not is_grouped_mm(path[-1]):
        return None
    match = GroupedMmAllReduceMatch(GROUPED_MM_ALL_REDUCE, collective, wait, reduced, path[-1],
                                    reduce_op, group_name, world_size)
    users = list(wait.users)
    if len(users) == 1 and is_call(users[0], *RESHAPES):
        match.view = users[0]
    if GROUPED_MM_ALL_REDUCE_RMSNORM in patterns:
        attach_rmsnorm_tail(match, match.view or wait, GROUPED_MM_ALL_REDUCE_RMSNORM)
    return match
