"""A whole decode step replayed from one CUDA graph, with nothing of torch.compile on the host.

Under `mode="reduce-overhead"` every call still runs Dynamo's frame, AOTAutograd's wrappers and
the CUDA-graph tree's bookkeeping: with many layers, most of a step's host time. `StepGraph(step)`
captures the whole call of `step` (compiled without "reduce-overhead") once per input signature,
then only copies the new inputs in and replays:

    step = StepGraph(torch.compile(model.__call__, backend="ditron", fullgraph=True))

The signature: the arguments' structure, each tensor's shape, strides, dtype, device and
requires_grad, every other argument's value (an object that is no number, string, None or enum
by its identity: a KV cache). Every call runs the step once. Each call copies the tensor
arguments into the graph's own (pass large state inside objects) and those the step writes back
out; the next replay overwrites the outputs; parameters are read at their addresses (update them
in place); forward only (no grad). Its compiles plan for a CUDA graph (`ditron.cuda_graphs`).
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import clean_exit, config

# leaves compared by value in a signature; any other object by identity
_BY_VALUE = (bool, int, float, complex, str, bytes, type(None), enum.Enum, torch.dtype,
             torch.device)


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[int, torch.Tensor]  # the graph's own copy of each tensor argument, by position
    written: list[int]  # positions of the tensor arguments the step writes
    out: Any
    # the other arguments, held: an object known by its id must not die and leave the id to another
    held: list


class StepGraph:
    """`step(*args, **kwargs)` replayed from a CUDA graph per argument signature (the module
    docstring says the rules). `warmup`: the eager calls of each signature before its capture."""

    def __init__(self, step: Callable, warmup: int = 1):
        if warmup < 1:
            raise ValueError(f"warmup={warmup}: at least one eager call must precede a capture")
        self.step = step
        self.warmup = warmup
        self.graphs: dict[tuple, _Captured] = {}
        self._eager: dict[tuple, tuple[int, set[int]]] = {}  # calls so far, inputs written
        self._pool = None
        _live.add(self)
        clean_exit.install()  # its graphs released before the process group (release_all)

    def release(self) -> None:
        """Destroys the captured graphs (each signature then warms up and captures again)."""
        if self.graphs and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no replay still running on what goes
        self.graphs.clear()
        self._eager.clear()
        self._pool = None

    def __call__(self, *args, **kwargs):
        flat, spec = tree_flatten((args, kwargs))
        if not any(isinstance(x, torch.Tensor) and x.is_cuda for x in flat):
            return self.step(*args, **kwargs)  # nothing on the GPU: no graph to replay
        if torch.cuda.is_current_stream_capturing():
            return self.step(*args, **kwargs)  # inside a capture of the caller's
        key = (spec, tuple(map(_signature, flat)))
        captured = self.graphs.get(key)
        if captured is None:
            calls, written = self._eager.get(key, (0, set()))
            if calls < self.warmup:
                return self._eager_call(key, args, kwargs, flat, calls, written)
            captured = self.graphs[key] = self._capture(flat, spec, sorted(written))
            del self._eager[key]
        for i, static in captured.inputs.items():
            static.copy_(flat[i])
        captured.graph.replay()
        for i in captured.written:
            flat[i].copy_(captured.inputs[i])
        return captured.out

    def _eager_call(self, key, args, kwargs, flat, calls, written):
        """A warm-up call, noting the tensor arguments it writes (their version counters move)."""
        versions = {i: x._version for i, x in enumerate(flat) if isinstance(x, torch.Tensor)}
        with _replayed_from_graphs():
            out = self.step(*args, **kwargs)
        written = written | {i for i, v in versions.items() if flat[i]._version != v}
        self._eager[key] = (calls + 1, written)
        return out

    def _capture(self, flat, spec, written) -> _Captured:
        """One call captured on the graph's own copies of the tensor arguments (the caller's may
        be views of something it keeps using); the replay that follows runs it."""
        if torch.is_grad_enabled():
            raise RuntimeError("StepGraph replays forward calls, no autograd: call it under "
                               "torch.no_grad() or torch.inference_mode()")
        inputs = {}
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                if not _dense(x):
                    raise ValueError(
                        f"StepGraph: tensor argument {i} ({tuple(x.shape)}, strides {x.stride()}) "
                        "is not dense (elements that share memory, as in an expanded view, or "
                        "gaps, as in a strided slice): pass a dense tensor")
                copy = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
                inputs[i] = copy.copy_(x).requires_grad_(x.requires_grad)
        static = [inputs.get(i, x) for i, x in enumerate(flat)]
        args, kwargs = tree_unflatten(static, spec)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()  # the copies above and every eager call done before capture
        try:
            with _replayed_from_graphs(), torch.cuda.graph(graph, pool=self._pool):
                out = self.step(*args, **kwargs)
        except RuntimeError as error:
            raise RuntimeError(
                f"StepGraph: the step could not be captured in a CUDA graph ({error}). Compile "
                "it without mode='reduce-overhead' (StepGraph is its CUDA graph) and keep "
                "host synchronisation (.item(), .cpu(), printing tensors) out of it") from error
        return _Captured(graph, inputs, written, out, static)


_live: "weakref.WeakSet[StepGraph]" = weakref.WeakSet()


def release_all() -> None:
    """Every StepGraph's graphs destroyed: NCCL's finalize in `destroy_process_group()` waits for
    the CUDA graphs that captured its collectives."""
    for graphed in list(_live):
        graphed.release()


def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill a block of memory one each, in some order of its dims."""
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(x.shape, x.stride()) if sz != 1):
        if stride != span:
            return False
        span *= size
    return True


def _signature(x: Any):
    if isinstance(x, torch.Tensor):  # what Dynamo's guards compare (so a capture never recompiles)
        return (torch.Tensor, tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad)
    if isinstance(x, _BY_VALUE):
        return (type(x), x)
    return (object, id(x))


def _replayed_from_graphs():
    """ditron's compiles inside: their graphs will be replayed from a CUDA graph."""
    return config.overriding(cuda_graphs=True)
