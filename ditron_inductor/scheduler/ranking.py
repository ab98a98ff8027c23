"""The candidates of an all-gather + GEMM or GEMM + reduce-scatter task ranked by the evidence:
the fastest measured at the nearest shape on the task's world size (with the rewrite's extra
costs, and whether it beats NCCL + cuBLAS by MEASURED_MIN_GAIN), else the link model's
prediction for each candidate it may price."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from . import calibration, evidence, link_model, policy
from .candidates import candidates_for, predicted_labels
from .task import Task, size_hint


class MeasuredDecision(NamedTuple):
    """The choice at a shape measured on the task's world size: the fastest candidate there,
    whether it beat NCCL + cuBLAS by MEASURED_MIN_GAIN (`label`, else None), both times with
    the rewrite's extra costs."""

    fastest: str
    label: Optional[str]
    fused_ms: float
    unfused_ms: float
    summary: str


def measured_decision(task: Task) -> Optional[MeasuredDecision]:
    """The decision from the measured candidates at the nearest measured shape of the task's op,
    world size and dtype, or None where none is near. The rows were launched eagerly; under
    CUDA graphs the same rows decide."""
    m, k, n = task.m_hint, size_hint(task.k), task.n_total
    row = evidence.nearest_measured(task.op, task.world_size, task.dtype, m, k, n)
    fastest = row and row.fastest(candidates_for(task))
    if not fastest:
        return None
    link = evidence.link(task.world_size)
    # a row timed as the sum (its terms apart) holds the op's accumulation and the graph's add
    timed = task if row.terms == 1 else dataclasses.replace(task, terms=1)
    copy_ms, sum_ms = link_model.rewrite_costs(timed, link)
    fused = row.ms[fastest] + copy_ms
    unfused = row.ms[evidence.NCCL_CUBLAS] + sum_ms
    rm, rk, rn = row.shape
    summary = (f"measured on {task.world_size} ranks at {rm}x{rk}x{rn} ({row.source}): "
               f"NCCL+cuBLAS {unfused:.3f} ms, fastest fused {fastest} {fused:.3f} ms"
               + ("" if row.source.startswith(calibration.CALIBRATION) else "; shipped table"))
    label = fastest if unfused >= fused * policy.MEASURED_MIN_GAIN else None
    return MeasuredDecision(fastest, label, fused, unfused, summary)


def predicted(task: Task) -> dict[str, float]:
    """The link model's ms per call of NCCL + cuBLAS ("nccl_cublas") and of each candidate it
    may choose at the task's world size."""
    link = evidence.link(task.world_size)
    labels = predicted_labels(task, evidence.calibrated_world(task.world_size))
    params = candidates_for(task)
    out = {evidence.NCCL_CUBLAS: link_model.unfused_ms(task, link)}
    out.update(link_model.predict(task, link, ((lb, params[lb].params) for lb in labels)))
    return out


def best_label(task: Task) -> str:
    """The fastest candidate measured at the task's shape, else the one predicted fastest."""
    measured = measured_decision(task)
    if measured is not None:
        return measured.fastest
    preds = predicted(task)
    del preds[evidence.NCCL_CUBLAS]
    return min(preds, key=preds.get)
