"""This machine's calibration (`python -m ditron_inductor.calibrate`), as the scheduler reads it:
a JSON file in $XDG_CACHE_HOME/ditron_inductor/calibration/ (default ~/.cache) named by what makes
it valid (`machine()`), whether the shipped tables' card is this one, and the ranks' agreement:
where their calibrations differ (`agreed`) every site keeps NCCL + cuBLAS.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import os
import pathlib
import re
from typing import NamedTuple, Optional

from ..log_names import LOGGER_NAME, process_rank

log = logging.getLogger(LOGGER_NAME)

# The cards the shipped tables were measured on (their sources' machines): Hopper SXM, 132 SMs,
# NVLink; the tables mix the two. No GPU visible ("cpu": decisions for CUDA tasks in tests on a
# host without one) reads them too.
SHIPPED_CARDS = ("H100", "H200")
CALIBRATION = "this machine's calibration"
# Ranks reach their first decision within one compile of each other; a rank not there by then
# counts as disagreeing (bounded: never a hang).
AGREE_TIMEOUT_S = 60.0


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ditron_inductor" / "calibration"


@functools.cache
def machine() -> dict:
    """What makes a calibration valid on this machine ("cpu": no GPU visible)."""
    import importlib.metadata

    import torch

    try:
        ditron = importlib.metadata.version("ditron-inductor")
    except importlib.metadata.PackageNotFoundError:  # a checkout on the path, not installed
        ditron = "source"
    m = dict(gpu="cpu", sms=0, memory_gib=0, peers="", driver="", torch=torch.__version__,
             triton="", ditron=ditron)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        n = torch.cuda.device_count()
        access = [torch.cuda.can_device_access_peer(i, j)
                  for i in range(n) for j in range(n) if i != j]
        driver = pathlib.Path("/proc/driver/nvidia/version")
        found = re.search(r"\d+\.\d+[.\d]*", driver.read_text()) if driver.exists() else None
        m.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30),
                 peers=f"{n} GPUs, peer access "
                       f"{'all' if all(access) else 'some' if any(access) else 'none'}",
                 driver=found.group() if found else "", triton=__import__("triton").__version__)
    return m


def calibration_path(m: Optional[dict] = None) -> pathlib.Path:
    m = m or machine()
    key = hashlib.sha1(json.dumps(m, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"{m['gpu'].replace(' ', '_')}-{key}.json"


def card_matches() -> bool:
    """Whether the shipped tables were measured on this card."""
    gpu = machine()["gpu"]
    return gpu == "cpu" or any(card in gpu for card in SHIPPED_CARDS)


class Local(NamedTuple):
    data: dict  # this machine's calibration, {} where none
    digest: str


_round = [0]  # agreement rounds: a re-read (clear_caches) agrees anew, on every rank alike


@functools.cache
def local() -> Local:
    path = calibration_path()
    text = path.read_text() if path.exists() else ""
    return Local(json.loads(text) if text else {},
                 hashlib.sha1(text.encode()).hexdigest()[:12] if text else "none")


@functools.cache
def calibrated() -> bool:
    """Whether this machine has evidence of its own card; says once (rank 0) where it has not."""
    if local().data or card_matches():
        return True
    if process_rank() == 0:
        log.warning("ditron: this machine (%s) is uncalibrated and the shipped tables were "
                    "measured on %s: fused only where the link model predicts a wide gain. "
                    "Calibrate once per world size W: torchrun --nproc-per-node W -m "
                    "ditron_inductor.calibrate --sites llama-8b", machine()["gpu"],
                    "/".join(SHIPPED_CARDS))
    return False


def agree(store, rank: int, world: int, digest: str, timeout_s: float) -> str:
    """The ranks' verdict on their digests in `store`: "same", "differ", or "late r,..." (ranks
    that did not set theirs in time). Each rank sets its own, waits for the others' (bounded)
    and proposes a verdict; the first proposal stands on every rank."""
    keys = [str(r) for r in range(world)]
    store.set(keys[rank], digest)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        proposal = "same" if all(store.get(k).decode() == digest for k in keys) else "differ"
    except Exception:  # noqa: BLE001 - a rank that did not come in time: not agreed
        proposal = "late " + ",".join(k for k in keys if not store.check([k]))
    return store.compare_set("verdict", "", proposal).decode()


@functools.cache
def agreed() -> bool:
    """Whether every rank of the default group holds the same calibration (checked once)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 \
            or dist.get_backend() == "fake":
        return True
    from torch.distributed.distributed_c10d import _get_default_store

    store = dist.PrefixStore(f"ditron/evidence/{_round[0]}", _get_default_store())
    verdict = agree(store, dist.get_rank(), dist.get_world_size(), local().digest,
                    AGREE_TIMEOUT_S)
    if verdict == "differ":
        log.warning("ditron: the ranks' scheduler evidence differs (this rank's calibration: "
                    "%s, %s): every site keeps NCCL + cuBLAS. Calibrate every machine alike, or "
                    "remove the calibration (python -m ditron_inductor.calibrate --show)",
                    local().digest, calibration_path())
    elif verdict != "same":
        log.warning("ditron: rank(s) %s did not reach the check of the ranks' scheduler evidence "
                    "within %.0f s of the others (it runs at a process's first compile; a compile "
                    "on some ranks only waits for it): every site keeps NCCL + cuBLAS",
                    verdict.removeprefix("late "), AGREE_TIMEOUT_S)
    return verdict == "same"


def cache_key() -> str:
    """The evidence in the pass's cache key; with a GPU every rank checks the agreement here, at
    its first compile, whether or not Inductor's cache then serves the graph."""
    import torch

    return local().digest + ("" if not torch.cuda.is_available() else f":{agreed()}")


def clear_caches() -> None:
    """Read the file again and agree on it anew."""
    _round[0] += agreed.cache_info().currsize
    for cached in (machine, local, calibrated, agreed):
        getattr(cached, "cache_clear", lambda: None)()  # a test may have replaced one
