"""The device plan of a task on CUDA: which fused plan, or none (the graph keeps NCCL + cuBLAS).

AG/RS and the GEMM + all-gather (launched eagerly): the fastest candidate measured at a near
shape on the task's world size where one beats NCCL + cuBLAS by MEASURED_MIN_GAIN, else (AG/RS)
the link model's fastest where it is predicted MIN_GAIN faster. GEMM (or grouped GEMM) +
all-reduce: the plan by M (policy), kept where the world-1 compute and the link model predict it
MIN_GAIN faster. FP8 and
MoE: where their measurements say (policy). Every "no" says why, for the log.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import calibration, evidence, link_model, policy
from .candidates import candidate_plan, candidates_for
from .plan import COPY_ENGINE, AllGatherPlan, AllReducePlan, FusedPlan, GroupedMmPlan
from .plan import TILE_PARAMS, MatmulAllGatherPlan, ReduceScatterPlan, family, from_params
from .task import (ALL_GATHER_MATMUL, ALL_GATHER_SCALED_MM, ALL_REDUCE_PATTERNS,
                   GROUPED_MM_ALL_REDUCE_PATTERNS, MATMUL_ALL_GATHER, MATMUL_REDUCE_SCATTER,
                   MOE_PATTERNS, SCALED_MM_ALL_REDUCE, SCALED_MM_REDUCE_SCATTER, Task, size_hint)
from .ranking import best_label, measured_decision, predicted

KEEP = "NCCL + cuBLAS (DITRON_PLAN=fused forces the fused kernels)"
_FUSED_PLAN_OPS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_GATHER,
                   *ALL_REDUCE_PATTERNS, ALL_GATHER_SCALED_MM, SCALED_MM_REDUCE_SCATTER,
                   *MOE_PATTERNS)


def has_fused_plan(op: str) -> bool:
    """Whether some fused plan runs the op on CUDA (one the scheduler may not choose)."""
    return op in _FUSED_PLAN_OPS


def _world1_note(task: Task, plan: FusedPlan, cuda_graphs: bool) -> str:
    """The plan's compute measured at world size 1 beside the unfused compute, for the log."""
    costs = evidence.world1_costs(task.op, family(plan), cuda_graphs, task.m_hint,
                                  size_hint(task.k), task.n_total)
    if costs is None:
        return ""
    return (f"; compute measured at world size 1: fused {costs.fused_ms:.3f} vs unfused "
            f"{costs.unfused_ms:.3f} ms" + (f" ({costs.source})" if costs.source else ""))


def _model_gain(task: Task) -> float:
    """The gain a link-model prediction must show: wider where its constants were not
    measured on this card."""
    return (policy.MIN_GAIN if evidence.link_measured(task.world_size)
            else policy.UNCALIBRATED_MIN_GAIN)


def _margin_note(gain: float) -> str:
    return "" if gain == policy.MIN_GAIN else f"; uncalibrated card: fused from {gain}x"


def _with_prediction(plan: FusedPlan, unfused: float, fused: float) -> FusedPlan:
    return dataclasses.replace(plan, predicted_ms=(("nccl_cublas", unfused), ("fused", fused)))


def all_gather_or_reduce_scatter_plan(task: Task,
                                      cuda_graphs: bool) -> tuple[Optional[FusedPlan], str]:
    if not task.rank_chunks_contiguous:
        return None, (f"the fused kernels take each rank's chunk as one block of rows; "
                      f"dim {task.dim} with a leading dim > 1 interleaves them")
    if cuda_graphs:  # the runtime would run the op's reference inside the captured graph
        return None, ("replayed from a CUDA graph: the fused all-gather and reduce-scatter "
                      "count their epochs on the host and run eagerly only: NCCL + cuBLAS")
    measured = _measured_plan(task)
    if measured is not None:
        return measured
    preds = predicted(task)
    base = preds.pop(evidence.NCCL_CUBLAS)
    best = min(preds, key=preds.get)
    plan = candidate_plan(task, best)
    gain = _model_gain(task)
    summary = (f"predicted NCCL+cuBLAS {base:.3f} ms, best fused {best} {preds[best]:.3f} ms "
               f"({evidence.link_source(task.world_size)}{_margin_note(gain)})"
               f"{_world1_note(task, plan, cuda_graphs)}")
    if preds[best] * gain > base:
        return None, f"no predicted gain: {summary}"
    return _with_prediction(plan, base, preds[best]), f"fused plan {best}: {summary}"


def _measured_plan(task: Task) -> Optional[tuple[Optional[FusedPlan], str]]:
    """(the fastest candidate measured near the task's shape where it beats NCCL + cuBLAS by
    MEASURED_MIN_GAIN, else None, and why), or None where no row is near."""
    measured = measured_decision(task)
    if measured is None:
        return None
    if measured.label is None:
        return None, f"no measured gain: {measured.summary}"
    plan = _with_prediction(candidate_plan(task, measured.label), measured.unfused_ms,
                            measured.fused_ms)
    return plan, f"fused plan {measured.label}: {measured.summary}"


def matmul_all_gather_plan(task: Task, cuda_graphs: bool) -> tuple[Optional[FusedPlan], str]:
    """From measured rows only (a calibration on several GPUs: the shipped tables hold none)."""
    if cuda_graphs:
        return None, ("replayed from a CUDA graph: the fused GEMM + all-gather counts its epochs "
                      "on the host and runs eagerly only: cuBLAS + NCCL")
    measured = _measured_plan(task)
    if measured is not None:
        return measured
    return None, (f"the fused GEMM + all-gather has no measured row near this shape on "
                  f"{task.world_size} ranks ({policy.MATMUL_ALL_GATHER_WHY}; ditron.plan=fused "
                  "fuses it): cuBLAS + NCCL")


def all_reduce_plan(task: Task, cuda_graphs: bool) -> tuple[Optional[AllReducePlan], str]:
    """The GEMM + all-reduce plan where a fused kernel measured a gain (policy's thresholds),
    and then only where the world-1 compute and the link model predict it MIN_GAIN faster."""
    m, world = task.m_hint, task.world_size
    copy_engine_min_m = (policy.COPY_ENGINE_GRAPH_MIN_M if cuda_graphs
                         else policy.COPY_ENGINE_EAGER_MIN_M)
    if (world <= policy.COPY_ENGINE_MAX_WORLD and m >= copy_engine_min_m
            and policy.copy_engine_serves(task)):
        chunks = policy.copy_engine_chunks(m, task.n_total, cuda_graphs)
        plan = fused_plan(task, dict(algo=COPY_ENGINE, chunks=chunks))
        return _costed_all_reduce_plan(task, plan, cuda_graphs,
                                       "copies beside the GEMM's row chunks")
    overlap = policy.pushes_beside_gemm(task) and m <= policy.OVERLAP_MAX_M
    if m > policy.FUSED_MAX_M and not overlap:
        if task.op in GROUPED_MM_ALL_REDUCE_PATTERNS:
            return None, (f"M={m} > {policy.FUSED_MAX_M}: push after the GEMM measured no gain "
                          "over NCCL at this size, and the reduced tensor has no GEMM to push "
                          f"beside: {KEEP}")
        bound = policy.OVERLAP_MAX_M if world <= policy.OVERLAP_MAX_WORLD else policy.FUSED_MAX_M
        return None, (f"M={m} > {bound}: no fused kernel measured a gain over NCCL at "
                      f"this size on {world} ranks: {KEEP}")
    if not cuda_graphs and not (overlap and m >= policy.OVERLAP_EAGER_MIN_M):
        return None, ("launched eagerly the fused kernel costs more host time than it saves; "
                      f"with CUDA graphs (mode='reduce-overhead') it is fused: {KEEP}")
    return _costed_all_reduce_plan(task, fused_plan(task), cuda_graphs,
                                   "beside the GEMM" if overlap else "")


def _costed_all_reduce_plan(task: Task, plan: AllReducePlan, cuda_graphs: bool,
                            where: str) -> tuple[Optional[AllReducePlan], str]:
    """The plan where the costs predict it MIN_GAIN faster than NCCL + cuBLAS, or where no
    world-1 measurement stands for the shape of a GEMM op on a calibrated card; else (None,
    why)."""
    how = "replayed in a CUDA graph" if cuda_graphs else "eager, host time hidden at this size"
    world1 = evidence.world1_costs(task.op, family(plan), cuda_graphs, task.m_hint,
                                   size_hint(task.k), task.n_total)
    if world1 is None and not calibration.calibrated():
        return None, f"no world-1 measurement on this uncalibrated card: {KEEP}"
    if world1 is None and task.op in GROUPED_MM_ALL_REDUCE_PATTERNS:  # no GEMM's row stands in
        return None, (f"no world-1 measurement of {task.op} near this shape "
                      f"({evidence.world1_source()}): {KEEP}")
    if world1 is None:
        note = f"no world-1 measurement near this shape ({evidence.world1_source()})"
    else:
        costs = link_model.all_reduce_costs(task, plan, evidence.link(task.world_size),
                                            world1.fused_ms, world1.unfused_ms)
        gain = _model_gain(task)
        note = (f"{costs.describe()}; compute from {world1.source or 'the shipped table'}, "
                f"{evidence.link_source(task.world_size)}{_margin_note(gain)}")
        if costs.fused * gain > costs.unfused:
            return None, f"no predicted gain: {note}: {KEEP}"
        plan = _with_prediction(plan, costs.unfused, costs.fused)
    return plan, (f"fused plan {plan.algo}{' ' + where if where else ''} (M={task.m_hint}, "
                  f"{how}; {note})")


def scaled_mm_plan(task: Task, cuda_graphs: bool) -> tuple[Optional[FusedPlan], str]:
    """The FP8 ops' plan where it was measured to win (policy.fp8_chosen), else None and why."""
    keep = ("the graph keeps the collective + _scaled_mm (DITRON_PLAN=reference runs the op's "
            "reference)")
    if task.op == SCALED_MM_ALL_REDUCE:
        return None, f"no fused fp8 all-reduce kernel: {keep}"
    fused = ("_scaled_mm per group of gathered chunks" if task.op == ALL_GATHER_SCALED_MM
             else "_scaled_mm per rank's rows, each pushed by the copy engine")
    where = (f"chosen on {policy.FP8_CHOSEN_WORLD} ranks from M {policy.FP8_CHOSEN_MIN_M}, "
             "launched eagerly, where the float8 training step measured faster fused")
    if policy.fp8_chosen(task, cuda_graphs) and calibration.card_matches():
        plan = fused_plan(task)
        return plan, f"fused plan {plan.label} ({fused}): {where}"
    return None, (f"the fp8 plan ({policy.FP8_LABEL}: {fused}) is {where}: {keep}, "
                  "DITRON_PLAN=fused that plan")


def moe_not_fused(op: str) -> str:
    """Why the graph keeps NCCL + grouped GEMM at an MoE op on several CUDA ranks."""
    return (f"{op}: {policy.MOE_WHY} (ditron.plan=fused fuses it): NCCL all-to-all + "
            "torch._grouped_mm")


def choose_device_plan(task: Task, cuda_graphs: bool = False) -> tuple[Optional[FusedPlan], str]:
    """(plan, why); a None plan leaves the graph as it was. cuda_graphs: the compiled graph is
    replayed as a CUDA graph."""
    if not calibration.agreed():
        return None, f"the ranks did not agree on the scheduler evidence (warned above): {KEEP}"
    if task.op in (ALL_GATHER_SCALED_MM, SCALED_MM_REDUCE_SCATTER, SCALED_MM_ALL_REDUCE):
        return scaled_mm_plan(task, cuda_graphs)
    if task.op in ALL_REDUCE_PATTERNS:
        return all_reduce_plan(task, cuda_graphs)
    if task.op in MOE_PATTERNS:
        return None, moe_not_fused(task.op)
    if task.op == MATMUL_ALL_GATHER:
        return matmul_all_gather_plan(task, cuda_graphs)
    if task.op in (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER):
        return all_gather_or_reduce_scatter_plan(task, cuda_graphs)
    # NCCL + cuBLAS, which Inductor can still schedule, rather than an opaque reference op
    return None, f"no fused CUDA kernel for {task.op} yet"


def fused_plan(task: Task, params: Optional[dict] = None) -> FusedPlan:
    """The fused plan for the task with the parameters a user or a test names: with none, or
    none that names the kind (gemm for AG, algo for the all-reduce), the task's default (the
    best candidate, or the all-reduce plan by M) with them on top; else those alone."""
    params = dict(params or {})
    if task.op in (ALL_GATHER_SCALED_MM, SCALED_MM_REDUCE_SCATTER):
        cls, default = ((AllGatherPlan, policy.FP8_AG_PARAMS) if task.op == ALL_GATHER_SCALED_MM
                        else (ReduceScatterPlan, policy.FP8_RS_PARAMS))
        named = "gemm" in params or "reduce" in params
        merged = {**({} if named else default), **params}
        return from_params(cls, merged, label="" if named else policy.FP8_LABEL).for_world(
            task.world_size)
    if task.op in MOE_PATTERNS:  # one family: the grouped GEMM's tile, by the rows unless named
        named = bool(params.keys() & set(TILE_PARAMS))  # a named tile is kept
        rules = {} if named else {"small_expert_rows": policy.SMALL_EXPERT_ROWS,
                                  "library_rows": policy.LIBRARY_DISPATCH_ROWS,
                                  "library_below_rows": policy.LIBRARY_DISPATCH_BELOW_ROWS,
                                  "library_combine_rows": policy.LIBRARY_COMBINE_ROWS}
        merged = {**rules, **params}
        return from_params(GroupedMmPlan, merged, label=merged.pop("label", "grouped_mm"))
    if task.op == MATMUL_ALL_GATHER:
        merged = {"chunks": policy.matmul_all_gather_chunks(task.m_hint), **params}
        return from_params(MatmulAllGatherPlan, merged, label=f"cublas_chunks_{merged['chunks']}")
    if task.op in ALL_REDUCE_PATTERNS:  # a sum of products, or no product: cuBLAS plans
        cublas = task.sums_terms or task.op in GROUPED_MM_ALL_REDUCE_PATTERNS
        base = ({} if "algo" in params else policy.cublas_all_reduce_params(task)
                if cublas else policy.all_reduce_params(task))
        merged = {**base, **params}
        return from_params(AllReducePlan, merged, label=merged["algo"]).for_world(
            task.world_size)
    if task.op not in (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER):
        raise ValueError(f"no fused plan runs {task.op}")
    cls = AllGatherPlan if task.op == ALL_GATHER_MATMUL else ReduceScatterPlan
    named = ("gemm" if task.op == ALL_GATHER_MATMUL else "reduce") in params
    label = "" if named else best_label(task)
    base = {} if named else candidates_for(task)[label].params
    return from_params(cls, {**base, **params}, label=label).for_world(task.world_size)
