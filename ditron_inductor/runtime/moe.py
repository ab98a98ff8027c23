"""The MoE ops' fused path: the experts' grouped GEMM (templates/grouped_gemm.py) reading its
rows through the dispatch's index and writing them through the combine's.

At world size 1 the all-to-all is the identity over ranks:
  dispatch  rows = x[row_index] (x when None), outs_i = grouped_mm(rows, W_i). With plan.tma_a
            one index_select gathers the rows and every GEMM reads them through TMA; else the
            first weight's GEMM gathers and stores them.
  combine   y = grouped_mm(left, W), row j to row row_index[j] of zeros [sum(splits), N]
            (accumulate: fp32 atomic adds, cast once), or y itself.
On more ranks: moe_dispatch.py and moe_combine.py. The scheduler plans neither op fused on its
own (no model step gained); they run where a plan names them. A sum of several grouped GEMMs
(a backward's gate + up) declines on any world size. Declines, and the first call a plan
serves, log at debug level (TORCH_LOGS=ditron).
"""

from __future__ import annotations

import logging

import torch

from ..log_names import LOGGER_NAME
from ..scheduler.plan import GroupedMmPlan
from ..scheduler.task import Task
from . import moe_combine, moe_dispatch
from .kernel_launch import cdiv, launch, next_power_of_2
from .launch import DTYPES, decline, num_sms

log = logging.getLogger(LOGGER_NAME)

# calls the fused path served: tests and benchmarks check that it ran, not the fallback
stats = {"all_to_all_grouped_mm": 0, "grouped_mm_all_to_all": 0}
_served_logged: set = set()


def _served(task: Task, plan: GroupedMmPlan) -> None:
    stats[task.op] += 1
    key = (task.op, plan)
    if key not in _served_logged:
        _served_logged.add(key)
        log.debug("%s: served by the fused grouped GEMM (%s)", task.describe(), plan.describe())


def _programs(plan: GroupedMmPlan, device: torch.device) -> int:
    if plan.progs:
        return plan.progs
    return num_sms(device) if device.type == "cuda" else 4


def grouped_gemm(plan: GroupedMmPlan, a, weight, offsets, c, *, rows: int, a_index=None,
                 rows_out=None, c_index=None, scale=None, accumulate: bool = False,
                 wait=None) -> None:
    """c (+)= the grouped GEMM of `rows` rows (row i: a[a_index[i]] or a[i]) by weight [E, K, N]
    per offsets, product row i (times scale[i]) to c[c_index[i]] or c[i]; rows_out: the rows
    read, stored there. wait (the multi-rank dispatch): (tile counters, expect, err word,
    limit), each tile first waits for counters[tile] >= expect[tile]."""
    experts, k, n = weight.shape
    if rows == 0 or n == 0:
        return
    bm, bn = plan.block_m, plan.block_n
    tiles = (cdiv(rows, bm) + experts) * cdiv(n, bn)
    progs = max(1, min(_programs(plan, a.device), tiles))
    unused = c  # pointer arguments a variant does not read
    b, b_desc = weight, 0
    if plan.tma_b:
        b, b_desc = weight_descriptor(weight, plan)
    a_desc = rows_descriptor(a, plan) if plan.tma_a and a_index is None else None
    launch(grouped_gemm_kernel(), (progs,),
           a, unused if a_desc is None else a_desc, unused if a_index is None else a_index, b,
           offsets, c,
           unused if c_index is None else c_index, unused if scale is None else scale,
           unused if rows_out is None else rows_out, *(wait[:3] if wait else (offsets,) * 3),
           rows, n, k, experts,
           a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
           c.stride(0), c.stride(1), wait[3] if wait else 0,
           GATHER=a_index is not None, WRITE_ROWS=rows_out is not None,
           SCATTER=c_index is not None, SCALE=scale is not None, ACCUMULATE=accumulate,
           WAIT=wait is not None, BLOCK_M=bm, BLOCK_N=bn,
           BLOCK_K=plan.block_k, E_P2=next_power_of_2(experts), NUM_PROGS=progs,
           GROUP_M=plan.group_m, B_DESC=b_desc, A_DESC=a_desc is not None,
           PROXY_FENCE=a_desc is not None and wait is not None and a.device.type == "cuda",
           num_warps=plan.warps, num_stages=plan.stages)


def _tensor_descriptor():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def rows_descriptor(a, plan: GroupedMmPlan):
    """A TMA descriptor over a [R, K] (block_m x block_k), or None (pointers) where TMA cannot
    take its layout: 16-byte aligned base and rows, unit column stride."""
    descriptor = _tensor_descriptor()
    r = a.shape[0]
    if (descriptor is None or a.stride(1) != 1 or a.data_ptr() % 16
            or a.stride(0) * a.element_size() % 16 or r == 0 or r >= 2 ** 31):
        return None
    return descriptor.from_tensor(a, [plan.block_m, plan.block_k])


def weight_descriptor(weight, plan: GroupedMmPlan):
    """(a TMA descriptor over the weight's 2-d view, its B_DESC kind): [E, K, N] row-major as
    [E * K, N] where block_k divides K (no K block reaches into the next expert), nn.Linear's
    [E, N, K] as [E * N, K], 16-byte aligned; else (weight, 0): pointers."""
    from ..templates.grouped_gemm import B_ROWS_K, B_ROWS_N

    TensorDescriptor = _tensor_descriptor()
    if TensorDescriptor is None:
        return weight, 0
    e, k, n = weight.shape
    if weight.data_ptr() % 16 or e * max(k, n) >= 2 ** 31:
        return weight, 0
    if weight.stride() == (k * n, n, 1) and n % 8 == 0 and k % plan.block_k == 0:
        return (TensorDescriptor.from_tensor(weight.reshape(e * k, n),
                                             [plan.block_k, plan.block_n]), B_ROWS_K.value)
    if weight.stride() == (k * n, 1, k) and k % 8 == 0:
        return (TensorDescriptor.from_tensor(weight.transpose(-2, -1).reshape(e * n, k),
                                             [plan.block_n, plan.block_k]), B_ROWS_N.value)
    return weight, 0


def grouped_gemm_kernel():
    from ..templates.grouped_gemm import grouped_gemm_kernel as kernel

    return kernel


def _experts_problem(rows_dtype, k: int, weights, offsets) -> str:
    """Why the grouped GEMM cannot take these weights and offsets ("" if it can)."""
    if rows_dtype not in DTYPES:
        return f"dtype {rows_dtype}"
    experts = weights[0].shape[0] if weights else 0
    for w in weights:
        if w.dim() != 3 or w.shape[0] != experts or w.shape[1] != k or w.dtype != rows_dtype:
            return f"weight {tuple(w.shape)} {w.dtype} for rows of {k} {rows_dtype}"
        if w.device != offsets.device:
            return "weights and offsets on different devices"
    if offsets.dim() != 1 or offsets.shape[0] != experts or offsets.dtype != torch.int32:
        return f"offsets {tuple(offsets.shape)} {offsets.dtype} for {experts} experts"
    if not offsets.is_contiguous():
        return "offsets not contiguous"
    return ""


def _index_problem(index, rows: int) -> str:
    if index is None:
        return ""
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        return f"row index {tuple(index.shape)} {index.dtype}"
    if not index.is_contiguous() or index.shape[0] != rows:
        return "row index not contiguous, or not one entry per row"
    return ""


def all_to_all_grouped_mm_fused(task: Task, plan: GroupedMmPlan, x, output_split_sizes,
                                input_split_sizes, row_index, weights, offsets, group_name,
                                world_size):
    if x.dim() != 2 or not weights:
        return decline(f"x of {x.dim()} dims, {len(weights)} weights")
    if world_size != 1:
        problem = _experts_problem(x.dtype, x.shape[1], weights, offsets)
        if problem:
            return decline(problem)
        plan = plan.for_rows(x.shape[0], weights[0].shape[0])
        outputs = moe_dispatch.dispatch(plan, x, output_split_sizes, input_split_sizes,
                                        row_index, weights, offsets, group_name, world_size,
                                        grouped_gemm)
        if outputs is not None:
            _served(task, plan)
        return outputs
    received = x.shape[0]
    if list(output_split_sizes) != [received] or list(input_split_sizes) != [received]:
        return decline(f"splits {output_split_sizes}/{input_split_sizes} for {received} rows")
    rows = row_index.shape[0] if row_index is not None else received
    problem = _experts_problem(x.dtype, x.shape[1], weights, offsets) or _index_problem(
        row_index, rows)
    if problem:
        return decline(problem)
    k = x.shape[1]
    rows_out = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    outs = [torch.empty((rows, w.shape[-1]), dtype=x.dtype, device=x.device) for w in weights]
    if rows and k == 0:
        rows_out.zero_()
        return [rows_out] + [o.zero_() for o in outs]
    gathered = plan.tma_a
    if gathered:  # in order first, so that every GEMM reads them through TMA
        if row_index is None:
            rows_out.copy_(x)
        else:
            torch.index_select(x, 0, row_index, out=rows_out)
    for i, (w, out) in enumerate(zip(weights, outs)):
        if i == 0 and not gathered:  # gathers x's rows, storing them as it reads
            grouped_gemm(plan, x, w, offsets, out, rows=rows, a_index=row_index,
                         rows_out=rows_out)
        else:
            grouped_gemm(plan, rows_out, w, offsets, out, rows=rows)
    if outs[0].shape[1] == 0 and not gathered:  # no n-tile stored the rows
        rows_out.copy_(x if row_index is None else x[row_index])
    _served(task, plan)
    return [rows_out] + outs


def grouped_mm_all_to_all_fused(task: Task, plan: GroupedMmPlan, lefts, weights, offsets,
                                row_index, accumulate, output_split_sizes, input_split_sizes,
                                group_name, world_size):
    if len(lefts) != 1 or len(weights) != 1:
        return decline(f"a sum of {len(lefts)} grouped GEMMs")
    left, weight = lefts[0], weights[0]
    if left.dim() != 2:
        return decline(f"rows of {left.dim()} dims")
    rows, n = left.shape[0], weight.shape[-1]
    if world_size != 1:
        problem = _experts_problem(left.dtype, left.shape[1], weights, offsets)
        if problem:
            return decline(problem)
        plan = plan.for_rows(sum(output_split_sizes), weight.shape[0])
        out = moe_combine.combine(plan, left, weight, offsets, row_index, accumulate,
                                  output_split_sizes, input_split_sizes, group_name, world_size,
                                  grouped_gemm)
        if out is not None:
            _served(task, plan)
        return out
    sent = sum(input_split_sizes)
    if list(output_split_sizes) != [sent] or len(input_split_sizes) != 1:
        return decline(f"splits {output_split_sizes}/{input_split_sizes}")
    problem = _experts_problem(left.dtype, left.shape[1], weights, offsets) or _index_problem(
        row_index, rows)
    if problem:
        return decline(problem)
    if row_index is None:
        if sent != rows:
            return decline(f"{rows} rows sent as {sent}")
        out = torch.empty((rows, n), dtype=left.dtype, device=left.device)
        if left.shape[1] == 0:
            out.zero_()
        grouped_gemm(plan, left, weight, offsets, out, rows=rows)
    elif accumulate:  # several rows land on one: fp32 atomic adds, one cast
        acc = torch.zeros((sent, n), dtype=torch.float32, device=left.device)
        grouped_gemm(plan, left, weight, offsets, acc, rows=rows, c_index=row_index,
                     accumulate=True)
        out = acc.to(left.dtype)
    else:
        out = torch.zeros((sent, n), dtype=left.dtype, device=left.device)
        grouped_gemm(plan, left, weight, offsets, out, rows=rows, c_index=row_index)
    _served(task, plan)
    return out
