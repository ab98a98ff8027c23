"""The ditron ops: one op per fused collective + matmul.

Each op is defined with `torch.library` (schema, one implementation for every backend, a fake
(meta) implementation), so Inductor and symbolic shapes see it as one opaque kernel. Its reference
implementation, from functional collectives and matmuls, runs on any device (CPU with gloo
included) and is the ground truth in tests. The ops are registered with `Library.define/impl`
rather than `torch.library.custom_op`, whose per-call Python wrapping (dynamo guard, alias checks
of the outputs) cost more host time than the rest of a call; the ops have no autograd formula:
they live in post-grad graphs.

The fused CUDA implementations come from one place, `runtime.FUSED_IMPLS`. An op whose plan asks
for a fused kernel calls it with the plan (decoded once per distinct text) and the Task (built only
then); the fused implementation returns None for an input its plan cannot serve (a layout or size
its kernel does not handle), and the op then takes the reference path instead of failing, and
says so at debug level.
"""

from __future__ import annotations

import functools
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
    all_gather_matmul_task,
    matmul_collective_task,
)

if torch.distributed.is_available():
    from torch._C._distributed_c10d import _resolve_process_group

log = logging.getLogger(LOGGER_NAME)
c10d = torch.ops._c10d_functional
_lib = torch.library.Library("ditron", "DEF")

# op name -> fused implementation (runtime.FUSED_IMPLS, loaded at the first fused call):
# fn(task, plan, *op_args) -> outputs, or None to fall back.
_fused_impls: dict[str, Callable] = {}
_fallbacks_logged: set[tuple[str, str]] = set()


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


_tasks: dict = {}
_MAX_TASKS = 4096


def _signature(arg):
    """What a Task can depend on in one op argument: a tensor's shape, dtype and device (CUDA or
    not), a list's items, anything else (sizes, names, flags) as it is."""
    if isinstance(arg, Tensor):
        return arg.shape, arg.dtype, arg.is_cuda
    if isinstance(arg, list):
        return tuple([_signature(a) for a in arg])
    return arg


def task_of(op: str, *args):
    """The Task of a call of `op` with these arguments, memoised on their signatures: a Task is
    a function of shapes, dtypes, options and the group, the same few recur call after call, and
    building one costs more host time than the rest of the dispatch (the table is dropped whole
    if it ever grows past _MAX_TASKS)."""
    key = (op, *map(_signature, args))
    task = _tasks.get(key)
    if task is None:
        if len(_tasks) >= _MAX_TASKS:
            _tasks.clear()
        task = _tasks[key] = _TASK_BUILDERS[op](*args)
    return task


# op -> its Task from the op's own arguments (scheduler/task.py's builders, which the matcher
# calls too)
_TASK_BUILDERS: dict[str, Callable] = {
    ALL_GATHER_MATMUL: all_gather_matmul_task,
    MATMUL_REDUCE_SCATTER: functools.partial(matmul_collective_task, MATMUL_REDUCE_SCATTER),
    MATMUL_ALL_REDUCE: lambda a, b, bias, out_shape, reduce_op, *group: matmul_collective_task(
        MATMUL_ALL_REDUCE, a, b, bias, out_shape, 0, reduce_op, *group),
    MATMUL_ALL_REDUCE_RMSNORM:
        lambda a, b, bias, out_shape, residual, _weight, _eps, _fp32, reduce_op, *group:
        matmul_collective_task(MATMUL_ALL_REDUCE_RMSNORM, a, b, bias, out_shape, 0, reduce_op,
                               *group, has_residual=residual is not None),
}


def _dispatch(op: str, plan_text: str, on_cuda: bool, reference: Callable, *args):
    """The fused implementation of `op` where the plan asks for it and serves the call, else the
    reference. args end in (group_name, world_size), as every op's arguments do."""
    check_group(args[-2], args[-1])
    plan = decode(plan_text)
    if plan.impl == FUSED and on_cuda:
        fused = _fused_impls.get(op) or _load_fused_impl(op)
        task = task_of(op, *args)
        out = fused(task, plan, *args) if fused is not None else None
        if out is not None:
            return out
        key = (op, plan_text)
        if key not in _fallbacks_logged:
            _fallbacks_logged.add(key)
            log.debug("%s: plan %s could not serve this call; ran the reference path",
                      task.describe(), plan.describe())
    return reference(*args)


def _load_fused_impl(op: str) -> Optional[Callable]:
    """The runtime's implementation of `op` (it imports triton and the kernels: only when a fused
    plan first runs)."""
    try:
        from .runtime import FUSED_IMPLS
    except ImportError as e:
        log.debug("fused implementations unavailable: %s", e)
        return None
    for name, fn in FUSED_IMPLS.items():
        _fused_impls.setdefault(name, fn)
    return _fused_impls.get(op)


def _define(schema: str, impl: Callable, fake: Callable) -> None:
    """torch.ops.ditron.<name>: `impl` for every backend, `fake` for fake tensors and meta."""
    name = schema.split("(", 1)[0]
    _lib.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ditron::{name}", fake, lib=_lib)


def _all_gather(x: Tensor, gather_dim: int, group_name: str, world_size: int) -> Tensor:
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world_size, group_name))
    if gather_dim != 0:
        gathered = torch.cat(gathered.chunk(world_size, dim=0), dim=gather_dim)
    return gathered


def _matmul(a: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
    return torch.mm(a, w) if bias is None else torch.addmm(bias, a, w)


def _as_nd(out: Tensor, out_shape: Sequence[int]) -> Tensor:
    return out.view(list(out_shape)) if len(out_shape) else out


def _full_shape(a: Tensor, b: Tensor, out_shape: Sequence) -> list:
    return list(out_shape) if len(out_shape) else [a.shape[0], b.shape[1]]


# ---------------------------------------------------------------------------- all-gather -> matmul


def all_gather_matmul_reference(a_shard, weights, biases, gather_dim, group_name, world_size):
    gathered = _all_gather(a_shard, gather_dim, group_name, world_size)
    a = gathered.reshape(-1, gathered.shape[-1])
    return [gathered] + [_matmul(a, w, b) for w, b in zip(weights, biases)]


def all_gather_matmul(a_shard: Tensor, weights: list[Tensor], biases: list[Optional[Tensor]],
                      gather_dim: int, group_name: str, world_size: int,
                      plan: str) -> list[Tensor]:
    """All-gather `a_shard` along `gather_dim` over the group, then multiply the gathered
    activation, flattened to [M, K], by each weight [K, N_i] (plus its bias).

    Returns [gathered activation (N-d, as the collective produces it), A @ W_0, A @ W_1, ...];
    the data crosses the wire once however many weights share it.
    """
    return _dispatch(ALL_GATHER_MATMUL, plan, a_shard.is_cuda, all_gather_matmul_reference,
                     a_shard, weights, biases, gather_dim, group_name, world_size)


def _all_gather_matmul_fake(a_shard, weights, biases, gather_dim, group_name, world_size, plan):
    shape = list(a_shard.shape)
    shape[gather_dim] = shape[gather_dim] * world_size
    gathered = a_shard.new_empty(shape)
    rows = gathered.numel() // shape[-1]
    return [gathered] + [a_shard.new_empty([rows, w.shape[1]]) for w in weights]


_define("all_gather_matmul(Tensor a_shard, Tensor[] weights, Tensor?[] biases, SymInt gather_dim, "
        "str group_name, SymInt world_size, str plan) -> Tensor[]",
        all_gather_matmul, _all_gather_matmul_fake)


# ------------------------------------------------------------------------ matmul -> reduce-scatter


def matmul_reduce_scatter_reference(a, b, bias, out_shape, scatter_dim, reduce_op, group_name,
                                    world_size):
    out = _as_nd(_matmul(a, b, bias), out_shape)
    if scatter_dim != 0:
        out = torch.cat(out.chunk(world_size, dim=scatter_dim), dim=0)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(out.contiguous(), reduce_op, world_size,
                                                       group_name))


def matmul_reduce_scatter(a: Tensor, b: Tensor, bias: Optional[Tensor], out_shape: Sequence[int],
                          scatter_dim: int, reduce_op: str, group_name: str, world_size: int,
                          plan: str) -> Tensor:
    """(a @ b + bias), viewed as `out_shape` (empty: the 2-d product), reduce-scattered over the
    group along `scatter_dim` with `reduce_op` ("sum" or "avg")."""
    return _dispatch(MATMUL_REDUCE_SCATTER, plan, a.is_cuda, matmul_reduce_scatter_reference,
                     a, b, bias, out_shape, scatter_dim, reduce_op, group_name, world_size)


def _matmul_reduce_scatter_fake(a, b, bias, out_shape, scatter_dim, reduce_op, group_name,
                                world_size, plan):
    shape = _full_shape(a, b, out_shape)
    shape[scatter_dim] = shape[scatter_dim] // world_size
    return a.new_empty(shape)


_define("matmul_reduce_scatter(Tensor a, Tensor b, Tensor? bias, SymInt[] out_shape, "
        "SymInt scatter_dim, str reduce_op, str group_name, SymInt world_size, str plan) -> Tensor",
        matmul_reduce_scatter, _matmul_reduce_scatter_fake)


# ---------------------------------------------------------------------------- matmul -> all-reduce


def matmul_all_reduce_reference(a, b, bias, out_shape, reduce_op, group_name, world_size):
    out = _as_nd(_matmul(a, b, bias), out_shape)
    return c10d.wait_tensor(c10d.all_reduce(out, reduce_op, group_name))


def matmul_all_reduce(a: Tensor, b: Tensor, bias: Optional[Tensor], out_shape: Sequence[int],
                      reduce_op: str, group_name: str, world_size: int, plan: str) -> Tensor:
    """(a @ b + bias), viewed as `out_shape` (empty: the 2-d product), all-reduced over the group
    with `reduce_op`."""
    return _dispatch(MATMUL_ALL_REDUCE, plan, a.is_cuda, matmul_all_reduce_reference, a, b, bias,
                     out_shape, reduce_op, group_name, world_size)


def _matmul_all_reduce_fake(a, b, bias, out_shape, reduce_op, group_name, world_size, plan):
    return a.new_empty(_full_shape(a, b, out_shape))


_define("matmul_all_reduce(Tensor a, Tensor b, Tensor? bias, SymInt[] out_shape, str reduce_op, "
        "str group_name, SymInt world_size, str plan) -> Tensor",
        matmul_all_reduce, _matmul_all_reduce_fake)


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


def matmul_all_reduce_rmsnorm(a: Tensor, b: Tensor, bias: Optional[Tensor],
                              out_shape: Sequence[int], residual: Optional[Tensor],
                              norm_weight: Tensor, eps: float, weight_in_fp32: bool,
                              reduce_op: str, group_name: str, world_size: int,
                              plan: str) -> tuple[Tensor, Tensor]:
    """The row-parallel layer of tensor-parallel inference in one op:
    h = all_reduce(a @ b + bias) (viewed as `out_shape`) + residual, y = RMSNorm(h) * norm_weight
    (see `rms_norm_reference` for the two roundings). Returns (h, y): h is the next residual."""
    return _dispatch(MATMUL_ALL_REDUCE_RMSNORM, plan, a.is_cuda,
                     matmul_all_reduce_rmsnorm_reference, a, b, bias, out_shape, residual,
                     norm_weight, eps, weight_in_fp32, reduce_op, group_name, world_size)


def _matmul_all_reduce_rmsnorm_fake(a, b, bias, out_shape, residual, norm_weight, eps,
                                    weight_in_fp32, reduce_op, group_name, world_size, plan):
    shape = _full_shape(a, b, out_shape)
    return a.new_empty(shape), a.new_empty(shape)


_define("matmul_all_reduce_rmsnorm(Tensor a, Tensor b, Tensor? bias, SymInt[] out_shape, "
        "Tensor? residual, Tensor norm_weight, float eps, bool weight_in_fp32, str reduce_op, "
        "str group_name, SymInt world_size, str plan) -> (Tensor, Tensor)",
        matmul_all_reduce_rmsnorm, _matmul_all_reduce_rmsnorm_fake)
