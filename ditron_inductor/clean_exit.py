"""A clean exit for a program that compiled with ditron, whatever order it shuts down in.

A process group outlives `destroy_process_group()` (DTensor's meshes and compiled graphs' guards
hold it); left to interpreter teardown, a C++ thread that then needs the GIL aborts the process
("terminate called without an active exception"), or a teardown waits on a peer that has gone.
So `release_at_exit` runs before the exit handlers registered earlier, while the interpreter is
whole, and releases in dependency order: ditron's runtime (symmetric memory lives on the group),
the compiled graphs, then the process groups the program did not destroy. Where a fused
kernel's wait gave up (runtime/faults.py), it releases nothing and ends the process with the
fault's exit code instead: a peer is gone, and every release would wait on it.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import sys

from .log_names import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)
_installed = False


def install() -> None:
    """Register `release_at_exit` once per process, and have the default group's
    `destroy_process_group()` release the CUDA graphs first."""
    global _installed
    if not _installed:
        atexit.register(release_at_exit)
        _release_graphs_before_destroy()
        _installed = True


def release_cuda_graphs() -> None:
    """Drops StepGraph's graphs, then the compiled graphs and Inductor's CUDA-graph trees
    (`torch._dynamo.reset()`): NCCL's finalize in `destroy_process_group()` waits until every
    CUDA graph that captured one of its collectives is destroyed, with the trees alive
    (mode="reduce-overhead") for good. Nothing to do where CUDA never started."""
    import torch

    step_graph = sys.modules.get("ditron_inductor.step_graph")  # loaded by a StepGraph's user
    if step_graph is not None:
        step_graph.release_all()
    if not torch.cuda.is_initialized():
        return
    log.info("exit: releasing the compiled graphs and CUDA graphs before the process group")
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()


def _release_graphs_before_destroy() -> None:
    from torch import distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d as c10d

    destroy = c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(*args, **kwargs):
        group = args[0] if args else kwargs.get("group")
        if group is None or group is c10d.GroupMember.WORLD:  # the whole world goes
            release_cuda_graphs()
        return destroy(*args, **kwargs)

    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group


def release_at_exit() -> None:
    import torch

    faults = sys.modules.get("ditron_inductor.runtime.faults")
    if faults is not None and faults.failed():  # a peer is gone: nothing here may wait on it
        faults.end()
        return
    for step in (_runtime_shutdown, torch._dynamo.reset, _destroy_process_groups, gc.collect):
        try:
            step()
        except Exception as e:  # noqa: BLE001 - an exit handler never fails the program
            log.debug("exit: %s: %s", getattr(step, "__name__", step), e)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream
            pass


def _runtime_shutdown() -> None:
    runtime = sys.modules.get("ditron_inductor.runtime")  # loaded by the first fused call only
    if runtime is not None:
        runtime.shutdown()


def _destroy_process_groups() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
