"""Symmetric memory per process group, on two backends.

A `SymmBuffer` is one allocation of the same size on every rank of a group, with views of every
peer's copy (what the copy engine reads or writes) and a device table of the peers' base
addresses (what a Triton kernel indexes). "torch": PyTorch symmetric memory, for any group.
"nvshmem": nvshmem4py, initialised once per process over the default group; its allocations are
collective over *all* processes, so it serves only groups spanning the world. "auto" (the plan's
symm_mem_backend, DITRON_SYMM_MEM_BACKEND) takes nvshmem where it imports and the group is the
world, else torch: a choice of the group and the installed packages, the same on every rank.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import warnings

import torch
import torch.distributed as dist

from ..log_names import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)


def resolve_group(group_name: str):
    from torch._C._distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def group_barrier(group) -> None:
    """Host-and-device barrier over the group (setup only, never on the hot path)."""
    torch.cuda.synchronize()
    t = torch.zeros(1, device="cuda")
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize()


class SymmBuffer:
    """nbytes on every rank of a group: `local` (uint8 view of this rank's copy), `peers[r]`
    (rank r's copy, addressable from this GPU) and `ptr_table` (int64 [world] on the device)."""

    def __init__(self, local: torch.Tensor, peers: list[torch.Tensor], owner=None):
        self.local = local
        self.peers = peers
        self.nbytes = local.numel()
        self.ptr_table = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64,
                                      device=local.device)
        self._owner = owner  # keeps the backend handle alive
        self.words = local.view(torch.int32) if self.nbytes % 4 == 0 else None  # flag words
        self._views: dict = {}  # the fused ops take the same few views call after call

    def view(self, rank: int, dtype: torch.dtype, shape, byte_offset: int = 0) -> torch.Tensor:
        """Rank `rank`'s copy (-1: mine) from byte_offset on as a `dtype` tensor of `shape`."""
        key = (rank, dtype, tuple(shape), byte_offset)
        found = self._views.get(key)
        if found is None:
            if len(self._views) >= 1024:  # many shapes (dynamic M): start over
                self._views.clear()
            nbytes = math.prod(shape) * dtype.itemsize
            assert byte_offset + nbytes <= self.nbytes, "symmetric buffer too small"
            src = self.local if rank < 0 else self.peers[rank]
            found = self._views[key] = src[byte_offset:byte_offset + nbytes].view(dtype).view(shape)
        return found


class TorchSymmBackend:
    name = "torch"

    def __init__(self, group_name: str):
        self.group_name = group_name
        self.group = resolve_group(group_name)
        self.rank = self.group.rank()
        self.world = self.group.size()
        import torch.distributed._symmetric_memory as symm_mem

        self._symm = symm_mem
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:  # older torch needs the group registered before rendezvous; harmless later
                symm_mem.enable_symm_mem_for_group(group_name)
            except Exception:  # noqa: BLE001
                pass
        self._handles = []

    def alloc(self, nbytes: int) -> SymmBuffer:
        t = self._symm.empty(nbytes, dtype=torch.uint8,
                             device=torch.device("cuda", torch.cuda.current_device()))
        handle = self._symm.rendezvous(t, self.group_name)
        peers = [t if r == self.rank else handle.get_buffer(r, (nbytes,), torch.uint8)
                 for r in range(self.world)]
        self._handles.append((t, handle))
        return SymmBuffer(t, peers, owner=handle)

    def close(self) -> None:
        self._handles.clear()


class NvshmemSymmBackend:
    name = "nvshmem"
    _initialised = False
    _tensors: list = []

    def __init__(self, group_name: str):
        self.group_name = group_name
        self.group = resolve_group(group_name)
        self.rank = self.group.rank()
        self.world = self.group.size()
        self.global_ranks = dist.get_process_group_ranks(self.group)
        self._init_once()
        import nvshmem.core as nvshmem

        self._nv = nvshmem

    @classmethod
    def _init_once(cls) -> None:
        if cls._initialised:
            return
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        # The symmetric heap must hold the workspaces (default 1 GiB is tight for big GEMMs).
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "4G")
        import nvshmem.core as nvshmem
        try:
            from cuda.core import Device
        except ImportError:  # cuda-core < 1.0
            from cuda.core.experimental import Device

        dev = Device(torch.cuda.current_device())
        dev.set_current()
        rank, world = dist.get_rank(), dist.get_world_size()
        uid = nvshmem.get_unique_id(empty=(rank != 0))
        obj = [uid if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        nvshmem.init(device=dev, uid=obj[0], rank=rank, nranks=world, initializer_method="uid")
        cls._initialised = True
        atexit.register(cls._finalize)
        log.info("nvshmem initialised: rank %d of %d", rank, world)

    @classmethod
    def _finalize(cls) -> None:
        if not cls._initialised:
            return
        import nvshmem.core as nvshmem

        try:
            torch.cuda.synchronize()
            for t in cls._tensors:  # collective frees, in allocation order on every rank
                nvshmem.free_tensor(t)
            cls._tensors.clear()
            nvshmem.finalize()
        except Exception as e:  # noqa: BLE001 - never fail at exit
            log.debug("nvshmem finalize: %s", e)
        cls._initialised = False

    def alloc(self, nbytes: int) -> SymmBuffer:
        t = self._nv.tensor((nbytes,), dtype=torch.uint8, except_on_del=False)
        NvshmemSymmBackend._tensors.append(t)
        peers = [t if gr == dist.get_rank() else self._nv.get_peer_tensor(t, gr)
                 for gr in self.global_ranks]
        return SymmBuffer(t, peers)

    def close(self) -> None:
        pass


def choose_backend_name(group_name: str, choice: str) -> str:
    """The backend that serves the group for the option's value ("auto", "nvshmem", "torch")."""
    if choice == "torch":
        return choice
    whole_world = resolve_group(group_name).size() == dist.get_world_size()
    if choice == "nvshmem":
        if not whole_world:
            log.info("group %s does not span the world: torch symmetric memory instead of "
                     "nvshmem (NVSHMEM allocations are world-collective)", group_name)
            return "torch"
        return choice
    if whole_world:
        try:
            import nvshmem.core  # noqa: F401
        except Exception:  # noqa: BLE001 - any import problem means: not available
            return "torch"
        return "nvshmem"
    return "torch"


_backends: dict[tuple[str, str], object] = {}


def backend_for(group_name: str, name: str):
    key = (group_name, name)
    if key not in _backends:
        # name: choose_backend_name's, nvshmem only for a group spanning the world
        backend = NvshmemSymmBackend if name == "nvshmem" else TorchSymmBackend
        _backends[key] = backend(group_name)
        log.info("symmetric memory for group %s: %s backend", group_name, name)
    return _backends[key]


def close_all() -> None:
    for b in _backends.values():
        b.close()
    _backends.clear()
