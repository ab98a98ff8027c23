"""Device level: how one GPU runs a Task, as one typed plan per op family.

A plan is decided completely at compile time by the scheduler, identically on every rank: every
field below holds the value the runtime runs, the defaults stated here once. It travels into the
graph as the op's string argument (`encode`), so the compiled code (and Inductor's cache) carries
the decision, and the runtime decodes each distinct text once (`decode`, cached).

Families: `AllGatherPlan` (all-gather + GEMM), `ReduceScatterPlan` (GEMM + reduce-scatter),
`MatmulAllGatherPlan` (GEMM + all-gather of its output), `AllReducePlan` (GEMM + all-reduce,
with or without the RMSNorm), `GroupedMmPlan` (the MoE ops: all-to-all + the experts' grouped
GEMM); `ReferencePlan` for the decomposed collective + matmul.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, ClassVar, Optional, Union

REFERENCE = "reference"  # decomposed collective + matmul: runs anywhere, the ground truth
FUSED = "fused"  # a fused kernel, CUDA only

COPY_ENGINE = "copy_engine"  # the all-reduce plan whose partials the copy engine moves
TRITON, CUBLAS, TORCH = "triton", "cublas", "torch"
GEMV = "gemv"  # the decode GEMM template (templates/gemv.py), for one-row products
COPY_ENGINE_CHUNKS = 4  # the copy-engine all-reduce's row chunks (the last one's copy is exposed)
# its sum + norm kernel holds whole rows: up to this many columns (the runtime declines more)
COPY_ENGINE_MAX_N = 16384
ALL_REDUCE_ALGOS = ("push", "push_all", "lamport", "lamport_all", COPY_ENGINE)


@dataclasses.dataclass(frozen=True)
class GemmTile:
    """The persistent Triton GEMM's tile program (TMA where the operands take it, else pointers)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8  # swizzle: row-blocks per group of consecutive tiles
    stages: int = 3
    warps: int = 8


@dataclasses.dataclass(frozen=True)
class ReferencePlan:
    impl: ClassVar[str] = REFERENCE
    kind: ClassVar[str] = REFERENCE

    def encode(self) -> str:
        return _encode(self)

    def describe(self) -> str:
        return REFERENCE


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """What every fused plan carries: its candidate's name (logs, tests), the options the runtime
    needs (read once at compile time) and, for the logs only, what the cost model predicted."""

    impl: ClassVar[str] = FUSED
    kind: ClassVar[str] = ""

    label: str = ""
    symm_mem_backend: str = "auto"  # "auto" | "nvshmem" | "torch"
    # bound of each flag wait in s (0: unbounded; None: the process group's timeout, read by
    # the runtime: runtime/context.wait_seconds)
    wait_timeout_s: Optional[float] = None
    predicted_ms: tuple[tuple[str, float], ...] = dataclasses.field(default=(), compare=False)
    # the layers the op replaces and their graph, which a wait that gives up names
    site: str = dataclasses.field(default="", compare=False)

    def encode(self) -> str:
        return _encode(self)

    def describe(self) -> str:
        defaults = type(self)()
        parts = [FUSED, self.label or self.kind]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (f.name not in ("label", "predicted_ms", "site")
                    and value != getattr(defaults, f.name)):
                parts.append(f"{f.name}={_text(value)}")
        if self.predicted_ms:
            parts.append("predicted " + ", ".join(f"{k} {v:.3f} ms" for k, v in self.predicted_ms))
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class AllGatherPlan(FusedPlan):
    """The peers' chunks pulled by the copy engine on `copy_streams` streams into the gathered A,
    and the GEMM over them: gemm="triton", one persistent Triton GEMM whose tiles wait on
    per-chunk flags; gemm="cublas", cuBLAS on groups of chunks in arrival order (`groups` chunks
    each, own chunk first), each group after its last chunk landed. My shard's two local copies
    (into my symmetric buffer, into my rows of the gathered A) run beside cuBLAS's GEMM of my
    rows on a stream of their own. ready_before_gemm: the copy the peers pull from runs before
    the GEMM, which then waits for every peer's READY (a barrier) and the pulls start after it;
    with barrier_beside the local copies' stream waits for the barrier instead, and the GEMM of
    my rows starts without it."""

    kind: ClassVar[str] = "all_gather"

    gemm: str = TRITON
    tile: GemmTile = GemmTile()
    groups: tuple[int, ...] = ()  # () until resolved for a world size: default_groups
    ready_before_gemm: bool = False
    barrier_beside: bool = False
    copy_streams: int = 1

    def for_world(self, world: int) -> "AllGatherPlan":
        return dataclasses.replace(self, groups=self.groups or default_groups(world))


@dataclasses.dataclass(frozen=True)
class ReduceScatterPlan(FusedPlan):
    """cuBLAS per destination chunk (rank+1 first), each chunk pushed by the copy engine as soon
    as it is computed; the received partials summed by torch (reduce="torch") or a Triton kernel
    (reduce="triton"). A sum of matmul products accumulates each further term into the same
    rows (runtime/launch.MatmulSum)."""

    kind: ClassVar[str] = "reduce_scatter"

    reduce: str = TORCH

    def for_world(self, world: int) -> "ReduceScatterPlan":
        return self


@dataclasses.dataclass(frozen=True)
class MatmulAllGatherPlan(FusedPlan):
    """cuBLAS in `chunks` row chunks into my slot of the gathered output (symmetric memory), each
    chunk pushed by the copy engine into my slot on every peer as soon as it is computed, then
    the slots concatenated along the gather dim into the output."""

    kind: ClassVar[str] = "matmul_all_gather"

    chunks: int = 0  # 0 until resolved for the rows (matmul_all_gather_chunks)

    def for_world(self, world: int) -> "MatmulAllGatherPlan":
        return self


@dataclasses.dataclass(frozen=True)
class AllReducePlan(FusedPlan):
    """cuBLAS writes the partial into symmetric memory, then one kernel, `algo`: push (each rank
    sums its blocks over the ranks and stores the sums on every rank), push_all (every rank
    stores its whole partial on every rank, one wait, a local sum), lamport (each rank stores
    its partial's blocks into their owners' slots, each owner sums its blocks and stores the
    sums on every rank, the data carrying its own arrival: no flags), lamport_all (push_all so),
    copy_engine (cuBLAS in `chunks` row chunks on every SM, each chunk's partial copied by the
    copy engine to every peer beside the next chunk's GEMM, then one kernel sums the W partials,
    adds the residual and normalises). overlap=True (push only): push's reduction on `progs`
    programs beside the GEMM in `chunks` row chunks: gemm="triton", a persistent Triton GEMM
    (`tile`) on the other SMs, else cuBLAS row chunks. block, warps and progs of the push
    kernels: 0 = chosen by the size of the call (runtime push_grid)."""

    kind: ClassVar[str] = "all_reduce"

    algo: str = "push"
    overlap: bool = False
    gemm: str = CUBLAS
    tile: GemmTile = GemmTile()
    chunks: int = 0  # overlap and copy_engine: 0 until resolved for a world size
    progs: int = 0
    block: int = 0
    warps: int = 0

    def __post_init__(self):
        if self.algo not in ALL_REDUCE_ALGOS:
            raise ValueError(f"all-reduce plan algo={self.algo!r}: not one of {ALL_REDUCE_ALGOS}")
        if self.overlap and self.algo != "push":
            raise ValueError(f"all-reduce plan algo={self.algo!r} runs after the whole GEMM: "
                             "overlap=True is for algo='push'")

    def for_world(self, world: int) -> "AllReducePlan":
        if self.algo == COPY_ENGINE:
            return dataclasses.replace(self, chunks=self.chunks or COPY_ENGINE_CHUNKS)
        if not self.overlap:
            return self
        # the GEMM beside the push: 8 chunks of the Triton GEMM, 2W of cuBLAS; most SMs to it
        return dataclasses.replace(self, chunks=self.chunks or (8 if self.gemm == TRITON
                                                                else 2 * world),
                                   progs=self.progs or 32)


@dataclasses.dataclass(frozen=True)
class GroupedMmPlan(FusedPlan):
    """The MoE ops (templates/grouped_gemm.py): the experts' grouped GEMM as one persistent
    Triton kernel over (expert, m-tile, n-tile) tiles, reading its rows through the dispatch's
    index and writing them through the combine's. block_*/stages/warps: its tile program;
    progs: its programs (0: one per SM)."""

    kind: ClassVar[str] = "grouped_mm"

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8  # swizzle within an expert: m-tiles per group over the n-tiles
    stages: int = 3
    warps: int = 8
    progs: int = 0
    tma_b: bool = True  # the weights through a TMA descriptor where their layout allows
    # the rows through a TMA descriptor where they are in order (at world size 1 the dispatch
    # then gathers x's rows before its GEMMs instead of in the first one)
    tma_a: bool = True
    # on several ranks: fewer rows than this (the dispatch's sent, the combine's received back:
    # each a rank's tokens x top-k) run the reference, NCCL all-to-all + grouped GEMM, where the
    # fused op measured slower. Every rank decides alike where every rank has as many tokens,
    # which the fused ops' buffers assume already (their size class comes from these rows)
    min_rows: int = 0
    # on several ranks the dispatch stores its rows output; False where the graph does not use
    # it: output 0 is then a view of the receive buffer, valid until the op's next call, and
    # the later GEMMs read that buffer
    rows: bool = True
    # on several ranks, where the rank routes at most this many rows per local expert, the
    # runtime (which knows the rows) runs SMALL_EXPERT_TILE instead (0: never; the scheduler's
    # policy.SMALL_EXPERT_ROWS where no tile is named)
    small_expert_rows: int = 0
    # on several ranks, the dispatch's GEMMs: TRITON, each tile of the first once its own rows
    # landed, or TORCH, torch._grouped_mm once every row landed (TRITON's where it cannot take
    # the operands' layout). A tile's rows come from any sender, so either waits for about
    # the last push
    dispatch_gemm: str = TRITON
    # on several ranks, the combine's GEMM: TRITON, storing its rows in send order, or TORCH,
    # torch._grouped_mm in expert order, the put kernel sending each row as its send row
    # (TRITON's where it cannot take the operands' layout)
    combine_gemm: str = TRITON
    # where the dispatch stores its rows output (rows) and the rank routes at least this many
    # rows per local expert, the runtime runs dispatch_gemm TORCH (0: never; the scheduler's
    # policy.LIBRARY_DISPATCH_ROWS where no tile is named)
    library_rows: int = 0
    # where the dispatch stores no rows output (inference graphs) and the rank routes more than
    # small_expert_rows but fewer than this many rows per local expert, the runtime runs
    # dispatch_gemm TORCH (0: never; policy.LIBRARY_DISPATCH_BELOW_ROWS where no tile is named)
    library_below_rows: int = 0
    # where the rank routes at least this many rows per local expert, the runtime runs
    # combine_gemm TORCH (0: never; the scheduler's policy.LIBRARY_COMBINE_ROWS where no tile
    # is named)
    library_combine_rows: int = 0

    def for_rows(self, rows: int, experts: int) -> "GroupedMmPlan":
        """The plan a call runs for `rows` (token, expert) rows routed over `experts` local
        experts: alike on every rank, which route as many rows (the fused ops' buffers assume
        it)."""
        small = bool(experts) and rows <= self.small_expert_rows * experts
        library = bool(experts) and (
            (self.rows and self.library_rows > 0 and rows >= self.library_rows * experts)
            or (not self.rows and not small and self.small_expert_rows > 0
                and rows < self.library_below_rows * experts))
        library_combine = (bool(experts) and self.library_combine_rows > 0
                           and rows >= self.library_combine_rows * experts)
        if small or library or library_combine:
            return _plan_for_rows(self, self.site, self.predicted_ms, small, library,
                                  library_combine)
        return self


# half the default's rows a tile: less of an expert's last tile computed past its rows
SMALL_EXPERT_TILE = dict(block_m=64, block_n=256, block_k=64, stages=4, warps=4)


@functools.lru_cache(maxsize=None)
def _plan_for_rows(plan: GroupedMmPlan, site: str, predicted_ms: tuple, small: bool,
                   library: bool, library_combine: bool) -> GroupedMmPlan:
    """Once per plan, not per call (a hot path); site and predicted_ms are in the key because
    plan equality leaves them out."""
    return dataclasses.replace(plan, **(SMALL_EXPERT_TILE if small else {}),
                               **({"dispatch_gemm": TORCH} if library else {}),
                               **({"combine_gemm": TORCH} if library_combine else {}))


def family(plan: FusedPlan) -> str:
    """What a plan runs, as the world-1 compute table (scheduler/measured.py) keys it: the GEMM
    engine and what moves the data, beside what the tile parameters change."""
    if isinstance(plan, AllReducePlan):
        return plan.algo + (f"+overlap:{plan.gemm}" if plan.overlap else "")
    if isinstance(plan, (ReduceScatterPlan, MatmulAllGatherPlan)):
        return CUBLAS
    if isinstance(plan, GroupedMmPlan):
        return "grouped_mm"
    return plan.gemm


Plan = Union[ReferencePlan, AllGatherPlan, ReduceScatterPlan, MatmulAllGatherPlan,
             AllReducePlan, GroupedMmPlan]
REFERENCE_PLAN = ReferencePlan()
PLAN_TYPES = {cls.kind: cls for cls in (AllGatherPlan, ReduceScatterPlan, MatmulAllGatherPlan,
                                        AllReducePlan, GroupedMmPlan)}


def default_groups(world: int) -> tuple[int, ...]:
    """Own chunk first (computed while the first peers' chunks arrive), then growing groups."""
    sizes, left, s = [1], world - 1, 1
    while left > 0:
        s = min(left, max(1, s * 2 if len(sizes) > 1 else s + 1))
        sizes.append(s)
        left -= s
    return tuple(sizes)


# Parameter names (as the candidate tables and the benchmarks write them) of the GEMM tile, by
# family: the all-reduce's own block/warps are the push kernel's, its GEMM's are gemm_*.
TILE_PARAMS = tuple(f.name for f in dataclasses.fields(GemmTile))
_TILE_KEYS = {
    AllGatherPlan: {k: k for k in TILE_PARAMS},
    AllReducePlan: {"gemm_block_n": "block_n", "gemm_stages": "stages", "gemm_warps": "warps"},
}


def from_params(cls, params: dict[str, Any], **fields) -> FusedPlan:
    """A plan of family `cls` from parameters by name (a candidate table's entry), every
    parameter it does not name at its default; an unknown name is an error."""
    tile_keys = _TILE_KEYS.get(cls, {})
    tile = {tile_keys[k]: v for k, v in params.items() if k in tile_keys}
    rest = {k: v for k, v in params.items() if k not in tile_keys}
    names = {f.name for f in dataclasses.fields(cls)} - {"tile"}
    unknown = sorted(set(rest) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown parameter(s) {unknown}; allowed: "
                         f"{sorted(names | set(tile_keys))}")
    if "groups" in rest:
        rest["groups"] = tuple(rest["groups"])
    if tile:
        rest["tile"] = GemmTile(**tile)
    return cls(**{**rest, **fields})


def _text(value) -> str:
    if isinstance(value, GemmTile):
        return "x".join(str(v) for v in (value.block_m, value.block_n, value.block_k)) + (
            f"/g{value.group_m}s{value.stages}w{value.warps}")
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _encode(plan) -> str:
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
              if f.name != "predicted_ms"}
    if "tile" in fields:
        fields["tile"] = dataclasses.asdict(fields["tile"])
    if plan.impl == REFERENCE:
        return json.dumps({"impl": REFERENCE})
    return json.dumps({"impl": FUSED, "plan": plan.kind, **fields}, sort_keys=True)


@functools.lru_cache(maxsize=None)
def decode(text: str) -> Plan:
    """The plan a graph carries (once per distinct text: the runtime calls this per call)."""
    fields = json.loads(text)
    if fields.pop("impl") == REFERENCE:
        return REFERENCE_PLAN
    cls = PLAN_TYPES[fields.pop("plan")]
    if "tile" in fields:
        fields["tile"] = GemmTile(**fields["tile"])
    if "groups" in fields:
        fields["groups"] = tuple(fields["groups"])
    return cls(**fields)
