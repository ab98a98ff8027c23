"""Find collective + matmul subgraphs in a post-grad FX graph, without changing it.

Each finder walks from one functional collective to a match (nodes, group, world size, dims);
where the subgraph has the right shape but cannot be rewritten safely, or no op serves it, the
match carries the problem, so that the log names it. Shapes handled (post-grad ATen):

  all_gather_into_tensor -> wait_tensor [-> split/slice on dim 0 -> cat(dim d)]
      [-> reshapes to 2-d] -> mm / addmm (one or several, the gathered activation as left operand)
  mm / addmm [-> reshapes to N-d] [-> split/slice on dim d -> cat(dim 0)]
      -> reduce_scatter_tensor -> wait_tensor
  mm / addmm [-> reshapes to N-d] -> all_reduce -> wait_tensor [-> + residual -> RMSNorm]
  mm / addmm [-> reshapes to N-d] -> all_gather_into_tensor -> wait_tensor
      [-> split/slice on dim 0 -> cat(dim d)]   (where no matmul takes the gathered result)
  grouped GEMM [-> the experts' weighted sum] -> all_reduce (lowering/grouped_all_reduce.py)
  all_to_all_single <-> torch._grouped_mm: expert parallelism (lowering/moe.py)

and the same with _scaled_mm (torchao's float8 tensor parallelism): float8 pieces moved as bytes
(view(uint8) -> cat -> view(float8)), a rowwise scale_a gathered like the rows. A collective a
finder declines comes back as an `Unmatched` with why (lowering/left.py).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from ..scheduler.task import (
    MATMUL_ALL_GATHER,
    MATMUL_ALL_REDUCE,
    MATMUL_ALL_REDUCE_RMSNORM,
    MATMUL_REDUCE_SCATTER,
    SCALED_MM_ALL_REDUCE,
    SCALED_MM_REDUCE_SCATTER,
    Task,
    all_gather_matmul_task,
    all_gather_scaled_mm_task,
    chunks_contiguous,
    matmul_collective_task,
    scale_kind,
    scaled_mm_collective_task,
)
from ..patterns import PATTERNS
from .grouped_all_reduce import GroupedMmAllReduceMatch, find_grouped_mm_all_reduce
from .left import Unmatched, declined, is_collective, no_matmul_served, op_name
from .moe import as_exchange, find_moe_matches
from .nodes import RESHAPES, call_arg, fake, is_call, matmul_arg, summands, weight_from_output
from .norm import RmsNormTail, attach_rmsnorm_tail
from .reorder import RowOrder, folds_into_producer, folds_into_users, static_sizes

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_NOT_ONE_WAIT = "its result is not waited on by one wait_tensor alone"


@dataclasses.dataclass
class MatmulUse:
    """One mm/addmm/_scaled_mm on the gathered activation or feeding a collective. Its operands
    are read from the node when asked: an earlier rewrite in the pass may have replaced one."""

    node: Node

    a = property(lambda self: matmul_arg(self.node, "a"))
    weight = property(lambda self: matmul_arg(self.node, "weight"))
    bias = property(lambda self: matmul_arg(self.node, "bias"))
    scale_a = property(lambda self: matmul_arg(self.node, "scale_a"))
    scale_b = property(lambda self: matmul_arg(self.node, "scale_b"))
    out_dtype = property(lambda self: matmul_arg(self.node, "out_dtype"))
    use_fast_accum = property(lambda self: bool(matmul_arg(self.node, "use_fast_accum")))

    @property
    def scaled(self) -> bool:
        return self.node.target is aten._scaled_mm.default


def as_matmul(node: Node) -> Optional[MatmulUse]:
    if is_call(node, aten.mm.default):
        return MatmulUse(node)
    # scale_result scales a float8 output, which no op here produces
    if is_call(node, aten._scaled_mm.default) and matmul_arg(node, "scale_result") is None:
        return MatmulUse(node)
    # the ops add a bias of shape [N] only
    if (is_call(node, aten.addmm.default) and not node.kwargs and len(node.args) == 3
            and len(fake(node.args[0]).shape) == 1):
        return MatmulUse(node)
    return None


@dataclasses.dataclass
class ChunkCat:
    """`src` cut into world-size pieces along `chunk_dim`, concatenated in order along `cat_dim`:
    how functional collectives move a non-zero gather/scatter dim to dim 0 and back."""

    cat: Node
    cat_dim: int
    inner: list[Node]  # the split/getitem or slice nodes between src and cat


def match_chunk_cat(src: Node, chunk_dim: int, world_size: int) -> Optional[ChunkCat]:
    """Other users of `src` are allowed here; callers decide whether they are a problem."""
    ndim = len(fake(src).shape)
    splits = [u for u in src.users if is_call(u, aten.split.Tensor)]
    slices = [u for u in src.users if is_call(u, aten.slice.Tensor)]
    if len(splits) == 1 and not slices:
        split = splits[0]
        if call_arg(split, 2, "dim", 0) % ndim != chunk_dim or len(fake(split)) != world_size:
            return None
        pieces = sorted(split.users,
                        key=lambda n: n.args[1] if is_call(n, operator.getitem) else -1)
        indices = [p.args[1] if is_call(p, operator.getitem) else None for p in pieces]
        if indices != list(range(world_size)):
            return None
        inner = [split] + pieces
    elif len(slices) == world_size and not splits:
        if any(u.args[1] % ndim != chunk_dim for u in slices):
            return None
        pieces = inner = slices
    else:
        return None
    if pieces is slices and not _slices_tile_in_order(pieces):
        return None
    as_bytes = _byte_views(pieces)
    if as_bytes:
        pieces, inner = as_bytes, inner + as_bytes
    cats = {u for p in pieces for u in p.users}
    if len(cats) != 1 or any(len(p.users) != 1 for p in pieces):
        return None
    cat = cats.pop()
    if not is_call(cat, aten.cat.default) or list(cat.args[0]) != pieces:
        return None
    cat_dim = call_arg(cat, 1, "dim", 0)
    if as_bytes:  # the concatenated bytes viewed back as src's dtype
        back = list(cat.users)
        if len(back) != 1 or not is_call(back[0], aten.view.dtype) or (
                back[0].args[1] != fake(src).dtype):
            return None
        inner, cat = inner + [cat], back[0]
    return ChunkCat(cat, cat_dim % ndim, list(inner))


def _byte_views(pieces: list[Node]) -> Optional[list[Node]]:
    """Each piece's only user, piece.view(uint8), or None: how DTensor moves float8 pieces."""
    views = [next(iter(p.users)) if len(p.users) == 1 else None for p in pieces]
    if all(is_call(v, aten.view.dtype) and v.args[1] == torch.uint8 for v in views):
        return views
    return None


def _slices_tile_in_order(slices: list[Node]) -> bool:
    """slice(x, d, start, end) pieces, in cat order, that cover x from 0 with no gap or overlap."""
    bounds = [(s.args[2] if len(s.args) > 2 else 0, s.args[3] if len(s.args) > 3 else None)
              for s in slices]
    if any(len(s.args) > 4 and s.args[4] != 1 for s in slices) or bounds[0][0] != 0:
        return False
    return all(prev[1] is not None and prev[1] == nxt[0] for prev, nxt in zip(bounds, bounds[1:]))


def matrix_views(node: Node) -> tuple[list[Node], list[Node]]:
    """The [rows, K] matrices that reshapes make of `node` (itself if 2-d), and the reshapes:
    each is `node.reshape(-1, K)` (row-major order kept), the matrix the op computes."""
    k = fake(node).shape[-1]
    matrices, chain, frontier = [], [], [node]
    while frontier:
        n = frontier.pop(0)
        shape = fake(n).shape
        if len(shape) == 2 and shape[-1] == k:
            matrices.append(n)
        views = [u for u in n.users if is_call(u, *RESHAPES)]
        chain += views
        frontier += views
    return matrices, chain


# ------------------------------------------------------------------------------ all-gather -> mm


@dataclasses.dataclass
class AllGatherMatmulMatch:
    gather: Node
    wait: Node
    chunk_cat: Optional[ChunkCat]
    gathered: Node  # the gathered N-d activation the graph uses (the wait, or the cat)
    matmuls: list[MatmulUse]
    gather_dim: int
    group_name: str
    world_size: int
    views: list[Node] = dataclasses.field(default_factory=list)  # reshapes of `gathered`
    problem: Optional[str] = None
    notes: list[str] = dataclasses.field(default_factory=list)  # uses the op does not compute
    # interleaved ranks' chunks: rank-major rows, permuted back in the graph (lowering/reorder.py)
    row_order: Optional[RowOrder] = None
    gathered_sizes: Optional[list[int]] = None
    # _scaled_mm: the scale_a the op takes, and the rowwise scales' (wait, gather) it replaces
    scale_a: Optional[Node] = None
    scale_gather: list[Node] = dataclasses.field(default_factory=list)

    @property
    def a_shard(self) -> Node:
        return self.gather.args[0]

    @property
    def scaled(self) -> bool:
        return bool(self.matmuls) and self.matmuls[0].scaled

    def task(self) -> Task:
        biases = [None if m.bias is None else fake(m.bias) for m in self.matmuls]
        if self.scaled:
            first = self.matmuls[0]
            task = all_gather_scaled_mm_task(
                fake(self.a_shard), fake(self.scale_a), [fake(m.weight) for m in self.matmuls],
                [fake(m.scale_b) for m in self.matmuls], biases, first.out_dtype,
                first.use_fast_accum, self.gather_dim, self.group_name, self.world_size)
        else:
            task = all_gather_matmul_task(
                fake(self.a_shard), [fake(m.weight) for m in self.matmuls], biases,
                self.gather_dim, self.group_name, self.world_size)
        if self.row_order is None:
            return task
        copied = sum((math.prod(fake(m.node).shape) for m in self.matmuls
                      if not folds_into_users(m.node)), 0)
        return dataclasses.replace(task, rank_chunks_contiguous=True, rows_reordered=True,
                                   copy_elems=copied)

    def replaced_nodes(self) -> list[Node]:
        return [m.node for m in self.matmuls]


def find_all_gather_matmul(gather: Node) -> AllGatherMatmulMatch | Unmatched:
    _, world_size, group_name = gather.args[:3]
    waits = list(gather.users)
    if len(waits) != 1 or not is_call(waits[0], c10d.wait_tensor.default):
        return declined(gather, _NOT_ONE_WAIT)
    wait = waits[0]
    chunk_cat = match_chunk_cat(wait, 0, world_size)
    gathered = chunk_cat.cat if chunk_cat else wait
    gather_dim = chunk_cat.cat_dim if chunk_cat else 0
    matrices, views = matrix_views(gathered)
    matmuls = [
        mm for a in matrices for u in a.users if (mm := as_matmul(u)) is not None and mm.a is a
    ]
    others = _matmuls_not_served(matrices)
    if not matmuls and not others:
        return no_matmul_served(gather, gathered, upstream=True, downstream=True)
    match = AllGatherMatmulMatch(gather, wait, chunk_cat, gathered, matmuls, gather_dim,
                                 group_name, world_size, views)
    match.notes = [f"{mm.name} {how}: it reads the gathered activation" for mm, how in others]
    if not matmuls:
        match.problem = "no matmul takes the gathered activation as its left operand (" + "; ".join(
            f"{mm.name} {how}" for mm, how in others) + ")"
    if chunk_cat:
        extra = [u for u in wait.users if u not in chunk_cat.inner]
        if extra:
            match.problem = (f"the raw all-gather output {wait.name} is also used by "
                             f"{', '.join(u.name for u in extra)}")
    match.problem = match.problem or weight_from_output(matmuls, lambda m: (m.weight, m.bias))
    if match.scaled:
        match.problem = match.problem or _scale_a_problem(match)
    if chunk_cat and _rows_interleave(fake(match.a_shard).shape, gather_dim):
        match.row_order, match.gathered_sizes, note = _rank_major(
            fake(match.a_shard).shape, fake(gathered).shape, gather_dim, world_size,
            [m.node for m in matmuls], folds_into_users, "gathered")
        match.notes.append(note)
    return match


def _scale_a_problem(match: AllGatherMatmulMatch) -> Optional[str]:
    """Sets the scale_a the op takes: the calls' one scale, or for rowwise scales of the gathered
    rows the shard's, whose all-gather the op replaces; or says why there is none."""
    scaled = [m for m in match.matmuls if m.scaled]
    names = ", ".join(m.node.name for m in match.matmuls)
    if len(scaled) != len(match.matmuls):
        return f"the gathered activation feeds both _scaled_mm and mm ({names})"
    first = scaled[0]
    match.scale_a = first.scale_a  # for the Task, whatever the problem
    if any((m.scale_a, m.out_dtype, m.use_fast_accum)
           != (first.scale_a, first.out_dtype, first.use_fast_accum) for m in scaled):
        return f"the _scaled_mm calls {names} differ in scale_a, out_dtype or use_fast_accum"
    scale = first.scale_a
    if statically_known_true(fake(scale).numel() == 1):
        return None
    wait = scale
    gather = wait.args[0] if is_call(wait, c10d.wait_tensor.default) else None
    rows = math.prod(fake(match.a_shard).shape[:-1])
    if not (is_call(wait, c10d.wait_tensor.default)
            and is_call(gather, c10d.all_gather_into_tensor.default)
            and list(gather.args[1:3]) == [match.world_size, match.group_name]
            and match.gather_dim == 0 and match.chunk_cat is None
            and statically_known_true(sym_eq(fake(gather.args[0]).shape, (rows, 1)))):
        return (f"scale_a {scale.name} of {first.node.name} holds a scale per row, but is not "
                f"the all-gather on dim 0 of the shard's [{rows}, 1] scales over group "
                f"{match.group_name}")
    match.scale_a, match.scale_gather = gather.args[0], [wait, gather]
    return None


def _rows_interleave(piece_shape, dim: int) -> bool:
    """Whether the ranks' pieces, cut along a dim before the last, interleave in the rows."""
    return dim < len(piece_shape) - 1 and not chunks_contiguous(piece_shape, dim)


def _rank_major(piece_shape, full_shape, dim: int, world_size: int, permuted: list[Node],
                folds: Callable[[Node], bool], verb: str
                ) -> tuple[Optional[RowOrder], Optional[list[int]], str]:
    """For ranks' chunks that interleave in the matrix of rows: the permutation to rank-major
    rows, the sizes that view the result as `full_shape`, and the log's note; no permutation
    where views cannot say the sizes (the op works along `dim`, and fused kernels decline it)."""
    order, sizes = RowOrder.of(piece_shape, dim, world_size), static_sizes(full_shape)
    if order is None or sizes is None:
        return None, None, (f"the ranks' chunks interleave and more than one of their sizes is "
                            f"symbolic: {verb} along dim {dim}")
    folded = ", ".join(n.name for n in permuted if folds(n)) or "none"
    copied = ", ".join(n.name for n in permuted if not folds(n)) or "none"
    return order, sizes, (f"{verb} rank-major on dim 0, the rows permuted in the graph (dim "
                          f"{dim} order): Inductor permutes {folded} within kernels it runs "
                          f"anyway and copies {copied}")


def _matmuls_not_served(matrices: list[Node]) -> list[tuple[Node, str]]:
    """The matmuls that use a gathered matrix other than as their left operand, and how (the
    weight gradients of a column-parallel layer: gathered^T @ grad)."""
    found = []
    for a in matrices:
        for u in a.users:
            if is_call(u, aten._scaled_mm.default):
                if MatmulUse(u).weight is a:
                    found.append((u, "takes it as its right operand"))
            elif is_call(u, aten.mm.default, aten.addmm.default):
                served = as_matmul(u)
                if served is not None and served.a is a:
                    continue
                found.append((u, "takes it as its right operand" if MatmulUse(u).a is not a
                              else "adds a bias that is not one value per column"))
            elif is_call(u, aten.t.default) or (is_call(u, aten.permute.default)
                                                and list(u.args[1]) == [1, 0]):
                found += [(mm, "takes it transposed") for mm in u.users
                          if is_call(mm, aten.mm.default, aten.addmm.default)]
    return found


# -------------------------------------------------------- mm -> reduce-scatter / all-reduce


@dataclasses.dataclass
class MatmulCollectiveMatch:
    # MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM, MATMUL_ALL_GATHER or
    # SCALED_MM_*
    op: str
    collective: Node
    wait: Node
    # One matmul, or a sum's terms (q/k/v's input gradient); the RMSNorm op takes them as one
    # matmul of the operands concatenated along K: sum_i a_i @ b_i = cat(a_i, 1) @ cat(b_i, 0).
    matmuls: list[MatmulUse]
    reshape: Optional[Node]  # product -> N-d activation
    # reduce-scatter: N-d activation -> pieces along dim stacked on dim 0; all-gather: the
    # gathered pieces stacked on dim 0 -> concatenated along dim
    chunk_cat: Optional[ChunkCat]
    dim: int
    reduce_op: str
    group_name: str
    world_size: int
    problem: Optional[str] = None
    norm: Optional[RmsNormTail] = None  # the residual add + RMSNorm after an all-reduce
    # the reshapes and a sum's adds from the collective to the matmuls, collective side first
    views: list[Node] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    # interleaved ranks' chunks: the graph permutes the left operand to rank-major rows
    row_order: Optional[RowOrder] = None
    scattered_sizes: Optional[list[int]] = None

    @property
    def matmul(self) -> MatmulUse:
        return self.matmuls[0]

    @property
    def out_shape(self) -> list:
        """The N-d shape of the matmul output as the graph views it ([] when it stays 2-d)."""
        return list(self.reshape.args[1]) if self.reshape is not None else []

    def task(self) -> Task:
        mm = self.matmul
        shape = fake(self.reshape).shape if self.reshape is not None else []
        bias = None if mm.bias is None else fake(mm.bias)
        if mm.scaled:  # the first term's: the matcher fuses a sum of one kind of scaling only
            task = scaled_mm_collective_task(
                self.op, fake(mm.a), fake(mm.weight), fake(mm.scale_a), fake(mm.scale_b), bias,
                mm.out_dtype, mm.use_fast_accum, shape, self.dim, self.reduce_op,
                self.group_name, self.world_size)
        else:
            task = matmul_collective_task(
                self.op, fake(mm.a), fake(mm.weight), bias, shape, self.dim, self.reduce_op,
                self.group_name, self.world_size)
        if len(self.matmuls) == 1 and self.row_order is None:
            return task
        return dataclasses.replace(
            task, k=sum((fake(m.a).shape[1] for m in self.matmuls), 0), terms=len(self.matmuls),
            rank_chunks_contiguous=task.rank_chunks_contiguous or self.row_order is not None,
            rows_reordered=self.row_order is not None, copy_elems=self._copied_elems())

    def _copied_elems(self):
        """What the rewrite copies: each permuted or concatenated left operand whose producer
        cannot write it so, and the weights that the RMSNorm op takes concatenated."""
        concatenated = len(self.matmuls) > 1 and self.norm is not None
        if not concatenated and self.row_order is None:
            return 0
        copied = sum((math.prod(fake(m.a).shape) for m in self.matmuls
                      if not folds_into_producer(m.a)), 0)
        if concatenated:
            copied = copied + sum((math.prod(fake(m.weight).shape) for m in self.matmuls), 0)
        return copied

    @property
    def gathered(self) -> Node:
        """All-gather: the node of the gathered result the graph uses."""
        return self.chunk_cat.cat if self.chunk_cat else self.wait

    def replaced_nodes(self) -> list[Node]:
        return [m.node for m in self.matmuls]


def find_matmul_collective(collective: Node, patterns=PATTERNS
                           ) -> Optional[MatmulCollectiveMatch | GroupedMmAllReduceMatch
                                         | Unmatched]:
    if is_call(collective, c10d.reduce_scatter_tensor.default):
        op = MATMUL_REDUCE_SCATTER
        inp, reduce_op, world_size, group_name = collective.args[:4]
    elif is_call(collective, c10d.all_reduce.default):
        op = MATMUL_ALL_REDUCE
        inp, reduce_op, group_name = collective.args[:3]
        world_size = group_size(collective.args[2])
    elif is_call(collective, c10d.all_gather_into_tensor.default):
        op, reduce_op = MATMUL_ALL_GATHER, None
        inp, world_size, group_name = collective.args[:3]
    else:
        return None
    waits = list(collective.users)
    if len(waits) != 1 or not is_call(waits[0], c10d.wait_tensor.default):
        return declined(collective, _NOT_ONE_WAIT)

    chunk_cat, dim, node = None, 0, inp
    if op == MATMUL_ALL_GATHER:
        chunk_cat = match_chunk_cat(waits[0], 0, world_size)
        dim = chunk_cat.cat_dim if chunk_cat else 0
    if op == MATMUL_REDUCE_SCATTER and is_call(node, aten.cat.default):
        chunk_cat = _chunk_cat_into(node, world_size)
        if chunk_cat is None:
            return declined(collective, f"shape not supported: {node.name} concatenates pieces "
                            f"that are not {world_size} chunks of one dim in rank order",
                            waits[0])
        dim, node = _chunk_dim(node), _chunk_source(node)
    chain, node = _unview(node)  # the collective's side first: it views them as chain[0]
    matmul = as_matmul(node) if isinstance(node, Node) else None
    if op == MATMUL_ALL_GATHER and (matmul is None or matmul.scaled):
        # the op gathers one product of mm / addmm: a sum's or a _scaled_mm's has no op
        return (_no_product(collective, node) if matmul is None
                else no_matmul_served(collective, waits[0], upstream=True, downstream=False))
    if matmul is not None:
        matmuls, inner = [matmul], []
    else:
        summed = _sum_of_matmuls(node)
        grouped = (find_grouped_mm_all_reduce(collective, waits[0], reduce_op, group_name,
                                              world_size, patterns)
                   if summed is None and op == MATMUL_ALL_REDUCE else None)
        if grouped is not None:
            return grouped
        if summed is None:
            return _no_product(collective, node)
        matmuls, inner = summed
    reshape = (chain or [n for n in inner if is_call(n, *RESHAPES)][:1] or [None])[0]
    match = MatmulCollectiveMatch(op, collective, waits[0], matmuls, reshape, chunk_cat, dim,
                                  reduce_op, group_name, world_size, views=chain + inner)
    match.problem = _users_problem(match) or _terms_problem(node, matmuls, op)
    if op == MATMUL_ALL_GATHER and chunk_cat:
        extra = [u for u in match.wait.users if u not in chunk_cat.inner]
        if extra:
            match.problem = match.problem or (
                f"the raw all-gather output {match.wait.name} is also used by "
                f"{', '.join(u.name for u in extra)}")
    piece = fake(match.wait).shape
    if op == MATMUL_REDUCE_SCATTER and chunk_cat and _rows_interleave(piece, dim):
        match.row_order, match.scattered_sizes, note = _rank_major(
            piece, piece, dim, world_size, [m.a for m in matmuls], folds_into_producer,
            "scattered")
        match.notes.append(note)
    if match.row_order is None and reshape is not None and not all(
            isinstance(s, (int, Node)) and not (isinstance(s, int) and s < 0)
            for s in reshape.args[1]):
        match.problem = match.problem or f"{reshape.name} infers a size (-1)"
    if matmuls[0].scaled:
        match.op = SCALED_MM_REDUCE_SCATTER if op == MATMUL_REDUCE_SCATTER else SCALED_MM_ALL_REDUCE
    elif op == MATMUL_ALL_REDUCE and MATMUL_ALL_REDUCE_RMSNORM in patterns:
        attach_rmsnorm_tail(match, match.wait, MATMUL_ALL_REDUCE_RMSNORM)
    return match


def _no_product(collective: Node, node: object) -> Unmatched:
    """Why what `collective` reduces is no matmul product (nor a sum of them) the ops take."""
    if is_call(node, aten.addmm.default):
        why = ("scales its product or its bias (alpha, beta)" if node.kwargs or len(node.args) > 3
               else "adds a bias that is not one value per column")
        return declined(collective, f"shape not supported: {node.name} {why}")
    if is_call(node, aten._scaled_mm.default):
        return declined(collective, f"shape not supported: {node.name} scales its result "
                        "(scale_result)")
    terms, _ = summands(node)
    products = [t for t in terms if as_matmul(_unview(t)[1]) is not None]
    if len(terms) > 1 and products and len(products) < len(terms):
        others = [t.name if isinstance(t, Node) else str(t) for t in terms
                  if as_matmul(_unview(t)[1]) is None]
        return declined(collective, f"{node.name} sums matmul products and terms that are none "
                        f"({', '.join(others)})")
    return no_matmul_served(collective, next(iter(collective.users)), upstream=True,
                            downstream=True)


def _unview(node: object) -> tuple[list[Node], object]:
    """The chain of reshapes that ends at `node` (it first), and what the chain is of."""
    chain = []
    while is_call(node, *RESHAPES):
        chain.append(node)
        node = node.args[0]
    return chain, node


def _sum_of_matmuls(total: object) -> Optional[tuple[list[MatmulUse], list[Node]]]:
    """The matmuls whose products (each maybe reshaped) `total` adds up, and the adds and
    reshapes between, outermost first; None unless every summand is a matmul product."""
    terms, adds = summands(total)
    unviewed = [_unview(t) for t in terms]
    matmuls = [mm for _, source in unviewed if (mm := as_matmul(source)) is not None]
    if len(terms) < 2 or len(matmuls) != len(terms):
        return None
    return matmuls, adds + [v for chain, _ in unviewed for v in chain]


def _users_problem(match: MatmulCollectiveMatch) -> Optional[str]:
    """Every node from the matmuls to the collective must serve the collective alone."""
    allowed = set((match.chunk_cat.inner if match.chunk_cat else []) + [match.collective]
                  + match.views)
    for n in [m.node for m in match.matmuls] + match.views:
        extra = [u for u in n.users if u not in allowed]
        if extra:
            return (f"the matmul result {n.name} is also used by "
                    f"{', '.join(u.name for u in extra)}")
    return None


def _terms_problem(total: Node, matmuls: list[MatmulUse], op: str) -> Optional[str]:
    """Why a sum's matmul products cannot be the op's terms, or None."""
    if len(matmuls) < 2:
        return None
    names = " + ".join(m.node.name for m in matmuls)
    if len({m.scaled for m in matmuls}) > 1:
        return f"{total.name} sums _scaled_mm and matmul products ({names})"
    if matmuls[0].scaled and op != MATMUL_REDUCE_SCATTER:
        return (f"{total.name} sums _scaled_mm products ({names}): each has scales of its own, "
                "and only the reduce-scatter op takes a sum of them")
    if len({(m.out_dtype, m.use_fast_accum) for m in matmuls}) > 1:
        return (f"{total.name} sums _scaled_mm products ({names}) that differ in out_dtype or "
                "use_fast_accum")
    if matmuls[0].scaled and len({scale_kind(fake(m.scale_a), fake(m.scale_b))
                                  for m in matmuls}) > 1:  # the Task reads the first term's
        return f"{total.name} sums _scaled_mm products ({names}) scaled in different ways"
    if any(m.bias is not None for m in matmuls):
        return f"{total.name} sums matmuls ({names}) of which one adds a bias"
    if len({tuple(fake(m.node).shape) for m in matmuls}) > 1 or any(
            fake(m.node).numel() != fake(total).numel() for m in matmuls):
        return f"{total.name} sums matmul products ({names}) of different shapes"
    if len({(fake(m.a).dtype, fake(m.weight).dtype) for m in matmuls}) > 1:
        return f"{total.name} sums matmuls ({names}) of different dtypes"
    return None


def _chunk_source(cat: Node) -> Node:
    first = cat.args[0][0]
    return first.args[0].args[0] if is_call(first, operator.getitem) else first.args[0]


def _chunk_dim(cat: Node) -> int:
    first = cat.args[0][0]
    split = is_call(first, operator.getitem)
    dim = call_arg(first.args[0], 2, "dim", 0) if split else first.args[1]
    return dim % len(fake(_chunk_source(cat)).shape)


def _chunk_cat_into(cat: Node, world_size: int) -> Optional[ChunkCat]:
    pieces = cat.args[0]
    if not pieces or not all(is_call(p, operator.getitem, aten.slice.Tensor) for p in pieces):
        return None
    if is_call(pieces[0], operator.getitem) and not is_call(pieces[0].args[0], aten.split.Tensor):
        return None
    found = match_chunk_cat(_chunk_source(cat), _chunk_dim(cat), world_size)
    if found is None or found.cat is not cat or found.cat_dim != 0:
        return None
    return found


def group_size(group_name: str) -> int:
    """all_reduce carries no group size, nor do its shapes: the group's (0 when the name is
    unknown here: the decision rejects it)."""
    from torch._C._distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name).size()
    except Exception:  # noqa: BLE001
        return 0


def find_candidates(graph: Graph, patterns=PATTERNS) -> tuple[list, list[Unmatched]]:
    """The candidates in graph order (`problem` set where one cannot be rewritten; an all-reduce
    takes the RMSNorm after it where that pattern is among `patterns`), and every other
    collective of the graph with why it is none."""
    found: list = []
    for node in graph.nodes:
        if is_call(node, c10d.all_gather_into_tensor.default):
            found.append(_all_gather_candidate(node, patterns))
        elif is_call(node, c10d.reduce_scatter_tensor.default, c10d.all_reduce.default):
            found.append(find_matmul_collective(node, patterns))
        elif is_call(node, c10d.all_to_all_single.default):
            found += [m for m in find_moe_matches(node) if m is not None] or [_exchange_left(node)]
        elif is_collective(node):
            found.append(no_matmul_served(node, node, upstream=True, downstream=True,
                                          why=f"no finder takes {op_name(node)}"))
    matches = [m for m in found if m is not None and not isinstance(m, Unmatched)]
    return matches, [m for m in found if isinstance(m, Unmatched)]


def _all_gather_candidate(gather: Node, patterns
                          ) -> AllGatherMatmulMatch | MatmulCollectiveMatch | Unmatched:
    """The matmuls that take the gathered activation (all_gather_matmul), else the matmul whose
    output is gathered (matmul_all_gather), else why neither."""
    after = find_all_gather_matmul(gather)
    if not isinstance(after, Unmatched):
        return after
    return find_matmul_collective(gather, patterns) or after


def _exchange_left(node: Node) -> Unmatched:
    """An all-to-all that neither feeds nor follows the experts' grouped GEMMs."""
    exchange = as_exchange(node)
    if exchange is None:
        return declined(node, f"{_NOT_ONE_WAIT} (and row counts)")
    return no_matmul_served(node, exchange.wait, upstream=True, downstream=True)
