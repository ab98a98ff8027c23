"""Plain tensor parallelism's all-reduces as a reduce-scatter and an all-gather, with the residual
stream between them sharded on its rows: the layout of sequence parallelism, made by the compiler
for a model that asked for plain tensor parallelism (prefill, inference).

In a Llama layer under plain TP every row-parallel matmul (o_proj, down_proj) ends in an all-reduce,
and what follows it, the residual add and the next RMSNorm, works row by row until the next
column-parallel matmuls read the normalised rows. So each rank can reduce-scatter instead, run
the residual adds and the norms on its 1/W of the rows, and gather the normalised rows in front
of the next matmuls. The two collectives move what the all-reduce moves,
and each sits next to a matmul the ditron pass fuses it with (matmul + reduce-scatter, all-gather +
matmul), the pair of sites that measured faster than NCCL + cuBLAS at the training step's shapes.

A region grows from the all-reduces (`wait_tensor(all_reduce(x, "sum"))` of [..., H] with M rows,
M divisible by the world size) through their users, in graph order:
  - elementwise ops (`SHARDED_POINTWISE`) whose other operands are scalars, tensors without rows
    (the norm's weight) or tensors of the same rows that every rank computes alike (the
    embedding's output, the first residual: `ditron.rank_rows` takes this rank's rows of it);
  - reductions over the last dim with keepdim (RMSNorm's mean of squares; LayerNorm's variance
    and mean, `var_mean`, and the two items taken from it);
  - reshapes that keep the rows and the last dim;
and ends at the readers that need the whole value (the matmuls that read the normalised rows,
a graph output): an all-gather of the rows goes in front of them, one per sharded value. A slice
of a few rows (the last token's of each sequence, for the logits) is instead summed over the
ranks from each rank's share of it (`ditron.held_rows`: the rows it holds, zeros elsewhere).

A region is rewritten where it gathers no more values than it has all-reduces (the same bytes on
the wire: a reduce-scatter and an all-gather move what an all-reduce moves), the scheduler fuses
each reduce-scatter with its matmul and each gather with the matmuls that read it, and, launched
eagerly, each rank holds at least EAGER_MIN_ROWS_PER_RANK rows (the fused calls' host time);
otherwise it keeps its all-reduces (a training forward under plain TP, whose saved activations
would each need a gather, keeps them).

Every rank sees the same graph and options, so every rank makes the same decision. A value kept
sharded is, in the original graph, the same on every rank (an all-reduce's result, or computed
from such values row by row), so the gathered rows are the original value.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import free_symbols

from .. import config
from .. import ops  # noqa: F401 - defines torch.ops.ditron.*, which the rewrite inserts
from ..scheduler.plan import FUSED
from ..scheduler.task import MATMUL_REDUCE_SCATTER, all_gather_matmul_task, matmul_collective_task
from .graph_edit import erase_unused, insert_call, refresh_value
from .match import as_matmul, group_size, unview
from .nodes import RESHAPES, fake, is_call

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

# Elementwise ops that may run on the rows of this rank alone.
SHARDED_POINTWISE = (
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default,
    aten.neg.default, prims.convert_element_type.default,
)
# Reductions over the last dim (keepdim): row by row. ROW_STATS return a tuple (LayerNorm's
# variance and mean, as Inductor's decomposition leaves it), whose items operator.getitem takes.
ROW_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList)
ROW_STATS = (aten.var_mean.correction,)
# What a tensor that every rank computes alike is not computed from.
_RANK_LOCAL = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default)
# Launched eagerly, the rewrite's fused calls (a reduce-scatter per all-reduce, an all-gather per
# gathered value) cost more host time than the all-reduces they replace, while the GPU's time per
# layer shrinks with the rows per rank: below this many rows per rank the host falls behind.
# Measured on H100s, 4 Llama-3-8B layers
# (benchmarks/results/e2e_llama_h100_prefill_sequence_shard.md):
# 2048 rows per rank (TP 2 at S 4096, TP 4 at S 8192) were host-bound, 13.2 and 19.0 ms per call
# against 9.5 and 13.0 without the rewrite; 4096 per rank (TP 2 at S 8192) 21.1 against 21.2 ms.
EAGER_MIN_ROWS_PER_RANK = 4096


@dataclasses.dataclass
class Region:
    """The all-reduces of one residual stream and the nodes kept sharded between them."""

    group_name: str
    world_size: int
    rows: int  # M: the rows of every value of the region, before sharding
    sources: list[Node] = dataclasses.field(default_factory=list)  # the all-reduces' waits
    members: list[Node] = dataclasses.field(default_factory=list)  # kept sharded, graph order
    # (reader, sharded operand, the operand's shape): what reads the whole value
    gathers: list[tuple[Node, Node, list[int]]] = dataclasses.field(default_factory=list)
    # (slice, sharded operand, its row dims, dim, start, length): a slice of at most
    # MAX_SLICED_ROWS rows (the last token's of each sequence, for the logits), all-reduced from
    # the ranks' shares of it
    slices: list[tuple[Node, Node, list[int], int, int, int]] = dataclasses.field(
        default_factory=list)
    # a reshape kept on the shards -> what it reshapes (on the shards both are [M / W, X])
    view_of: dict[Node, Node] = dataclasses.field(default_factory=dict)
    problem: Optional[str] = None

    def describe(self) -> str:
        return (f"{len(self.sources)} all-reduce(s) of {self.rows} rows on {self.world_size} "
                f"ranks")

    def root(self, node: Node) -> Node:
        """The sharded value a kept reshape is of (the node itself otherwise)."""
        while node in self.view_of:
            node = self.view_of[node]
        return node

    def gathered_values(self) -> list[Node]:
        return list(dict.fromkeys(self.root(operand) for _, operand, _ in self.gathers))


def _static_shape(node: Node) -> Optional[list[int]]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or free_symbols(val):
        return None
    return [int(s) for s in val.shape]


def _rows(shape: list[int]) -> int:
    return math.prod(shape[:-1])


def all_reduce_source(node: Node, world_size) -> Optional[tuple[str, int, int]]:
    """(group name, world size, rows) where `node` is the wait of a sum all-reduce of [..., H]
    whose rows divide among the ranks, else None. world_size(group name) -> ranks."""
    if not is_call(node, c10d.wait_tensor.default):
        return None
    reduce = node.args[0]
    if not is_call(reduce, c10d.all_reduce.default) or len(reduce.users) != 1:
        return None
    x, reduce_op, group_name = reduce.args[:3]
    shape = _static_shape(x)
    world = world_size(group_name)
    if reduce_op != "sum" or shape is None or len(shape) < 2 or not world or world < 2:
        return None
    rows = _rows(shape)
    return (group_name, world, rows) if rows % world == 0 and rows > 0 else None


class _Regions:
    """Union-find over the regions that the graph's all-reduces start."""

    def __init__(self):
        self.regions: list[Region] = []
        self.parent: list[int] = []
        self.of: dict[Node, int] = {}  # sharded node -> region id

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def new(self, region: Region) -> int:
        self.regions.append(region)
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def region(self, node: Node) -> Optional[Region]:
        i = self.of.get(node)
        return None if i is None else self.regions[self.find(i)]

    def merge(self, ids: list[int], node: Node) -> int:
        roots = sorted({self.find(i) for i in ids})
        keep = self.regions[roots[0]]
        for r in roots[1:]:
            other = self.regions[r]
            if (other.group_name, other.world_size, other.rows) != (
                    keep.group_name, keep.world_size, keep.rows):
                keep.problem = keep.problem or (
                    f"{node.name} joins all-reduces of other groups or rows")
            keep.problem = keep.problem or other.problem
            keep.sources += other.sources
            keep.members += other.members
            keep.gathers += other.gathers
            keep.slices += other.slices
            keep.view_of.update(other.view_of)
            self.parent[r] = roots[0]
        return roots[0]

    def roots(self) -> list[Region]:
        return [self.regions[i] for i in range(len(self.regions)) if self.find(i) == i]


def find_regions(graph: Graph, world_size) -> list[Region]:
    """The regions of the graph's all-reduces (module doc). world_size(group name) -> the
    group's ranks (None: unknown)."""
    regions = _Regions()
    for node in graph.nodes:
        source = all_reduce_source(node, world_size)
        if source is not None:
            group_name, world, rows = source
            i = regions.new(Region(group_name, world, rows, sources=[node], members=[node]))
            regions.of[node] = i
            continue
        sharded = [a for a in node.all_input_nodes if a in regions.of]
        if not sharded:
            continue
        i = regions.merge([regions.of[a] for a in sharded], node)
        region = regions.regions[i]
        sliced = _few_rows_sliced(node, sharded)
        if sliced is not None:
            region.slices.append((node, sharded[0], *sliced))
            continue
        if not _runs_on_shards(node, sharded, region):
            roots = [region.root(a) for a in sharded]
            if len(set(roots)) < len(roots):
                region.problem = region.problem or (
                    f"{node.name} reads one sharded value in two shapes")
            region.gathers += [(node, a, _static_shape(a)) for a in sharded]
            continue
        regions.of[node] = i
        region.members.append(node)
        if is_call(node, *RESHAPES):
            region.view_of[node] = node.args[0]
    return regions.roots()


MAX_SLICED_ROWS = 1024  # a slice of more rows than this is gathered whole


def _few_rows_sliced(node: Node, sharded: list[Node]) -> Optional[tuple[list[int], int, int, int]]:
    """(row dims, dim, start, length) where `node` slices at most MAX_SLICED_ROWS rows of a
    sharded value along one of its row dims (the logits' last tokens: hidden[:, -1:]), else
    None."""
    if not is_call(node, aten.slice.Tensor) or len(sharded) != 1 or node.kwargs:
        return None
    shape = _static_shape(node.args[0])
    dim = node.args[1] % len(shape) if len(node.args) > 1 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    if step != 1 or dim >= len(shape) - 1:
        return None
    start, end, _ = slice(node.args[2] if len(node.args) > 2 else None,
                          node.args[3] if len(node.args) > 3 else None).indices(shape[dim])
    if end <= start or _rows(shape) // shape[dim] * (end - start) > MAX_SLICED_ROWS:
        return None
    return shape[:-1], dim, start, end - start


def _over_last_dim_keepdim(node: Node) -> bool:
    """Whether a reduction node reduces its input's last dim alone, keeping it (size 1)."""
    ndim = len(_static_shape(node.args[0]) or ())
    dims = [d % ndim for d in node.args[1]] if len(node.args) > 1 and node.args[1] else []
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return ndim > 0 and dims == [ndim - 1] and bool(keepdim) and node.kwargs.get("dtype") is None


def _runs_on_shards(node: Node, sharded: list[Node], region: Region) -> bool:
    """Whether `node`, which reads sharded rows, can itself run on this rank's rows alone."""
    if is_call(node, *ROW_STATS):  # a tuple of [.., 1] values: the input's rows are checked
        shape = _static_shape(node.args[0])
        return _over_last_dim_keepdim(node) and _rows(shape) == region.rows
    if node.target is operator.getitem:  # an item of ROW_STATS' tuple: its rows, as it was
        return is_call(node.args[0], *ROW_STATS) and node.args[0] in sharded
    shape = _static_shape(node)
    if node.op != "call_function" or shape is None or not shape or _rows(shape) != region.rows:
        return False
    if is_call(node, *RESHAPES):  # the rows and the last dim kept
        return _static_shape(node.args[0])[-1] == shape[-1]
    if is_call(node, *ROW_REDUCTIONS):
        return _over_last_dim_keepdim(node)
    if not is_call(node, *SHARDED_POINTWISE):
        return False
    # the sharded operands with the output's rows (no broadcast along them), the others
    # row-free or the same rows computed alike on every rank
    return all(_static_shape(a)[:-1] == shape[:-1] if a in sharded
               else _operand_kind(a, shape) is not None for a in node.all_input_nodes)


ROW_FREE, SAME_ROWS = "row-free", "same rows"


def _operand_kind(operand: Node, out_shape: list[int]) -> Optional[str]:
    """How an operand that is not sharded meets sharded rows of `out_shape`: ROW_FREE (sizes 1
    over the rows: broadcast to every row), SAME_ROWS (the output's rows, computed alike on
    every rank: this rank's rows are taken), or None."""
    shape = _static_shape(operand)
    if shape is None:
        return None
    rows = shape[:-1] if len(shape) == len(out_shape) else None
    if math.prod(shape[:-1]) == 1:
        return ROW_FREE
    if rows == out_shape[:-1] and same_on_every_rank(operand):
        return SAME_ROWS
    return None


def same_on_every_rank(node: Node) -> bool:
    """Whether every rank computes the same `node` under tensor parallelism: no matmul (the
    weights are the ranks' shards) and no collective among what it is computed from. The graph's
    inputs count as the same (token ids, embedding and norm weights are replicated under TP)."""
    seen: set[Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and (
                n.target in _RANK_LOCAL
                or getattr(n.target, "namespace", None) in ("_c10d_functional", "ditron")):
            return False
        stack += n.all_input_nodes
    return True


# ------------------------------------------------------------------------------------ decision


def why_kept(region: Region) -> Optional[str]:
    """Why the region keeps its all-reduces, or None: it has a problem, it would gather more
    values than it has all-reduces, an all-reduce that no matmul feeds, the graph is replayed
    from a CUDA graph or launched eagerly with too few rows per rank, or the scheduler would not
    fuse a reduce-scatter with its matmul or a gather with the matmuls that read it (decided as
    the sites will be after the rewrite)."""
    from ..scheduler.decide import decide, replayed_in_cuda_graph

    if region.problem:
        return region.problem
    gathered = region.gathered_values()
    if len(gathered) > len(region.sources):
        names = ", ".join(n.name for n in gathered[:4]) + (", ..." if len(gathered) > 4 else "")
        return (f"{len(gathered)} values would be gathered for {len(region.sources)} "
                f"all-reduce(s), more bytes than the all-reduces move ({names})")
    scatters = []  # (the matmul, its reduce-scatter's Task) per all-reduce
    for wait in region.sources:
        reduce = wait.args[0]
        mm = as_matmul(unview(reduce.args[0]))
        if mm is None or mm.scaled:
            return f"{reduce.name} reduces what no matmul computed"
        weight = fake(mm.weight)
        scatters.append((mm, matmul_collective_task(
            MATMUL_REDUCE_SCATTER, fake(mm.a), weight, None if mm.bias is None else fake(mm.bias),
            [region.rows, weight.shape[1]], 0, "sum", region.group_name, region.world_size)))
    if scatters[0][1].device_type == "cuda":
        if replayed_in_cuda_graph():
            # the fused all-gather and reduce-scatter decline a capture (their epochs are host
            # values): NCCL would run both, where the all-reduce has fused plans of its own
            return "replayed from a CUDA graph, where the fused reduce-scatters do not run"
        if (region.rows // region.world_size < EAGER_MIN_ROWS_PER_RANK
                and config.force_plan != FUSED):  # DITRON_PLAN=fused forces it, as in decide
            return (f"launched eagerly, the fused reduce-scatters and all-gathers cost more host "
                    f"time than they save below {EAGER_MIN_ROWS_PER_RANK} rows per rank")
    for mm, task in scatters:
        decision = decide(task)
        if not decision.fuse:
            return f"{mm.node.name}'s reduce-scatter would not be fused: {decision.reason}"
    for value in gathered:
        why = _gather_not_fused(region, value)
        if why:
            return why
    return None


def _gather_not_fused(region: Region, value: Node) -> Optional[str]:
    """Why the all-gather of `value` in front of the matmuls that read it would not be fused
    with them (the scheduler's decision for the site the rewrite makes), or None. Its other
    readers (a graph output) take the gathered rows as they are."""
    from ..scheduler.decide import decide

    operands, matmuls = [], []
    for reader, operand, _ in region.gathers:
        mm = as_matmul(reader)
        if (region.root(operand) is value and mm is not None and mm.a is operand
                and fake(operand).dim() == 2):
            operands.append(operand)
            matmuls.append(mm)
    if not matmuls:
        return None
    # the op gathers [M / W, K] shards into the [M, K] matrix the matmuls read: that matrix
    # stands for a shard (its shape, dtype and device), with the gathered rows set to M
    task = dataclasses.replace(all_gather_matmul_task(
        fake(operands[0]), [fake(m.weight) for m in matmuls],
        [None if m.bias is None else fake(m.bias) for m in matmuls], 0, region.group_name,
        region.world_size), m=region.rows, dim_size=region.rows)
    decision = decide(task)
    if not decision.fuse:
        names = ", ".join(m.node.name for m in matmuls)
        return f"the all-gather in front of {names} would not be fused: {decision.reason}"
    return None


# ------------------------------------------------------------------------------------- rewrite


def rewrite_region(graph: Graph, region: Region) -> None:
    """The region's all-reduces as reduce-scatters, its members on [M / W, last dim] shards, an
    all-gather (one per sharded value) in front of the readers of the whole value."""
    w, group, rows = region.world_size, region.group_name, region.rows
    order = {n: i for i, n in enumerate(graph.nodes)}  # merged regions listed theirs in turn
    members = sorted((n for n in region.members if n not in region.sources),
                     key=order.__getitem__)
    sharded: set[Node] = set()  # the region's values, now [M / W, last dim]
    now: dict[Node, Node] = {}  # an all-reduce's wait -> the reduce-scatter's
    for wait in region.sources:
        reduce = wait.args[0]
        x = reduce.args[0]
        x2d = insert_call(graph, aten.reshape.default, (x, [rows, fake(x).shape[-1]]))
        scattered = insert_call(graph, c10d.reduce_scatter_tensor.default, (x2d, "sum", w, group))
        shard = insert_call(graph, c10d.wait_tensor.default, (scattered,))
        wait.replace_all_uses_with(shard)
        graph.erase_node(wait)
        graph.erase_node(reduce)
        sharded.add(shard)
        now[wait] = shard
    taken: dict[Node, Node] = {}  # an operand that is not sharded -> what the shards read
    views = []
    for node in members:
        if is_call(node, *RESHAPES):  # rows and last dim kept: on the shards, the same [M/W, X]
            node.replace_all_uses_with(node.args[0])
            views.append(node)
            continue
        if is_call(node, *ROW_REDUCTIONS, *ROW_STATS):
            node.update_arg(1, [-1])
        elif node.target is operator.getitem:  # ROW_STATS' item: refreshed below
            pass
        else:
            out_shape = _static_shape(node)
            for operand in node.all_input_nodes:
                if operand not in sharded:
                    if operand not in taken:
                        taken[operand] = _shard_operand(graph, operand, out_shape, region)
                    node.replace_input_with(operand, taken[operand])
        refresh_value(node)
        sharded.add(node)
    whole: dict[Node, Node] = {}  # a sharded value -> its gathered rows [M, X]
    shaped: dict[tuple, Node] = {}  # (a sharded value, a shape) -> the gathered rows so shaped
    for reader, operand, shape in region.gathers:
        shard = now.get(region.root(operand), region.root(operand))
        if shard not in whole:
            ag = insert_call(graph, c10d.all_gather_into_tensor.default, (shard, w, group))
            whole[shard] = insert_call(graph, c10d.wait_tensor.default, (ag,))
        key = (shard, tuple(shape))
        if key not in shaped:
            same = list(fake(whole[shard]).shape) == list(shape)
            shaped[key] = whole[shard] if same else insert_call(
                graph, aten.reshape.default, (whole[shard], list(shape)))
        reader.replace_input_with(shard, shaped[key])
    for piece, operand, row_dims, dim, start, length in region.slices:
        shard = now.get(region.root(operand), region.root(operand))
        held = insert_call(graph, torch.ops.ditron.held_rows.default,
                           (shard, row_dims, dim, start, length, w, group))
        summed = insert_call(graph, c10d.all_reduce.default, (held, "sum", group))
        got = insert_call(graph, c10d.wait_tensor.default, (summed,))
        whole = insert_call(graph, aten.reshape.default, (got, list(fake(piece).shape)))
        piece.replace_all_uses_with(whole)
        graph.erase_node(piece)
    erase_unused(graph, list(reversed(views)))


def _shard_operand(graph: Graph, operand: Node, out_shape: list[int], region: Region) -> Node:
    """What a sharded node reads instead of `operand` (not sharded): a row-free tensor as its
    last dim alone, or this rank's rows of a tensor every rank computes alike."""
    shape = _static_shape(operand)
    if _operand_kind(operand, out_shape) == ROW_FREE:
        return insert_call(graph, aten.reshape.default, (operand, shape[-1:])) if len(
            shape) > 1 else operand
    rows2d = insert_call(graph, aten.reshape.default, (operand, [region.rows, shape[-1]]))
    return insert_call(graph, torch.ops.ditron.rank_rows.default,
                       (rows2d, region.world_size, region.group_name))


def shard_residual_streams(graph: Graph) -> list[tuple[Region, Optional[str]]]:
    """Every region of the graph with why it kept its all-reduces (None: rewritten)."""
    done = []
    for region in find_regions(graph, group_size):
        why = why_kept(region)
        if why is None:
            rewrite_region(graph, region)
        done.append((region, why))
    return done
