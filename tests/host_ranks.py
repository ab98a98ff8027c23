"""Ranks emulated in host memory for the runtimes' data paths on CPU: a symmetric buffer and
flag words behind real addresses (HostContext), the runtime module's stream operations done at
once (host_driver), and the all-reduce runtime wired to them (all_reduce_on_host)."""

import ctypes
import math
from types import SimpleNamespace

import torch



class HostBuffer:
    """A rank's symmetric buffer as host memory (the runtime's view(rank, dtype, shape))."""

    def __init__(self, nbytes):
        self.local = torch.zeros(nbytes, dtype=torch.uint8)
        self.nbytes, self.ptr_table = nbytes, None

    def view(self, rank, dtype, shape, byte_offset=0):
        return self.local[byte_offset:].view(dtype)[:math.prod(shape)].view(shape)


class HostContext:
    """What the runtimes read of an OpContext, on host memory: data and flag words behind real
    addresses, so that the runtime's copies (driver.memcpy / write) move real bytes."""

    READY = 0

    def __init__(self, world, rank, nbytes):
        self.world, self.rank, self.epoch, self.device = world, rank, 0, "cpu"
        self.DONE = world  # as OpContext's: W words of READY, then W of DONE
        self.data = HostBuffer(nbytes)
        self.flag_words = torch.zeros(64, dtype=torch.int32)
        self.side = SimpleNamespace(cuda_stream=0)
        self.ev_start = self.ev_end = 0
        self.ev_chunks = [0] * world
        self.ev_sides = [0] * 4
        self.flags = SimpleNamespace(ptr_table=None, words=self.flag_words)
        self.err = None
        self.timeout_s = 0.0  # unbounded: the emulated ranks run producers first

    def sides(self, count):
        return [self.side] * max(1, min(4, count))

    def chunk_events(self, count):
        return [0] * max(count, self.world)

    def connect(self, ranks):
        self.data_addrs = [r.data.local.data_ptr() for r in ranks]
        self.flag_bases = [r.flag_words.data_ptr() for r in ranks]

    def next_epoch(self):
        self.epoch += 1
        return self.epoch

    def flag_addr(self, idx):
        return self.flag_bases[self.rank] + 4 * idx

    def peer_flag_addr(self, peer, idx):
        return self.flag_bases[peer] + 4 * idx

    def signal(self, stream, epoch, dst_addrs):
        for dst in dst_addrs:
            ctypes.c_int32.from_address(dst).value = epoch


def random_terms(world, rows, ks, n, seed, dtype=torch.bfloat16):
    """Each emulated rank's terms of a sum of matmul products, ([a_i], [b_i]) with a_i
    [world * rows, k_i] and b_i [k_i, n] (one term for a plain matmul)."""
    gen = torch.Generator().manual_seed(seed)
    return [([torch.randn(world * rows, k, generator=gen).to(dtype) for k in ks],
             [(torch.randn(k, n, generator=gen) / k ** 0.5).to(dtype) for k in ks])
            for _ in range(world)]


def host_driver(module, monkeypatch):
    """The runtime module's stream operations on host memory: copies and writes done at once,
    events and waits no-ops (the emulated ranks run one after the other)."""
    fake = SimpleNamespace(record=lambda *a: None, stream_wait=lambda *a: None,
                           memcpy=lambda dst, src, n, stream: ctypes.memmove(dst, src, n),
                           write=lambda stream, addr, v: setattr(
                               ctypes.c_int32.from_address(addr), "value", v))
    monkeypatch.setattr(module, "driver", fake)
    monkeypatch.setattr(module, "current_stream", lambda: 0)
    monkeypatch.setattr(module, "check_errors", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def all_reduce_on_host(monkeypatch, ctx, on_launch):
    """runtime/all_reduce on ranks emulated in host memory (host_driver): `ctx` as every
    context, the device epoch 7, 132 SMs, each kernel launch handed to
    on_launch(kernel, grid, args, meta) instead of Triton."""
    from ditron_inductor.runtime import all_reduce

    host_driver(all_reduce, monkeypatch)
    monkeypatch.setattr(all_reduce, "get_context", lambda *args, **kw: ctx)
    monkeypatch.setattr(all_reduce, "device_epoch", lambda c: SimpleNamespace(
        epoch=torch.tensor([0, 7], dtype=torch.int32), arrive=None, side=None))
    monkeypatch.setattr(all_reduce, "num_sms", lambda device: 132)
    monkeypatch.setattr(all_reduce, "build_outside_graph_pools", lambda device, fn: None)
    monkeypatch.setattr(all_reduce, "launch", lambda kernel, grid, *args, **meta: on_launch(
        kernel, grid, args, meta))
