"""The per-match decision: fuse or not, and with which device plan.

Every input to `decide` is rank-invariant (the Task, the compile's options, the group's size), so
every rank makes the same decision and the ranks never disagree on the communication protocol.
The checks run in order: options, the group, the dtype, the reference plan (forced, or off
CUDA), then the device plan (choose.py). Every "no" carries its reason, which TORCH_LOGS=ditron
prints.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..config import Options, defaults, dtypes
from . import calibration
from .choose import choose_device_plan, fused_plan, has_fused_plan
from .decode_gemm import with_decode_gemm
from .plan import FUSED, REFERENCE, REFERENCE_PLAN, FusedPlan, Plan
from .precision import unserved_dtype
from .task import REDUCE_SCATTER_PATTERNS, Task


@dataclasses.dataclass(frozen=True)
class Decision:
    fuse: bool
    reason: str
    plan: Optional[Plan] = None


def reject(reason: str) -> Decision:
    return Decision(False, reason)


def group_problem(group_name: str, world_size: int) -> Optional[str]:
    """Why the ops cannot serve this process group, or None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return "torch.distributed is not initialised"
    from torch._C._distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
    except Exception:  # noqa: BLE001 - an unknown name raises RuntimeError or ValueError
        return f"process group {group_name!r} is not known in this process"
    if group.size() != world_size:
        return f"process group {group_name!r} has {group.size()} ranks, the collective says {world_size}"
    return None


def replayed_in_cuda_graph(options: Options) -> bool:
    """Whether this graph will be replayed from a CUDA graph: as the ditron.cuda_graphs option
    says (StepGraph's captures set it), else whether Inductor replays it as one
    (mode="reduce-overhead"). The same on every rank, since every rank compiles with the same
    mode and options."""
    if options.cuda_graphs is not None:
        return options.cuda_graphs
    from torch._inductor import config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


def decide(task: Task, options: Options = Options()) -> Decision:
    if task.op not in options.patterns:
        return reject(f"pattern {task.op} is disabled (ditron.patterns / DITRON_PATTERNS)")
    problem = group_problem(task.group_name, task.world_size)
    if problem:
        return reject(problem)
    if task.world_size <= 1:
        return reject("world size 1: there is nothing to communicate")
    if task.dtype not in dtypes:
        return reject(f"dtype {task.dtype} is not supported")
    if (
        task.op in REDUCE_SCATTER_PATTERNS
        and task.dim_size is not None
        and statically_known_true(task.dim_size % task.world_size != 0)
    ):
        return reject(
            f"scatter dim {task.dim} of size {task.dim_size} does not divide by world size "
            f"{task.world_size}"
        )

    if options.force_plan == REFERENCE or task.device_type != "cuda":
        why = "reference plan (decomposed collective + matmul)"
        if options.force_plan == FUSED:
            why += (": plan=fused forced, but the fused kernels run on CUDA only, "
                    f"not {task.device_type}")
        return Decision(True, why, REFERENCE_PLAN)
    unserved = unserved_dtype(task)
    if unserved:
        return reject(unserved)
    plan, why = choose_device_plan(task, cuda_graphs=replayed_in_cuda_graph(options))
    if (options.force_plan == FUSED and plan is None and has_fused_plan(task.op)
            and calibration.agreed()):  # ranks whose evidence differs would force different plans
        plan, why = fused_plan(task), "fused plan forced (ditron.plan / DITRON_PLAN=fused)"
    if plan is None:
        return reject(why)
    return Decision(True, why, with_options(plan, task, options))


def with_options(plan: FusedPlan, task: Optional[Task] = None,
                 options: Options = Options()) -> FusedPlan:
    """The plan with the options the runtime needs, read here once at compile time; given the
    task, also what the options choose for its shape (a one-row GEMM in the decode template)."""
    plan = dataclasses.replace(plan, symm_mem_backend=options.symm_mem_backend,
                               wait_timeout_s=options.wait_timeout_s)
    return plan if task is None else with_decode_gemm(plan, task, options.decode_gemm)


def plan_for(task: Task, options: Optional[Options] = None, **params) -> FusedPlan:
    """A fused plan for the task as a test or a benchmark names it (`fused_plan`), with the
    options (default: those a compile would start from now): what a graph compiled for it
    would carry."""
    options = options if options is not None else defaults()
    return with_options(fused_plan(task, params), options=options)
