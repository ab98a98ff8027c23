"""Device plans for fused ops on CUDA, chosen from the Task alone (shape, dtype, world size).

The model predicts, per candidate plan, the time of one call from a few constants measured on the
GPU machines (H200X8 and H200X4 below, by world size; a world size takes the nearest) and
picks the fastest; when no fused plan is predicted to beat the plain collective + cuBLAS by
MIN_GAIN, it returns None: the graph keeps NCCL + cuBLAS. Only shapes, dtype and world size
enter, so every rank makes the same choice. Where the AG/RS candidates were all timed on the
task's world size at a shape near its own (measured_plans.py), the measurement decides instead
of the prediction (measured_decision: the fastest validated candidate, or NCCL + cuBLAS where
none beats it by MEASURED_MIN_GAIN).

Candidates (parameters of the typed plans in scheduler/plan.py, which say what each means):
  gemm="triton": one persistent Triton GEMM (TMA, block_m x block_n x block_k, stages, warps)
                 whose tiles wait on per-chunk flags, chunks pulled by the copy engine;
  gemm="cublas": (AG) cuBLAS on groups of chunks in arrival order, `groups` chunks each, each
                 group after its last chunk landed; (RS) cuBLAS per destination chunk, rank+1 first,
                 each pushed by the copy engine as soon as it is computed; reduce="triton" sums the
                 received partials with templates/reduce.py (else torch.sum);
  copy_streams:  copy-engine streams for the AG pulls; transfer="sm" + comm_sms: the AG pulls by a
                 Triton kernel on comm_sms SMs instead; for RS, the reduction pulled by comm_sms
                 SMs beside one persistent Triton GEMM, in `chunks` chunks (UNVALIDATED: the
                 model predicts them but does not choose them).

The host-time floor (host_floor_ms: 0.75 ms at W=8, 0.23 at W=4) dominates small shapes on the
8-GPU machine. The measurements behind the constants: docs/performance.md and
docs/experiments.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from .. import config
from . import measured, measured_plans
from .plan import (COPY_ENGINE, COPY_ENGINE_MAX_N, AllGatherPlan, AllReducePlan, FusedPlan,
                   GroupedMmPlan, ReduceScatterPlan, family, from_params)
from .task import (
    ALL_GATHER_MATMUL,
    ALL_GATHER_SCALED_MM,
    ALL_TO_ALL_GROUPED_MM,
    SCALED_MM_PATTERNS,
    MATMUL_ALL_REDUCE,
    MATMUL_ALL_REDUCE_RMSNORM,
    MATMUL_REDUCE_SCATTER,
    GROUPED_MM_ALL_TO_ALL,
    MOE_PATTERNS,
    SCALED_MM_ALL_REDUCE,
    SCALED_MM_REDUCE_SCATTER,
    Task,
    size_hint,
)

_TRITON_BIG = dict(gemm="triton", tma=True, block_m=128, block_n=256, block_k=64, group_m=8,
                   stages=3, warps=8)
_TRITON_MID = dict(gemm="triton", tma=True, block_m=128, block_n=128, block_k=64, group_m=8,
                   stages=4, warps=8)

# Candidate plans by label (the benchmark measures each of them).
AG_CANDIDATES = {
    "tri_tma_128x256": _TRITON_BIG,
    "tri_tma_128x128": _TRITON_MID,
    "cublas_1_3_4": dict(gemm="cublas", groups=[1, 3, 4]),
    "cublas_1_2_5": dict(gemm="cublas", groups=[1, 2, 5]),
    "cublas_1_7": dict(gemm="cublas", groups=[1, 7]),
    "tri_tma_128x256_s2": dict(_TRITON_BIG, copy_streams=2),
    "cublas_1_3_4_s2": dict(gemm="cublas", groups=[1, 3, 4], copy_streams=2),
    "cublas_1_1_2_4": dict(gemm="cublas", groups=[1, 1, 2, 4]),
    # every chunk's GEMM as soon as it lands (the last GEMM after the last pull is one chunk's)
    "cublas_each": dict(gemm="cublas", groups=[1] * 16),
    # my shard's copy into my symmetric buffer before the GEMM of my rows, then a barrier on
    # every peer's READY, the pulls after it (PyTorch's async TP orders its all-gather so): on
    # 2 H100s at the Llama-3-8B training sites 0.73-0.95x the time of the plans chosen before
    # (all_gather_h100x2_ready_before_gemm.md)
    "cublas_each_first_ready": dict(gemm="cublas", groups=[1] * 16, ready_before_gemm=True),
    # the persistent Triton GEMM after the same barrier (its local copies run before it anyway):
    # the pulls start on the barrier's event, not on their own flag waits
    "tri_tma_128x256_ready": dict(_TRITON_BIG, ready_before_gemm=True),
    # the barrier waited for beside the GEMM of my rows (which needs no peer), on the local
    # copies' stream: the GEMM no longer waits for the signals' round trip. On 2 H200s 1-2%
    # faster at gate/up, lm_head and down's output gradient, 2-4% slower at q/k/v and o's output
    # gradient, whose pulls outlast the GEMM of my rows (fused_h200x2_llama8b_ag_barrier_8192.md;
    # both local copies as one kernel before the barrier measured no faster and was dropped)
    "cublas_each_first_ready_beside": dict(gemm="cublas", groups=[1] * 16,
                                           ready_before_gemm=True, barrier_beside=True),
    "tri_sm16_128x256": dict(_TRITON_BIG, transfer="sm", comm_sms=16),
    "tri_sm24_128x256": dict(_TRITON_BIG, transfer="sm", comm_sms=24),
    "tri_sm16_128x128": dict(_TRITON_MID, transfer="sm", comm_sms=16),
    "tri_sm16_ptr": dict(_TRITON_MID, tma=False, transfer="sm", comm_sms=16),
    # 4x the bytes in flight per pulling SM (32 warps, 128 KB a step): the all-reduce's push on
    # few SMs was NVLink-latency-bound with 8 warps
    "tri_sm16w32_128x256": dict(_TRITON_BIG, transfer="sm", comm_sms=16, pull_block=32768,
                                pull_warps=32),
    "tri_sm32w32_128x256": dict(_TRITON_BIG, transfer="sm", comm_sms=32, pull_block=32768,
                                pull_warps=32),
}
# The calibrations (world sizes of CALIBRATION_BY_WORLD) on whose machines each candidate was
# measured, fused correctly and in the table the model was fitted to: the model chooses a
# candidate only there. Absent: predicted, never chosen (a plan can still name it): the SM-pull
# transfers, slower than the copy engine on the suite's shapes (2 and 4 ranks; not measured on 8,
# where the copy engine limits the AG and RS shapes with short GEMMs). At the Llama-3-8B sites on
# 4 H200 some measured faster (q/k/v's gather: tri_sm32w32 0.278 ms, NCCL + cuBLAS 0.328;
# fused_h200x4_llama8b_sites.md), but the training step that took the SM-pull all-gathers ended
# with weights up to 3.5e+02 away from Inductor's (loss equal; the SM-pull reduce-scatter alone
# matched), though each passed bench_fused's check and the free-running GPU test: a defect not
# found yet (issue 23's notes). cublas_each was measured on 4 ranks only.
_BOTH = (4, 8)
VALIDATED_ON = {
    **{label: _BOTH for label in ("tri_tma_128x256", "tri_tma_128x128", "cublas_1_3_4",
                                  "cublas_1_2_5", "cublas_1_7", "tri_tma_128x256_s2",
                                  "cublas_1_3_4_s2", "cublas_1_1_2_4")},
    "cublas_each": (4,),
    # taken only where measured (measured_plans.json), never from the model, which prices the
    # local copies as hidden either way (the all-gathers), or has no term for the pulls (the
    # reduce-scatters that accumulate)
    **{label: () for label in ("cublas_each_first_ready", "tri_tma_128x256_ready",
                               "cublas_each_first_ready_beside", "cublas_accumulate",
                               "cublas_accumulate_c4")},
    **{label: _BOTH for label in ("cublas_triton_reduce", "cublas")},
}


def unvalidated(world: int) -> frozenset:
    """The labels the model does not choose on this many ranks."""
    calibrated = _calibration_world(world)
    return frozenset(label for label in (*AG_CANDIDATES, *RS_CANDIDATES)
                     if calibrated not in VALIDATED_ON.get(label, ()))


# First = preferred on a tie: the torch.sum reduction ("cublas") showed an unexplained 2.2 ms
# host-blocked outlier on the first reduce-scatter shape of run v2; the Triton one did not.
RS_CANDIDATES = {
    "cublas_triton_reduce": dict(gemm="cublas", reduce="triton"),
    "cublas": dict(gemm="cublas"),
    "tri_tma_128x256": _TRITON_BIG,
    # one persistent Triton GEMM on SMs - comm_sms, the reduction pulled by comm_sms SMs beside
    # it, chunk by chunk (runtime/reduce_scatter.py). On 2 and 4 ranks slower than the copy-engine
    # plan on every suite shape (fused_h200x4_rs_sm_pull.md, reduce_scatter_h200x4_sm_pull_more_sms.md: the GEMM on fewer SMs;
    # 48 and 64 pulling SMs slower still); for 8 ranks, where the copy engine limits RS
    # 8192x1024, not yet measured
    "tri_pull_p16": dict(gemm="triton", transfer="sm", comm_sms=16, chunks=8),
    "tri_pull_p32": dict(gemm="triton", transfer="sm", comm_sms=32, chunks=8),
    "tri_pull_p16_c16": dict(gemm="triton", transfer="sm", comm_sms=16, chunks=16),
    "tri_pull_p32_c16": dict(gemm="triton", transfer="sm", comm_sms=32, chunks=16),
    # the receivers pull their rows of the partials and cuBLAS adds their own product onto them
    # (runtime/reduce_scatter._pull_accumulate): no reduction after the last GEMM
    "cublas_accumulate": dict(gemm="cublas", accumulate=True, chunks=2),
    "cublas_accumulate_c4": dict(gemm="cublas", accumulate=True, chunks=4),
}


def candidates_for(task: Task) -> dict:
    """The AG or RS candidates that can run the task, less the option's skipped ones
    (ditron.skip_plans): for a sum of matmul products, the plans that take its terms
    (ReduceScatterPlan.takes_terms)."""
    table = AG_CANDIDATES if task.op == ALL_GATHER_MATMUL else RS_CANDIDATES
    return {label: p for label, p in table.items() if label not in config.skip_plans
            and (not task.sums_terms or from_params(ReduceScatterPlan, p).takes_terms)}


# Calibration: 8x H200 (NVLink, NV18 all-to-all), torch 2.11, Triton 3.6, measured 2026-11-20 by
#   torchrun --nproc-per-node 8 benchmarks/bench_fused.py  (benchmarks/results/fused_h200x8_*.json)
# (see docs/experiments.md for how each constant was read off the table).
H200X8 = dict(
    cublas_tflops=710.0,  # bf16 GEMM alone, the suite's shapes: 660-770 TFLOP/s
    cublas_small_m_rows=1024,  # below about this many rows a cuBLAS GEMM loses efficiency
    nccl_ag_gbps=320.0,  # NCCL all-gather alone, GB/s of gathered bytes (287-351)
    nccl_rs_gbps=345.0,  # NCCL reduce-scatter alone, GB/s of input bytes (333-361)
    ce_gbps=150.0,  # copy-engine peer copies, GB/s per GPU, one or two streams (140-160)
    sm_gbps=320.0,  # Triton pull through the peer table with 16 SMs (ARCHITECTURE.md: 320-350)
    triton_overhead_ms=0.10,  # fused Triton AG: tail and setup beyond max(GEMM, transfer), 0-0.16
    host_floor_ms=0.75,  # host time of one fused call at W=8 (driver calls + launches), 0.72-0.78
    reduce_gbps=2500.0,  # the reduction of W partial slots, GB/s read
    # Inductor's copy kernels for the rewrite's reorders and concatenations, GB/s read + written:
    # 3630-3980 on one H200 (benchmarks/bench_local_copy.py)
    copy_gbps=3800.0,
    cublas_groups_factor=1.0,  # AG with cuBLAS on groups of chunks: measured / modelled time
    num_sms=132,
    # NCCL's all-reduce alone replayed in a CUDA graph (all_reduce_h200x8_final_defaults.md,
    # column AR of the CUDA-graph table): bus bandwidth (2 (W-1)/W x bytes / ms: 8192 x 8192 bf16
    # in 0.765 ms) and the latency of a small one (M 1-32: 0.022-0.027 ms); the fused kernels'
    # own flag round trip, a few microseconds
    nccl_ar_busbw_gbps=315.0,
    nccl_latency_ms=0.022,
    fused_latency_ms=0.005,
    # push beside the persistent Triton GEMM: the ring's bytes (2 (W-1)/W x the partial) moved by
    # its 16-32 SMs while the GEMM holds the others, GB/s; what outlasts the GEMM is left after
    # it. Read off 4x H100 where the push outlasted the GEMM (K 1024 at N 4096, M 4096-32768:
    # 197-222; K 2048 at N 8192: 176; all_reduce_h100x4_two_shot.md, all_reduce_h100x4_m32k.md):
    # the predicted gain over NCCL + cuBLAS at K 1024 went from 1.6-1.9x to 1.08-1.23x (measured
    # 1.06-1.08x), no decision changed
    push_beside_gbps=210.0,
)
# 4x H200 (nvidia-h200-x4), same versions, 2026-11-21 (benchmarks/results/
# all_gather_h200x4_own_rows_main_stream.md): the copy engine pulls ~330 GB/s per GPU, alone or beside a GEMM
# (benchmarks/bench_copy.py; ~150 measured through the plans on the 8-GPU machine), a fused
# call costs 0.20-0.28 ms of host time (0.39-0.78 there), NCCL's all-gather and reduce-scatter
# alone move ~360 GB/s of the gathered / input bytes (8192x8192: 0.354 ms), the persistent Triton
# AG ends ~0.05 ms after max(GEMM, transfer), and the AG plans with cuBLAS on groups of chunks
# take ~1.1x their modelled time (0.9-1.2x). With these constants the model picks the measured
# best plan of that table on every shape (offline re-selection: bench_fused.py --from-json);
# the 8-GPU constants had left three shapes to NCCL + cuBLAS.
H200X4 = dict(H200X8, ce_gbps=300.0, host_floor_ms=0.23, nccl_ag_gbps=360.0,
              nccl_rs_gbps=360.0, cublas_groups_factor=1.1, triton_overhead_ms=0.05,
              nccl_ar_busbw_gbps=300.0)  # all_reduce_h200x4_overlap_defaults.md: 0.680 ms
CALIBRATION_BY_WORLD = {8: H200X8, 4: H200X4}  # by the world size they were measured at


def _calibration_world(world: int) -> int:
    """The measured world size nearest to `world` (the larger on a tie)."""
    return min(CALIBRATION_BY_WORLD, key=lambda w: (abs(w - world), -w))


def calibration(world: int) -> dict:
    """The constants measured at the world size nearest to `world`."""
    return CALIBRATION_BY_WORLD[_calibration_world(world)]


MIN_GAIN = 1.03  # a fused plan must be predicted this much faster than NCCL + cuBLAS


def _itemsize(task: Task) -> int:
    return getattr(task.dtype, "itemsize", 2)


def _gemm_ms(m: int, k: int, n: int, triton: bool = False) -> float:
    c = H200X8  # the GEMM alone: the same H200 on both machines, fitted on the 8-GPU one
    eff = min(1.0, m / c["cublas_small_m_rows"]) ** 0.25  # tile/wave quantisation at small m
    ms = 2.0 * m * k * n / (c["cublas_tflops"] * 1e12 * eff) * 1e3
    if triton:  # persistent TMA Triton GEMM relative to cuBLAS, by N (measured)
        ms /= 1.05 if n >= 3584 and m >= 8192 else (0.94 if n >= 2048 else 0.82)
    return ms


def rewrite_costs(task: Task) -> tuple[float, float]:
    """(ms of the rewrite's copies around the fused op and of its sum's accumulation, ms of the
    sum of products that the unfused graph adds): what neither a fused candidate's nor NCCL +
    cuBLAS's time on one matmul holds. The fused op reads its output rows once more per further
    term (cuBLAS with beta = 1); the graph's adds read every product and write the sum."""
    c = calibration(task.world_size)
    b = _itemsize(task)
    elems = task.m_hint * task.n_total
    gbps = c["copy_gbps"] * 1e6
    accumulated = (task.terms - 1) * elems if task.sums_terms else 0
    copy_ms = (2 * size_hint(task.copy_elems) + accumulated) * b / gbps
    sum_ms = (task.terms + 1) * elems * b / gbps if task.terms > 1 else 0.0
    return copy_ms, sum_ms


def predict(task: Task) -> dict[str, float]:
    """Predicted ms per call, by contender label ("nccl_cublas" and each candidate)."""
    w = task.world_size
    c = calibration(w)
    m, k = task.m_hint, size_hint(task.k)
    n = task.n_total
    b = _itemsize(task)
    rows = max(1, m // w)
    copy_ms, sum_ms = rewrite_costs(task)
    out: dict[str, float] = {}
    if task.op == ALL_GATHER_MATMUL:
        gathered = m * k * b
        out["nccl_cublas"] = gathered / (c["nccl_ag_gbps"] * 1e6) + _gemm_ms(m, k, n)
        moved = gathered * (w - 1) / w
        chunk_ms = gathered / w / (c["ce_gbps"] * 1e6)  # one peer chunk over the copy engine
        for label, p in candidates_for(task).items():
            if p["gemm"] == "triton" and p.get("transfer") == "sm":
                nsm = p["comm_sms"]
                g = _gemm_ms(m, k, n, triton=True) * c["num_sms"] / (c["num_sms"] - nsm)
                g *= 1.0 if p.get("block_n") == 256 and p.get("tma", True) else 1.05
                bw = c["sm_gbps"] * min(1.1, (nsm / 16) ** 0.5)
                t = max(g, moved / (bw * 1e6) + g / w) + c["triton_overhead_ms"]
            elif p["gemm"] == "triton":
                g = _gemm_ms(m, k, n, triton=True) * (1.0 if p["block_n"] == 256 else 1.04)
                t = max(g, (w - 1) * chunk_ms + g / w) + c["triton_overhead_ms"]
            else:
                t, arrived = 0.0, 1
                for size in p["groups"]:
                    if arrived > w:
                        break
                    last = min(arrived + size - 1, w)
                    t = max(t, (last - 1) * chunk_ms) + _gemm_ms((last - arrived + 1) * rows, k, n)
                    arrived = last + 1
                t *= c["cublas_groups_factor"]
            out[label] = max(t + copy_ms, c["host_floor_ms"])
    elif task.op == MATMUL_REDUCE_SCATTER:
        full = m * n * b
        out["nccl_cublas"] = _gemm_ms(m, k, n) + full / (c["nccl_rs_gbps"] * 1e6) + sum_ms
        chunk_ms = full / w / (c["ce_gbps"] * 1e6)
        reduce_ms = full / (c["reduce_gbps"] * 1e6)  # W slots of one chunk = full bytes
        for label, p in candidates_for(task).items():
            if p.get("accumulate"):  # no term for the pulls: taken only where measured
                continue
            if p.get("transfer") == "sm":  # the pull beside the GEMM; the last chunk's after it
                nsm = p["comm_sms"]
                g = _gemm_ms(m, k, n, triton=True) * c["num_sms"] / (c["num_sms"] - nsm)
                pull = full * (w - 1) / w / (c["sm_gbps"] * min(1.1, (nsm / 16) ** 0.5) * 1e6)
                out[label] = (max(g, pull) + min(g, pull) / p["chunks"]
                              + c["triton_overhead_ms"] + copy_ms)
                continue
            g = _gemm_ms(rows, k, n)
            if p["gemm"] == "triton":  # one Triton launch per chunk: ~0.1 ms of host time each
                g = max(g / 0.95, 0.1)
            # chunk i is pushed after its GEMM; pushes queue behind each other on the link
            t_push = 0.0
            for i in range(1, w):
                t_push = max(t_push, i * g) + chunk_ms
            out[label] = max(max(w * g, t_push) + reduce_ms + copy_ms, c["host_floor_ms"])
    return out


def plan_label(plan: Optional[FusedPlan]) -> Optional[str]:
    return plan.label if plan is not None else None


class MeasuredDecision(NamedTuple):
    """The choice at a shape measured on the task's world size (scheduler/measured_plans.py):
    the fastest fused candidate there (`fastest`), whether it beat NCCL + cuBLAS by
    MEASURED_MIN_GAIN (`label`: else None), both times with the rewrite's extra costs."""

    fastest: str
    label: Optional[str]
    fused_ms: float
    unfused_ms: float
    summary: str


# Measured (per-call medians, the slowest rank), not predicted: the margin covers run-to-run
# noise (~2% between runs of the same table), not a model's error.
MEASURED_MIN_GAIN = 1.02


def measured_decision(task: Task) -> Optional[MeasuredDecision]:
    """The decision from the measured candidates at the nearest measured shape of the task's op,
    world size and dtype, or None where none is near or the option is off
    (ditron.measured_plans). Only candidates validated somewhere (VALIDATED_ON) are taken:
    bench_fused's check of each candidate's output passed for the SM-pull all-gathers too, yet in
    the Llama training step at TP 4 they gave wrong weight gradients (see VALIDATED_ON). The runs
    were launched eagerly; under CUDA graphs the same rows decide."""
    if not config.measured_plans:
        return None
    m, k, n = task.m_hint, size_hint(task.k), task.n_total
    row = measured_plans.nearest(task.op, task.world_size, task.dtype, m, k, n)
    cands = candidates_for(task)
    fastest = row and row.fastest(label for label in cands if label in VALIDATED_ON)
    if not fastest:
        return None
    # a row timed as the sum (its terms apart) holds the op's accumulation and the graph's add
    copy_ms, sum_ms = rewrite_costs(task if row.terms == 1 else dataclasses.replace(task, terms=1))
    fused = row.ms[fastest] + copy_ms
    unfused = row.ms[measured_plans.NCCL_CUBLAS] + sum_ms
    rm, rk, rn = row.shape
    summary = (f"measured on {task.world_size} ranks at {rm}x{rk}x{rn} ({row.source}): "
               f"NCCL+cuBLAS {unfused:.3f} ms, fastest fused {fastest} {fused:.3f} ms")
    label = fastest if unfused >= fused * MEASURED_MIN_GAIN else None
    return MeasuredDecision(fastest, label, fused, unfused, summary)


def _best_label(task: Task) -> str:
    """The fastest candidate measured at the task's shape and world size, else the one
    predicted fastest among those validated on this many ranks."""
    measured = measured_decision(task)
    if measured is not None:
        return measured.fastest
    skip = unvalidated(task.world_size)
    preds = {k: v for k, v in predict(task).items() if k not in skip}
    return min(candidates_for(task), key=lambda label: preds.get(label, float("inf")))


def candidate_plan(task: Task, label: str, **fields) -> FusedPlan:
    """The AG or RS candidate `label` as a plan resolved for the task's world size."""
    if task.op == ALL_GATHER_MATMUL:
        return from_params(AllGatherPlan, AG_CANDIDATES[label], label=label,
                           **fields).for_world(task.world_size)
    return from_params(ReduceScatterPlan, RS_CANDIDATES[label], label=label,
                       **fields).for_world(task.world_size)


def grouped_mm_params(task: Task) -> dict:
    """The MoE grouped GEMM's plan where it differs from GroupedMmPlan's defaults (128 x 256,
    rows and weights through TMA: 0.90x torch._grouped_mm's time at world size 1 on H100,
    benchmarks/results/moe_h100x1_tma.md): the combine on several ranks stores its rows in send
    order and puts them after its GEMM (staged_push: 0.85-0.87x NCCL + torch._grouped_mm's time
    on 2 H100s at Mixtral and DeepSeek-V3 sizes, where the push from the GEMM's epilogue took
    1.22-1.39x; moe_ep_h100x2_staged.md)."""
    if task.op == GROUPED_MM_ALL_TO_ALL and task.world_size > 1:
        return dict(staged_push=True)
    return {}


def fused_plan(task: Task, params: Optional[dict] = None) -> FusedPlan:
    """The fused plan for the task given the parameters a user or a test names: with none, or
    none that names the kind (gemm for AG/RS, algo for the all-reduce), the task's default (the
    best validated candidate, or the all-reduce plan by M) with them on top; else those alone."""
    params = dict(params or {})
    if task.op in (ALL_GATHER_SCALED_MM, SCALED_MM_REDUCE_SCATTER):
        cls, default = ((AllGatherPlan, FP8_AG_PARAMS) if task.op == ALL_GATHER_SCALED_MM
                        else (ReduceScatterPlan, FP8_RS_PARAMS))
        label = "" if "gemm" in params else FP8_LABEL
        merged = {**({} if "gemm" in params else default), **params}
        return from_params(cls, merged, label=label).for_world(task.world_size)
    if task.op == SCALED_MM_ALL_REDUCE:
        merged = {**({} if "algo" in params else cublas_all_reduce_params(task)), **params}
        return from_params(AllReducePlan, merged, label=merged["algo"]).for_world(
            task.world_size)
    if task.op in MOE_PATTERNS:  # one family: the grouped GEMM's tile, its defaults
        merged = {**grouped_mm_params(task), **params}
        return from_params(GroupedMmPlan, merged, label=merged.pop("label", "grouped_mm"))
    if task.op in (MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM):
        cls, selector, label = AllReducePlan, "algo", ""
        base = ({} if selector in params else cublas_all_reduce_params(task) if task.sums_terms
                else all_reduce_params(task))
    else:
        cls = AllGatherPlan if task.op == ALL_GATHER_MATMUL else ReduceScatterPlan
        selector = "gemm"
        label = "" if selector in params else _best_label(task)
        base = {} if selector in params else candidates_for(task)[label]
    merged = {**base, **params}
    if cls is AllReducePlan:
        label = merged["algo"]
    return from_params(cls, merged, label=label).for_world(task.world_size)


# GEMM + all-reduce: the plan by M and world size, thresholds where the measurements crossed
# over (docs/performance.md, "GEMM + all-reduce", has the figures and result files):
#   M <= PUSH_ALL_MAX_M: push_all (one network wait, a local sum; its traffic is W - 1 partials
#     per rank, too much from M=16 on 8 ranks); on up to LAMPORT_MAX_WORLD ranks M <=
#     LAMPORT_ALL_MAX_M: lamport_all (2 us below lamport at M=16 on 2 and 4 H100s, not at 32);
#   M <= LAMPORT_MAX_M on up to LAMPORT_MAX_WORLD ranks: lamport (no flags: the data carries its
#     own arrival); measured on 2 and 4 ranks only, so push on more;
#   M <= FUSED_MAX_M: push after the whole GEMM;
#   FUSED_MAX_M < M <= OVERLAP_MAX_M on up to OVERLAP_MAX_WORLD ranks: push beside the persistent
#     GEMM (overlap_params); measured on 4 ranks only;
#   above, or on more ranks: NCCL + cuBLAS (no fused kernel measured a gain).
# Launched eagerly, a fused call costs more host time than it saves below OVERLAP_EAGER_MIN_M:
# fused only where the graph is replayed as a CUDA graph.
# On up to COPY_ENGINE_MAX_WORLD ranks, from COPY_ENGINE_EAGER_MIN_M rows on launched eagerly
# and from COPY_ENGINE_GRAPH_MIN_M under CUDA graphs: copy_engine (cuBLAS row chunks on every
# SM, each chunk's partial copied to every peer by the copy engine beside the next chunk's GEMM,
# one kernel for the sum + residual + norm); W - 1 partials leave each rank, as much as NCCL's
# ring at 2 ranks.
FUSED_MAX_M = 512
PUSH_ALL_MAX_M = 8
LAMPORT_ALL_MAX_M, LAMPORT_MAX_M, LAMPORT_MAX_WORLD = 16, 128, 4
# push beside the GEMM on 4x H100, with the residual + RMSNorm, over NCCL + cuBLAS + Inductor's
# norm: Llama-3-8B o_proj / down_proj 1.07x / 1.33x at M 16384 (all_reduce_h100x4_two_shot.md),
# 1.07-1.09x / 1.34-1.35x at 32768; Llama-3-70B's 1.00-1.01x / 1.05-1.06x at 16384, 0.99-1.02x /
# 1.06-1.08x at 32768 (all_reduce_h100x4_m32k.md). The Llama prefill at TP 4, S 16384: fusions
# only 1.025-1.055x Inductor against 0.99-1.01x with NCCL there
# (e2e_llama_h100x4_prefill_tp4_m16k.md). Up to 32768 rows, the most measured
OVERLAP_MAX_M, OVERLAP_EAGER_MIN_M, OVERLAP_MAX_WORLD = 32768, 8192, 4
# copy_engine, measured on 2x H100 (Llama-3-8B's o_proj / down_proj + residual + RMSNorm,
# bench_all_reduce.py, host time hidden: 1.10-1.53x NCCL + cuBLAS + Inductor's norm at M
# 2048-16384, level with push beside the Triton GEMM; benchmarks/results/
# all_reduce_h100x2_copy_engine.md): launched eagerly in the Llama prefill at S 2048 the host
# fell behind (a fused call then cost ~0.3 ms more host time than cuBLAS + NCCL + the norm
# kernel; ~0.2 ms since): 0.74x Inductor, so from 4096 rows on (1.05x there,
# e2e_llama_h100x2_prefill_copy_engine.md)
COPY_ENGINE_EAGER_MIN_M, COPY_ENGINE_MAX_WORLD = 4096, 2
# Under CUDA graphs (no host time), same bench at M 1024-16384 (all_reduce_h100x2_copy_engine_
# graphs.md): 1.08-1.24x NCCL + cuBLAS + Inductor's norm from 1024 rows on, and level with or
# faster than push beside the Triton GEMM at every M (0.75-1.00x its time). In the Llama
# prefill under CUDA graphs (e2e_llama_h100x2_prefill_graphs_copy_engine.md) fusions only went
# from 1.035 to 1.044-1.061x Inductor at S 2048 and 1.053 to 1.072-1.079x at 4096, but from
# 1.042 to 1.029-1.035x at 1024: from 2048 rows on. Llama-3-70B's TP 2 sites (N 8192, K 14336 /
# 4096, all_reduce_h100x2_copy_engine_70b.md): 1.09-1.19x / 1.22-1.42x, eager and under graphs
COPY_ENGINE_GRAPH_MIN_M = 2048


def copy_engine_serves(task: Task) -> bool:
    """Whether the copy-engine runtime takes the task's shape (it declines wider rows than its
    sum kernel holds, and buffers past 32-bit offsets), as the size hints say."""
    n = task.n_total
    return n <= COPY_ENGINE_MAX_N and task.world_size * task.m_hint * n < 2 ** 31


def copy_engine_chunks(m: int, n: int, cuda_graphs: bool = False) -> int:
    """The copy-engine all-reduce's row chunks, from 2 to 8, by the partial's size in rows of
    N 4096 (M N / 4096): a chunk per 2048 of them launched eagerly, per 1024 under CUDA graphs.
    On 2x H100 at N 4096 8 chunks were 2-9% faster than 4 at 16384 rows (the last chunk's copy,
    which nothing hides, shorter); at 4096 and 8192 rows 4 and 8 chunks were 2-7% faster than
    half as many under CUDA graphs, and level launched eagerly, where each chunk costs host
    time; at 1024 rows 2 chunks were 8-29% faster than 4. At N 8192 (Llama-3-70B's TP 2 sites,
    all_reduce_h100x2_copy_engine_70b.md) twice the chunks per row were 3-7% faster eagerly at
    M 4096-8192, and under CUDA graphs 2-6% faster at M 2048 and -1 to +2.5% at 4096."""
    rows = m * n // 4096
    return max(2, min(8, rows // (1024 if cuda_graphs else 2048)))


def overlap_params(task: Task) -> dict:
    """push beside the persistent GEMM (prefill): with a long GEMM (K > 2048) the push gets 16
    SMs and 16 chunks, with a short one 32 SMs and 8 chunks (the best measured at K 3584 / 1024);
    32-warp programs with blocks of 16384 (bytes in flight per SM set the speed over NVLink)."""
    long_gemm = size_hint(task.k) > 2048
    return dict(algo="push", overlap=True, gemm="triton", chunks=16 if long_gemm else 8,
                progs=16 if long_gemm else 32, block=16384, warps=32)


def all_reduce_params(task: Task) -> dict:
    """Parameters of a fused GEMM + all-reduce plan given without any (DITRON_PLAN=fused)."""
    lamport = task.world_size <= LAMPORT_MAX_WORLD  # no flags: measured on up to 4 ranks
    if task.m_hint <= (LAMPORT_ALL_MAX_M if lamport else PUSH_ALL_MAX_M):
        return dict(algo="lamport_all" if lamport else "push_all")
    if task.m_hint <= LAMPORT_MAX_M and lamport:
        return dict(algo="lamport")
    if task.m_hint > FUSED_MAX_M and task.world_size <= OVERLAP_MAX_WORLD:
        return overlap_params(task)
    return dict(algo="push")


class AllReduceCosts(NamedTuple):
    """A fused GEMM + all-reduce plan's predicted time against NCCL + cuBLAS's: the compute of
    each at world size 1, measured (scheduler/measured.py), plus the communication each leaves
    exposed, from the link model."""

    fused_compute: float
    unfused_compute: float
    fused_exposed: float
    nccl: float

    @property
    def fused(self) -> float:
        return self.fused_compute + self.fused_exposed

    @property
    def unfused(self) -> float:
        return self.unfused_compute + self.nccl

    def describe(self) -> str:
        return (f"predicted fused {self.fused:.3f} ms (compute {self.fused_compute:.3f} measured "
                f"at world size 1 + {self.fused_exposed:.3f} exposed) vs NCCL + cuBLAS "
                f"{self.unfused:.3f} ms (compute {self.unfused_compute:.3f} measured + NCCL "
                f"{self.nccl:.3f})")


def all_reduce_costs(task: Task, plan: AllReducePlan,
                     cuda_graphs: bool) -> Optional[AllReduceCosts]:
    """The plan's and NCCL + cuBLAS's predicted times, or None where no world-1 measurement
    stands for the task's shape. Exposed communication (link model): NCCL's ring, 2 (W-1)/W of
    the partial at its bus bandwidth after its latency; the two-shot kernels move as much after
    the GEMM (beside it, overlap=True: the last chunk's share, and what of the push at its
    bandwidth beside the GEMM outlasts the GEMM), the one-shot ones (push_all, lamport_all) W - 1
    partials, the copy-engine plan the copies of its last chunk."""
    costs = measured.world1_costs(task.op, family(plan), cuda_graphs, task.m_hint,
                                  size_hint(task.k), task.n_total)
    if costs is None:
        return None
    c, w = calibration(task.world_size), task.world_size
    partial_gb = task.m_hint * task.n_total * _itemsize(task) / 1e9
    ring_gb = 2 * (w - 1) / w * partial_gb
    ring_ms = ring_gb / c["nccl_ar_busbw_gbps"] * 1e3
    if plan.algo in ("push_all", "lamport_all"):
        moved_ms = (w - 1) * partial_gb / c["nccl_ar_busbw_gbps"] * 1e3
    elif plan.algo == COPY_ENGINE:  # the last chunk's copies to every peer, on the copy engine
        moved_ms = (w - 1) * partial_gb / c["ce_gbps"] * 1e3 / plan.chunks
    elif plan.overlap:  # the last chunk's share, and what of the push outlasts the GEMM
        beside_ms = ring_gb / c["push_beside_gbps"] * 1e3
        moved_ms = ring_ms / plan.chunks + max(0.0, beside_ms - costs.fused_ms)
    else:
        moved_ms = ring_ms
    return AllReduceCosts(costs.fused_ms, costs.unfused_ms, moved_ms + c["fused_latency_ms"],
                          ring_ms + c["nccl_latency_ms"])


def all_reduce_plan(task: Task, cuda_graphs: bool) -> tuple[Optional[AllReducePlan], str]:
    """(plan, why) for the GEMM + all-reduce ops: where a fused kernel measured a gain on the
    GPU machines (the thresholds above), and then only if the world-1 compute table and the link
    model predict it faster than NCCL + cuBLAS by MIN_GAIN."""
    keep = "NCCL + cuBLAS (DITRON_PLAN=fused forces the fused kernels)"
    m, world = task.m_hint, task.world_size
    copy_engine_min_m = COPY_ENGINE_GRAPH_MIN_M if cuda_graphs else COPY_ENGINE_EAGER_MIN_M
    if world <= COPY_ENGINE_MAX_WORLD and m >= copy_engine_min_m and copy_engine_serves(task):
        chunks = copy_engine_chunks(m, task.n_total, cuda_graphs)
        plan = fused_plan(task, dict(algo=COPY_ENGINE, chunks=chunks))
        return _costed_all_reduce_plan(task, plan, cuda_graphs,
                                       "copies beside the GEMM's row chunks", keep)
    overlap = FUSED_MAX_M < m <= OVERLAP_MAX_M and world <= OVERLAP_MAX_WORLD
    if m > FUSED_MAX_M and not overlap:
        bound = OVERLAP_MAX_M if world <= OVERLAP_MAX_WORLD else FUSED_MAX_M
        return None, (f"M={m} > {bound}: no fused kernel measured a gain over NCCL at "
                      f"this size on {world} ranks: {keep}")
    if not cuda_graphs and not (overlap and m >= OVERLAP_EAGER_MIN_M):
        return None, ("launched eagerly the fused kernel costs more host time than it saves; "
                      f"with CUDA graphs (mode='reduce-overhead') it is fused: {keep}")
    return _costed_all_reduce_plan(task, fused_plan(task), cuda_graphs,
                                   "beside the GEMM" if overlap else "", keep)


def _costed_all_reduce_plan(task: Task, plan: AllReducePlan, cuda_graphs: bool, where: str,
                            keep: str) -> tuple[Optional[AllReducePlan], str]:
    """(plan, why): the plan where the world-1 compute table and the link model predict it
    faster than NCCL + cuBLAS by MIN_GAIN, or where no world-1 measurement stands for the shape;
    else (None, why)."""
    how = "replayed in a CUDA graph" if cuda_graphs else "eager, host time hidden at this size"
    costs = all_reduce_costs(task, plan, cuda_graphs)
    if costs is None:
        predicted = f"no world-1 measurement near this shape ({measured.source()})"
    elif costs.fused * MIN_GAIN > costs.unfused:
        return None, f"no predicted gain: {costs.describe()}: {keep}"
    else:
        predicted = costs.describe()
        plan = dataclasses.replace(plan, predicted_ms=(("nccl_cublas", costs.unfused),
                                                       ("fused", costs.fused)))
    return plan, (f"fused plan {plan.algo}{' ' + where if where else ''} (M={task.m_hint}, "
                  f"{how}; {predicted})")


# FP8 (the scaled ops): the bf16 plans whose GEMM is cuBLAS, each GEMM a _scaled_mm into the
# same buffers (runtime/scaled.py): the all-gather's on groups of chunks in arrival order (moving
# one byte an element), the reduce-scatter's copy-engine plan per rank's rows (its reduce="triton"
# preferred as RS_CANDIDATES's tie order does), the all-reduce's plan by M (all_reduce_params) with
# a cuBLAS GEMM. The all-gather's and reduce-scatter's are measured end to end only
# (benchmarks/results/e2e_llama_fp8_h200x2_fused.md: Llama-3-8B layers' float8 training step at TP
# 2, B 1 x S 8192 rows, eager launch, every fp8 gather and scatter on these plans: 1.045x
# Inductor's step, 1.042x async TP's, the numbers as far from Inductor's as async TP's), so the
# scheduler chooses them there only: 2 ranks, M >= 8192, eager launch (the all-gather declines
# under CUDA-graph capture), each rank's rows one block. At every fp8 site there: per site
# (benchmarks/results/fp8_tp_h200x2.md) the plans lose at the q/k/v, gate/up and down
# output-gradient gathers, but leaving those to NCCL made the step slower, 86.16 vs 84.45 ms
# fused everywhere (e2e_llama_fp8_h200x2_per_site_gate.md, two runs): the isolated times do not
# decide the fp8 sites. The all-reduce's: never (DITRON_PLAN=fused does).
FP8_LABEL = "cublas_scaled_mm"
FP8_CHOSEN_WORLD, FP8_CHOSEN_MIN_M = 2, 8192
FP8_AG_PARAMS, FP8_RS_PARAMS = dict(gemm="cublas"), dict(gemm="cublas", reduce="triton")
_FUSED_PLAN_OPS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE,
                   MATMUL_ALL_REDUCE_RMSNORM, *SCALED_MM_PATTERNS, *MOE_PATTERNS)


def cublas_all_reduce_params(task: Task) -> dict:
    """all_reduce_params with a cuBLAS GEMM, for the scaled op and a sum of matmul products (the
    persistent Triton GEMM takes no float8, and one term): beside push (prefill sizes), cuBLAS in
    row chunks, as many as AllReducePlan.for_world gives it (the chunks all_reduce_params names
    are the Triton GEMM's)."""
    params = {**all_reduce_params(task), "gemm": "cublas"}
    if params.get("overlap"):
        del params["chunks"]
    return params


def has_fused_plan(op: str) -> bool:
    """Whether some fused plan runs the op on CUDA (one the scheduler may not choose yet)."""
    return op in _FUSED_PLAN_OPS


def scaled_mm_plan(task: Task, cuda_graphs: bool) -> tuple[Optional[FusedPlan], str]:
    """(plan, why) for the FP8 ops: the fused plan where it was measured (see FP8_CHOSEN_WORLD),
    else None, what runs instead and how to ask for the fused plan."""
    fused = {ALL_GATHER_SCALED_MM: "_scaled_mm per group of gathered chunks",
             SCALED_MM_REDUCE_SCATTER: "_scaled_mm per rank's rows, each pushed by the copy "
                                       "engine",
             SCALED_MM_ALL_REDUCE: "_scaled_mm into the partial, then the all-reduce kernel "
                                   "for M"}[task.op]
    keep = ("the graph keeps the collective + _scaled_mm (DITRON_PLAN=reference runs the op's "
            "reference, DITRON_PLAN=fused that plan)")
    if task.op == SCALED_MM_ALL_REDUCE:
        return None, f"the fp8 plan ({FP8_LABEL}: {fused}) is not timed on GPUs yet: {keep}"
    measured = (f"measured end to end on {FP8_CHOSEN_WORLD} ranks, M >= {FP8_CHOSEN_MIN_M}, "
                "eager launch (the float8 Llama training step with every fp8 site fused: 1.045x "
                "Inductor's on 2x H200)")
    if (task.world_size == FP8_CHOSEN_WORLD and task.m_hint >= FP8_CHOSEN_MIN_M
            and not cuda_graphs and task.rank_chunks_contiguous):
        plan = fused_plan(task)
        return plan, f"fused plan {plan.label} ({fused}): {measured}"
    return None, f"the fp8 plan ({FP8_LABEL}: {fused}) is chosen only as {measured}: {keep}"


# The MoE ops on more than one rank. The fused grouped GEMM (templates/grouped_gemm.py) runs at
# world size 1, where a plan names it (benchmarks/bench_moe.py: 0.90x torch._grouped_mm's time
# with its default tile on H100). On more ranks the dispatch (runtime/moe_dispatch.py) and the
# combine (runtime/moe_combine.py) are correct on 2x H100, 2x H200 and (the dispatch) 4x H100;
# the graph keeps NCCL + grouped GEMM for both, because no model step got faster: with the route
# kernels the dispatch is level to 1.20x NCCL + torch._grouped_mm's time and the staged combine
# 0.82-0.95x (2x H100, benchmarks/results/moe_ep_h100x4_routes.md), but in transformers'
# Mixtral training step (2 layers, EP 2, 4096 and 8192 tokens per rank) both fused are 1.02x
# Inductor's step and the combine alone 0.994-1.002x (e2e_moe_h100x4_mixtral.md): the exchange
# is too small a part of the step. The token counts are unbacked SymInts at compile time: a plan
# chosen for some of them would carry GroupedMmPlan.min_rows, which the runtime applies per call
# alike on every rank. `ditron.plan=fused` fuses them (decide.py; e2e_moe.py's contenders).
MOE_NOT_FUSED = ("{op}: {why} (ditron.plan=fused fuses it): NCCL all-to-all + "
                 "torch._grouped_mm")
MOE_WHY = {
    ALL_TO_ALL_GROUPED_MM: ("the fused dispatch measured level to slower than NCCL all-to-all + "
                            "torch._grouped_mm on 2x H100 (0.99-1.20x its time, "
                            "moe_ep_h100x4_routes.md) and 1.02x Inductor's step with the "
                            "combine in transformers' Mixtral (e2e_moe_h100x4_mixtral.md)"),
    GROUPED_MM_ALL_TO_ALL: ("the fused combine measured 0.82-0.95x NCCL all-to-all + "
                            "torch._grouped_mm's time on 2x H100 (moe_ep_h100x4_routes.md) but "
                            "level in transformers' Mixtral training step (0.994-1.002x "
                            "Inductor's, e2e_moe_h100x4_mixtral.md)"),
}


def moe_not_fused(op: str) -> str:
    """Why the graph keeps NCCL + grouped GEMM at an MoE op on CUDA."""
    return MOE_NOT_FUSED.format(op=op, why=MOE_WHY[op])


def world1_compute_note(task: Task, plan: FusedPlan, cuda_graphs: bool) -> str:
    """The plan's compute measured at world size 1 beside the unfused compute (the nearest shape
    of scheduler/measured.py's table), for the log only: the AG/RS predictions come from the
    link and GEMM model fitted to the multi-GPU tables, which prices the fused plans' GEMMs and
    copies as the unfused ones; the reader sees what they cost on one GPU."""
    costs = measured.world1_costs(task.op, family(plan), cuda_graphs, task.m_hint,
                                  size_hint(task.k), task.n_total)
    if costs is None:
        return ""
    return (f"; compute measured at world size 1: fused {costs.fused_ms:.3f} vs unfused "
            f"{costs.unfused_ms:.3f} ms")


def choose_device_plan(task: Task, cuda_graphs: bool = False) -> tuple[Optional[FusedPlan], str]:
    """(plan, why). A None plan means: leave the graph as it was (no predicted gain).
    cuda_graphs: the compiled graph is replayed as a CUDA graph (Inductor's cudagraphs)."""
    if task.op in SCALED_MM_PATTERNS:
        return scaled_mm_plan(task, cuda_graphs)
    if task.op in (MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM):
        return all_reduce_plan(task, cuda_graphs)
    if task.op in MOE_PATTERNS:
        return None, moe_not_fused(task.op)
    # Where no fused kernel applies, the graph keeps NCCL + cuBLAS, which Inductor can still
    # schedule, rather than the same work hidden inside an opaque reference op.
    if task.op not in (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER):
        return None, f"no fused CUDA kernel for {task.op} yet"
    if not task.rank_chunks_contiguous:
        return None, (f"the fused kernels take each rank's chunk as one block of rows; "
                      f"dim {task.dim} with a leading dim > 1 interleaves them")
    measured = measured_decision(task)
    if measured is not None:
        if measured.label is None:
            return None, f"no measured gain: {measured.summary}"
        plan = dataclasses.replace(candidate_plan(task, measured.label), predicted_ms=(
            ("nccl_cublas", measured.unfused_ms), ("fused", measured.fused_ms)))
        return plan, f"fused plan {measured.label}: {measured.summary}"
    skip = unvalidated(task.world_size)
    preds = {k: v for k, v in predict(task).items() if k not in skip}
    base = preds.pop("nccl_cublas")
    if not preds:
        return None, f"every candidate skipped (ditron.skip_plans) or unvalidated on " \
                     f"{task.world_size} ranks"
    best = min(preds, key=preds.get)
    plan = candidate_plan(task, best)
    summary = (f"predicted NCCL+cuBLAS {base:.3f} ms, best fused {best} {preds[best]:.3f} ms"
               f"{world1_compute_note(task, plan, cuda_graphs)}")
    if preds[best] * MIN_GAIN > base:
        return None, f"no predicted gain: {summary}"
    plan = dataclasses.replace(plan, predicted_ms=(("nccl_cublas", base), ("fused", preds[best])))
    return plan, f"fused plan {best}: {summary}"
