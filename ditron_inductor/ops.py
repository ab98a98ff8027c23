"""The ditron ops: one per fused collective + matmul (or grouped GEMM), and the decode step's ops
without one (decode_mm, decode_mm_group, decode_attention).

Each is a `torch.library` op (schema, one implementation for every backend, a fake), one opaque
kernel to Inductor; `Library.define/impl` because `custom_op`'s per-call wrapping costs more host
time than the rest of a call. Its reference implementation (functional collectives and matmuls,
on any device, gloo included) is the ground truth in tests. An op whose plan asks for a fused
kernel calls `runtime.FUSED_IMPLS`' implementation, which returns None for an input its kernel
does not handle: the op then runs the reference. The ops go in post-grad graphs, after autograd;
only the MoE ops have an autograd formula (each one's backward is the other's transposed), for
training steps that call them directly; the scaled ops have none, as _scaled_mm has none
(float8 training's backward is more _scaled_mm calls, which the pass finds).
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .log_names import LOGGER_NAME
from .rms_norm import reciprocal_rms, rms_norm_reference
from .scheduler.decode_gemm import gemv_applies
from .scheduler.plan import FUSED, decode
from .scheduler.precision import FLOAT8
from .scheduler.task import (
    ALL_GATHER_MATMUL,
    ALL_GATHER_SCALED_MM,
    SCALED_MM_ALL_REDUCE,
    SCALED_MM_REDUCE_SCATTER,
    all_gather_scaled_mm_task,
    scaled_mm_collective_task,
    scaled_mm_reduce_scatter_task,
    ALL_TO_ALL_GROUPED_MM,
    GROUPED_MM_ALL_REDUCE,
    GROUPED_MM_ALL_REDUCE_RMSNORM,
    GROUPED_MM_ALL_TO_ALL,
    MATMUL_ALL_GATHER,
    MATMUL_ALL_REDUCE,
    MATMUL_ALL_REDUCE_RMSNORM,
    MATMUL_REDUCE_SCATTER,
    all_gather_matmul_task,
    all_to_all_grouped_mm_task,
    grouped_mm_all_reduce_task,
    grouped_mm_all_to_all_task,
    matmul_collective_task,
    matmul_terms_task,
)

if torch.distributed.is_available():
    from torch._C._distributed_c10d import _resolve_process_group

log = logging.getLogger(LOGGER_NAME)
c10d = torch.ops._c10d_functional
_lib = torch.library.Library("ditron", "DEF")

# op name -> fn(task, plan, *op_args) -> outputs, or None to fall back (runtime.FUSED_IMPLS)
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
    """What a Task depends on in one op argument: a tensor's shape, dtype and is_cuda."""
    if isinstance(arg, Tensor):
        return arg.shape, arg.dtype, arg.is_cuda
    if isinstance(arg, list):
        return tuple([_signature(a) for a in arg])
    return arg


def task_of(op: str, *args):
    """The Task of a call of `op`, memoised on its arguments' signatures: the same few recur
    call after call, and building one costs more host time than the rest of the dispatch."""
    key = (op, *map(_signature, args))
    task = _tasks.get(key)
    if task is None:
        if len(_tasks) >= _MAX_TASKS:
            _tasks.clear()
        task = _tasks[key] = _TASK_BUILDERS[op](*args)
    return task


# op -> its Task from the op's arguments (scheduler/task.py's builders, the matcher's too)
_TASK_BUILDERS: dict[str, Callable] = {
    ALL_GATHER_MATMUL: all_gather_matmul_task,
    MATMUL_REDUCE_SCATTER: functools.partial(matmul_terms_task, MATMUL_REDUCE_SCATTER),
    MATMUL_ALL_GATHER: lambda a, b, bias, out_shape, gather_dim, *group: matmul_collective_task(
        MATMUL_ALL_GATHER, a, b, bias, out_shape, gather_dim, None, *group),
    MATMUL_ALL_REDUCE: lambda a, b, bias, out_shape, reduce_op, *group: matmul_terms_task(
        MATMUL_ALL_REDUCE, a, b, bias, out_shape, 0, reduce_op, *group),
    MATMUL_ALL_REDUCE_RMSNORM:
        lambda a, b, bias, out_shape, _residual, _weight, _eps, _fp32, reduce_op, *group:
        matmul_collective_task(MATMUL_ALL_REDUCE_RMSNORM, a, b, bias, out_shape, 0, reduce_op,
                               *group),
    GROUPED_MM_ALL_REDUCE: lambda x, reduce_op, *group: grouped_mm_all_reduce_task(
        GROUPED_MM_ALL_REDUCE, x, reduce_op, *group),
    GROUPED_MM_ALL_REDUCE_RMSNORM:
        lambda x, _residual, _weight, _eps, _fp32, reduce_op, *group: grouped_mm_all_reduce_task(
            GROUPED_MM_ALL_REDUCE_RMSNORM, x, reduce_op, *group),
    ALL_TO_ALL_GROUPED_MM: all_to_all_grouped_mm_task,
    GROUPED_MM_ALL_TO_ALL: grouped_mm_all_to_all_task,
    ALL_GATHER_SCALED_MM: all_gather_scaled_mm_task,
    SCALED_MM_REDUCE_SCATTER: scaled_mm_reduce_scatter_task,
    SCALED_MM_ALL_REDUCE:
        lambda a, b, scale_a, scale_b, bias, out_dtype, fast, out_shape, reduce_op, *group:
        scaled_mm_collective_task(SCALED_MM_ALL_REDUCE, a, b, scale_a, scale_b, bias, out_dtype,
                                  fast, out_shape, 0, reduce_op, *group),
}


def _dispatch(op: str, plan_text: str, on_cuda: bool, reference: Callable, *args, **options):
    """The fused implementation of `op` where the plan asks for it and serves the call, else the
    reference. args end in (group_name, world_size), as every op's arguments do; `options`: the
    op's keyword-only arguments, which its Task does not depend on."""
    check_group(args[-2], args[-1])
    plan = decode(plan_text)
    if plan.impl == FUSED and on_cuda:
        fused = _fused_impls.get(op) or _load_fused_impl(op)
        task = task_of(op, *args)
        out = fused(task, plan, *args, **options) if fused is not None else None
        if out is not None:
            return out
        key = (op, plan_text)
        if key not in _fallbacks_logged:
            _fallbacks_logged.add(key)
            log.debug("%s: plan %s could not serve this call; ran the reference path",
                      task.describe(), plan.describe())
    return reference(*args, **options)


def _load_fused_impl(op: str) -> Optional[Callable]:
    """The runtime's implementation of `op` (it imports triton: only at the first fused call)."""
    try:
        from .runtime import FUSED_IMPLS
    except ImportError as e:
        log.debug("fused implementations unavailable: %s", e)
        return None
    for name, fn in FUSED_IMPLS.items():
        _fused_impls.setdefault(name, fn)
    return _fused_impls.get(op)


def _define(schema: str, impl: Callable, fake: Callable, backward: Optional[Callable] = None,
            setup_context: Optional[Callable] = None) -> None:
    """torch.ops.ditron.<name>: `impl` for every backend, `fake`, the autograd formula if any."""
    name = schema.split("(", 1)[0]
    _lib.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ditron::{name}", fake, lib=_lib)
    if backward is not None:
        torch.library.register_autograd(f"ditron::{name}", backward,
                                        setup_context=setup_context, lib=_lib)


def _fused_op(op: str, signature: str, reference: Callable, fake: Callable,
              check: Optional[Callable] = None, **autograd) -> Callable:
    """Defines torch.ops.ditron.<op> (its arguments end in group_name, world_size, plan): `check`
    the arguments, then `_dispatch` on the first tensor's device. Returns the implementation,
    ops.<op>, which tests and benchmarks also call directly."""

    def impl(*call, **options):
        *args, plan = call
        if check is not None:
            check(*args)
        first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
        return _dispatch(op, plan, first.is_cuda, reference, *args, **options)

    impl.__name__ = impl.__qualname__ = op
    _define(op + signature, impl, fake, **autograd)
    return impl


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


def _gathered_fakes(a_shard, weights, gather_dim, world_size, dtype) -> list[Tensor]:
    """The all-gather ops' outputs: the gathered activation, then [rows, N_i] per weight."""
    shape = list(a_shard.shape)
    shape[gather_dim] = shape[gather_dim] * world_size
    gathered = a_shard.new_empty(shape)
    rows = gathered.numel() // shape[-1]
    return [gathered] + [a_shard.new_empty([rows, w.shape[1]], dtype=dtype) for w in weights]


def _scattered_fake(a, b, out_shape, scatter_dim, world_size, dtype) -> Tensor:
    shape = _full_shape(a, b, out_shape)
    shape[scatter_dim] = shape[scatter_dim] // world_size
    return a.new_empty(shape, dtype=dtype)


def _sum_of_products(a: Sequence[Tensor], b: Sequence[Tensor], bias: Optional[Tensor]) -> Tensor:
    """a[0] @ b[0] (+ bias) + a[1] @ b[1] + ...: added in turn, as the graph's adds did."""
    out = _matmul(a[0], b[0], bias)
    for a_i, b_i in zip(a[1:], b[1:]):
        out = out + torch.mm(a_i, b_i)
    return out


# ---------------------------------------------------------------------------- all-gather -> matmul


def all_gather_matmul_reference(a_shard, weights, biases, gather_dim, group_name, world_size):
    gathered = _all_gather(a_shard, gather_dim, group_name, world_size)
    a = gathered.reshape(-1, gathered.shape[-1])
    return [gathered] + [_matmul(a, w, b) for w, b in zip(weights, biases)]


def _all_gather_matmul_fake(a_shard, weights, biases, gather_dim, group_name, world_size, plan):
    return _gathered_fakes(a_shard, weights, gather_dim, world_size, a_shard.dtype)


# All-gather `a_shard` along `gather_dim`, then A (the gathered activation as [M, K]) @ each
# weight [K, N_i] (+ bias): [gathered (N-d), A @ W_0, ...], on the wire once for all weights.
all_gather_matmul = _fused_op(
    ALL_GATHER_MATMUL, "(Tensor a_shard, Tensor[] weights, Tensor?[] biases, SymInt gather_dim, "
    "str group_name, SymInt world_size, str plan) -> Tensor[]",
    all_gather_matmul_reference, _all_gather_matmul_fake)


# ------------------------------------------------------------------------ matmul -> reduce-scatter


def _reduce_scatter(out: Tensor, scatter_dim: int, reduce_op: str, group_name: str,
                    world_size: int) -> Tensor:
    if scatter_dim != 0:
        out = torch.cat(out.chunk(world_size, dim=scatter_dim), dim=0)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(out.contiguous(), reduce_op, world_size,
                                                       group_name))


def matmul_reduce_scatter_reference(a, b, bias, out_shape, scatter_dim, reduce_op, group_name,
                                    world_size):
    return _reduce_scatter(_as_nd(_sum_of_products(a, b, bias), out_shape), scatter_dim,
                           reduce_op, group_name, world_size)


def _matmul_reduce_scatter_fake(a, b, bias, out_shape, scatter_dim, reduce_op, group_name,
                                world_size, plan):
    return _scattered_fake(a[0], b[0], out_shape, scatter_dim, world_size, a[0].dtype)


# (a[0] @ b[0] + bias + a[1] @ b[1] + ...: q/k/v's input gradient) viewed as `out_shape` (empty:
# the 2-d product), reduce-scattered along `scatter_dim` with `reduce_op`.
matmul_reduce_scatter = _fused_op(
    MATMUL_REDUCE_SCATTER, "(Tensor[] a, Tensor[] b, Tensor? bias, SymInt[] out_shape, "
    "SymInt scatter_dim, str reduce_op, str group_name, SymInt world_size, str plan) -> Tensor",
    matmul_reduce_scatter_reference, _matmul_reduce_scatter_fake)


# ------------------------------------------------------------------------ matmul -> all-gather


def matmul_all_gather_reference(a, b, bias, out_shape, gather_dim, group_name, world_size):
    return _all_gather(_as_nd(_matmul(a, b, bias), out_shape), gather_dim, group_name, world_size)


def _matmul_all_gather_fake(a, b, bias, out_shape, gather_dim, group_name, world_size, plan):
    shape = _full_shape(a, b, out_shape)
    shape[gather_dim] = shape[gather_dim] * world_size
    return a.new_empty(shape)


# a @ b (+ bias) viewed as `out_shape` (empty: the 2-d product), all-gathered along
# `gather_dim`: the output of a column-parallel layer gathered (lm_head), or the input gradient
# of a row-parallel layer whose input was split.
matmul_all_gather = _fused_op(
    MATMUL_ALL_GATHER, "(Tensor a, Tensor b, Tensor? bias, SymInt[] out_shape, "
    "SymInt gather_dim, str group_name, SymInt world_size, str plan) -> Tensor",
    matmul_all_gather_reference, _matmul_all_gather_fake)


# ---------------------------------------------------------------------------- matmul -> all-reduce


def matmul_all_reduce_reference(a, b, bias, out_shape, reduce_op, group_name, world_size):
    out = _as_nd(_sum_of_products(a, b, bias), out_shape)
    return c10d.wait_tensor(c10d.all_reduce(out, reduce_op, group_name))


def _matmul_all_reduce_fake(a, b, bias, out_shape, reduce_op, group_name, world_size, plan):
    return a[0].new_empty(_full_shape(a[0], b[0], out_shape))


# matmul_reduce_scatter's sum of products, viewed as `out_shape`, all-reduced.
matmul_all_reduce = _fused_op(
    MATMUL_ALL_REDUCE, "(Tensor[] a, Tensor[] b, Tensor? bias, SymInt[] out_shape, "
    "str reduce_op, str group_name, SymInt world_size, str plan) -> Tensor",
    matmul_all_reduce_reference, _matmul_all_reduce_fake)


# ------------------------------------------------- matmul -> all-reduce (+ residual) -> RMSNorm


def _residual_rmsnorm(summed, residual, norm_weight, eps, weight_in_fp32, with_rstd) -> list:
    """[h, y] (+ h's reciprocal RMS): h = summed + residual, y = RMSNorm(h)."""
    h = summed if residual is None else summed + residual
    rstd = reciprocal_rms(h, eps)
    return [h, rms_norm_reference(h, norm_weight, eps, weight_in_fp32, rstd)] + (
        [rstd] if with_rstd else [])


def matmul_all_reduce_rmsnorm_reference(a, b, bias, out_shape, residual, norm_weight, eps,
                                        weight_in_fp32, reduce_op, group_name, world_size, *,
                                        with_rstd=False):
    summed = matmul_all_reduce_reference([a], [b], bias, out_shape, reduce_op, group_name,
                                         world_size)
    return _residual_rmsnorm(summed, residual, norm_weight, eps, weight_in_fp32, with_rstd)


def _matmul_all_reduce_rmsnorm_fake(a, b, bias, out_shape, *_, with_rstd=False):
    shape = _full_shape(a, b, out_shape)
    rstd = [a.new_empty(shape[:-1] + [1], dtype=torch.float32)] if with_rstd else []
    return [a.new_empty(shape), a.new_empty(shape)] + rstd


# The row-parallel layer of tensor-parallel models: h = all_reduce(a @ b + bias) (viewed as
# `out_shape`) + residual, y = RMSNorm(h). Returns [h, y], h the next residual, and with_rstd
# (training: the norm's backward saves it) h's reciprocal RMS, float32 [..., 1].
matmul_all_reduce_rmsnorm = _fused_op(
    MATMUL_ALL_REDUCE_RMSNORM, "(Tensor a, Tensor b, Tensor? bias, SymInt[] out_shape, "
    "Tensor? residual, Tensor norm_weight, float eps, bool weight_in_fp32, str reduce_op, "
    "str group_name, SymInt world_size, str plan, *, bool with_rstd=False) -> Tensor[]",
    matmul_all_reduce_rmsnorm_reference, _matmul_all_reduce_rmsnorm_fake)


# ------------------------------------------ grouped GEMM -> all-reduce (+ residual) -> RMSNorm


def grouped_mm_all_reduce_reference(x, reduce_op, group_name, world_size):
    return c10d.wait_tensor(c10d.all_reduce(x, reduce_op, group_name))


def _grouped_mm_all_reduce_fake(x, reduce_op, group_name, world_size, plan):
    return x.new_empty(x.shape)


# all_reduce(x), x what grouped GEMMs computed (the experts' weighted sum; the graph computes it:
# lowering/grouped_all_reduce.py).
grouped_mm_all_reduce = _fused_op(
    GROUPED_MM_ALL_REDUCE, "(Tensor x, str reduce_op, str group_name, SymInt world_size, "
    "str plan) -> Tensor", grouped_mm_all_reduce_reference, _grouped_mm_all_reduce_fake)


def grouped_mm_all_reduce_rmsnorm_reference(x, residual, norm_weight, eps, weight_in_fp32,
                                            reduce_op, group_name, world_size, *,
                                            with_rstd=False):
    summed = grouped_mm_all_reduce_reference(x, reduce_op, group_name, world_size)
    return _residual_rmsnorm(summed, residual, norm_weight, eps, weight_in_fp32, with_rstd)


def _grouped_mm_all_reduce_rmsnorm_fake(x, *_, with_rstd=False):
    rstd = [x.new_empty(list(x.shape[:-1]) + [1], dtype=torch.float32)] if with_rstd else []
    return [x.new_empty(x.shape), x.new_empty(x.shape)] + rstd


# h = all_reduce(x) + residual, y = RMSNorm(h), as matmul_all_reduce_rmsnorm returns them.
grouped_mm_all_reduce_rmsnorm = _fused_op(
    GROUPED_MM_ALL_REDUCE_RMSNORM, "(Tensor x, Tensor? residual, Tensor norm_weight, float eps, "
    "bool weight_in_fp32, str reduce_op, str group_name, SymInt world_size, str plan, *, "
    "bool with_rstd=False) -> Tensor[]",
    grouped_mm_all_reduce_rmsnorm_reference, _grouped_mm_all_reduce_rmsnorm_fake)


# ------------------------------------------ expert parallelism: all-to-all <-> grouped GEMM
# Local expert e multiplies rows offsets[e - 1]:offsets[e] (cumulative int32 counts, as
# torch._grouped_mm takes them) by weight[e] [K, N]. The all-to-all sends input_split_sizes[r]
# rows to rank r and receives output_split_sizes[r] from it, rank-major.


def _exchange(x: Tensor, output_split_sizes, input_split_sizes, group_name: str) -> Tensor:
    return c10d.wait_tensor(c10d.all_to_all_single(x.contiguous(), output_split_sizes,
                                                   input_split_sizes, group_name))


def _sum_of_grouped_mms(lefts: Sequence[Tensor], weights: Sequence[Tensor],
                        offsets: Tensor) -> Tensor:
    """sum_i lefts[i] @ weights[i], grouped by offsets, added in order."""
    y = None
    for a, w in zip(lefts, weights):
        term = torch._grouped_mm(a, w, offs=offsets)
        y = term if y is None else y + term
    return y


def _send_rows(y: Tensor, row_index: Optional[Tensor], accumulate: bool, output_split_sizes,
               input_split_sizes, group_name: str) -> Tensor:
    """y's row i to row row_index[i] of the rows to send (zeros where none lands, summed where
    several do and `accumulate`), exchanged."""
    if row_index is not None:
        rows = y.new_zeros([sum(input_split_sizes), y.shape[1]])
        y = rows.index_put_((row_index,), y, accumulate)
    return _exchange(y, output_split_sizes, input_split_sizes, group_name)


def all_to_all_grouped_mm_reference(x, output_split_sizes, input_split_sizes, row_index, weights,
                                    offsets, group_name, world_size):
    received = _exchange(x, output_split_sizes, input_split_sizes, group_name)
    rows = received if row_index is None else received[row_index]
    return [rows] + [torch._grouped_mm(rows, w, offs=offsets) for w in weights]


def _all_to_all_grouped_mm_fake(x, output_split_sizes, input_split_sizes, row_index, weights, *_):
    rows = row_index.shape[0] if row_index is not None else sum(output_split_sizes)
    return [x.new_empty([rows, x.shape[1]])] + [x.new_empty([rows, w.shape[-1]])
                                                for w in weights]


def _all_to_all_grouped_mm_setup(ctx, inputs, output):
    x, output_split_sizes, input_split_sizes, row_index, weights, offsets, *group_plan = inputs
    ctx.save_for_backward(output[0], offsets, row_index, *weights)
    ctx.splits, ctx.group_name = (output_split_sizes, input_split_sizes), group_plan[0]
    ctx.set_materialize_grads(False)


def _all_to_all_grouped_mm_backward(ctx, grads):
    """The combine's sequence, transposed: the outputs' gradients through the transposed weights
    (+ the rows' own), put back where the rows came from, exchanged; weights' rows^T @ grad."""
    grad_rows, grad_outs = grads[0], [None if g is None else g.contiguous() for g in grads[1:]]
    rows, offsets, row_index, *weights = ctx.saved_tensors
    taken = [(g, w.transpose(-2, -1)) for g, w in zip(grad_outs, weights) if g is not None]
    y = _sum_of_grouped_mms([g for g, _ in taken], [w for _, w in taken], offsets)
    if grad_rows is not None:
        y = grad_rows if y is None else y + grad_rows
    output_split_sizes, input_split_sizes = ctx.splits
    grad_x = None if y is None else _send_rows(y, row_index, True, input_split_sizes,
                                               output_split_sizes, ctx.group_name)
    grad_weights = [None if g is None else torch._grouped_mm(rows.t(), g, offs=offsets)
                    for g in grad_outs]
    return grad_x, None, None, None, grad_weights, None, None, None, None


# The dispatch: all-to-all of x's rows [tokens, K], taken in the order of row_index (None:
# arrival order), then [rows, rows @ W_0, ...] by grouped GEMMs. Where a row lands depends on the
# splits and row_index alone, never on arrival order, so fused kernels compute the same rows.
all_to_all_grouped_mm = _fused_op(
    ALL_TO_ALL_GROUPED_MM, "(Tensor x, SymInt[] output_split_sizes, SymInt[] input_split_sizes, "
    "Tensor? row_index, Tensor[] weights, Tensor offsets, str group_name, SymInt world_size, "
    "str plan) -> Tensor[]", all_to_all_grouped_mm_reference, _all_to_all_grouped_mm_fake,
    backward=_all_to_all_grouped_mm_backward, setup_context=_all_to_all_grouped_mm_setup)


def grouped_mm_all_to_all_reference(lefts, weights, offsets, row_index, accumulate,
                                    output_split_sizes, input_split_sizes, group_name,
                                    world_size):
    return _send_rows(_sum_of_grouped_mms(lefts, weights, offsets), row_index, accumulate,
                      output_split_sizes, input_split_sizes, group_name)


def _grouped_mm_all_to_all_fake(lefts, weights, offsets, row_index, accumulate,
                                output_split_sizes, *_):
    return lefts[0].new_empty([sum(output_split_sizes), weights[0].shape[-1]])


def _grouped_mm_all_to_all_setup(ctx, inputs, output):
    lefts, weights, offsets, row_index, _, output_split_sizes, input_split_sizes, *group = inputs
    ctx.save_for_backward(offsets, row_index, *lefts, *weights)
    ctx.terms, ctx.splits, ctx.group = len(lefts), (output_split_sizes, input_split_sizes), group


def _grouped_mm_all_to_all_backward(ctx, grad):
    """The dispatch's sequence, transposed: the gradient exchanged back, its rows taken where the
    forward put them, through each transposed weight; the weights' gradients left^T @ rows."""
    offsets, row_index, *saved = ctx.saved_tensors
    lefts, weights = saved[:ctx.terms], saved[ctx.terms:]
    output_split_sizes, input_split_sizes = ctx.splits
    group_name, world_size, _ = ctx.group
    rows, *grad_lefts = all_to_all_grouped_mm_reference(
        grad, input_split_sizes, output_split_sizes, row_index,
        [w.transpose(-2, -1) for w in weights], offsets, group_name, world_size)
    grad_weights = [torch._grouped_mm(a.t(), rows, offs=offsets) for a in lefts]
    return grad_lefts, grad_weights, None, None, None, None, None, None, None, None


# The combine: y = sum_i lefts[i] @ weights[i] by grouped GEMMs (gate's and up's backward sums
# two), put by `_send_rows` and all-to-all'd back: the received rows, rank-major (a fused kernel
# writes each row to that place from the GEMM's epilogue).
grouped_mm_all_to_all = _fused_op(
    GROUPED_MM_ALL_TO_ALL, "(Tensor[] lefts, Tensor[] weights, Tensor offsets, Tensor? row_index, "
    "bool accumulate, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name, "
    "SymInt world_size, str plan) -> Tensor", grouped_mm_all_to_all_reference,
    _grouped_mm_all_to_all_fake, backward=_grouped_mm_all_to_all_backward,
    setup_context=_grouped_mm_all_to_all_setup)


# ------------------------------------------------------------------------ FP8: the scaled ops
# torch._scaled_mm: float8 a [M, K] @ b [K, N], dequantised by float32 scales, tensorwise (one
# each) or rowwise (scale_a [M, 1], scale_b [1, N]), the product (+ bias) in out_dtype.

FLOAT8_DTYPES = FLOAT8  # the scaled ops' operands (scheduler/precision.py)


def check_scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor,
                    bias: Optional[Tensor], what: str, rows: Optional[int] = None) -> None:
    """Fail before any collective, naming the problem, where _scaled_mm would fail after it (or
    on some ranks only). rows: a rowwise scale_a's (default: a's)."""
    problem = None
    rows = a.shape[0] if rows is None else rows
    if a.dtype not in FLOAT8_DTYPES or b.dtype not in FLOAT8_DTYPES:
        problem = f"operands must be float8 (e4m3fn or e5m2), got {a.dtype} and {b.dtype}"
    elif a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        problem = f"a {list(a.shape)} @ b {list(b.shape)} is not a [M, K] @ [K, N] product"
    elif scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        problem = f"scales must be float32, got {scale_a.dtype} and {scale_b.dtype}"
    elif not ((scale_a.numel() == 1 and scale_b.numel() == 1)
              or (list(scale_a.shape) == [rows, 1] and list(scale_b.shape) == [1, b.shape[1]])):
        problem = (f"scales {list(scale_a.shape)} and {list(scale_b.shape)} are neither "
                   f"tensorwise (one element each) nor rowwise ([{rows}, 1] and "
                   f"[1, {b.shape[1]}])")
    elif bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1]):
        problem = f"bias {list(bias.shape)} is not one value per column ({b.shape[1]})"
    if problem:
        raise ValueError(f"ditron.{what}: {problem}")


def _all_gather_bytes(x: Tensor, gather_dim: int, group_name: str, world_size: int) -> Tensor:
    """_all_gather of a float8 tensor as its bytes: gloo and CPU cat have no float8 dtypes."""
    if x.dtype not in FLOAT8_DTYPES:
        return _all_gather(x, gather_dim, group_name, world_size)
    return _all_gather(x.view(torch.uint8), gather_dim, group_name, world_size).view(x.dtype)


def _scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
    # rowwise scales need stride 1 along their size-1 dim, which an Inductor layout may lack
    if scale_a.numel() > 1:
        scale_a, scale_b = scale_a.reshape(-1).unsqueeze(1), scale_b.reshape(-1).unsqueeze(0)
    return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def all_gather_scaled_mm_reference(a_shard, scale_a, weights, scales_b, biases, out_dtype,
                                   use_fast_accum, gather_dim, group_name, world_size):
    gathered = _all_gather_bytes(a_shard, gather_dim, group_name, world_size)
    a = gathered.reshape(-1, gathered.shape[-1])
    if scale_a.numel() > 1:  # rowwise: the shard's rows' scales, gathered like its rows
        scale_a = _all_gather(scale_a, 0, group_name, world_size)
    return [gathered] + [_scaled_mm(a, w, scale_a, s, b, out_dtype, use_fast_accum)
                         for w, s, b in zip(weights, scales_b, biases)]


def _check_all_gather_scaled_mm(a_shard, scale_a, weights, scales_b, biases, out_dtype,
                                use_fast_accum, gather_dim, *_):
    if not len(weights) == len(scales_b) == len(biases) or not weights:
        raise ValueError(f"ditron.all_gather_scaled_mm: {len(weights)} weights, "
                         f"{len(scales_b)} scales_b and {len(biases)} biases: one of each per "
                         "product, at least one")
    if scale_a.numel() > 1 and gather_dim != 0:
        raise ValueError("ditron.all_gather_scaled_mm: a rowwise scale_a is gathered on dim 0 "
                         f"with the rows, but gather_dim is {gather_dim}")
    a2d = a_shard.reshape(-1, a_shard.shape[-1])
    for w, s, b in zip(weights, scales_b, biases):
        check_scaled_mm(a2d, w, scale_a, s, b, "all_gather_scaled_mm")


def _all_gather_scaled_mm_fake(a_shard, scale_a, weights, scales_b, biases, out_dtype,
                               use_fast_accum, gather_dim, group_name, world_size, plan):
    return _gathered_fakes(a_shard, weights, gather_dim, world_size, out_dtype or a_shard.dtype)


# all_gather_matmul for float8 (one byte an element on the wire), each product a _scaled_mm;
# scale_a: one element, or the shard's rows' [rows, 1] (gather_dim 0), gathered with them.
all_gather_scaled_mm = _fused_op(
    ALL_GATHER_SCALED_MM, "(Tensor a_shard, Tensor scale_a, Tensor[] weights, Tensor[] scales_b, "
    "Tensor?[] biases, ScalarType? out_dtype, bool use_fast_accum, SymInt gather_dim, "
    "str group_name, SymInt world_size, str plan) -> Tensor[]",
    all_gather_scaled_mm_reference, _all_gather_scaled_mm_fake, _check_all_gather_scaled_mm)


def scaled_mm_reduce_scatter_reference(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum,
                                       out_shape, scatter_dim, reduce_op, group_name,
                                       world_size):
    # added in out_dtype in turn, as the graph's adds did
    total = functools.reduce(operator.add, (
        _scaled_mm(a_i, b_i, s_a, s_b, bias if i == 0 else None, out_dtype, use_fast_accum)
        for i, (a_i, b_i, s_a, s_b) in enumerate(zip(a, b, scale_a, scale_b))))
    return _reduce_scatter(_as_nd(total, out_shape), scatter_dim, reduce_op, group_name,
                           world_size)


def _check_scaled_mm_terms(a, b, scale_a, scale_b, bias, *_) -> None:
    what = "scaled_mm_reduce_scatter"
    if not len(a) == len(b) == len(scale_a) == len(scale_b) or not a:
        raise ValueError(f"ditron.{what}: {len(a)} a, {len(b)} b, {len(scale_a)} scale_a and "
                         f"{len(scale_b)} scale_b: one of each per term, at least one")
    for i, term in enumerate(zip(a, b, scale_a, scale_b)):
        check_scaled_mm(*term, bias if i == 0 else None, what)
    shapes = {(a_i.shape[0], b_i.shape[1]) for a_i, b_i in zip(a, b)}
    if len(shapes) > 1:
        raise ValueError(f"ditron.{what}: the terms' products differ in shape "
                         f"({sorted(shapes)}): the sum needs one [M, N]")


def _scaled_mm_reduce_scatter_fake(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum,
                                   out_shape, scatter_dim, reduce_op, group_name, world_size,
                                   plan):
    return _scattered_fake(a[0], b[0], out_shape, scatter_dim, world_size,
                           out_dtype or a[0].dtype)


# matmul_reduce_scatter for float8, in out_dtype: each term a _scaled_mm with scales of its own
# (so the terms cannot be concatenated along K).
scaled_mm_reduce_scatter = _fused_op(
    SCALED_MM_REDUCE_SCATTER, "(Tensor[] a, Tensor[] b, Tensor[] scale_a, Tensor[] scale_b, "
    "Tensor? bias, ScalarType? out_dtype, bool use_fast_accum, SymInt[] out_shape, "
    "SymInt scatter_dim, str reduce_op, str group_name, SymInt world_size, str plan) -> Tensor",
    scaled_mm_reduce_scatter_reference, _scaled_mm_reduce_scatter_fake, _check_scaled_mm_terms)


def scaled_mm_all_reduce_reference(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum,
                                   out_shape, reduce_op, group_name, world_size):
    out = _as_nd(_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum), out_shape)
    return c10d.wait_tensor(c10d.all_reduce(out, reduce_op, group_name))


def _scaled_mm_all_reduce_fake(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum,
                               out_shape, reduce_op, group_name, world_size, plan):
    return a.new_empty(_full_shape(a, b, out_shape), dtype=out_dtype or a.dtype)


# matmul_all_reduce for float8, one term. No fused plan serves it: it runs its reference.
scaled_mm_all_reduce = _fused_op(
    SCALED_MM_ALL_REDUCE, "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, "
    "ScalarType? out_dtype, bool use_fast_accum, SymInt[] out_shape, str reduce_op, "
    "str group_name, SymInt world_size, str plan) -> Tensor",
    scaled_mm_all_reduce_reference, _scaled_mm_all_reduce_fake,
    lambda a, b, scale_a, scale_b, bias, *_: check_scaled_mm(a, b, scale_a, scale_b, bias,
                                                             SCALED_MM_ALL_REDUCE))


# ------------------------------------------------------------------- decode GEMM (no collective)


def decode_mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b by the decode GEMM template on CUDA where it takes the operands, else torch.mm."""
    if a.is_cuda and gemv_applies(a, b) is None:
        from .runtime.gemv import decode_mm as decode_gemm_template

        return decode_gemm_template(a, b)
    return torch.mm(a, b)


def _decode_mm_fake(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


_define("decode_mm(Tensor a, Tensor b) -> Tensor", decode_mm, _decode_mm_fake)


def decode_mm_group(a: Tensor, bs: list[Tensor]) -> list[Tensor]:
    """[a @ b for b in bs]: decode_mm of the same rows in one launch of the template."""
    if a.is_cuda and all(gemv_applies(a, b) is None for b in bs):
        from .runtime.gemv import decode_mm_group as grouped_template

        return grouped_template(a, bs)
    return [torch.mm(a, b) for b in bs]


def _decode_mm_group_fake(a, bs):
    return [a.new_empty((a.shape[0], b.shape[1])) for b in bs]


_define("decode_mm_group(Tensor a, Tensor[] bs) -> Tensor[]", decode_mm_group,
        _decode_mm_group_fake)


# ----------------------------------------------------------- decode attention (no collective)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                     scale: float) -> Tensor:
    """softmax(q k^T * scale + mask) v for a decode step's packed query rows (q [B, KV, R, D],
    k and v [B, KV, L, D]): the split-keys template on CUDA where it takes them, SDPA otherwise."""
    if q.is_cuda:
        from .runtime import decode_attention as template

        if template.decode_attention_applies(q, k, v, mask) is None:
            return template.decode_attention(q, k, v, mask, scale)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _decode_attention_fake(q, k, v, mask, scale):
    return q.new_empty(q.shape)


_define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor",
        decode_attention, _decode_attention_fake)
