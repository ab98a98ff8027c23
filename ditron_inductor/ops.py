"""The ditron ops: one op per fused collective + matmul.

Each op is a `torch.library.custom_op` with a fake (meta) implementation, so Inductor and symbolic
shapes see it as one opaque kernel, and a reference implementation from functional collectives and
matmuls that runs on any device (CPU with gloo included) and is the ground truth in tests.

The fused CUDA implementations plug in at one place: `register_fused`. An op whose plan asks for a
fused kernel calls it with the plan (decoded once per distinct text); the fused implementation
returns None for an input its plan cannot serve (a layout or size its kernel does not handle), and
the op then takes the reference path instead of failing, and says so at debug level.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .log_names import LOGGER_NAME
from .scheduler.plan import FUSED, decode
from .scheduler.task import (
    ALL_GATHER_MATMUL,
    MATMUL_ALL_REDUCE,
    MATMUL_ALL_REDUCE_RMSNORM,
    MATMUL_REDUCE_SCATTER,
    Task,
    chunks_contiguous,
)

log = logging.getLogger(LOGGER_NAME)
c10d = torch.ops._c10d_functional
if torch.distributed.is_available():
    from torch._C._distributed_c10d import _resolve_process_group

# op name -> fused implementation: fn(task, plan, *op_args) -> outputs, or None to fall back.
_fused_impls: dict[str, Callable] = {}
_fallbacks_logged: set[tuple[str, str]] = set()


def register_fused(op_name: str) -> Callable[[Callable], Callable]:
    def wrap(fn: Callable) -> Callable:
        _fused_impls[op_name] = fn
        return fn

    return wrap


def check_group(group_name: str, world_size: int) -> None:
    """Fail with a message that names the problem when the graph's group does not match this
    process, instead of a hang or an opaque error inside a collective."""
    try:
        group = _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        raise RuntimeError(
            f"ditron: process group {group_name!r} of a compiled graph is not known in this "
            f"process (is torch.distributed initialised, and is this rank in the group?): {e}"
        ) from e
    if group.size() != world_size:
        raise RuntimeError(
            f"ditron: process group {group_name!r} has {group.size()} ranks, but the graph was "
            f"compiled for {world_size}; every rank of the group must run the same program"
        )


def _dispatch(task: Task, plan_text: str, reference: Callable, *args):
    plan = decode(plan_text)
    check_group(task.group_name, task.world_size)
    if plan.impl == FUSED and task.device_type == "cuda":
        _load_fused_impls()
        fused = _fused_impls.get(task.op)
        out = fused(task, plan, *args) if fused is not None else None
        if out is not None:
            return out
        key = (task.op, plan_text)
        if key not in _fallbacks_logged:
            _fallbacks_logged.add(key)
            log.debug("%s: plan %s could not serve this call; ran the reference path",
                      task.describe(), plan.describe())
    return reference(*args)


def _load_fused_impls() -> None:
    # Importing the runtime registers the CUDA implementations (templates + symmetric memory).
    if not _fused_impls:
        try:
            from . import runtime  # noqa: F401
        except ImportError as e:
            log.debug("fused implementations unavailable: %s", e)


def _all_gather(x: Tensor, gather_dim: int, group_name: str, world_size: int) -> Tensor:
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world_size, group_name))
    if gather_dim != 0:
        gathered = torch.cat(gathered.chunk(world_size, dim=0), dim=gather_dim)
    return gathered


def _matmul(a: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
    return torch.mm(a, w) if bias is None else torch.addmm(bias, a, w)


def _as_nd(out: Tensor, out_shape: Sequence[int]) -> Tensor:
    return out.view(list(out_shape)) if len(out_shape) else out


def _scattered_shape(shape: Sequence, scatter_dim: int, world_size: int) -> list:
    shape = list(shape)
    shape[scatter_dim] = shape[scatter_dim] // world_size
    return shape


# ---------------------------------------------------------------------------- all-gather -> matmul


def all_gather_matmul_task(a_shard: Tensor, weights: Sequence[Tensor], biases, gather_dim: int,
                           group_name: str, world_size: int) -> Task:
    gathered_rows = 1
    for i, s in enumerate(a_shard.shape[:-1]):
        gathered_rows = gathered_rows * (s * world_size if i == gather_dim else s)
    return Task(
        op=ALL_GATHER_MATMUL, group_name=group_name, world_size=world_size, m=gathered_rows,
        k=a_shard.shape[-1], ns=tuple(w.shape[1] for w in weights), dtype=a_shard.dtype,
        device_type=a_shard.device.type, dim=gather_dim,
        dim_size=a_shard.shape[gather_dim] * world_size,
        has_bias=tuple(b is not None for b in biases),
        rank_chunks_contiguous=chunks_contiguous(a_shard.shape, gather_dim),
    )


def all_gather_matmul_reference(a_shard, weights, biases, gather_dim, group_name, world_size):
    gathered = _all_gather(a_shard, gather_dim, group_name, world_size)
    a = gathered.reshape(-1, gathered.shape[-1])
    return [gathered] + [_matmul(a, w, b) for w, b in zip(weights, biases)]


@torch.library.custom_op("ditron::all_gather_matmul", mutates_args=())
def all_gather_matmul(
    a_shard: Tensor,
    weights: list[Tensor],
    biases: list[Optional[Tensor]],
    gather_dim: int,
    group_name: str,
    world_size: int,
    plan: str,
) -> list[Tensor]:
    """All-gather `a_shard` along `gather_dim` over the group, then multiply the gathered
    activation, flattened to [M, K], by each weight [K, N_i] (plus its bias).

    Returns [gathered activation (N-d, as the collective produces it), A @ W_0, A @ W_1, ...];
    the data crosses the wire once however many weights share it.
    """
    task = all_gather_matmul_task(a_shard, weights, biases, gather_dim, group_name, world_size)
    return _dispatch(task, plan, all_gather_matmul_reference,
                     a_shard, weights, biases, gather_dim, group_name, world_size)


@all_gather_matmul.register_fake
def _(a_shard, weights, biases, gather_dim, group_name, world_size, plan):
    shape = list(a_shard.shape)
    shape[gather_dim] = shape[gather_dim] * world_size
    gathered = a_shard.new_empty(shape)
    rows = gathered.numel() // shape[-1]
    return [gathered] + [a_shard.new_empty([rows, w.shape[1]]) for w in weights]


# ------------------------------------------------------------------------ matmul -> reduce-scatter


def matmul_collective_task(op: str, a: Tensor, b: Tensor, bias, out_shape, dim: int,
                           reduce_op: str, group_name: str, world_size: int) -> Task:
    shape = list(out_shape) if len(out_shape) else [a.shape[0], b.shape[1]]
    return Task(
        op=op, group_name=group_name, world_size=world_size, m=a.shape[0], k=a.shape[1],
        ns=(b.shape[1],), dtype=a.dtype, device_type=a.device.type, dim=dim,
        dim_size=shape[dim] if op == MATMUL_REDUCE_SCATTER else None,
        reduce_op=reduce_op, has_bias=(bias is not None,),
        rank_chunks_contiguous=chunks_contiguous(shape, dim),
    )


def matmul_reduce_scatter_reference(a, b, bias, out_shape, scatter_dim, reduce_op, group_name,
                                    world_size):
    out = _as_nd(_matmul(a, b, bias), out_shape)
    if scatter_dim != 0:
        out = torch.cat(out.chunk(world_size, dim=scatter_dim), dim=0)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(out.contiguous(), reduce_op, world_size,
                                                       group_name))


@torch.library.custom_op("ditron::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    out_shape: Sequence[int],
    scatter_dim: int,
    reduce_op: str,
    group_name: str,
    world_size: int,
    plan: str,
) -> Tensor:
    """(a @ b + bias), viewed as `out_shape` (empty: the 2-d product), reduce-scattered over the
    group along `scatter_dim` with `reduce_op` ("sum" or "avg")."""
    task = matmul_collective_task(MATMUL_REDUCE_SCATTER, a, b, bias, out_shape, scatter_dim,
                                  reduce_op, group_name, world_size)
    return _dispatch(task, plan, matmul_reduce_scatter_reference,
                     a, b, bias, out_shape, scatter_dim, reduce_op, group_name, world_size)


@matmul_reduce_scatter.register_fake
def _(a, b, bias, out_shape, scatter_dim, reduce_op, group_name, world_size, plan):
    shape = list(out_shape) if len(out_shape) else [a.shape[0], b.shape[1]]
    return a.new_empty(_scattered_shape(shape, scatter_dim, world_size))


# ---------------------------------------------------------------------------- matmul -> all-reduce


def matmul_all_reduce_reference(a, b, bias, out_shape, reduce_op, group_name, world_size):
    out = _as_nd(_matmul(a, b, bias), out_shape)
    return c10d.wait_tensor(c10d.all_reduce(out, reduce_op, group_name))


@torch.library.custom_op("ditron::matmul_all_reduce", mutates_args=())
def matmul_all_reduce(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    out_shape: Sequence[int],
    reduce_op: str,
    group_name: str,
    world_size: int,
    plan: str,
) -> Tensor:
    """(a @ b + bias), viewed as `out_shape` (empty: the 2-d product), all-reduced over the group
    with `reduce_op`."""
    task = matmul_collective_task(MATMUL_ALL_REDUCE, a, b, bias, out_shape, 0, reduce_op,
                                  group_name, world_size)
    return _dispatch(task, plan, matmul_all_reduce_reference,
                     a, b, bias, out_shape, reduce_op, group_name, world_size)


@matmul_all_reduce.register_fake
def _(a, b, bias, out_shape, reduce_op, group_name, world_size, plan):
    return a.new_empty(list(out_shape) if len(out_shape) else [a.shape[0], b.shape[1]])


# ------------------------------------------------- matmul -> all-reduce (+ residual) -> RMSNorm


def rms_norm_reference(h: Tensor, weight: Tensor, eps: float, weight_in_fp32: bool) -> Tensor:
    """Llama-style RMSNorm over the last dim, in the two roundings models use:
    weight_in_fp32=False: (h32 * rsqrt(mean(h32^2) + eps)).to(h.dtype) * weight (Hugging Face);
    weight_in_fp32=True:  (h32 * rsqrt(mean(h32^2) + eps) * weight).to(h.dtype) (F.rms_norm)."""
    h32 = h.float()
    normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (normed * weight).to(h.dtype)
    return normed.to(h.dtype) * weight


def matmul_all_reduce_rmsnorm_reference(a, b, bias, out_shape, residual, norm_weight, eps,
                                        weight_in_fp32, reduce_op, group_name, world_size):
    summed = matmul_all_reduce_reference(a, b, bias, out_shape, reduce_op, group_name, world_size)
    h = summed if residual is None else summed + residual
    return h, rms_norm_reference(h, norm_weight, eps, weight_in_fp32)


def matmul_all_reduce_rmsnorm_task(a, b, bias, out_shape, has_residual: bool, reduce_op: str,
                                   group_name: str, world_size: int) -> Task:
    task = matmul_collective_task(MATMUL_ALL_REDUCE, a, b, bias, out_shape, 0, reduce_op,
                                  group_name, world_size)
    return dataclasses.replace(task, op=MATMUL_ALL_REDUCE_RMSNORM, has_residual=has_residual)


@torch.library.custom_op("ditron::matmul_all_reduce_rmsnorm", mutates_args=())
def matmul_all_reduce_rmsnorm(
    a: Tensor,
    b: Tensor,
    bias: Optional[Tensor],
    out_shape: Sequence[int],
    residual: Optional[Tensor],
    norm_weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    reduce_op: str,
    group_name: str,
    world_size: int,
    plan: str,
) -> tuple[Tensor, Tensor]:
    """The row-parallel layer of tensor-parallel inference in one op:
    h = all_reduce(a @ b + bias) (viewed as `out_shape`) + residual, y = RMSNorm(h) * norm_weight
    (see `rms_norm_reference` for the two roundings). Returns (h, y): h is the next residual."""
    task = matmul_all_reduce_rmsnorm_task(a, b, bias, out_shape, residual is not None, reduce_op,
                                          group_name, world_size)
    return _dispatch(task, plan, matmul_all_reduce_rmsnorm_reference, a, b, bias, out_shape,
                     residual, norm_weight, eps, weight_in_fp32, reduce_op, group_name,
                     world_size)


@matmul_all_reduce_rmsnorm.register_fake
def _(a, b, bias, out_shape, residual, norm_weight, eps, weight_in_fp32, reduce_op, group_name,
      world_size, plan):
    shape = list(out_shape) if len(out_shape) else [a.shape[0], b.shape[1]]
    return a.new_empty(shape), a.new_empty(shape)

