"""A wait that gave up: its report, read on the host without synchronising, and the error.

Every flag wait is bounded by default by the timeout of the op's process group (the user's bound
on how late a peer may be, after which NCCL's watchdog aborts too); 0 is unbounded.

A wait that gives up (templates/flags.give_up) claims its error words and writes one
process-wide report into host-mapped (pinned) memory: the wait's code, the epoch it saw and the
one it expected, the late peer where the wait knows it, the words' id. Each call site (the layers
an op replaces, its plan's `site`) has error words of its own (`site_words`), so the report names
the layer whose wait gave up, not only the op. A kernel stores into it directly, also one
replayed from a CUDA graph. Two readers, neither synchronising the device:

- every fused call, first (`raise_if_failed`, a load of host memory): it raises `WaitTimeout`,
  naming the op, its layers, the rank, the flag, the peer and the epochs;
- a watcher thread (`watch`), every WATCH_S: where the program does not reach another fused call
  (its host blocked in a synchronisation, an NCCL collective, the exit), it logs the same message
  and, GRACE_S later if the process is still there, ends it with EXIT_CODE, as NCCL's watchdog
  ends a process at its timeout: after a wait gave up the call's outputs and the protocol's
  epochs are not valid, and the peer that did not come will not.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import sys
import threading
from typing import Callable, Optional

import torch

from ..log_names import LOGGER_NAME
from ..templates import flags

log = logging.getLogger(LOGGER_NAME)

DEFAULT_TIMEOUT_S = 600.0  # a group whose timeout cannot be read: NCCL's default
WATCH_S = 0.1
GRACE_S = 5.0
EXIT_CODE = 86

# the process-wide report (REPORT_WORDS int32, host-mapped), made with the first context
_report: Optional[torch.Tensor] = None
# per error words' id: what names their waits (op, rank, world, bound, flag namer, site), set at
# each call
_sites: dict[int, tuple] = {}
# per (context id, site): the site's error words (their id, the words)
_site_words: dict[tuple[int, str], tuple[int, torch.Tensor]] = {}
_next_id = [1]
_watcher: Optional[threading.Thread] = None


class WaitTimeout(RuntimeError):
    """A bounded flag wait of a fused kernel gave up: a peer never signalled."""


class ShapesDiffer(RuntimeError):
    """The ranks of a group called a fused op with inputs of different shapes, or some did not
    come to it within the bound."""


# (op, group, shapes) the group's ranks agreed on; per (op, group) the checks made so far
_agreed_shapes: set = set()
_shape_checks: dict[tuple[str, str], int] = {}


def check_shapes(op: str, group_name: str, shapes: tuple, bound_s) -> None:
    """Before an op's protocol: the first time this process calls `op` on the group with these
    `shapes` (what must agree on every rank: the inputs' sizes and dtype), the group's ranks
    compare them through the default store (scheduler/calibration.agree: one round trip per
    rank, once per shape; none at world size 1). Where they differ, or a rank does not come
    within bound_s (the plan's bound, else the group's timeout), every rank raises
    ShapesDiffer naming each rank's shapes, before any protocol step: inputs that differ
    within one buffer size class would otherwise give wrong numbers without an error."""
    key = (op, group_name, shapes)
    if key in _agreed_shapes:
        return
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

    from ..scheduler.calibration import agree

    if not dist.is_initialized():  # ranks emulated in one process (the tests): no group
        return
    group = _resolve_process_group(group_name)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > 1:
        bound_s = bound_s or group_timeout_s(group)
        n = _shape_checks.get(key[:2], 0)
        _shape_checks[key[:2]] = n + 1
        store = dist.PrefixStore(f"ditron/shapes/{group_name}/{op}/{n}", _get_default_store())
        verdict = agree(store, rank, world, repr(shapes), bound_s)
        if verdict == "differ":
            seen = "; ".join(f"rank {q}: {store.get(str(q)).decode()}" for q in range(world))
            raise ShapesDiffer(f"ditron: {op} on rank {rank} of {world}: the ranks' inputs "
                               f"differ ({seen}); every rank of the group must call a fused "
                               "collective with the same shapes")
        if verdict != "same":
            raise ShapesDiffer(f"ditron: {op} on rank {rank} of {world}: rank(s) "
                               f"{verdict.removeprefix('late ')} did not come to the op within "
                               f"{bound_s} s (it crashed, raised or took another branch before "
                               "it, or is later than the bound)")
    _agreed_shapes.add(key)


def group_timeout_s(group) -> float:
    """The process group's timeout in seconds (its backend's option), else DEFAULT_TIMEOUT_S."""
    for device_type in ("cuda", "cpu"):
        try:
            timeout = group._get_backend(torch.device(device_type)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend, or one without options
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
    return DEFAULT_TIMEOUT_S


def report() -> torch.Tensor:
    """The process-wide report; pinned where CUDA is (a kernel's stores reach it directly)."""
    global _report
    if _report is None:
        _report = torch.zeros(flags.REPORT_WORDS, dtype=torch.int32,
                              pin_memory=torch.cuda.is_available())
    return _report


def error_words(device, count: int = 1):
    """New error words (a context's or a call site's) and their id: no code, the id, the
    report's address; with count > 1 a list of `count` (id, words), made in one copy."""
    first = _next_id[0]
    _next_id[0] += count
    words = torch.zeros(count, flags.ERR_WORDS, dtype=torch.int32)
    words[:, flags.ERR_ID] = torch.arange(first, first + count, dtype=torch.int32)
    words.view(torch.int64)[:, 1] = report().data_ptr()
    words = words.to(device)
    made = [(first + i, words[i]) for i in range(count)]
    return made[0] if count == 1 else made


SPARE_WORDS = 64  # error words made ahead per device, for the sites a CUDA graph captures first
_spare: dict[str, list] = {}


def site_words(ctx, site: str) -> torch.Tensor:
    """The error words the waits of a call at `site` claim: the site's own, taken at its first
    call from words made ahead (a first call captured into a CUDA graph may not copy to the
    device); the context's where the call names no site, or where a capture finds none left."""
    if not site:
        return ctx.err
    key = (ctx.fault_id, site)
    if key not in _site_words:
        device = ctx.err.device
        spare = _spare.setdefault(str(device), [])
        if len(spare) < SPARE_WORDS // 2 and not _capturing(device):  # topped up outside one
            spare += error_words(device, SPARE_WORDS)
        if not spare:
            return ctx.err
        _site_words[key] = spare.pop()
    return _site_words[key][1]


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def note(ctx, op: str, bound_s: float, flag_name: Optional[Callable] = None,
         site: str = "") -> None:
    """What names the waits of a call at `site` of ctx (the context's own words: its last call's
    op, no site): flag_name(code, peer) -> text."""
    _sites[ctx.fault_id] = (op, ctx.rank, ctx.world, bound_s, flag_name, "")
    if (ctx.fault_id, site) in _site_words:
        _sites[_site_words[(ctx.fault_id, site)][0]] = (op, ctx.rank, ctx.world, bound_s,
                                                        flag_name, site)


def failed() -> bool:
    """Whether a wait of this process gave up (a load of host memory)."""
    return _report is not None and ctypes.c_int32.from_address(_report.data_ptr()).value != 0


def message() -> str:
    words = [ctypes.c_int32.from_address(_report.data_ptr() + 4 * i).value
             for i in range(flags.REPORT_WORDS)]
    code, seen, expected, peer = (words[flags.REPORT_CODE], words[flags.REPORT_SEEN],
                                  words[flags.REPORT_EXPECTED], words[flags.REPORT_PEER])
    op, rank, world, bound_s, flag_name, site = _sites.get(
        words[flags.REPORT_ID], ("a fused op", "?", "?", "?", None, ""))
    flag = flag_name(code, peer) if flag_name else f"flag {code - 1}"
    epochs = (f"it saw epoch {seen}, expected {expected}" if expected >= 0
              else "its data never arrived")
    where = f" at {site}" if site else ""
    return (f"ditron: {op}{where} on rank {rank} of {world}: a wait on {flag} gave up after "
            f"{bound_s} s ({epochs}): that peer never signalled. It crashed, raised or took "
            "another branch before the op, is later than the bound, or runs another program, "
            "plan, shape or option on the same group. This call's outputs are not valid; the "
            "process ends (ditron.wait_timeout_s sets the bound; the process group's timeout "
            "by default).")


def raise_if_failed() -> None:
    """At a fused call: raise WaitTimeout where a wait of this process gave up."""
    if failed():
        raise WaitTimeout(message())


def watch(grace_s: float = GRACE_S) -> None:
    """Start the watcher thread once per process (module docstring)."""
    global _watcher
    if _watcher is None:
        _watcher = threading.Thread(target=_watch, args=(grace_s,), name="ditron-waits",
                                    daemon=True)
        _watcher.start()


def _watch(grace_s: float) -> None:
    stop = threading.Event()
    while not failed():
        stop.wait(WATCH_S)
    text = message()
    log.error("%s", text)
    print(text, file=sys.stderr, flush=True)
    stop.wait(grace_s)
    end()


def end() -> None:
    """End the process with EXIT_CODE, running no exit handler: they would synchronise with
    kernels whose protocol is broken and destroy process groups whose peer is gone."""
    print(f"ditron: ending the process (exit code {EXIT_CODE}) after a wait gave up",
          file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)
