"""Every flag wait of the fused kernels is bounded by default (ditron.wait_timeout_s=auto: the
process group's timeout): nanoseconds of the GPU's global timer where the kernels are compiled,
polls under the interpreter (no inline assembly there), converted from the plan's seconds by
runtime/context.wait_limit; the timed wait compiles for sm_90 in tests/sm90_compile.py
(wait_flags_kernel with an int32 and an int64 bound).

Faults, injected on two CPU ranks whose flag words are shared memory that both processes map,
the bounded stream wait (launch.wait_geq's kernel, under the interpreter) and launch.check_errors
as the fused calls run them: a peer that never enters the op, one that raises before it, one later
than the bound, one killed inside a call. Each ends, on every rank, in WaitTimeout naming the op,
its layers, the flag, the peer and the epochs; a rank whose host is then blocked is ended by the
watcher thread with its exit code. Inputs whose shapes differ between the ranks end in
ShapesDiffer on every rank."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from ditron_inductor.runtime import context, faults
from ditron_inductor.scheduler.plan import AllGatherPlan
from ditron_inductor.templates import flags
from tests import REPO_ROOT
from tests.distributed import run_ranks

BOUND_S = 0.0005  # 500 polls under the interpreter: well under a second
SITE = "layers.0.self_attn.q_proj (graph 0/0 forward)"  # what the pass puts in a plan


def test_the_bound_is_the_group_timeout_by_default_polls_interpreted_ns_compiled(monkeypatch):
    ctx = SimpleNamespace(timeout_s=600.0)
    assert AllGatherPlan().wait_timeout_s is None  # auto
    assert flags.WAIT_IN_NS is (os.environ.get("TRITON_INTERPRET", "0") != "1")
    monkeypatch.setattr(flags, "WAIT_IN_NS", False)
    assert context.wait_limit(AllGatherPlan(wait_timeout_s=2.5), ctx) == 2_500_000  # ~1 us polls
    assert context.wait_limit(AllGatherPlan(), ctx) == 600_000_000
    monkeypatch.setattr(flags, "WAIT_IN_NS", True)
    assert context.wait_limit(AllGatherPlan(), ctx) == 600_000_000_000  # an int64 in the kernels
    assert context.wait_limit(AllGatherPlan(wait_timeout_s=0.0), ctx) == 0  # unbounded


def test_the_default_bound_is_the_process_groups_timeout():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))
    try:
        assert faults.group_timeout_s(dist.group.WORLD) == 77.0
    finally:
        dist.destroy_process_group()
    assert faults.group_timeout_s(object()) == faults.DEFAULT_TIMEOUT_S  # no backend to ask


def _rank_context(rank, world, flag_dir, name):
    """An OpContext as launch.wait_geq and check_errors read it: READY and DONE words of every
    rank in shared memory (files both processes map), error words that report to the process."""
    words = [torch.from_file(os.path.join(flag_dir, f"{name}.{q}"), shared=True, size=2 * world,
                             dtype=torch.int32) for q in range(world)]
    fault_id, err = faults.error_words("cpu")
    bases = [w.data_ptr() for w in words]
    return SimpleNamespace(rank=rank, world=world, READY=0, DONE=world, epoch=0, timeout_s=600.0,
                           fault_id=fault_id, err=err, flags=SimpleNamespace(words=words[rank]),
                           flag_bases=bases, flag_addr=lambda idx: bases[rank] + 4 * idx,
                           mapped=words)


def _signal(ctx) -> int:
    """A call's first step: READY[me] = its epoch on the peer (a stream write, driver.write)."""
    import ctypes

    e = ctx.epoch = ctx.epoch + 1
    peer_word = ctx.flag_bases[1 - ctx.rank] + 4 * (ctx.READY + ctx.rank)
    ctypes.c_int32.from_address(peer_word).value = e
    return e


def _call(ctx, plan):
    """One call of a two-rank protocol step: the signal, the bounded stream wait for the
    peer's, then the call's error check."""
    from ditron_inductor.runtime import launch

    e = _signal(ctx)
    launch.wait_geq(ctx, plan, 0, ctx.READY + 1 - ctx.rank, e)
    launch.check_errors(ctx, plan, "all_gather_matmul")


def killed_peer(flag_dir):
    """Rank 1 of the killed case, a process of its own: one whole call, then the next call's
    signal, and SIGKILL before that call's wait."""
    import signal

    _interpreted_launches()
    ctx = _rank_context(1, 2, flag_dir, "killed")
    plan = AllGatherPlan(wait_timeout_s=BOUND_S, site=SITE)
    open(os.path.join(flag_dir, "killed.ready"), "w").close()
    go = os.path.join(flag_dir, "killed.go")
    while not os.path.exists(go):  # no sleep: rank 0's bound starts as it writes go
        pass
    _call(ctx, plan)
    _signal(ctx)
    os.kill(os.getpid(), signal.SIGKILL)


def _interpreted_launches():
    from ditron_inductor.runtime import launch

    launch.launch = lambda kernel, grid, *args, stream=None, **meta: kernel[grid](*args, **meta)


CASES = ("absent", "raises", "late")


def fault_ranks(rank, world, flag_dir):
    """Each case on both ranks (rank 1 the faulty one): the outcome and seconds on each."""
    import torch.distributed as dist

    _interpreted_launches()
    plan = AllGatherPlan(wait_timeout_s=BOUND_S, site=SITE)
    outcomes = {}
    for case in CASES:
        dist.barrier()
        ctx = _rank_context(rank, world, flag_dir, case)
        marker = os.path.join(flag_dir, f"{case}.gave_up")
        start = time.monotonic()
        try:
            if rank == 1 and case == "raises":
                raise ValueError("a bug before the op")
            if rank == 1 and case == "late":  # enters after rank 0 gave up
                while not os.path.exists(marker) and time.monotonic() < start + 60:
                    time.sleep(0.01)
            if rank == 0 or case == "late":
                for _ in range(2):
                    _call(ctx, plan)
            outcome = "no error"
        except faults.WaitTimeout as e:
            outcome = str(e)
        except ValueError as e:
            outcome = f"raised {e}"
        outcomes[case] = (outcome, time.monotonic() - start)
        if rank == 0:
            open(marker, "w").close()
        faults.report().zero_()  # a real process ends here; the next case starts clean
    dist.barrier()
    outcomes["killed"] = _killed_case(rank, world, flag_dir, plan)
    return outcomes


def _killed_case(rank, world, flag_dir, plan):
    """Rank 1's protocol runs in a process that is killed inside its second call (a gloo rank
    that died would end the launcher's run); rank 0 makes three calls. Rank 1 returns that
    process's exit code, rank 0 its outcome and the seconds from the start of its calls."""
    if rank == 1:
        code = f"from tests.test_wait_limit import killed_peer; killed_peer({flag_dir!r})"
        return (subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, timeout=120,
                               capture_output=True).returncode, 0.0)
    ctx = _rank_context(rank, world, flag_dir, "killed")
    ready = os.path.join(flag_dir, "killed.ready")
    deadline = time.monotonic() + 120
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    open(os.path.join(flag_dir, "killed.go"), "w").close()
    start = time.monotonic()
    try:
        for _ in range(3):
            _call(ctx, plan)
        outcome = "no error"
    except faults.WaitTimeout as e:
        outcome = str(e)
    faults.report().zero_()
    return outcome, time.monotonic() - start


@pytest.fixture(scope="module")
def fault_outcomes(tmp_path_factory):
    flag_dir = tmp_path_factory.mktemp("flags")
    for case in CASES + ("killed",):
        for q in range(2):
            (flag_dir / f"{case}.{q}").write_bytes(bytes(4 * 2 * 2))
    return run_ranks("tests.test_wait_limit:fault_ranks", 2, args=(str(flag_dir),),
                     timeout_s=120)


@pytest.mark.parametrize("case", CASES)
def test_a_faulty_peer_is_a_clear_error_within_the_bound(fault_outcomes, case):
    text, seconds = fault_outcomes[0][case]
    assert text.startswith(f"ditron: all_gather_matmul at {SITE} on rank 0 of 2: a wait on READY "
                           "of rank 1"), text
    assert f"gave up after {BOUND_S} s (it saw epoch 0, expected 1)" in text
    assert "that peer never signalled" in text and "the process ends" in text
    assert seconds < 20  # the bound (polls) plus the interpreter's slack
    faulty = fault_outcomes[1][case][0]
    if case == "raises":
        assert faulty == "raised a bug before the op"
    elif case == "late":  # its first call found rank 0's signal; its next one waited for good
        assert faulty.startswith(f"ditron: all_gather_matmul at {SITE} on rank 1 of 2: a wait "
                                 "on READY of rank 0"), faulty
        assert "(it saw epoch 1, expected 2)" in faulty


def test_a_peer_killed_inside_a_call_is_a_clear_error_within_the_bound(fault_outcomes):
    """Rank 1 is killed after its second call's signal: rank 0's second call completes (the
    signal landed), its third gives up at the bound naming rank 1 and the epochs."""
    text, seconds = fault_outcomes[0]["killed"]
    assert text.startswith(f"ditron: all_gather_matmul at {SITE} on rank 0 of 2: a wait on READY "
                           "of rank 1"), text
    assert f"gave up after {BOUND_S} s (it saw epoch 2, expected 3)" in text
    assert seconds < 20
    assert fault_outcomes[1]["killed"][0] == -9  # SIGKILL


def test_a_site_first_called_under_capture_has_error_words_of_its_own(monkeypatch):
    """Sites take their error words from words made ahead (faults.SPARE_WORDS per device, in
    one copy, topped up outside captures), so a site whose first call is captured into a CUDA
    graph (no copy to the device there) still has its own and the error names it; only a
    capture that finds none left falls back to the context's words."""
    monkeypatch.setattr(faults, "_spare", {})
    fault_id, err = faults.error_words("cpu")
    ctx = SimpleNamespace(fault_id=fault_id, err=err, rank=0, world=2)
    eager = faults.site_words(ctx, "layers.0.eager")
    monkeypatch.setattr(faults, "_capturing", lambda device: True)
    captured = faults.site_words(ctx, "layers.1.captured")
    assert captured.data_ptr() not in (eager.data_ptr(), err.data_ptr())
    assert faults.site_words(ctx, "layers.1.captured") is captured
    faults.note(ctx, "matmul_all_reduce", 1.0, lambda code, peer: "READY", "layers.1.captured")
    report = faults.report()
    try:
        report[flags.REPORT_ID] = int(captured[flags.ERR_ID])
        report[flags.REPORT_CODE] = 1
        assert faults.message().startswith("ditron: matmul_all_reduce at layers.1.captured on "
                                           "rank 0 of 2: a wait on READY gave up")
    finally:
        report.zero_()
    faults._spare["cpu"].clear()
    assert faults.site_words(ctx, "layers.2.none_left") is err


SHAPE_CASES = ("same", "differ", "late")


def shape_ranks(rank, world, marker_dir):
    """faults.check_shapes on both ranks, per case: equal shapes (agreed once, then no second
    round), rank 1's one row more, rank 1 coming after rank 0 gave up. The outcome and seconds
    on each."""
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    outcomes = {}
    for case in SHAPE_CASES:
        dist.barrier()
        shapes = (8 + (rank if case == "differ" else 0), 4, "torch.float16")
        marker = os.path.join(marker_dir, case)
        start = time.monotonic()
        try:
            if rank == 1 and case == "late":
                while not os.path.exists(marker) and time.monotonic() < start + 60:
                    time.sleep(0.01)
            faults.check_shapes(f"op_{case}", group, shapes, 2.0)
            rounds = dict(faults._shape_checks)
            faults.check_shapes(f"op_{case}", group, shapes, 2.0)
            outcome = "agreed" if faults._shape_checks == rounds else "a second round"
        except faults.ShapesDiffer as e:
            outcome = str(e)
        outcomes[case] = (outcome, time.monotonic() - start)
        if rank == 0:
            open(marker, "w").close()
    return outcomes


@pytest.fixture(scope="module")
def shape_outcomes(tmp_path_factory):
    return run_ranks("tests.test_wait_limit:shape_ranks", 2,
                     args=(str(tmp_path_factory.mktemp("markers")),), timeout_s=120)


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_ranks_whose_shapes_differ_all_raise_before_the_protocol(shape_outcomes, case):
    for rank in range(2):
        text, seconds = shape_outcomes[rank][case]
        if case == "same":
            assert text == "agreed"
        elif case == "differ":
            assert text.startswith(f"ditron: op_differ on rank {rank} of 2: the ranks' inputs "
                                   "differ (rank 0: (8, 4, 'torch.float16'); rank 1: (9, 4, "
                                   "'torch.float16'))"), text
            assert seconds < 10
        else:  # rank 0 gives up at the bound; rank 1, later, reads that verdict
            assert text == (f"ditron: op_late on rank {rank} of 2: rank(s) 1 did not come to "
                            "the op within 2.0 s (it crashed, raised or took another branch "
                            "before it, or is later than the bound)"), text
            assert (seconds >= 2.0 or rank == 1) and seconds < 20


WATCHED = f"""
import time
from tests.test_wait_limit import _interpreted_launches, _rank_context, BOUND_S
from ditron_inductor.runtime import faults, launch
from ditron_inductor.scheduler.plan import AllGatherPlan
_interpreted_launches()
ctx = _rank_context(0, 2, {{flag_dir!r}}, "watched")
plan = AllGatherPlan(wait_timeout_s=BOUND_S)
faults.watch(grace_s=0.2)
faults.note(ctx, "matmul_reduce_scatter", BOUND_S, lambda code, peer: "DONE of rank 1")
launch.wait_geq(ctx, plan, 0, ctx.DONE + 1, 1)  # rank 1 never signals
time.sleep(120)  # the host blocked elsewhere (a synchronisation, NCCL, the exit)
print("not ended")
"""


def test_the_watcher_ends_a_blocked_process_with_the_error(tmp_path):
    for q in range(2):
        (tmp_path / f"watched.{q}").write_bytes(bytes(16))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WATCHED.format(flag_dir=str(tmp_path))],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == faults.EXIT_CODE, proc.stderr[-3000:]
    assert "ditron: matmul_reduce_scatter on rank 0 of 2: a wait on DONE of rank 1 gave up" in (
        proc.stderr)
    assert "not ended" not in proc.stdout
    assert time.monotonic() - start < 60


def test_compiled_kernels_wait_in_ns_unless_interpreted():
    """The switch is read once, at import, as Triton reads TRITON_INTERPRET."""
    code = "from ditron_inductor.templates import flags; print(flags.WAIT_IN_NS)"
    for interpret, want in (("0", "True"), ("1", "False")):
        env = {**os.environ, "TRITON_INTERPRET": interpret}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, cwd=REPO_ROOT, timeout=120)
        assert out.stdout.strip() == want, out.stderr[-2000:]


def test_the_pass_names_the_layers_in_the_fused_plan(monkeypatch):
    from ditron_inductor.lowering import graph_pass
    from ditron_inductor.scheduler.decide import Decision
    from ditron_inductor.scheduler.plan import AllReducePlan, decode
    from tests.fx_helpers import fake_group
    from tests.test_logs import Model, compile_and_run

    # CPU tensors take the reference plan, which has no waits: decide as on CUDA (the op still
    # runs its reference on CPU)
    monkeypatch.setattr(graph_pass, "_decide", lambda match, task, rewritten, options: Decision(
        True, "fused for the test", AllReducePlan() if "reduce" in task.op else AllGatherPlan()))
    texts = []
    for kind, rewrite in list(graph_pass.REWRITES.items()):
        monkeypatch.setitem(graph_pass.REWRITES, kind, lambda graph, match, text, rewrite=rewrite: (
            texts.append(text), rewrite(graph, match, text)))
    with fake_group(2), torch._inductor.config.patch(fx_graph_cache=False):  # the pass runs
        compile_and_run(Model(), torch.randn(4, 8))
    plans = [decode(text) for text in texts]
    assert [p.site.split(" (graph ")[0] for p in plans] == ["layers.0.mlp.up_proj",
                                                           "layers.0.mlp.down_proj"]
    assert all(p.site.endswith(" forward)") for p in plans)  # and the graph: "0/0 forward"
    assert all("site" not in p.describe() for p in plans)  # the log line names the layer already
