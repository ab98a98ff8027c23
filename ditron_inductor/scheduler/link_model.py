"""The link model: predicted ms per call of each contender at a task, as pure functions of the
Task and the link constants of evidence/link.json (`link`, one calibration's dict).

It prices the GEMMs by a cuBLAS rate with a small-M penalty, the transfers by the bandwidth of
what moves them (NCCL, the copy engine, the push kernels), and adds the host time of a fused
call and the copies the rewrite adds around the op. Only shapes, dtype and world size enter, so
every rank predicts the same.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from .plan import COPY_ENGINE, AllReducePlan
from .task import ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, Task, size_hint


def _itemsize(task: Task) -> int:
    return getattr(task.dtype, "itemsize", 2)


def gemm_ms(link: dict, m: int, k: int, n: int, triton: bool = False) -> float:
    """One bf16 GEMM [m, k] @ [k, n]: cuBLAS's rate, less efficient below cublas_small_m_rows;
    the persistent TMA Triton GEMM relative to cuBLAS by N (faster only on long, wide ones)."""
    eff = min(1.0, m / link["cublas_small_m_rows"]) ** 0.25
    ms = 2.0 * m * k * n / (link["cublas_tflops"] * 1e12 * eff) * 1e3
    if triton:
        ms /= 1.05 if n >= 3584 and m >= 8192 else (0.94 if n >= 2048 else 0.82)
    return ms


def rewrite_costs(task: Task, link: dict) -> tuple[float, float]:
    """(ms of the rewrite's copies around the fused op and of its sum's accumulation, ms of the
    sum of products that the unfused graph adds): what neither side's time on one matmul holds.
    The fused op reads its output rows once more per further term (cuBLAS with beta = 1); the
    graph's adds read every product and write the sum."""
    b = _itemsize(task)
    elems = task.m_hint * task.n_total
    gbps = link["copy_gbps"] * 1e6
    accumulated = (task.terms - 1) * elems if task.sums_terms else 0
    copy_ms = (2 * size_hint(task.copy_elems) + accumulated) * b / gbps
    sum_ms = (task.terms + 1) * elems * b / gbps if task.terms > 1 else 0.0
    return copy_ms, sum_ms


def _all_gather_ms(task: Task, link: dict, params: dict) -> float:
    w, m, k, n = task.world_size, task.m_hint, size_hint(task.k), task.n_total
    chunk_ms = m * k * _itemsize(task) / w / (link["ce_gbps"] * 1e6)  # one peer's chunk
    if params["gemm"] == "triton":  # its tiles wait for the chunks the copy engine pulls
        g = gemm_ms(link, m, k, n, triton=True) * (1.0 if params["block_n"] == 256 else 1.04)
        return max(g, (w - 1) * chunk_ms + g / w) + link["triton_overhead_ms"]
    t, arrived, rows = 0.0, 1, max(1, m // w)  # cuBLAS per group, after its last chunk
    for size in params["groups"]:
        if arrived > w:
            break
        last = min(arrived + size - 1, w)
        t = max(t, (last - 1) * chunk_ms) + gemm_ms(link, (last - arrived + 1) * rows, k, n)
        arrived = last + 1
    return t * link["cublas_groups_factor"]


def _reduce_scatter_ms(task: Task, link: dict) -> float:
    """cuBLAS per destination chunk, each pushed after its GEMM (the pushes queue on the link),
    then the reduction of the W received partials."""
    w, m, k, n = task.world_size, task.m_hint, size_hint(task.k), task.n_total
    full = m * n * _itemsize(task)
    chunk_ms = full / w / (link["ce_gbps"] * 1e6)
    g = gemm_ms(link, max(1, m // w), k, n)
    t_push = 0.0
    for i in range(1, w):
        t_push = max(t_push, i * g) + chunk_ms
    return max(w * g, t_push) + full / (link["reduce_gbps"] * 1e6)


def unfused_ms(task: Task, link: dict) -> float:
    """NCCL + cuBLAS on one matmul, with the sum of products the unfused graph adds."""
    m, k, n, b = task.m_hint, size_hint(task.k), task.n_total, _itemsize(task)
    if task.op == ALL_GATHER_MATMUL:
        return m * k * b / (link["nccl_ag_gbps"] * 1e6) + gemm_ms(link, m, k, n)
    _, sum_ms = rewrite_costs(task, link)
    return gemm_ms(link, m, k, n) + m * n * b / (link["nccl_rs_gbps"] * 1e6) + sum_ms


def predict(task: Task, link: dict, candidates: Iterable[tuple[str, dict]]) -> dict[str, float]:
    """Predicted ms per call of each (label, params) AG or RS candidate, at least the host time
    of one fused call."""
    assert task.op in (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER), task.op
    copy_ms, _ = rewrite_costs(task, link)
    out = {}
    for label, params in candidates:
        t = (_all_gather_ms(task, link, params) if task.op == ALL_GATHER_MATMUL
             else _reduce_scatter_ms(task, link))
        out[label] = max(t + copy_ms, link["host_floor_ms"])
    return out


class AllReduceCosts(NamedTuple):
    """A fused GEMM + all-reduce plan's predicted time against NCCL + cuBLAS's: the compute of
    each at world size 1, measured (evidence.world1_costs), plus the communication each leaves
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


def all_reduce_costs(task: Task, plan: AllReducePlan, link: dict, fused_compute: float,
                     unfused_compute: float) -> AllReduceCosts:
    """Exposed communication beside each side's world-1 compute. NCCL's ring moves 2 (W-1)/W of
    the partial at its bus bandwidth after its latency; push moves as much after the GEMM (beside
    it, overlap=True: the last chunk's share, and what of the push at its bandwidth beside the
    GEMM outlasts the GEMM), the one-shot kernels (push_all, lamport_all) W - 1 partials, the
    copy-engine plan the copies of its last chunk."""
    w = task.world_size
    partial_gb = task.m_hint * task.n_total * _itemsize(task) / 1e9
    ring_gb = 2 * (w - 1) / w * partial_gb
    ring_ms = ring_gb / link["nccl_ar_busbw_gbps"] * 1e3
    if plan.algo in ("push_all", "lamport_all"):
        moved_ms = (w - 1) * partial_gb / link["nccl_ar_busbw_gbps"] * 1e3
    elif plan.algo == COPY_ENGINE:
        moved_ms = (w - 1) * partial_gb / link["ce_gbps"] * 1e3 / plan.chunks
    elif plan.overlap:
        beside_ms = ring_gb / link["push_beside_gbps"] * 1e3
        moved_ms = ring_ms / plan.chunks + max(0.0, beside_ms - fused_compute)
    else:
        moved_ms = ring_ms
    return AllReduceCosts(fused_compute, unfused_compute, moved_ms + link["fused_latency_ms"],
                          ring_ms + link["nccl_latency_ms"])
