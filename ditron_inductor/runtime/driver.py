"""Thin ctypes bindings of the CUDA driver calls that the fused ops issue on their hot path.

One fused call issues dozens of small stream operations (waits, flag writes, copies, events);
through Triton launches or torch ops, which cost the host many times a ctypes driver call, the
fused ops would be bound by the host whatever the shape.

- `wait_geq`: cuStreamWaitValue32 (GEQ, a cyclic int32 compare): the stream waits for a flag
  word without occupying an SM, so a persistent GEMM holding every SM never starves the transfer
  it waits for.
- `write`: cuStreamWriteValue32: a flag word, local or a peer's mapped one, = value once the
  stream's prior work is done (after a memory barrier); it holds the stream up less than a 4-byte
  copy would (benchmarks/bench_flags.py).
- `memcpy`: cuMemcpyAsync (unified addressing): the copy engine for peer memory; a copy within
  one GPU runs on the SMs (benchmarks/bench_copy.py), so beside a cuBLAS GEMM, which holds every
  SM, it waits for the GEMM's last wave.
"""

from __future__ import annotations

import ctypes
import functools

CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
CU_EVENT_DISABLE_TIMING = 0x2

_u64, _u32, _vp = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p


@functools.lru_cache(None)
def _lib():
    lib = ctypes.CDLL("libcuda.so.1")
    sigs = {
        "cuStreamWaitValue32_v2": [_vp, _u64, _u32, ctypes.c_uint],
        "cuStreamWriteValue32_v2": [_vp, _u64, _u32, ctypes.c_uint],
        "cuMemcpyAsync": [_u64, _u64, ctypes.c_size_t, _vp],
        "cuEventCreate": [ctypes.POINTER(_vp), ctypes.c_uint],
        "cuEventRecord": [_vp, _vp],
        "cuStreamWaitEvent": [_vp, _vp, ctypes.c_uint],
        "cuEventDestroy_v2": [_vp],
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"ditron: {what} failed with CUresult {rc}")


def wait_geq(stream: int, addr: int, value: int) -> None:
    """Work queued on `stream` (a CUstream handle) after this waits until *(int32*)addr >= value."""
    _check(_lib().cuStreamWaitValue32_v2(stream, addr, value & 0xFFFFFFFF,
                                         CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")


def write(stream: int, addr: int, value: int) -> None:
    _check(_lib().cuStreamWriteValue32_v2(stream, addr, value & 0xFFFFFFFF,
                                          CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")


def memcpy(dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(_lib().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")


def event() -> int:
    ev = _vp()
    _check(_lib().cuEventCreate(ctypes.byref(ev), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    return ev.value


def record(ev: int, stream: int) -> None:
    _check(_lib().cuEventRecord(ev, stream), "cuEventRecord")


def stream_wait(stream: int, ev: int) -> None:
    _check(_lib().cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")


def destroy_event(ev: int) -> None:
    try:
        _lib().cuEventDestroy_v2(ev)
    except Exception:  # noqa: BLE001 - at exit the driver may be gone
        pass
