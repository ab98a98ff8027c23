"""Task level: what one fused operation does, as every rank sees it.

A `Task` is pure data derived from shapes, dtypes and the process group, never from timing, so
every rank that compiles the same graph builds the same Task and makes the same decision. The
matcher builds one per candidate at compile time; the ops build the same one from their inputs at
run time. Everything downstream (scheduler, plans, kernels, logs) reads shapes from here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

SymOrInt = Union[int, torch.SymInt]

ALL_GATHER_MATMUL = "all_gather_matmul"
MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"
MATMUL_ALL_REDUCE = "matmul_all_reduce"
MATMUL_ALL_REDUCE_RMSNORM = "matmul_all_reduce_rmsnorm"
OPS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM)


@dataclasses.dataclass(frozen=True)
class Task:
    """One collective + matmul.

    m, k, ns: the matmul is [m, k] @ [k, n] for each n in ns. For all-gather, m counts the rows
    gathered from all ranks; for reduce-scatter and all-reduce, the rows of the local matmul
    before the collective. dim is the gather/scatter dim of the N-d activation and dim_size its
    full length. rank_chunks_contiguous: each rank's chunk is one block of consecutive rows of
    the [m, k] matrix (dim 0, or every dim before dim has size 1), the layout the fused kernels
    take; a gather/scatter on dim 1 of [B > 1, S, H] interleaves the ranks' rows instead.
    """

    op: str
    group_name: str
    world_size: int
    m: SymOrInt
    k: SymOrInt
    ns: tuple[SymOrInt, ...]
    dtype: torch.dtype
    device_type: str
    dim: int = 0
    dim_size: Optional[SymOrInt] = None
    reduce_op: Optional[str] = None
    has_bias: tuple[bool, ...] = ()
    rank_chunks_contiguous: bool = True
    # matmul_all_reduce_rmsnorm: a residual is added before the norm
    has_residual: bool = False

    @property
    def m_hint(self) -> int:
        return size_hint(self.m)

    @property
    def n_total(self) -> int:
        return sum(size_hint(n) for n in self.ns)

    def describe(self) -> str:
        ns = ",".join(str(n) for n in self.ns)
        dtype = str(self.dtype).replace("torch.", "")
        extra = f" dim={self.dim}" if self.dim else ""
        if self.reduce_op:
            extra += f" {self.reduce_op}"
        return (
            f"{self.op} M={self.m} K={self.k} N={ns} {dtype} world={self.world_size}"
            f" group={self.group_name}{extra}"
        )


def size_hint(x: SymOrInt) -> int:
    """A concrete value for a possibly symbolic size (its hint), for cost estimates only."""
    if isinstance(x, torch.SymInt):
        return x.node.hint if x.node.has_hint() else 8192
    return int(x)


def numel(shape) -> SymOrInt:
    total = 1
    for s in shape:
        total = total * s
    return total


def chunks_contiguous(shape, dim: int) -> bool:
    """Whether cutting `shape` into equal pieces along `dim` leaves each piece one block of
    consecutive rows of the flattened [rows, last] matrix (a symbolic size counts as > 1)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return dim == 0 or statically_known_true(numel(shape[:dim]) == 1)
