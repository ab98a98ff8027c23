"""The ditron post-grad pass: find candidates, let the scheduler decide, rewrite, and say so.

TORCH_LOGS=ditron prints, per compiled graph, a summary line and each candidate with the model
layer it comes from and whether it was fused (and why not), and each collective beside a matmul
that no candidate holds, with why; TORCH_LOGS=+ditron adds the collectives far from any matmul,
the graph before and after the pass and the chosen plans.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
from typing import Any, Callable, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph

from .. import config
from ..log_names import LOGGER_NAME, all_ranks_logging
from ..scheduler import calibration
from ..scheduler.decide import Decision, decide, reject
from ..scheduler.plan import FusedPlan
from .decode_gemm import group_decode_mms, rewrite_decode_mms
from .grouped_all_reduce import GroupedMmAllReduceMatch
from .left import Unmatched, collectives, describe, is_collective
from .match import AllGatherMatmulMatch, MatmulCollectiveMatch, find_candidates
from .moe import (
    AllToAllGroupedMmMatch,
    GroupedMmAllToAllMatch,
    rewrite_all_to_all_grouped_mm,
    rewrite_grouped_mm_all_to_all,
)
from .rewrite import (rewrite_all_gather_matmul, rewrite_grouped_mm_all_reduce,
                      rewrite_matmul_collective)

log = logging.getLogger(LOGGER_NAME)

# match type -> its rewrite(graph, match, plan text)
REWRITES: dict[type, Callable] = {
    AllGatherMatmulMatch: rewrite_all_gather_matmul,
    MatmulCollectiveMatch: rewrite_matmul_collective,
    GroupedMmAllReduceMatch: rewrite_grouped_mm_all_reduce,
    AllToAllGroupedMmMatch: rewrite_all_to_all_grouped_mm,
    GroupedMmAllToAllMatch: rewrite_grouped_mm_all_to_all,
}


@dataclasses.dataclass(frozen=True)
class CandidateReport:
    task: str  # Task.describe()
    fused: bool
    reason: str
    plan: Optional[str]  # the plan's describe() when fused
    layers: tuple[str, ...] = ()  # the model's modules whose matmuls the candidate holds
    op: str = ""  # Task.op


# Why a collective is left, by kind: its candidate was not fused (the candidate's line says why),
# it is beside a matmul but no candidate holds it, or no matmul is near it.
IN_CANDIDATE, BESIDE_MATMUL, APART = "candidate", "beside", "apart"
_LEFT_KINDS = {IN_CANDIDATE: "in candidates not fused",
               BESIDE_MATMUL: "beside a matmul with no candidate",
               APART: "with no matmul beside it"}


@dataclasses.dataclass(frozen=True)
class LeftCollective:
    """A collective the pass leaves in the graph, and why."""

    collective: str  # left.describe()
    reason: str
    kind: str  # IN_CANDIDATE, BESIDE_MATMUL or APART
    layer: str = ""


@dataclasses.dataclass(frozen=True)
class GraphReport:
    graph: str  # compile id and forward/backward
    candidates: tuple[CandidateReport, ...]
    from_cache: bool = False  # served by Inductor's caches: the pass did not run this time
    collectives: int = 0  # the functional collectives in the graph before the pass
    left: tuple[LeftCollective, ...] = ()  # those still there after it

    def summary(self) -> str:
        if self.from_cache:
            return ("served from Inductor's cache, compiled earlier by the ditron pass with the "
                    "same options (the decisions were logged then)")
        if not self.candidates:
            text = "no collective + matmul candidates"
        else:
            fused = [c for c in self.candidates if c.fused]
            left = [c for c in self.candidates if not c.fused]
            text = (f"{len(self.candidates)} candidate(s): {len(fused)} fused{_by_op(fused)}, "
                    f"{len(left)} left{_by_op(left)}")
        if not self.collectives:
            return text
        kinds = collections.Counter(c.kind for c in self.left)
        parts = ", ".join(f"{kinds[k]} {words}" for k, words in _LEFT_KINDS.items() if kinds[k])
        return (f"{text}; {self.collectives} collective(s): "
                f"{self.collectives - len(self.left)} fused, {len(self.left)} left"
                + (f" ({parts})" if parts else ""))


def _by_op(candidates: list[CandidateReport]) -> str:
    counts = collections.Counter(c.op for c in candidates)
    return f" ({', '.join(f'{op} {n}' for op, n in sorted(counts.items()))})" if counts else ""


# The latest graphs this process compiled, for programs (the demo, tests) that want to show them.
reports: collections.deque[GraphReport] = collections.deque(maxlen=256)


def _source_files() -> tuple[str, ...]:
    """Every source and data file of the package: any of them can change a decision or a
    rewrite (the scheduler's evidence tables among them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return tuple(sorted(os.path.join(where, name) for where, _, names in os.walk(root)
                        for name in names if name.endswith((".py", ".json"))))


class DitronPass(CustomGraphPass):
    """Inductor's `post_grad_custom_post_pass`, carrying the options of its compile (a backward
    graph is compiled later, outside the backend's call); runs a pass the user had configured
    there first."""

    def __init__(self, options: Optional[config.Options] = None,
                 user_pass: Optional[Callable[[Graph], Any]] = None):
        self.options = options if options is not None else config.Options()
        self.user_pass = user_pass

    def __call__(self, graph: Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)
        with all_ranks_logging(self.options.log_all_ranks):
            run_pass(graph, self.options)
            if self.options.decode_gemm:
                _rewrite_decode_mms(graph, self.options.decode_gemm_groups)

    def uuid(self) -> Any:
        user = None
        if self.user_pass is not None:
            user = getattr(self.user_pass, "uuid", lambda: None)()
            if user is None:  # an uncacheable user pass makes the whole pass uncacheable
                return None
        return (get_hash_for_files(_source_files()).hex(), self.options.cache_key(), user,
                process_groups_key(), calibration.cache_key())  # this machine's calibration


def process_groups_key() -> tuple:
    """The process groups' names and sizes: a rewritten graph names its group and world size, so
    a graph cached by a run with 8 ranks must not serve one where group '0' has 2."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ()
    from torch.distributed.distributed_c10d import _world

    return tuple(sorted((name, len(_world.pg_group_ranks.get(pg, ())))
                        for pg, name in _world.pg_names.items()))


def graph_name(graph: Graph) -> str:
    compile_id = torch._guards.CompileContext.current_compile_id()
    is_backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
    return f"{compile_id or '?'} {'backward' if is_backward else 'forward'}"


_SUBSCRIPT = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def source_layer(node: torch.fx.Node) -> str:
    """The model layer a node comes from, as its module path (`layers.0.mlp.down_proj`): the
    innermost module of the node's nn_module_stack (a backward node carries its forward node's),
    else the file and line of the user code that made it."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        # the frame's local: L['self'], or L['args'][0] where the compiled forward is wrapped
        # (Hugging Face's models under torch 2.13)
        path = re.sub(r"^L\['args'\]\[\d+\]|^L\['[^']*'\]", "", path).replace("._modules", "")
        path = _SUBSCRIPT.sub(r".\1", path).strip(".")
        if path:
            return path
    frames = [f for f in _FRAME.findall(node.meta.get("stack_trace") or "")
              if not f[0].startswith(_TORCH_DIR)]  # torch's own frames (funcol) name no layer
    return f"{os.path.basename(frames[-1][0])}:{frames[-1][1]}" if frames else ""


def source_layers(match) -> tuple[str, ...]:
    """The layers of the nodes a match replaces (its matmuls, first)."""
    return tuple(dict.fromkeys(
        layer for n in match.replaced_nodes() if (layer := source_layer(n))))


def run_pass(graph: Graph, options: config.Options = config.Options()) -> GraphReport:
    name = graph_name(graph)
    matches, unmatched = find_candidates(graph, options.patterns)
    total = len(collectives(graph))
    if matches:
        log.debug("graph %s before the ditron pass:\n%s", name, graph)

    # Tasks first: they are shapes and dtypes, which rewrites do not change, and a rewrite may
    # erase a node that a later match shares (the later match is then rejected).
    tasks = [match.task() for match in matches]
    rewritten: set = set()
    candidates = []
    left_in: dict = {}  # collective -> the reason its candidate was not fused
    for match, task in zip(matches, tasks):
        decision = _decide(match, task, rewritten, options)
        if not decision.fuse:
            for node in _collectives_of(match):
                left_in.setdefault(node, decision.reason)
        layers = source_layers(match)
        where = f"{', '.join(layers)}: " if layers else ""
        if decision.fuse:
            plan = decision.plan
            if isinstance(plan, FusedPlan):  # what a wait of the op that gives up names
                plan = dataclasses.replace(
                    plan, site=f"{', '.join(layers)} (graph {name})" if layers else f"graph {name}")
            REWRITES[type(match)](graph, match, plan.encode())
            rewritten.update(match.replaced_nodes())
            log.info("graph %s: %s%s -> ditron.%s [%s]", name, where, task.describe(), task.op,
                     decision.reason)
            log.debug("graph %s: plan for %s: %s", name, task.op, decision.plan.describe())
        else:
            log.info("graph %s: %s%s not fused: %s", name, where, task.describe(),
                     decision.reason)
        for note in match.notes:
            log.info("graph %s: %s%s: %s", name, where, task.describe(), note)
        candidates.append(CandidateReport(
            task.describe(), decision.fuse, decision.reason,
            decision.plan.describe() if decision.fuse else None, layers, task.op))
    if rewritten:
        stable_topological_sort(graph)
        graph.lint()
        log.debug("graph %s after the ditron pass:\n%s", name, graph)
    report = GraphReport(name, tuple(candidates), collectives=total,
                         left=_left_collectives(name, graph, left_in, unmatched))
    reports.append(report)
    log.info("graph %s: %s", name, report.summary())
    return report


def _collectives_of(match) -> list:
    """The collectives a match's op would replace."""
    if isinstance(match, AllGatherMatmulMatch):
        return [match.gather] + [n for n in match.scale_gather if is_collective(n)]
    if isinstance(match, (MatmulCollectiveMatch, GroupedMmAllReduceMatch)):
        return [match.collective]
    return [match.exchange.node]


def _left_collectives(name: str, graph: Graph, left_in: dict,
                      unmatched: list[Unmatched]) -> tuple[LeftCollective, ...]:
    """The collectives still in the graph after the pass, each with why; logs a line for each
    one that no candidate holds (a left candidate's line has said why already)."""
    why_unmatched = {u.collective: u for u in unmatched}
    left = []
    for node in collectives(graph):
        layer = source_layer(node)
        where = f"{layer}: " if layer else ""
        if node in left_in:
            left.append(LeftCollective(describe(node), left_in[node], IN_CANDIDATE, layer))
            continue
        found = why_unmatched.get(node)
        reason = found.reason if found is not None else (
            "its candidate was fused, but the graph still uses its result elsewhere")
        kind = BESIDE_MATMUL if found is None or found.beside_matmul else APART
        left.append(LeftCollective(describe(node), reason, kind, layer))
        # A collective with no matmul near it (an embedding's all-reduce, a loss's) is no site a
        # ditron op could take: INFO counts it in the summary, TORCH_LOGS=+ditron names it.
        log.log(logging.INFO if kind == BESIDE_MATMUL else logging.DEBUG,
                "graph %s: %s%s not fused: %s", name, where, describe(node), reason)
    return tuple(left)


def _rewrite_decode_mms(graph: Graph, grouped: bool) -> None:
    replaced = rewrite_decode_mms(graph)
    if replaced:
        log.info("graph %s: %d one-row matmul(s) -> ditron.decode_mm (the decode GEMM template)",
                 graph_name(graph), len(replaced))
        log.debug("graph %s: decode_mm replaced %s", graph_name(graph), ", ".join(replaced))
    groups = group_decode_mms(graph) if grouped and replaced else []
    if groups:
        log.info("graph %s: %d of them in %d launch(es) of ditron.decode_mm_group (products of "
                 "the same rows)", graph_name(graph), sum(map(len, groups)), len(groups))
        log.debug("graph %s: decode_mm_group took %s", graph_name(graph),
                  "; ".join(", ".join(g) for g in groups))


def _decide(match, task, rewritten: set, options: config.Options) -> Decision:
    if match.problem:
        return reject(match.problem)
    taken = [n.name for n in match.replaced_nodes() if n in rewritten]
    if taken:
        return reject(f"{', '.join(taken)} already belongs to an earlier ditron op")
    return decide(task, options)
