"""The bound of the fused kernels' waits (ditron.wait_timeout_s): nanoseconds of the GPU's global
timer where the kernels are compiled, polls under the interpreter (no inline assembly there),
converted from the plan's seconds by runtime/context.wait_limit; the timed wait compiles for
sm_90 in tests/sm90_compile.py (wait_flags_kernel with an int32 and an int64 bound)."""

from __future__ import annotations

import os
import subprocess
import sys

from ditron_inductor.runtime import context
from ditron_inductor.scheduler.plan import AllGatherPlan
from ditron_inductor.templates import flags
from tests import REPO_ROOT


def test_the_bound_is_polls_under_the_interpreter_and_ns_where_compiled(monkeypatch):
    plan = AllGatherPlan(wait_timeout_s=2.5)
    assert flags.WAIT_IN_NS is (os.environ.get("TRITON_INTERPRET", "0") != "1")
    monkeypatch.setattr(flags, "WAIT_IN_NS", False)
    assert context.wait_limit(plan) == 2_500_000  # polls of about a microsecond
    monkeypatch.setattr(flags, "WAIT_IN_NS", True)
    assert context.wait_limit(plan) == 2_500_000_000  # past int32: the kernels take an int64
    assert context.wait_limit(AllGatherPlan(wait_timeout_s=0.0)) == 0  # unbounded


def test_compiled_kernels_wait_in_ns_unless_interpreted():
    """The switch is read once, at import, as Triton reads TRITON_INTERPRET."""
    code = "from ditron_inductor.templates import flags; print(flags.WAIT_IN_NS)"
    for interpret, want in (("0", "True"), ("1", "False")):
        env = {**os.environ, "TRITON_INTERPRET": interpret}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, cwd=REPO_ROOT, timeout=120)
        assert out.stdout.strip() == want, out.stderr[-2000:]
