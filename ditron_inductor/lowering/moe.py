"""Expert parallelism: an MoE layer's all-to-alls beside its experts' grouped GEMMs.

Shapes handled (post-grad ATen of a torchtitan-style EP layer; a combine's backward is a
dispatch and the other way round, so forward and backward graphs hold both):

  dispatch: all_to_all_single(x, out_splits, in_splits) -> wait_tensor
              [-> index(received, [row_index])] -> _grouped_mm(rows, W_i, offsets) per weight
  combine:  _grouped_mm(a_i, W_i, offsets) [+ _grouped_mm(...) ...]
              [-> index_put(empty | zeros, [row_index], y, accumulate)]
              -> all_to_all_single(., out_splits, in_splits) -> wait_tensor

The split sizes (unbacked SymInts, or constants after a graph break) and the row index are taken
as the graph holds them. Experts that loop over matmuls are candidates with a problem, so that
the log names them; an all-to-all whose rows reach no matmul (the counts' exchange) is none.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import ops  # noqa: F401 - defines torch.ops.ditron.*, which the rewrite inserts
from ..scheduler.plan import GroupedMmPlan, decode
from ..scheduler.task import Task, all_to_all_grouped_mm_task, grouped_mm_all_to_all_task
from .graph_edit import erase_unused, insert_call, insert_getitem
from .nodes import call_arg, fake, is_call, matmul_arg, summands, weight_from_output

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ditron = torch.ops.ditron


def _vals(sizes) -> list:
    return [fake(s) if isinstance(s, Node) else s for s in sizes]


def _names(nodes) -> str:
    return ", ".join(n.name for n in nodes)


@dataclasses.dataclass
class GroupedMm:
    """A torch._grouped_mm of 2-d rows by 3-d weights [experts, K, N], grouped by offsets: the
    experts' GEMM (its 2-d x 2-d form, a weight gradient, is not one)."""

    node: Node

    a = property(lambda self: self.node.args[0])
    weight = property(lambda self: self.node.args[1])
    offsets = property(lambda self: call_arg(self.node, 2, "offs"))


def as_grouped_mm(node: object) -> Optional[GroupedMm]:
    if not is_call(node, aten._grouped_mm.default):
        return None
    if call_arg(node, 3, "bias") is not None or call_arg(node, 4, "out_dtype") is not None:
        return None
    if call_arg(node, 2, "offs") is None or fake(node.args[0]).dim() != 2 or fake(
            node.args[1]).dim() != 3:
        return None
    return GroupedMm(node)


@dataclasses.dataclass
class Exchange:
    """all_to_all_single -> wait_tensor, and the row-count queries AOTAutograd saves for later."""

    node: Node
    wait: Node
    row_counts: list[Node]

    x = property(lambda self: self.node.args[0])
    output_split_sizes = property(lambda self: list(self.node.args[1]))
    input_split_sizes = property(lambda self: list(self.node.args[2]))
    group_name = property(lambda self: self.node.args[3])
    world_size = property(lambda self: len(self.node.args[1]))


def as_exchange(node: Node) -> Optional[Exchange]:
    if not is_call(node, c10d.all_to_all_single.default):
        return None
    waits = [u for u in node.users if is_call(u, c10d.wait_tensor.default)]
    counts = [u for u in node.users if is_call(u, aten.sym_size.int) and u.args[1] == 0]
    if len(waits) != 1 or len(waits) + len(counts) != len(node.users):
        return None
    return Exchange(node, waits[0], counts)


def _row_index(node: Node) -> Optional[Node]:
    """i where `node` is index(src, [i]) / index_put(dst, [i], ...) with one 1-d integer index:
    rows taken (put) in the order of i."""
    indices = node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], Node):
        return None
    index = fake(indices[0])
    if index.dim() != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
        return None
    return indices[0]


def _loop_matmuls(rows: Node) -> tuple[list[Node], int]:
    """The matmuls that take pieces of `rows` (split_with_sizes, or slices on dim 0, as a loop
    over experts makes them) as their left operand, and the number of pieces."""
    pieces = []
    for u in rows.users:
        if is_call(u, aten.split_with_sizes.default, aten.split.Tensor):
            pieces += [p for p in u.users if is_call(p, operator.getitem)]
        elif is_call(u, aten.slice.Tensor) and call_arg(u, 1, "dim", 0) == 0:
            pieces.append(u)
    mms = [mm for p in pieces for mm in p.users if _is_matmul(mm) and matmul_arg(mm, "a") is p]
    return mms, len(pieces)


def _is_matmul(node: Node) -> bool:
    """mm, or addmm: Inductor's post-grad passes make a backward's `mm + mm` an addmm."""
    return is_call(node, aten.mm.default, aten.addmm.default)


def _offsets_problem(grouped_mms: list[GroupedMm]) -> Optional[str]:
    if len({g.offsets for g in grouped_mms}) > 1:
        return f"the grouped GEMMs {_names(g.node for g in grouped_mms)} take different offsets"
    return None


class _ExpertsMatch:
    """What the dispatch's and the combine's matches share: `exchange`, `grouped_mms`, `loop`
    (the experts' matmuls where they loop over them) and `rows`, and `_task()`."""

    def task(self) -> Task:
        task = self._task()
        if not self.loop:
            return task
        # the log's Task for experts that loop over matmuls: all the rows, the first matmul's N
        return dataclasses.replace(task, m=fake(self.rows).shape[0],
                                   ns=(fake(self.loop[0]).shape[-1],))

    def replaced_nodes(self) -> list[Node]:
        return [g.node for g in self.grouped_mms] + self.loop + [self.exchange.node]


# ---------------------------------------------------------------- dispatch: all-to-all -> GEMMs


@dataclasses.dataclass
class AllToAllGroupedMmMatch(_ExpertsMatch):
    exchange: Exchange
    gather: Optional[Node]  # index(received, [row_index]): the rows in the experts' order
    grouped_mms: list[GroupedMm]
    problem: Optional[str] = None
    notes: list[str] = dataclasses.field(default_factory=list)
    loop: list[Node] = dataclasses.field(default_factory=list)  # the experts' matmuls, looped

    @property
    def rows(self) -> Node:
        """The rows the experts read."""
        return self.gather if self.gather is not None else self.exchange.wait

    @property
    def row_index(self) -> Optional[Node]:
        return None if self.gather is None else self.gather.args[1][0]

    def _task(self) -> Task:
        ex = self.exchange
        return all_to_all_grouped_mm_task(
            fake(ex.x), _vals(ex.output_split_sizes), _vals(ex.input_split_sizes),
            None if self.gather is None else fake(self.row_index),
            [fake(g.weight) for g in self.grouped_mms], None, ex.group_name, ex.world_size)


def find_all_to_all_grouped_mm(node: Node) -> Optional[AllToAllGroupedMmMatch]:
    exchange = as_exchange(node)
    if exchange is None:
        return None
    wait = exchange.wait
    gathers = [u for u in wait.users if is_call(u, aten.index.Tensor) and u.args[0] is wait
               and _row_index(u) is not None]
    gather = gathers[0] if len(gathers) == 1 else None
    rows = gather if gather is not None else wait
    grouped_mms = [g for u in rows.users if (g := as_grouped_mm(u)) is not None and g.a is rows]
    loop, pieces = ([], 0) if grouped_mms else _loop_matmuls(rows)
    if not grouped_mms and not loop:
        return None
    match = AllToAllGroupedMmMatch(exchange, gather, grouped_mms, loop=loop)
    extra = [u for u in wait.users if u is not gather] if gather is not None else []
    match.problem = (
        (f"the experts multiply {pieces} pieces of {rows.name} in a loop of matmuls "
         f"({_names(loop)}): only torch._grouped_mm is matched" if loop else None)
        or (f"the received rows {wait.name} are also used in arrival order by {_names(extra)}"
            if extra else None)
        or _offsets_problem(grouped_mms)
        or weight_from_output(grouped_mms, lambda g: (g.weight, g.offsets)))
    match.notes = [f"{mm.name} takes them transposed: it reads the rows the op returns"
                   for u in rows.users if is_call(u, aten.permute.default, aten.t.default)
                   for mm in u.users if is_call(mm, aten._grouped_mm.default, aten.mm.default)]
    return match


def rewrite_all_to_all_grouped_mm(graph: Graph, match: AllToAllGroupedMmMatch, plan: str) -> Node:
    ex, grouped_mms = match.exchange, match.grouped_mms
    fused = decode(plan)
    replaced = {g.node for g in grouped_mms}
    if isinstance(fused, GroupedMmPlan) and all(u in replaced for u in match.rows.users):
        # nothing reads the rows output (no backward saves them): the dispatch need not store it
        plan = dataclasses.replace(fused, rows=False).encode()
    args = (ex.x, ex.output_split_sizes, ex.input_split_sizes, match.row_index,
            [g.weight for g in grouped_mms], grouped_mms[0].offsets, ex.group_name,
            ex.world_size, plan)
    op = insert_call(graph, ditron.all_to_all_grouped_mm.default, args)
    outputs = [insert_getitem(graph, op, i) for i in range(1 + len(grouped_mms))]
    match.rows.replace_all_uses_with(outputs[0])
    for g, out in zip(grouped_mms, outputs[1:]):
        g.node.replace_all_uses_with(out)
    _count_rows_from_splits(graph, ex)
    erase_unused(graph, [g.node for g in grouped_mms] + [match.rows, ex.wait, ex.node])
    return op


def _count_rows_from_splits(graph: Graph, exchange: Exchange) -> None:
    """The erased all-to-all's row-count queries answered by the sum of its output splits."""
    for query in exchange.row_counts:
        query.replace_all_uses_with(
            insert_call(graph, torch.sym_sum, (exchange.output_split_sizes,)))
        graph.erase_node(query)


# ----------------------------------------------------------------- combine: GEMMs -> all-to-all


@dataclasses.dataclass
class GroupedMmAllToAllMatch(_ExpertsMatch):
    exchange: Exchange
    grouped_mms: list[GroupedMm]  # the terms of the sum
    adds: list[Node]  # the sum's adds, outermost first
    scatter: Optional[Node]  # index_put(buffer, [row_index], y, accumulate): rank-major rows
    problem: Optional[str] = None
    notes: list[str] = dataclasses.field(default_factory=list)
    loop: list[Node] = dataclasses.field(default_factory=list)  # the experts' matmuls, looped

    @property
    def rows(self) -> Node:
        """The rows the experts computed, in their order."""
        return self.scatter.args[2] if self.scatter is not None else self.exchange.x

    @property
    def row_index(self) -> Optional[Node]:
        return None if self.scatter is None else self.scatter.args[1][0]

    @property
    def accumulate(self) -> bool:
        return self.scatter is not None and bool(call_arg(self.scatter, 3, "accumulate", False))

    def _task(self) -> Task:
        ex = self.exchange
        lefts = [g.a for g in self.grouped_mms] or [matmul_arg(mm, "a") for mm in self.loop[:1]]
        return grouped_mm_all_to_all_task(
            [fake(a) for a in lefts], [fake(g.weight) for g in self.grouped_mms], None,
            None if self.scatter is None else fake(self.row_index), self.accumulate,
            _vals(ex.output_split_sizes), _vals(ex.input_split_sizes), ex.group_name,
            ex.world_size)


def find_grouped_mm_all_to_all(node: Node) -> Optional[GroupedMmAllToAllMatch]:
    exchange = as_exchange(node)
    if exchange is None:
        return None
    y, scatter = exchange.x, None
    if is_call(y, aten.index_put.default) and _row_index(y) is not None:
        scatter, y = y, y.args[2]
    terms, adds = _sum_of_grouped_mms(y)
    loop = [] if terms else _concatenated_matmuls(y)
    if not terms and not loop:
        return None
    match = GroupedMmAllToAllMatch(exchange, terms, adds, scatter, loop=loop)
    match.problem = (
        (f"the experts' outputs {_names(loop)} come from a loop of matmuls, concatenated by "
         f"{y.name}: only torch._grouped_mm is matched" if loop else None)
        or _scatter_problem(match, y)
        or _terms_problem(y, terms)
        or _offsets_problem(terms)
        or _users_problem(match))
    return match


def _sum_of_grouped_mms(y: Node) -> tuple[list[GroupedMm], list[Node]]:
    """The grouped GEMMs that `y` adds up, and the adds; none unless every summand is one."""
    parts, adds = summands(y)
    terms = [g for s in parts if (g := as_grouped_mm(s)) is not None]
    return (terms, adds) if len(terms) == len(parts) else ([], [])


def _concatenated_matmuls(y: Node) -> list[Node]:
    """The matmuls of a loop over experts whose outputs (or sums of them: gate's and up's input
    gradients) `y` concatenates."""
    if not is_call(y, aten.cat.default):
        return []
    mms = [s for piece in y.args[0] for s in summands(piece)[0]]
    return mms if all(_is_matmul(mm) for mm in mms) else []


_FRESH_BUFFERS = (aten.empty.memory_format, aten.full.default, aten.zeros.default)


def _scatter_problem(match: GroupedMmAllToAllMatch, y: Node) -> Optional[str]:
    """The rows must go into a buffer of zeros (or an uninitialised one, whose rows no index
    reaches may hold anything, zeros too) that serves nothing else, as long as what is sent."""
    scatter = match.scatter
    if scatter is None:
        return None
    buffer = scatter.args[0]
    if not is_call(buffer, *_FRESH_BUFFERS) or (
            is_call(buffer, aten.full.default) and buffer.args[1] != 0):
        return f"{scatter.name} puts the rows into {buffer.name}, not into a buffer of zeros"
    if len(buffer.users) != 1:
        others = [u for u in buffer.users if u is not scatter]
        return f"the buffer {buffer.name} is also used by {_names(others)}"
    rows, sent = fake(buffer).shape[0], sum(_vals(match.exchange.input_split_sizes))
    if fake(buffer).dim() != 2 or not statically_known_true(rows == sent):
        return f"the buffer {buffer.name} holds {rows} rows, the all-to-all sends {sent}"
    if fake(buffer).dtype != fake(y).dtype:
        return f"the buffer {buffer.name} is {fake(buffer).dtype}, the rows {fake(y).dtype}"
    return None


def _terms_problem(y: Node, terms: list[GroupedMm]) -> Optional[str]:
    first = fake(terms[0].node)
    for g in terms[1:]:
        out = fake(g.node)
        if out.dtype != first.dtype or out.dim() != first.dim() or not all(
                statically_known_true(a == b) for a, b in zip(out.shape, first.shape)):
            return (f"{y.name} sums grouped GEMMs ({_names(t.node for t in terms)}) of "
                    f"different shapes or dtypes")
    return None


def _users_problem(match: GroupedMmAllToAllMatch) -> Optional[str]:
    """Every node from the grouped GEMMs to the all-to-all must serve the all-to-all alone."""
    sender = match.scatter if match.scatter is not None else match.exchange.node
    allowed = set(match.adds) | {sender}
    for n in [g.node for g in match.grouped_mms] + match.adds:
        extra = [u for u in n.users if u not in allowed]
        if extra:
            return f"the grouped GEMM result {n.name} is also used by {_names(extra)}"
    if match.scatter is not None and len(match.scatter.users) > 1:
        others = [u for u in match.scatter.users if u is not match.exchange.node]
        return f"the rows to send {match.scatter.name} are also used by {_names(others)}"
    return None


def rewrite_grouped_mm_all_to_all(graph: Graph, match: GroupedMmAllToAllMatch, plan: str) -> Node:
    ex, terms = match.exchange, match.grouped_mms
    args = ([g.a for g in terms], [g.weight for g in terms], terms[0].offsets, match.row_index,
            match.accumulate, ex.output_split_sizes, ex.input_split_sizes, ex.group_name,
            ex.world_size, plan)
    op = insert_call(graph, ditron.grouped_mm_all_to_all.default, args)
    ex.wait.replace_all_uses_with(op)
    _count_rows_from_splits(graph, ex)
    scatter = [match.scatter, match.scatter.args[0]] if match.scatter is not None else []
    erase_unused(graph, [ex.wait, ex.node] + scatter + match.adds + [g.node for g in terms])
    return op


def find_moe_matches(node: Node) -> list:
    """The candidates at one all-to-all (None where there is none): the combine that feeds it,
    the dispatch it feeds."""
    return [find_grouped_mm_all_to_all(node), find_all_to_all_grouped_mm(node)]
