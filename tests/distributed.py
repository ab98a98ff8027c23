"""Run a function on W CPU ranks over gloo, for tests.

    results = run_ranks(fn, world_size=2, args=(...), timeout_s=120)

`fn(rank, world_size, *args)` runs in each of W fresh processes (multiprocessing "spawn": nothing
of the test process is forked) with the default process group initialised over gloo. The list of
the ranks' return values (they must pickle) comes back in rank order.

- Free port: the test process hosts the rendezvous TCPStore on a port the OS picks (port 0), so
  concurrent runs never collide and there is no pick-then-bind race.
- Hard timeout: if any rank has not finished after `timeout_s`, every rank is killed and
  `RankTimeout` names the ranks that never reported (a hang fails the test instead of CI).
- Errors: an exception in a rank is raised in the test process as `RankError`, carrying the
  traceback of the first rank that failed (and then the other ranks' failures, which are often
  consequences: a peer that went away). A rank that dies without a Python
  exception (a segfault, os._exit) is reported with its exit code.

Keep the per-launch cost low: a launch costs a torch import per rank and the ranks share the
machine's cores, so group several checks into one `fn` where they can share a launch.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import os
import queue as queue_mod
import sys
import time
import traceback
from typing import Any, Callable, Optional, Sequence, Union

import multiprocessing as mp

# Environment every rank gets unless the caller's env says otherwise. One compile thread per rank:
# the ranks already share the cores, and a compile worker pool per rank costs more than it saves.
DEFAULT_ENV = {
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RankTimeout(RuntimeError):
    """Not every rank finished in time; all were killed."""


def _resolve(fn: Union[Callable, str]) -> Callable:
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def _worker(rank: int, world_size: int, port: int, fn: Union[Callable, str], args: tuple,
            env: dict, results, timeout_s: float, init: bool) -> None:
    # Each report is (rank, ok, value or traceback, time): a failure is reported before the
    # process group is torn down, and its time lets the launcher name the rank that failed first.
    os.environ.update(env)
    initialised = False
    try:
        import torch.distributed as dist

        fn = _resolve(fn)
        if init:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            initialised = True
        results.put((rank, True, fn(rank, world_size, *args), time.time()))
    except BaseException:  # noqa: BLE001 - everything goes back to the test process
        results.put((rank, False, traceback.format_exc(), time.time()))
    finally:
        if initialised:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the result matters, not the teardown
                pass


def run_ranks(fn: Union[Callable, str], world_size: int, args: Sequence[Any] = (), *,
              timeout_s: float = 240.0, env: Optional[dict] = None,
              init_process_group: bool = True) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return their results.

    `fn` is a module-level function, or "package.module:function" (robust whatever name pytest
    gave the test module), since the ranks are fresh interpreters that import it by name. With
    `init_process_group=False` the ranks start with no process group at all."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The test process hosts the store; port 0: the OS picks a free port.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    full_env = {**DEFAULT_ENV, **(env or {})}
    if sys.platform.startswith("linux"):
        full_env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    procs = [
        ctx.Process(target=_worker, name=f"rank{rank}", daemon=True,
                    args=(rank, world_size, store.port, fn, tuple(args), full_env, results,
                          timeout_s, init_process_group))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    got: dict[int, tuple[bool, Any, float]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value, when = results.get(timeout=min(left, 1.0))
                got[rank] = (ok, value, when)
            except queue_mod.Empty:
                pass
            # A rank that died without reporting: give the queue a moment, then report it.
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                try:
                    while True:
                        rank, ok, value, when = results.get(timeout=2.0)
                        got[rank] = (ok, value, when)
                except queue_mod.Empty:
                    pass
                for r in dead:
                    if r not in got:
                        got[r] = (False, f"rank {r} exited with code {procs[r].exitcode} "
                                         "without reporting (crash or killed)", time.time())
            if any(not ok for ok, _, _ in got.values()):
                # No point waiting long for the others (they may wait on the failed rank), but
                # give them a moment: the rank that failed first may report after a peer.
                grace = time.monotonic() + 3.0
                while len(got) < world_size and time.monotonic() < grace:
                    try:
                        rank, ok, value, when = results.get(timeout=0.5)
                        got[rank] = (ok, value, when)
                    except queue_mod.Empty:
                        pass
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
        del store

    failures = {r: v for r, (ok, v, _) in sorted(got.items(), key=lambda kv: kv[1][2]) if not ok}
    if failures:
        # The first rank to fail is usually the cause; the others often fail because of it.
        first = next(iter(failures))
        others = "".join(f"\n--- rank {r} also failed:\n{tb}" for r, tb in failures.items()
                         if r != first)
        raise RankError(f"rank {first} of {world_size} failed:\n{failures[first]}{others}")
    missing = [r for r in range(world_size) if r not in got]
    if missing:
        raise RankTimeout(f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s;"
                          " all ranks were killed")
    return [got[r][1] for r in range(world_size)]


def launched_once(fn: str, world_size: int, timeout_s: float,
                  env: Optional[dict] = None) -> Callable[[], list]:
    """The ranks' results of one launch of `fn` ("module:function"), as a function that the
    tests of a module share: the first call launches, the later ones return the same results,
    and a launch that failed fails each test that asks, with its error."""
    @functools.cache
    def launch():
        try:
            return run_ranks(fn, world_size, timeout_s=timeout_s, env=env)
        except Exception as e:  # noqa: BLE001 - every test of the launch reports it
            return e

    def results() -> list:
        ranks = launch()
        if isinstance(ranks, Exception):
            raise ranks
        return ranks
    return results
