"""Per-op contexts: the buffers, flags, streams and events of one fused op on one process group.

A context is made at the first call that needs it, per (op, group, symmetric-memory backend, size
class), a collective step (every rank makes the same calls in the same order), and reused: no
allocation or host synchronisation on the hot path. Each call takes the next epoch (1, 2, ...).

Symmetric flag words (int32), written by peers:
  READY + r : rank r's data for epoch e is in place (AG: its shard in its buffer; RS: its partial
              in my slot)
  DONE + r  : rank r is done with my buffer for epoch e (AG: it pulled my shard; RS: it has
              reduced, its slots are free)
A flag is set, on a peer as here, by a stream write of the epoch (driver.write): ordered after the
stream's earlier work, copies included, and fenced so that the data is visible before the flag;
streams wait for one with runtime/launch.wait_geq. The MoE ops set READY instead by a release
store at system scope in the launch that then waits (launch.wait_words; the dispatch's publish
kernel), in place of a stream write per peer and a wait launch.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Callable, Optional, TypeVar

import torch

from ..templates import flags
from . import driver, faults
from .kernel_launch import next_power_of_2
from .symm import backend_for, choose_backend_name, group_barrier

T = TypeVar("T")
MIN_CLASS = 1 << 20
MAX_STREAMS = 4


def build_outside_graph_pools(device: torch.device, build: Callable[[], T]) -> T:
    """build() (state that outlives the call: contexts, flags, epochs) on a helper thread with a
    stream of its own, while this thread waits: Inductor's CUDA-graph trees route the current
    thread's (torch < 2.8: stream's) allocations into their pool while they warm up and record,
    then refuse tensors there that no output tracks ("not tracked as outputs")."""
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
    return max(MIN_CLASS, next_power_of_2(nbytes))


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
        self.data_addrs = [t.data_ptr() for t in self.data.peers]
        self.flag_bases = [t.data_ptr() for t in self.flags.peers]
        # chunk flags of the local gathered buffer (AG): written by copy streams, read by the GEMM
        self.chunk_flags = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        # bounded waits: the group's timeout (the default bound) and the error words
        self.timeout_s = faults.group_timeout_s(self.backend.group)
        self.fault_id, self.err = faults.error_words(self.device)
        self._sides = [torch.cuda.Stream(device=self.device, priority=-1)]
        # AG: my shard's local copies beside cuBLAS (the peers wait for them: high priority)
        self.local = torch.cuda.Stream(device=self.device, priority=-1)
        self.ev_start, self.ev_end = driver.event(), driver.event()
        self.ev_buffer = driver.event()  # AG: my shard is in my symmetric buffer
        self.ev_ready = driver.event()  # AG: every peer's shard is in its buffer
        self.ev_sides = [driver.event() for _ in range(MAX_STREAMS)]
        self.ev_chunks = [driver.event() for _ in range(self.world)]
        self.epoch = 0
        group_barrier(self.backend.group)  # every rank's flags are zero before anyone signals
        faults.watch()

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
        """At least `count` events of ev_chunks (one per rank; more for a plan of more chunks)."""
        while len(self.ev_chunks) < count:
            self.ev_chunks.append(driver.event())
        return self.ev_chunks

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def flag_addr(self, idx: int) -> int:
        """Address of my own flag word idx (what my streams wait on)."""
        return self.flag_bases[self.rank] + 4 * idx

    def peer_flag_addr(self, peer: int, idx: int) -> int:
        return self.flag_bases[peer] + 4 * idx

    def signal(self, stream: int, epoch: int, dst_addrs) -> None:
        """After the prior work of `stream`: every dst flag word (local or peer) = epoch."""
        for dst in dst_addrs:
            driver.write(stream, dst, epoch)


_contexts: dict[tuple, OpContext] = {}  # by the backend that serves the request
_by_request: dict[tuple, OpContext] = {}  # by the backend the plan names ("auto" included)


def get_context(op: str, group_name: str, symm_mem_backend: str, data_bytes: int,
                flag_words: int = 0, create: bool = True) -> Optional[OpContext]:
    """The op's context for this size class on the plan's symmetric-memory backend; with
    create=False (CUDA-graph capture: no collective setup there) None if it does not exist."""
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


def wait_seconds(plan, ctx) -> float:
    """The bound of each wait in seconds (0: unbounded): the plan's ditron.wait_timeout_s, or
    where it is auto (None) the context's process-group timeout (runtime/faults.py says why)."""
    return ctx.timeout_s if plan.wait_timeout_s is None else plan.wait_timeout_s


def wait_limit(plan, ctx) -> int:
    """wait_seconds in the kernels' units: nanoseconds on a GPU, polls under the interpreter
    (templates/flags.WAIT_IN_NS)."""
    return int(wait_seconds(plan, ctx) * (1e9 if flags.WAIT_IN_NS else POLLS_PER_S))


def clear_contexts() -> None:
    for ctx in _contexts.values():
        for ev in [ctx.ev_start, ctx.ev_end, ctx.ev_buffer, ctx.ev_ready, *ctx.ev_sides,
                   *ctx.ev_chunks]:
            driver.destroy_event(ev)
    _contexts.clear()
    _by_request.clear()


@dataclasses.dataclass
class DeviceEpoch:
    """The device words of a context whose epochs live on the device (the all-reduce; local)."""

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
            arrive=torch.zeros(1 + flags.MAX_CHUNKS, dtype=torch.int32, device=ctx.device),
            side=torch.cuda.Stream(device=ctx.device, priority=-1)))
    return state
