"""Task level: what one fused operation does, as every rank sees it.

A `Task` is pure data from shapes, dtypes and the process group, never from timing, so every rank
that compiles the same graph builds the same Task and makes the same decision. The matcher builds
one per candidate at compile time, the ops the same one from their inputs on the fused path (the
builders below serve both); the scheduler, plans, kernels and logs read shapes from it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..patterns import (  # noqa: F401 - the op names, re-exported beside the Task
    ALL_GATHER_MATMUL,
    ALL_GATHER_SCALED_MM,
    ALL_REDUCE_PATTERNS,
    ALL_TO_ALL_GROUPED_MM,
    GROUPED_MM_ALL_REDUCE,
    GROUPED_MM_ALL_REDUCE_PATTERNS,
    GROUPED_MM_ALL_REDUCE_RMSNORM,
    GROUPED_MM_ALL_TO_ALL,
    MATMUL_ALL_GATHER,
    MATMUL_ALL_REDUCE,
    MATMUL_ALL_REDUCE_RMSNORM,
    MATMUL_REDUCE_SCATTER,
    MOE_PATTERNS,
    REDUCE_SCATTER_PATTERNS,
    SCALED_MM_ALL_REDUCE,
    SCALED_MM_REDUCE_SCATTER,
)

SymOrInt = Union[int, torch.SymInt]


@dataclasses.dataclass(frozen=True)
class Task:
    """One collective + matmul: [m, k] @ [k, n] for each n in ns, m the rows gathered from all
    ranks (all-gather) or the local matmul's (reduce-scatter, all-reduce, and the matmul whose
    output is all-gathered); dim the gather/scatter dim of the N-d activation, dim_size its full
    length (reduce-scatter). rank_chunks_contiguous: each rank's chunk is one block of
    consecutive rows of [m, k], the layout the fused kernels take.

    For the cost model: rows_reordered, the graph permutes rank-major rows around the op; terms,
    the products over the same rows that the op sums (k counts every term's; each accumulated
    into the same rows, but the RMSNorm op concatenates them along K); copy_elems, what the
    rewrite's reorders and concatenations copy outside any kernel the graph runs anyway.

    MoE ops: m counts the rows the local experts compute, which the routing decides (an unbacked
    SymInt, or a per-rank constant after a graph break: no decision may depend on it); k, ns per
    expert; experts, this rank's; tokens, the (token, expert) rows it routes; rows_permuted, the
    experts read (write) the exchanged rows through an index. The all-reduce of what grouped
    GEMMs computed (GROUPED_MM_ALL_REDUCE_PATTERNS): [m, n] the reduced tensor's rows, no
    product (k = 1, which keeps the evidence's shape ratios defined; the log omits it). Scaled
    ops: dtype the float8 operands' (what an all-gather moves), out_dtype the product's, scales
    `scale_kind`'s.
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
    rank_chunks_contiguous: bool = True
    rows_reordered: bool = False
    terms: int = 1
    copy_elems: SymOrInt = 0
    experts: SymOrInt = 0
    tokens: SymOrInt = 0
    rows_permuted: bool = False
    out_dtype: Optional[torch.dtype] = None
    scales: str = ""
    fast_accum: bool = False

    # The cross-rank schedule; the interpreter tests compare templates/schedule.py's with it.

    def ring_order(self, rank: int) -> list[int]:
        """The AG and RS: chunk c belongs to rank c, and each rank takes the chunks from its own
        on (rank, rank+1, ...), so that at every step the ranks work on distinct chunks."""
        return [(rank + i) % self.world_size for i in range(self.world_size)]

    def block_owner(self, block: int) -> int:
        """The AR: block g of the flattened partial is reduced by rank g % W, so that every row
        chunk of the GEMM holds work for every rank."""
        return block % self.world_size

    @property
    def m_hint(self) -> int:
        return size_hint(self.m)

    @property
    def sums_terms(self) -> bool:
        """Whether the op accumulates a sum's products (the RMSNorm op concatenates along K)."""
        return self.terms > 1 and self.op != MATMUL_ALL_REDUCE_RMSNORM

    @property
    def n_total(self) -> int:
        return sum(size_hint(n) for n in self.ns)

    def describe(self) -> str:
        ns = ",".join(str(n) for n in self.ns)
        dtype = str(self.dtype).replace("torch.", "")
        extra = f" dim={self.dim}" if self.dim else ""
        if self.reduce_op:
            extra += f" {self.reduce_op}"
        if self.rows_reordered:
            extra += ", rank-major rows reordered in the graph"
        if self.experts:
            extra += f" experts={self.experts} tokens={self.tokens}"
        if self.rows_permuted:
            extra += ", rows permuted"
        if self.terms > 1:
            extra += (f", {self.terms} grouped GEMMs summed" if self.op in MOE_PATTERNS
                      else f", {self.terms} _scaled_mm products summed" if self.out_dtype
                      else f", {self.terms} matmul products summed" if self.sums_terms
                      else f", {self.terms} matmuls concatenated along K")
        if self.copy_elems:
            extra += f", copies {self.copy_elems} elements"
        if self.out_dtype is not None:
            out = str(self.out_dtype).replace("torch.", "")
            dtype += f" {self.scales}{' fast-accum' if self.fast_accum else ''} -> {out}"
        k = "" if self.op in GROUPED_MM_ALL_REDUCE_PATTERNS else f" K={self.k}"
        return (
            f"{self.op} M={self.m}{k} N={ns} {dtype} world={self.world_size}"
            f" group={self.group_name}{extra}"
        )


def size_hint(x: SymOrInt) -> int:
    """A concrete value for a possibly symbolic size (its hint), for cost estimates only."""
    if isinstance(x, torch.SymInt):
        return x.node.hint if x.node.has_hint() else 8192
    return int(x)


def chunks_contiguous(shape, dim: int) -> bool:
    """Whether cutting `shape` into equal pieces along `dim` leaves each piece one block of
    consecutive rows of the flattened [rows, last] matrix (a symbolic size counts as > 1)."""
    return dim == 0 or statically_known_true(math.prod(shape[:dim]) == 1)


# ------------------------------------- Tasks from an op's arguments (the matcher's and the ops')


def all_gather_matmul_task(a_shard, weights, biases, gather_dim: int, group_name: str,
                           world_size: int) -> Task:
    gathered_rows = 1
    for i, s in enumerate(a_shard.shape[:-1]):
        gathered_rows = gathered_rows * (s * world_size if i == gather_dim else s)
    return Task(
        op=ALL_GATHER_MATMUL, group_name=group_name, world_size=world_size, m=gathered_rows,
        k=a_shard.shape[-1], ns=tuple(w.shape[1] for w in weights), dtype=a_shard.dtype,
        device_type=a_shard.device.type, dim=gather_dim,
        dim_size=a_shard.shape[gather_dim] * world_size,
        rank_chunks_contiguous=chunks_contiguous(a_shard.shape, gather_dim),
    )


def matmul_collective_task(op: str, a, b, bias, out_shape, dim: int, reduce_op: str,
                           group_name: str, world_size: int) -> Task:
    """A matmul, then a reduce-scatter (along `dim` of `out_shape`, empty: the 2-d product), an
    all-gather (along `dim`) or an all-reduce (+ residual + RMSNorm)."""
    shape = list(out_shape) if len(out_shape) else [a.shape[0], b.shape[1]]
    return Task(
        op=op, group_name=group_name, world_size=world_size, m=a.shape[0], k=a.shape[1],
        ns=(b.shape[1],), dtype=a.dtype, device_type=a.device.type, dim=dim,
        dim_size=shape[dim] if op in REDUCE_SCATTER_PATTERNS else None,
        reduce_op=reduce_op, rank_chunks_contiguous=chunks_contiguous(shape, dim),
    )


def grouped_mm_all_reduce_task(op: str, x, reduce_op: str, group_name: str,
                               world_size: int) -> Task:
    """The all-reduce (op: GROUPED_MM_ALL_REDUCE or _RMSNORM) of x [..., n], as rows [m, n]."""
    return Task(
        op=op, group_name=group_name, world_size=world_size, m=math.prod(x.shape[:-1]), k=1,
        ns=(x.shape[-1],), dtype=x.dtype, device_type=x.device.type, reduce_op=reduce_op)


def with_terms(task: Task, a) -> Task:
    """The first term's task for a sum of products of left operands `a`: K counts every term's."""
    if len(a) == 1:
        return task
    return dataclasses.replace(task, k=sum((t.shape[1] for t in a), 0), terms=len(a))


def matmul_terms_task(op: str, a, b, bias, out_shape, dim: int, reduce_op: str,
                      group_name: str, world_size: int) -> Task:
    """matmul_collective_task's from the op's lists of terms (a, b: one per term)."""
    return with_terms(matmul_collective_task(op, a[0], b[0], bias, out_shape, dim, reduce_op,
                                             group_name, world_size), a)


def scale_kind(scale_a, scale_b) -> str:
    """How _scaled_mm's operands are scaled, from the scales' shapes (A [M, K], B [K, N])."""
    def one(size) -> bool:  # a symbolic size counts as > 1: no guard from a Task
        return statically_known_true(size == 1)

    if one(scale_a.numel()) and one(scale_b.numel()):
        return "tensorwise"
    if scale_a.dim() == 2 and one(scale_a.shape[1]) and scale_b.dim() == 2 and one(
            scale_b.shape[0]):
        return "rowwise"
    return f"scales {list(scale_a.shape)}x{list(scale_b.shape)}"


def _scaled(task: Task, op: str, scale_a, scale_b, out_dtype, use_fast_accum: bool) -> Task:
    return dataclasses.replace(task, op=op, out_dtype=out_dtype or task.dtype,
                               scales=scale_kind(scale_a, scale_b), fast_accum=use_fast_accum)


def all_gather_scaled_mm_task(a_shard, scale_a, weights, scales_b, biases, out_dtype,
                              use_fast_accum: bool, gather_dim: int, group_name: str,
                              world_size: int) -> Task:
    """all_gather_matmul's Task for fp8; a rowwise scale_a is the shard's ([rows, 1])."""
    task = all_gather_matmul_task(a_shard, weights, biases, gather_dim, group_name, world_size)
    return _scaled(task, ALL_GATHER_SCALED_MM, scale_a, scales_b[0], out_dtype, use_fast_accum)


def scaled_mm_collective_task(op: str, a, b, scale_a, scale_b, bias, out_dtype,
                              use_fast_accum: bool, out_shape, dim: int, reduce_op: str,
                              group_name: str, world_size: int) -> Task:
    """matmul_collective_task's for _scaled_mm (op: SCALED_MM_REDUCE_SCATTER or _ALL_REDUCE)."""
    plain = MATMUL_REDUCE_SCATTER if op == SCALED_MM_REDUCE_SCATTER else MATMUL_ALL_REDUCE
    task = matmul_collective_task(plain, a, b, bias, out_shape, dim, reduce_op, group_name,
                                  world_size)
    return _scaled(task, op, scale_a, scale_b, out_dtype, use_fast_accum)


def scaled_mm_reduce_scatter_task(a, b, scale_a, scale_b, bias, out_dtype,
                                  use_fast_accum: bool, out_shape, dim: int, reduce_op: str,
                                  group_name: str, world_size: int) -> Task:
    """From the op's lists of terms, scales the first term's (the matcher fuses one kind only)."""
    return with_terms(scaled_mm_collective_task(
        SCALED_MM_REDUCE_SCATTER, a[0], b[0], scale_a[0], scale_b[0], bias, out_dtype,
        use_fast_accum, out_shape, dim, reduce_op, group_name, world_size), a)


def all_to_all_grouped_mm_task(x, output_split_sizes, input_split_sizes, row_index, weights,
                               offsets, group_name: str, world_size: int) -> Task:
    """The dispatch: x's rows exchanged, then (through row_index) each weight's grouped GEMM."""
    rows = row_index.shape[0] if row_index is not None else sum(output_split_sizes)
    return Task(
        op=ALL_TO_ALL_GROUPED_MM, group_name=group_name, world_size=world_size, m=rows,
        k=x.shape[1], ns=tuple(w.shape[-1] for w in weights), dtype=x.dtype,
        device_type=x.device.type, experts=_experts(weights), tokens=x.shape[0],
        rows_permuted=row_index is not None,
    )


def grouped_mm_all_to_all_task(lefts, weights, offsets, row_index, accumulate: bool,
                               output_split_sizes, input_split_sizes, group_name: str,
                               world_size: int) -> Task:
    """The combine: the sum of the grouped GEMMs, (through row_index) exchanged back."""
    return Task(
        op=GROUPED_MM_ALL_TO_ALL, group_name=group_name, world_size=world_size,
        m=lefts[0].shape[0], k=sum(a.shape[1] for a in lefts),
        ns=tuple(w.shape[-1] for w in weights[:1]), dtype=lefts[0].dtype,
        device_type=lefts[0].device.type, experts=_experts(weights),
        tokens=sum(output_split_sizes), rows_permuted=row_index is not None, terms=len(lefts),
    )


def _experts(weights) -> SymOrInt:
    """The grouped GEMM's groups (0: no grouped GEMM, a candidate the log names only)."""
    return weights[0].shape[0] if weights else 0
