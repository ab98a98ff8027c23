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

The calls for users (`ditron_inductor.compile_decode`, `ditron_inductor.compile_step`): the
compile and the StepGraph in one, for transformers' `generate()` and for a loop of one's own.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import clean_exit, config
from .log_names import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)

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


# ----------------------------------------------------------------------- the calls for users


def compile_step(step: Callable, options: dict | None = None, *, backend: str = "ditron",
                 dynamic: bool | None = False, warmup: int = 1) -> Callable:
    """A step of one's own loop (a serving engine's), compiled whole without "reduce-overhead"
    (`torch.compile(step, backend=backend, fullgraph=True, dynamic=dynamic, options=options)`)
    in a StepGraph; without CUDA the compiled step alone (the ditron log says so once). Keep one
    KV cache object and reset it in place: a new one is a new signature, captured anew."""
    return _graphed(torch.compile(step, backend=backend, fullgraph=True, dynamic=dynamic,
                                  options=options), StepGraph, warmup)


def compile_decode(model, options: dict | None = None, *, backend: str = "ditron",
                   dynamic: bool | None = False, warmup: int = 1):
    """Makes `model.generate(..., cache_implementation="static")` (or with a `StaticCache`
    passed in), greedy or sampling, run each decode step as `compile_step(model.__call__, ...)`
    makes it; the prefill runs eagerly, as transformers runs it. transformers' compiled-call
    hook `model.get_compiled_call` returns that step whatever `compile_config` generate() has
    (`disable_compile=True` runs eagerly), and the generation config's `compile_config` passes
    generate()'s compile criteria on any device. A new KV cache (`cache_implementation="static"`
    makes one per call) drops the previous cache's graphs. Returns the model;
    `model.get_compiled_call(None)` is the step, to call in a loop of one's own."""
    name = type(model).__name__
    if not (callable(getattr(model, "can_generate", None)) and model.can_generate()):
        raise TypeError(f"compile_decode: {name} is no transformers model with generate() "
                        "(GenerationMixin); compile a step of your own with compile_step")
    if not getattr(model, "_can_compile_fullgraph", False):
        raise ValueError(f"compile_decode: transformers does not compile {name}'s decode step "
                         "whole over a static cache (its _can_compile_fullgraph is False)")
    from transformers import CompileConfig

    step = _graphed(torch.compile(model.__call__, backend=backend, fullgraph=True,
                                  dynamic=dynamic, options=options), _DecodeStep, warmup)
    model.get_compiled_call = lambda compile_config=None: step
    compile_config = CompileConfig(fullgraph=True, dynamic=dynamic, backend=backend, mode=None,
                                   options=options)
    compile_config._compile_all_devices = True  # else generate() compiles on accelerators only
    model.generation_config.compile_config = compile_config
    return model


class _DecodeStep(StepGraph):
    """A model's decode step with the graphs of one KV cache at a time (each graph holds its
    cache, which would otherwise outlive the generate() call that made it)."""

    cache = None

    def __call__(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not self.cache:
            self.release()
            self.cache = cache
        return super().__call__(*args, **kwargs)


def _graphed(compiled: Callable, kind: type[StepGraph], warmup: int) -> Callable:
    if torch.cuda.is_available():
        return kind(compiled, warmup)
    _no_cuda()
    return compiled


@functools.cache
def _no_cuda() -> None:
    log.info("StepGraph: no CUDA here: compiled steps run without a CUDA graph")
