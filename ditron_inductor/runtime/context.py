"""Per-op contexts: the buffers, flags, streams and events of one fused op on one process group.

A context is created once per (op, group, symmetric-memory backend, size class) at the first call
that needs it (a collective step: every rank makes the same calls in the same order), and reused:
no allocation or host synchronisation on the hot path. Each call takes the next *epoch*
(1, 2, 3, ...); flags hold epochs and only grow, so nothing is reset between calls.

Symmetric flag words (int32, one symmetric allocation per context), written by peers:
  READY + r : rank r's data for epoch e is in place       (AG: r's shard is in r's buffer;
                                                            RS: r pushed its partial into mine)
  DONE + r  : rank r has finished with my buffer for epoch e (AG: r pulled my shard;
                                                            RS: r has reduced, its slots are free)
A flag is set on a peer as on this GPU, by a stream write (cuStreamWriteValue32) of the epoch to
the peer's mapped word: ordered after the stream's earlier work, copies included, and fenced so
that the data is visible before the flag. It costs the stream 3 us between two kernels, where the
4-byte copy-engine copy of a local word used before cost 12 us (benchmarks/bench_flags.py, 2x
H200, both backends).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Callable, Optional, TypeVar

import torch

from ..templates.flags import MAX_CHUNKS
from . import driver
from .symm import backend_for, choose_backend_name, group_barrier

T = TypeVar("T")
MIN_CLASS = 1 << 20
MAX_STREAMS = 4


def build_outside_graph_pools(device: torch.device, build: Callable[[], T]) -> T:
    """build() (which allocates state that outlives the call: contexts, flags, epochs), run where
    Inductor's CUDA-graph trees do not route allocations into their pool. They do so while they
    warm up and record a graph, for the current thread since torch 2.8 (the current stream
    before), and then refuse a pool holding tensors that no output tracks ("tensors in the
    cudagraph pool not tracked as outputs", seen on 8x H200 with torch 2.11). So: a helper thread,
    on a stream of its own, while this thread waits (collectives inside build() run there too)."""
    result: list = []

    def work():
        try:
            torch.cuda.set_device(device)  # the current device is per thread
            stream = torch.cuda.Stream(device=device)
            with torch.cuda.stream(stream):
                result.append(build())
            stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result.append(exc)

    helper = threading.Thread(target=work, name="ditron-setup")
    helper.start()
    helper.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def size_class(nbytes: int) -> int:
    c = MIN_CLASS
    while c < nbytes:
        c <<= 1
    return c


class OpContext:
    READY = 0

    def __init__(self, group_name: str, backend_name: str, data_bytes: int, flag_words: int = 0):
        self.backend = backend_for(group_name, backend_name)
        self.rank = self.backend.rank
        self.world = self.backend.world
        self.DONE = self.world
        self.data = self.backend.alloc(data_bytes)
        self.flags = self.backend.alloc(4 * max(2 * self.world, flag_words))
        self.flags.local.zero_()
        self.device = self.data.local.device
        w = self.world
        self.data_addrs = [t.data_ptr() for t in self.data.peers]
        self.flag_bases = [t.data_ptr() for t in self.flags.peers]
        # chunk flags of the local gathered buffer (AG): written by copy streams, read by the GEMM
        self.chunk_flags = torch.zeros(w, dtype=torch.int32, device=self.device)
        self.err = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._sides = [torch.cuda.Stream(device=self.device, priority=-1)]
        # AG with cuBLAS: my shard's local copies beside the GEMM of my rows (the peers wait
        # for the first of them, hence the priority)
        self.local = torch.cuda.Stream(device=self.device, priority=-1)
        self.ev_start, self.ev_end = driver.event(), driver.event()
        self.ev_buffer = driver.event()  # AG: my shard is in my symmetric buffer
        self.ev_ready = driver.event()  # AG: every peer's shard is in its buffer
        self.ev_sides = [driver.event() for _ in range(MAX_STREAMS)]
        self.ev_chunks = [driver.event() for _ in range(w)]
        self.epoch = 0
        self.announced = 0  # announcements(): chunks announced so far, over every call
        self._counters: dict[int, list] = {}
        group_barrier(self.backend.group)  # every rank's flags are zero before anyone signals

    @property
    def side(self) -> torch.cuda.Stream:
        return self._sides[0]

    def sides(self, count: int) -> list:
        """`count` copy streams (1..MAX_STREAMS), created once."""
        count = max(1, min(MAX_STREAMS, count))
        while len(self._sides) < count:
            self._sides.append(torch.cuda.Stream(device=self.device, priority=-1))
        return self._sides[:count]

    def chunk_events(self, count: int) -> list:
        """At least `count` events of ev_chunks (one per rank from the start; a plan that cuts
        its GEMM into more row chunks than ranks adds the rest, once)."""
        while len(self.ev_chunks) < count:
            self.ev_chunks.append(driver.event())
        return self.ev_chunks

    def counters(self, nprog: int):
        """(arrival counters of the SM-pull plan with nprog programs, the value that means
        "arrived" for this call): each call adds nprog to every chunk's counter."""
        entry = self._counters.get(nprog)
        if entry is None:
            counters = build_outside_graph_pools(self.device, lambda: torch.zeros(
                self.world, dtype=torch.int32, device=self.device))
            entry = self._counters[nprog] = [counters, 0]
        entry[1] += 1
        return entry[0], entry[1] * nprog

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def announcements(self, count: int) -> int:
        """The flag value before this call's `count` announcements (a READY word that grows by
        one per chunk announced, c = 1..count: base + c), then counted. Not epoch x count: calls
        that cut different numbers of chunks share the context, and a value written by a call of
        more chunks would satisfy a later call's waits before its data is there. Every rank makes
        the same calls, so every rank counts alike."""
        base = self.announced
        self.announced += count
        return base

    def flag_addr(self, idx: int) -> int:
        """Address of my own flag word idx (what my streams wait on)."""
        return self.flag_bases[self.rank] + 4 * idx

    def peer_flag_addr(self, peer: int, idx: int) -> int:
        return self.flag_bases[peer] + 4 * idx

    def signal(self, stream: int, epoch: int, dst_addrs) -> None:
        """After the prior work of `stream`: every dst flag word (local or peer) = epoch."""
        for dst in dst_addrs:
            driver.write(stream, dst, epoch)


_contexts: dict[tuple, OpContext] = {}


_by_request: dict[tuple, OpContext] = {}


def get_context(op: str, group_name: str, symm_mem_backend: str, data_bytes: int,
                flag_words: int = 0, create: bool = True) -> Optional[OpContext]:
    """The op's context for this size class on the plan's symmetric-memory backend ("auto",
    "nvshmem" or "torch"); with create=False (e.g. during CUDA-graph capture, where the
    collective setup cannot run) None if it does not exist yet."""
    cls = size_class(data_bytes)
    fast_key = (op, group_name, symm_mem_backend, cls)
    ctx = _by_request.get(fast_key)
    if ctx is not None or not create:
        return ctx
    backend_name = choose_backend_name(group_name, symm_mem_backend)
    key = (op, group_name, backend_name, cls)
    ctx = _contexts.get(key)
    if ctx is None:
        ctx = _contexts[key] = build_outside_graph_pools(
            torch.device("cuda", torch.cuda.current_device()),
            lambda: OpContext(group_name, backend_name, cls, flag_words))
    _by_request[fast_key] = ctx
    return ctx


POLLS_PER_S = 1_000_000  # where waits count polls (templates/flags.WAIT_IN_NS): about 1 us each


def wait_limit(plan) -> int:
    """The bound of the kernels' waits (0: unbounded) from the plan's timeout, in their units:
    nanoseconds on a GPU, polls under the interpreter (templates/flags.WAIT_IN_NS)."""
    from ..templates.flags import WAIT_IN_NS

    return int(plan.wait_timeout_s * (1e9 if WAIT_IN_NS else POLLS_PER_S))


def clear_contexts() -> None:
    for ctx in _contexts.values():
        for ev in [ctx.ev_start, ctx.ev_end, ctx.ev_buffer, ctx.ev_ready, *ctx.ev_sides,
                   *ctx.ev_chunks]:
            driver.destroy_event(ev)
    _contexts.clear()
    _by_request.clear()


@dataclasses.dataclass
class DeviceEpoch:
    """The device words of a context whose epochs live on the device (the all-reduce and the
    reduce-scatter pull): local, not symmetric."""

    epoch: torch.Tensor  # [last finished epoch, current epoch]
    arrive: torch.Tensor  # arrival counters: [kernel, chunk 0, chunk 1, ...]
    side: torch.cuda.Stream  # the kernel beside the GEMM runs here


# per context, dropped with it (a new context starts from zeroed flags and epoch 1 on every rank)
_epochs: "weakref.WeakKeyDictionary[OpContext, DeviceEpoch]" = weakref.WeakKeyDictionary()


def device_epoch(ctx: OpContext) -> DeviceEpoch:
    state = _epochs.get(ctx)
    if state is None:
        state = _epochs[ctx] = build_outside_graph_pools(ctx.device, lambda: DeviceEpoch(
            epoch=torch.tensor([0, 1], dtype=torch.int32, device=ctx.device),
            arrive=torch.zeros(1 + MAX_CHUNKS, dtype=torch.int32, device=ctx.device),
            side=torch.cuda.Stream(device=ctx.device, priority=-1)))
    return state
