"""Thin ctypes bindings of the CUDA driver calls that the fused ops issue on their hot path.

Why the driver and not torch/Triton calls: one fused call issues ~40 small stream operations
(waits, flag writes, chunk copies, events). Measured on the 8x H200 machine (2026-11-20), a Triton
launch from Python costs ~100 us of host time and a torch op ~10-20 us, which made the fused ops
host-bound (1.2-1.7 ms per call whatever the shape); a ctypes driver call costs ~1-2 us.

- `wait_geq`: cuStreamWaitValue32 (GEQ, cyclic int32 compare): the stream waits until a flag word
  reaches a value, without occupying an SM, so a persistent GEMM holding every SM can never starve
  the transfer it waits for.
- `write`: cuStreamWriteValue32: a flag word, local or a peer's mapped one, = value once the prior
  work of the stream is done (the write is ordered after a memory barrier): 3 us of the stream's
  time, where a 4-byte copy of a local word to the peer cost 12 (benchmarks/bench_flags.py).
- `memcpy`: cuMemcpyAsync (unified addressing): the copy engine for peer memory. A copy within
  one GPU runs as a kernel on the SMs (benchmarks/bench_copy.py):
  beside a cuBLAS GEMM, whose persistent kernel holds every SM, it waits for the GEMM's last wave.
- `memcpy_copy_engine`: one cuMemcpyBatchAsync copy with the hint to overlap compute
  (CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE, CUDA 12.8+ drivers): the driver may run a local copy
  on a copy engine instead; cuMemcpyAsync where the driver lacks the call.
- events: cuEventCreate (timing disabled), cuEventRecord, cuStreamWaitEvent.
"""

from __future__ import annotations

import ctypes
import functools

CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
CU_EVENT_DISABLE_TIMING = 0x2
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1

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


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_location", _MemLocation),
                ("dst_location", _MemLocation), ("flags", ctypes.c_uint)]


@functools.lru_cache(None)
def _batch_copy():
    """(cuMemcpyBatchAsync, whether it takes failIdx) or None: CUDA 13 drivers export the call
    without failIdx as cuMemcpyBatchAsync_v2 beside the 12.8 one with it."""
    lib = _lib()
    for name, fail_idx in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        try:
            fn = getattr(lib, name)
        except AttributeError:
            continue
        fn.restype = ctypes.c_int
        return fn, fail_idx
    return None


@functools.lru_cache(None)
def _overlap_attributes(device: int) -> _MemcpyAttributes:
    here = _MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device)
    return _MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, here, here,
                             CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)


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


def memcpy_copy_engine(dst: int, src: int, nbytes: int, stream: int, device: int) -> None:
    """A copy within GPU `device`, queued with the hint that it should overlap compute."""
    batch = _batch_copy()
    if batch is None:
        return memcpy(dst, src, nbytes, stream)
    fn, fail_idx = batch
    attrs = _overlap_attributes(device)
    args = [(_u64 * 1)(dst), (_u64 * 1)(src), (ctypes.c_size_t * 1)(nbytes), ctypes.c_size_t(1),
            ctypes.byref(attrs), (ctypes.c_size_t * 1)(0), ctypes.c_size_t(1)]
    if fail_idx:
        args.append(ctypes.byref(ctypes.c_size_t(0)))
    _check(fn(*args, _vp(stream)), "cuMemcpyBatchAsync")


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
