"""How fast one rank pulls its peers' shards (the all-gather's transfer), by method, alone and
beside a cuBLAS GEMM on another stream. Prints a table (GB/s of pulled bytes per GPU, median
over reps, slowest rank).

    torchrun --nproc-per-node 4 benchmarks/bench_copy.py [--mb 32] [--reps 10]

Methods (each pulls the W - 1 peer shards of `--mb` MB in ring order, rank + 1 first):
  driver_ce     cuMemcpyAsync from the peer's symmetric buffer, one stream (ditron's AG plans)
  driver_ce_wS  the same, each peer on its own stream
  torch_copy    Tensor.copy_ from the peer's buffer view, one stream (PyTorch's fused AG)
and one local copy of `--mb` MB (my shard into my rows of the output): local_ce (cuMemcpyAsync,
which the driver runs on SMs), local_ce_hint (cuMemcpyBatchAsync with the hint to overlap compute,
memcpy_copy_engine) and local_sm (the elementwise kernel); GB/s of copied bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from ditron_inductor.runtime import driver

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_location", _MemLocation),
                ("dst_location", _MemLocation), ("flags", ctypes.c_uint)]


@functools.lru_cache(None)
def _batch_copy():
    """(cuMemcpyBatchAsync, whether it takes failIdx) or None: CUDA 13 drivers export the call
    without failIdx as cuMemcpyBatchAsync_v2 beside the 12.8 one with it."""
    lib = driver._lib()
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


def memcpy_copy_engine(dst: int, src: int, nbytes: int, stream: int, device: int) -> None:
    """A copy within GPU `device`, queued with the hint that it should overlap compute (CUDA
    12.8+ drivers; the driver may then run it on a copy engine); driver.memcpy where the driver
    lacks the call."""
    batch = _batch_copy()
    if batch is None:
        return driver.memcpy(dst, src, nbytes, stream)
    fn, fail_idx = batch
    attrs = _overlap_attributes(device)
    args = [(ctypes.c_uint64 * 1)(dst), (ctypes.c_uint64 * 1)(src), (ctypes.c_size_t * 1)(nbytes),
            ctypes.c_size_t(1), ctypes.byref(attrs), (ctypes.c_size_t * 1)(0), ctypes.c_size_t(1)]
    if fail_idx:
        args.append(ctypes.byref(ctypes.c_size_t(0)))
    driver._check(fn(*args, ctypes.c_void_p(stream)), "cuMemcpyBatchAsync")


def timed(fn, streams, reps, before=None):
    """Median ms from the first stream's start to every stream's end (max over ranks). before:
    (stream, fn) queued ahead of the start, untimed (a GEMM on its own stream beside the timed
    work; a spin on the timed stream, behind which the host queues it all)."""
    main = torch.cuda.current_stream()
    times = []
    for _ in range(reps + 2):
        dist.barrier()
        torch.cuda.synchronize()
        if before is not None:
            with torch.cuda.stream(before[0]):
                before[1]()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for s in streams:
            s.wait_stream(main)
        fn()
        for s in streams:
            main.wait_stream(s)
        end.record(main)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = torch.tensor(statistics.median(times[2:]), device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    group = dist.group.WORLD
    numel = args.mb * 2 ** 20 // 2
    buf = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(buf, group.group_name)
    buf.copy_(torch.randn(numel, device="cuda"))
    peers = [(rank + i) % world for i in range(1, world)]
    views = {p: handle.get_buffer(p, (numel,), torch.bfloat16) for p in peers}
    out = torch.empty(world, numel, dtype=torch.bfloat16, device="cuda")
    streams = [torch.cuda.Stream() for _ in peers]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 1280, device="cuda", dtype=torch.bfloat16)
    gemm = (torch.cuda.Stream(), lambda: torch.mm(a, b))

    def driver_ce(wide):
        def run():
            for i, p in enumerate(peers):
                s = streams[i if wide else 0]
                driver.memcpy(out[p].data_ptr(), views[p].data_ptr(), numel * 2, s.cuda_stream)
        return run, streams if wide else streams[:1]

    def torch_copy():
        with torch.cuda.stream(streams[0]):
            for p in peers:
                out[p].copy_(views[p])

    def local(kind):  # my own shard into the gathered output: what the AG plans also copy
        def run():
            with torch.cuda.stream(streams[0]):
                if kind == "ce":
                    driver.memcpy(out[rank].data_ptr(), buf.data_ptr(), numel * 2,
                                  streams[0].cuda_stream)
                elif kind == "ce_hint":
                    memcpy_copy_engine(out[rank].data_ptr(), buf.data_ptr(), numel * 2,
                                       streams[0].cuda_stream, rank)
                else:
                    torch.mul(buf, 1, out=out[rank])
        return run, streams[:1]

    local_rows = []
    for kind in ("ce", "ce_hint", "sm"):
        fn, used = local(kind)
        for beside in (False, True):
            out[rank].zero_()
            ms = timed(fn, used, args.reps, gemm if beside else None)
            assert torch.equal(out[rank], buf), f"local_{kind}: wrong data"
            local_rows.append((f"local_{kind}", "beside GEMM" if beside else "alone", ms,
                               numel * 2 / 1e9 / ms * 1e3))
    methods = {"driver_ce": driver_ce(False), "driver_ce_wS": driver_ce(True),
               "torch_copy": (torch_copy, streams[:1])}
    pulled_gb = (world - 1) * numel * 2 / 1e9
    gemm_ms = timed(gemm[1], [], args.reps)
    rows = []
    for name, (fn, used) in methods.items():
        for beside in (False, True):
            ms = timed(fn, used, args.reps, gemm if beside else None)
            for p in peers:
                assert torch.equal(out[p], views[p]), f"{name}: wrong data from rank {p}"
            rows.append((name, "beside GEMM" if beside else "alone", ms, pulled_gb / ms * 1e3))
    if rank == 0:
        print(f"\nPull of {world - 1} peer shards of {args.mb} MB on {world} ranks "
              f"(GEMM 8192x8192x1280 alone: {gemm_ms:.3f} ms)\n")
        print("| method | when | ms | GB/s per GPU |\n| --- | --- | --- | --- |")
        for name, when, ms, gbps in rows + local_rows:
            print(f"| {name} | {when} | {ms:.3f} | {gbps:.0f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
