"""Launching a @triton.jit kernel at the host cost of its compiled launcher.

`kernel[grid](*args, **meta)` spends most of its host time before the launch (binding arguments,
computing the specialization key, looking the kernel up, checking globals). The fused ops launch
the same kernels with arguments of the same kinds call after call, so `launch` looks up once per
*argument class*, then calls the compiled kernel's own launcher (`CompiledKernel[grid]`). A class
holds everything Triton specializes on, or more (`arg_class`): a finer class costs a few extra
lookups, a coarser one could launch a kernel specialized for other inputs, so anything not
recognised is classed by its value. Under the interpreter, or where a Triton release returns no
compiled kernel, every call takes the ordinary path.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: no descriptors to class
    TensorDescriptor = ()

_I32_MIN, _I32_MAX, _I64_MAX = -(2 ** 31), 2 ** 31 - 1, 2 ** 63 - 1

# the CUDA build's C entry points (absent from a CPU build, which launches through the interpreter)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# (kernel, grid, meta, device, argument classes) -> (runner, the values of the params after
# args) or None (the ordinary path)
_runners: dict = {}
_MAX_RUNNERS = 4096


def arg_class(a: Any):
    """What Triton specializes a kernel on for this argument (or more)."""
    t = type(a)  # exact types first: this runs for every argument of every launch
    if t is int:
        return (int, a == 1, a & 15 == 0,
                0 if _I32_MIN <= a <= _I32_MAX else 1 if a <= _I64_MAX else 2)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if t is bool or a is None:
        return a
    if t is float:
        return float
    if isinstance(a, TensorDescriptor):
        # Triton keys a descriptor on its dtype and block shape (specialize.cc) and builds the TMA
        # descriptor from shape and strides at each launch: one runner serves every row count
        # (the MoE GEMMs'); alignment and padding are kept, finer than Triton's key
        base = a.base
        return (TensorDescriptor, base.dtype, base.data_ptr() & 15 == 0, tuple(a.block_shape),
                getattr(a, "padding", None))
    return t, a  # anything else (an int or float subclass included): by its value


# grid helpers: triton.cdiv and triton.next_power_of_2's constexpr wrappers cost microseconds
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def current_stream() -> int:
    """The current CUDA stream's handle, without torch's Stream object."""
    if _current_stream is None:
        return torch.cuda.current_stream().cuda_stream
    return _current_stream(_current_device())


def launch(kernel, grid: tuple, *args, stream: Optional[int] = None, **meta) -> None:
    """kernel[grid](*args, **meta) on `stream` (a CUstream handle; default: the current stream).
    `meta`: the constexpr and launch options (num_warps, ...), hashable values."""
    if _current_device is None:
        _ordinary_launch(kernel, grid, args, stream, meta)
        return
    device = _current_device()
    key = (kernel, grid, tuple(meta.items()), device, tuple(map(arg_class, args)))
    entry = _runners.get(key, False)
    if entry is False:  # launch through Triton; keep what later calls of this class launch with
        compiled = _ordinary_launch(kernel, grid, args, stream, meta)
        _remember(key, _runner_entry(kernel, grid, args, meta, compiled))
        return
    if entry is None:
        _ordinary_launch(kernel, grid, args, stream, meta)
        return
    runner, tail = entry
    runner(*args, *tail, stream=_current_stream(device) if stream is None else stream)


def _ordinary_launch(kernel, grid, args, stream, meta):
    if stream is None:
        return kernel[grid](*args, **meta)
    with torch.cuda.stream(stream_of(stream)):
        return kernel[grid](*args, **meta)


def stream_of(handle: int) -> torch.cuda.Stream:
    """torch's stream object for a CUstream handle. Handle 0 (the default stream) needs the
    default stream's own object: torch reads ExternalStream(0)'s null pointer as "none given"
    and hands out a new stream of its pool (THCPStream_pynew), which would run the launch
    unordered with the caller's stream."""
    if handle == 0:
        return torch.cuda.default_stream()
    return torch.cuda.ExternalStream(handle)


def preload(kernel, grid: tuple, *args, **meta) -> None:
    """Compile and load `kernel` for this class of arguments without launching it. A kernel
    queued while one of ours may spin on a peer must be loaded first: CUDA's lazy loading may
    synchronise the context to load a module, and a host waiting for its spinning kernel while
    the peers wait for it never returns (NVIDIA's lazy loading guide, "concurrent execution")."""
    if _current_device is None or not hasattr(kernel, "warmup"):
        return
    key = (kernel, grid, tuple(meta.items()), _current_device(), tuple(map(arg_class, args)))
    if key in _runners:
        return
    compiled = kernel.warmup(*args, grid=grid, **meta)
    init_handles = getattr(compiled, "_init_handles", None)
    if init_handles is None:
        return  # a Triton without it: the first launch loads the module
    init_handles()
    _remember(key, _runner_entry(kernel, grid, args, meta, compiled))


def _remember(key, entry) -> None:
    if len(_runners) >= _MAX_RUNNERS:  # many shapes (dynamic M): start over
        _runners.clear()
    _runners[key] = entry


def _runner_entry(kernel, grid, args, meta, compiled):
    """The compiled kernel's runner and the values Triton passes for the params after `args`,
    or None (this kernel takes the ordinary path)."""
    if compiled is None or not hasattr(compiled, "__getitem__") or not hasattr(kernel, "fn"):
        return None  # the interpreter, or a Triton that does not hand the kernel back
    params = list(inspect.signature(kernel.fn).parameters.values())
    tail = []
    for p in params[len(args):]:
        if p.name in meta:
            tail.append(meta[p.name])
        elif p.default is not inspect.Parameter.empty:
            tail.append(p.default)
        else:
            return None  # a param passed some other way: keep Triton's binding
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    return compiled[grid3], tuple(tail)
