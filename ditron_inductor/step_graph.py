"""A whole decode step replayed from one CUDA graph, with nothing of torch.compile on the host.

Under `mode="reduce-overhead"` a compiled step replays its kernels from a CUDA graph, but every
call still runs Dynamo's frame (collecting the ~11 parameters and cache tensors of each layer
as graph inputs), AOTAutograd's wrappers and the CUDA-graph tree's bookkeeping around the
replay: at 32 layers on 1x H100 most of a step's host time, the replay itself 0.02 ms of it
(benchmarks/results/logs/gpu_checks_s44.log). `StepGraph(step)` captures the whole call of
`step` (compiled without "reduce-overhead": this graph is the CUDA graph) once per input
signature and then only copies the new inputs in and replays:

    step = StepGraph(torch.compile(model.__call__, backend="ditron", fullgraph=True))
    out = step(**inputs)     # a signature's first call runs eagerly (and compiles), the second
                             # is captured and replayed, later ones replayed

Rules, as for any CUDA graph:
- the signature is the structure of the arguments, each tensor's shape, strides, dtype,
  device and requires_grad, and every other argument's value (an object that is not a number,
  string, None or enum by its identity: a KV cache object); a new signature warms up and
  captures a graph of its own (one memory pool for all of them);
- every call runs the step once, as eagerly (the warm-up calls are the caller's own calls, and
  capturing runs nothing): a stateful step (a KV cache's position) advances once per call;
- the graph has its own copy of each tensor argument: each call copies the caller's tensors in
  (pass large state, weights or caches, inside modules or objects, not as tensor arguments),
  and a tensor the step writes (its version counter moved in a warm-up call) is copied back out
  after the replay, so the caller sees the writes as it would eagerly;
- the outputs are the captured ones: the next replay overwrites them (use them, or copy them,
  before the next call);
- parameters and buffers are read at their addresses: update them in place, not by assigning
  new tensors;
- it replays forward calls: capture under `torch.no_grad()` or `torch.inference_mode()` (as
  `generate()` runs).

While it warms up and captures, graphs that ditron compiles are told that they will be replayed
from a CUDA graph (`config.cuda_graphs`), so the scheduler picks the plans it measured under
CUDA graphs (the decode all-reduces), as under "reduce-overhead". Without CUDA the step is
called as it is.
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
    # the other arguments, held: an object known by its identity (a KV cache) must not die and
    # leave its id to another while the graph reads its tensors
    held: list


class StepGraph:
    """`step(*args, **kwargs)` replayed from a CUDA graph per argument signature (see the module
    docstring for the rules). `warmup`: the eager calls of each signature before its capture
    (torch.compile compiles in the first); each call, eager or replayed, runs the step once."""

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
        """Destroys the captured graphs (the next call of each signature warms up and captures
        again)."""
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
        """A warm-up call: the step as it is (it compiles at the first), noting the tensor
        arguments it writes (their version counters move)."""
        versions = {i: x._version for i, x in enumerate(flat) if isinstance(x, torch.Tensor)}
        with _replayed_from_graphs():
            out = self.step(*args, **kwargs)
        written = written | {i for i, v in versions.items() if flat[i]._version != v}
        self._eager[key] = (calls + 1, written)
        return out

    def _capture(self, flat, spec, written) -> _Captured:
        """One call captured on the graph's own copies of the tensor arguments (the caller's may
        be views of something the caller keeps using); capturing runs nothing, the replay that
        follows does."""
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
                inputs[i] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                device=x.device)
                inputs[i].copy_(x)
                inputs[i].requires_grad_(x.requires_grad)
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
    """Every StepGraph's graphs destroyed: NCCL's finalize in `destroy_process_group()` waits
    for every CUDA graph that captured one of its collectives (clean_exit.release_cuda_graphs
    calls this first)."""
    for graphed in list(_live):
        graphed.release()


def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill a block of memory one each, in some order of its dims (so a
    tensor of its shape and strides can be written)."""
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
    return config.using(dataclasses.replace(config.current(), cuda_graphs=True))
