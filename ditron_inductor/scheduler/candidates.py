"""The registry of the all-gather + GEMM, GEMM + reduce-scatter and GEMM + all-gather variants
the scheduler can choose, by op: label -> Candidate. A label is namespaced by its op (the same
label under two ops names two entries), and every entry says where it may be chosen.

A candidate is a set of parameters of its op's typed plan (plan.py says what each means). The
scheduler takes one where it ran fastest among the candidates measured at a near shape on the
task's world size (evidence.nearest_measured), else where the link model predicts it fastest
among those `predicted_on` the calibration's world size: a candidate the model cannot price
(`predicted_on=()`) is chosen from measurements only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .plan import AllGatherPlan, FusedPlan, MatmulAllGatherPlan, ReduceScatterPlan, from_params
from .task import ALL_GATHER_MATMUL, MATMUL_ALL_GATHER, MATMUL_REDUCE_SCATTER, Task

# The calibrations' world sizes (evidence/link.json) where a candidate was measured, fused
# correctly, and in the table the link model was fitted to.
BOTH = (4, 8)


@dataclasses.dataclass(frozen=True)
class Candidate:
    params: dict[str, Any]
    predicted_on: tuple[int, ...] = BOTH


_TRITON_BIG = dict(gemm="triton", block_m=128, block_n=256, block_k=64, group_m=8, stages=3,
                   warps=8)
_TRITON_MID = dict(_TRITON_BIG, block_n=128, stages=4)
_EACH = dict(gemm="cublas", groups=[1] * 16)  # each chunk's GEMM as soon as it lands

CANDIDATES: dict[str, dict[str, Candidate]] = {
    ALL_GATHER_MATMUL: {
        "tri_tma_128x256": Candidate(_TRITON_BIG),
        "tri_tma_128x128": Candidate(_TRITON_MID),
        "cublas_1_3_4": Candidate(dict(gemm="cublas", groups=[1, 3, 4])),
        "cublas_1_2_5": Candidate(dict(gemm="cublas", groups=[1, 2, 5])),
        "cublas_1_7": Candidate(dict(gemm="cublas", groups=[1, 7])),
        "tri_tma_128x256_s2": Candidate(dict(_TRITON_BIG, copy_streams=2)),
        "cublas_1_1_2_4": Candidate(dict(gemm="cublas", groups=[1, 1, 2, 4])),
        "cublas_each": Candidate(_EACH, predicted_on=(4,)),
        # my shard's copy into my symmetric buffer, then a barrier on every peer's READY before
        # the pulls (as PyTorch's async TP orders its all-gather): the model prices the local
        # copies as hidden either way, so these are taken where measured only
        "cublas_each_first_ready": Candidate(dict(_EACH, ready_before_gemm=True), ()),
        "tri_tma_128x256_ready": Candidate(dict(_TRITON_BIG, ready_before_gemm=True), ()),
        # the barrier waited for beside the GEMM of my rows, which needs no peer
        "cublas_each_first_ready_beside": Candidate(
            dict(_EACH, ready_before_gemm=True, barrier_beside=True), ()),
    },
    MATMUL_REDUCE_SCATTER: {
        # first = preferred on a tie: the Triton reduction of the received partials
        "cublas_triton_reduce": Candidate(dict(reduce="triton")),
        "cublas": Candidate(dict(reduce="torch")),
    },
    # cuBLAS in row chunks, each pushed beside the next chunk's GEMM; no model prices them
    MATMUL_ALL_GATHER: {f"cublas_chunks_{c}": Candidate(dict(chunks=c), ()) for c in (1, 2, 4)},
}
_PLAN_TYPES = {ALL_GATHER_MATMUL: AllGatherPlan, MATMUL_REDUCE_SCATTER: ReduceScatterPlan,
               MATMUL_ALL_GATHER: MatmulAllGatherPlan}


def candidates_for(task: Task) -> dict[str, Candidate]:
    """The candidates of the task's op (AG, RS or the GEMM + all-gather)."""
    return CANDIDATES[task.op]


def predicted_labels(task: Task, calibrated_world: int) -> list[str]:
    """The labels the link model may choose with the calibration of `calibrated_world`."""
    return [label for label, c in candidates_for(task).items()
            if calibrated_world in c.predicted_on]


def candidate_plan(task: Task, label: str, **fields) -> FusedPlan:
    """The candidate `label` of the task's op as a plan resolved for the task's world size."""
    cls = _PLAN_TYPES[task.op]
    return from_params(cls, CANDIDATES[task.op][label].params, label=label,
                       **fields).for_world(task.world_size)
