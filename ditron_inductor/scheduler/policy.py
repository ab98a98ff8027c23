"""The scheduler's policy: the thresholds where the measurements crossed over, each with why.

The figures behind each threshold are in the docs (performance, "Why the scheduler's thresholds
are where they are"); this module holds the rules alone. Every input is rank-invariant: shapes,
dtype, world size and whether the graph is replayed from a CUDA graph.
"""

from __future__ import annotations

from .plan import COPY_ENGINE_MAX_N
from .task import GROUPED_MM_ALL_REDUCE_PATTERNS, Task, size_hint

# A fused plan must be predicted this much faster than NCCL + cuBLAS: the margin covers the link
# model's error.
MIN_GAIN = 1.03
# Measured (per-call medians, the slowest rank) rather than predicted: the margin covers
# run-to-run noise only.
MEASURED_MIN_GAIN = 1.02
# Predicted with constants not measured on this card (no calibration, not a card of the shipped
# tables): each may be off by 1.5x there (another generation's bf16 GEMM rate can be under half,
# its links two thirds). At the Llama-3-8B/70B training sites on 2-8 ranks, gains predicted up to
# 1.44x turned into losses with one of the GEMM rate, the bandwidths or the host time 1.5x off.
UNCALIBRATED_MIN_GAIN = 1.5

# ------------------------------------------------------------------ GEMM + all-reduce, by M
# push_all: one network wait and a local sum, but W - 1 partials leave each rank: up to this M.
PUSH_ALL_MAX_M = 8
# lamport_all / lamport carry their own arrival in the data (no flags); measured on up to
# LAMPORT_MAX_WORLD ranks, so push on more.
LAMPORT_ALL_MAX_M, LAMPORT_MAX_M, LAMPORT_MAX_WORLD = 16, 128, 4
# push after the whole GEMM: up to this M; above it the GEMM is long enough to hide the push.
FUSED_MAX_M = 512
# push beside the persistent Triton GEMM: up to the most rows measured, on up to the most ranks
# measured; launched eagerly only from OVERLAP_EAGER_MIN_M rows, where the host time of a fused
# call is hidden behind the GEMM.
OVERLAP_MAX_M, OVERLAP_EAGER_MIN_M, OVERLAP_MAX_WORLD = 32768, 8192, 4
# copy_engine (cuBLAS row chunks on every SM, each chunk's partial copied to every peer by the
# copy engine beside the next chunk's GEMM): W - 1 partials leave each rank, as much as NCCL's
# ring only at 2 ranks; from 4096 rows launched eagerly (below, the host falls behind) and from
# 2048 under CUDA graphs (below, fusions only measured slower).
COPY_ENGINE_MAX_WORLD, COPY_ENGINE_EAGER_MIN_M, COPY_ENGINE_GRAPH_MIN_M = 2, 4096, 2048


def copy_engine_serves(task: Task) -> bool:
    """Whether the copy-engine runtime takes the task's shape (it declines wider rows than its
    sum kernel holds, and buffers past 32-bit offsets), as the size hints say."""
    n = task.n_total
    return n <= COPY_ENGINE_MAX_N and task.world_size * task.m_hint * n < 2 ** 31


def copy_engine_chunks(m: int, n: int, cuda_graphs: bool = False) -> int:
    """The copy-engine all-reduce's row chunks, 2 to 8, by the partial's size in rows of N 4096:
    one per 2048 of them launched eagerly (each chunk costs host time), per 1024 under CUDA
    graphs (a shorter last chunk, whose copy nothing hides)."""
    rows = m * n // 4096
    return max(2, min(8, rows // (1024 if cuda_graphs else 2048)))


def overlap_params(task: Task) -> dict:
    """push beside the persistent GEMM (prefill): a long GEMM (K > 2048) leaves the push 16 SMs
    and 16 chunks, a short one 32 SMs and 8 chunks; 32-warp programs with blocks of 16384
    (bytes in flight per SM set the speed over NVLink)."""
    long_gemm = size_hint(task.k) > 2048
    return dict(algo="push", overlap=True, gemm="triton", chunks=16 if long_gemm else 8,
                progs=16 if long_gemm else 32, block=16384, warps=32)


def pushes_beside_gemm(task: Task) -> bool:
    """Whether push beside the op's GEMM takes the task (prefill M, up to the world measured):
    the grouped-GEMM ops reduce a tensor the graph computed, and have no GEMM to hide it."""
    return (task.m_hint > FUSED_MAX_M and task.world_size <= OVERLAP_MAX_WORLD
            and task.op not in GROUPED_MM_ALL_REDUCE_PATTERNS)


def all_reduce_params(task: Task) -> dict:
    """The fused GEMM + all-reduce plan by M and world size (what DITRON_PLAN=fused takes)."""
    lamport = task.world_size <= LAMPORT_MAX_WORLD
    if task.m_hint <= (LAMPORT_ALL_MAX_M if lamport else PUSH_ALL_MAX_M):
        return dict(algo="lamport_all" if lamport else "push_all")
    if task.m_hint <= LAMPORT_MAX_M and lamport:
        return dict(algo="lamport")
    if pushes_beside_gemm(task):
        return overlap_params(task)
    return dict(algo="push")


def cublas_all_reduce_params(task: Task) -> dict:
    """all_reduce_params with a cuBLAS GEMM, for a sum of matmul products (the persistent Triton
    GEMM takes one term): beside push, cuBLAS in as many row chunks as AllReducePlan.for_world
    gives it."""
    params = {**all_reduce_params(task), "gemm": "cublas"}
    if params.get("overlap"):
        del params["chunks"]
    return params


# ------------------------------------------------------ GEMM + all-gather of its output
# Chosen from measured rows only: the shipped tables hold none (it was measured on one GPU, its
# chunked GEMM and concatenation beside cuBLAS), so without a calibration on several GPUs the
# graph keeps cuBLAS + NCCL unless ditron.plan=fused.
MATMUL_ALL_GATHER_WHY = ("the shipped tables hold none; torchrun -m "
                         "ditron_inductor.calibrate on several GPUs measures it")
# Its GEMM's row chunks: each chunk's push runs beside the next chunk's GEMM, the last one's
# exposed; one chunk per MATMUL_ALL_GATHER_CHUNK_ROWS rows, at most MATMUL_ALL_GATHER_MAX_CHUNKS,
# so that each chunk's GEMM keeps cuBLAS's full rate.
MATMUL_ALL_GATHER_CHUNK_ROWS, MATMUL_ALL_GATHER_MAX_CHUNKS = 1024, 4


def matmul_all_gather_chunks(m: int) -> int:
    return max(1, min(MATMUL_ALL_GATHER_MAX_CHUNKS, m // MATMUL_ALL_GATHER_CHUNK_ROWS))


# --------------------------------------------------------------- FP8: the scaled ops
# The all-gather's and reduce-scatter's cuBLAS plans, each GEMM a _scaled_mm, are measured end
# to end only, on 2 ranks from 8192 rows launched eagerly, where the float8 training step with
# every fp8 site fused beat Inductor's and async TP's; per site timings do not decide them (the
# step with the slower-looking sites left to NCCL was slower).
FP8_LABEL = "cublas_scaled_mm"
FP8_CHOSEN_WORLD, FP8_CHOSEN_MIN_M = 2, 8192
FP8_AG_PARAMS, FP8_RS_PARAMS = dict(gemm="cublas"), dict(reduce="triton")


def fp8_chosen(task: Task, cuda_graphs: bool) -> bool:
    """Where the fp8 AG/RS plans were measured to win (each rank's rows one block)."""
    return (task.world_size == FP8_CHOSEN_WORLD and task.m_hint >= FP8_CHOSEN_MIN_M
            and not cuda_graphs and task.rank_chunks_contiguous)


# ------------------------------------------------------------------------------ MoE
# On several ranks the fused dispatch and combine are correct but no model step got faster with
# them (the exchange is a small part of a step): the graph keeps NCCL all-to-all + the grouped
# GEMM unless ditron.plan=fused.
MOE_WHY = "no measured model step gained from it (see the docs' performance page)"

# The grouped GEMM's m-tile. An expert's rows end inside its last tile, which computes in full:
# where a rank routes at most this many rows per local expert (as many as it receives, routing
# balanced), the 64-row tile (plan.SMALL_EXPERT_TILE) measured faster than the 128-row default,
# which wins from twice as many.
SMALL_EXPERT_ROWS = 128

# The dispatch's GEMM engine on several ranks. Where the dispatch stores its rows output
# (training graphs) and a rank routes at least this many rows per local expert, torch's grouped
# GEMM after every row landed measured faster than the Triton tiles that wait for their rows
# and store them; with fewer rows, and in inference graphs, the tiles measured faster.
LIBRARY_DISPATCH_ROWS = 128

# Where the dispatch stores no rows output (inference graphs), the tiles measured faster at up
# to SMALL_EXPERT_ROWS rows per local expert (the 64-row tile) and from two 128-row tiles' rows
# on, and torch's grouped GEMM faster in between, where each expert's rows take two 128-row
# tiles, the last one part full.
LIBRARY_DISPATCH_BELOW_ROWS = 256

# The combine's GEMM engine on several ranks. Where a rank routes at least this many rows per
# local expert, torch._grouped_mm in expert order with the put sending each row by its send
# index measured at least as fast as the Triton tiles storing in send order, and faster where an
# expert's last 128-row tile is about half full; at 128 rows and fewer the tiles measured faster.
LIBRARY_COMBINE_ROWS = 160
