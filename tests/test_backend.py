"""The backend as a user meets it: found by name, Inductor's options kept, logs, caching."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from ditron_inductor import config
from ditron_inductor.backend import ditron_backend, inductor_patches
from ditron_inductor.lowering import graph_pass
from ditron_inductor.lowering.graph_pass import DitronPass
from tests.fx_helpers import all_gather, fake_group

# A script that never imports ditron_inductor: the entry points must do everything.
FUSABLE_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, torch.nn.functional as F
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    def layer(x, w):
        return F.linear(gather(x, 0, dist.group.WORLD), w)
    out = torch.compile(layer, backend="ditron")(torch.randn(4, 8), torch.randn(16, 8))
    assert out.shape == (8, 16), out.shape
    import sys
    print("pass ran:", "ditron_inductor.lowering.graph_pass" in sys.modules)
""")


def run_script(script: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=full_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_backend_is_found_by_name_without_import():
    proc = run_script(FUSABLE_SCRIPT)
    assert "pass ran: True" in proc.stdout


def test_torch_logs_ditron_reports_each_candidate():
    proc = run_script(FUSABLE_SCRIPT, TORCH_LOGS="ditron")
    assert "all_gather_matmul M=8 K=8 N=16 float32 world=2 group=0 -> ditron.all_gather_matmul" \
        in proc.stderr
    assert "before the ditron pass" not in proc.stderr


def test_torch_logs_plus_ditron_with_another_component_and_import_first():
    script = "import ditron_inductor\n" + FUSABLE_SCRIPT
    proc = run_script(script, TORCH_LOGS="+ditron,graph_breaks")
    assert "-> ditron.all_gather_matmul" in proc.stderr
    assert "forward before the ditron pass" in proc.stderr
    assert "forward after the ditron pass" in proc.stderr
    assert "plan for all_gather_matmul: reference" in proc.stderr


def test_graph_with_nothing_to_fuse_compiles_as_inductor_does():
    from torch._inductor.utils import run_and_get_code

    def f(x, w):
        return torch.relu(x @ w) + 1

    x, w = torch.randn(8, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    ours, (our_code,) = run_and_get_code(torch.compile(f, backend="ditron"), x, w)
    torch._dynamo.reset()
    theirs, (their_code,) = run_and_get_code(torch.compile(f, backend="inductor"), x, w)
    torch.testing.assert_close(ours, theirs)
    compile_counter = re.compile(r"# AOT ID: .*")  # counts compiles in this process
    assert compile_counter.sub("", our_code) == compile_counter.sub("", their_code)


def test_user_options_and_mode_are_kept():
    calls = []
    patches = inductor_patches("max-autotune-no-cudagraphs",
                               {"post_grad_custom_post_pass": calls.append, "epilogue_fusion": False})
    assert patches["max_autotune"] is True and patches["epilogue_fusion"] is False
    ours = patches["post_grad_custom_post_pass"]
    assert isinstance(ours, DitronPass) and ours.user_pass == calls.append

    torch._dynamo.reset()
    out = torch.compile(lambda x: x * 2, backend="ditron",
                        options={"post_grad_custom_post_pass": calls.append})(torch.ones(3))
    assert out.tolist() == [2, 2, 2] and len(calls) == 1


def test_unknown_inductor_option_is_an_error():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="not_an_inductor_option"):
        torch.compile(lambda x: x + 1, backend="ditron",
                      options={"not_an_inductor_option": 1})(torch.ones(2))


def test_pass_uuid_follows_options_and_user_pass(monkeypatch):
    assert DitronPass().uuid() == DitronPass().uuid() is not None
    before = DitronPass().uuid()
    assert DitronPass(config.Options(force_plan="reference")).uuid() != before
    # a user pass with no uuid: no caching
    assert DitronPass(user_pass=lambda graph: None).uuid() is None


def test_pass_uuid_follows_the_process_groups():
    """A rewritten graph names its group and world size: a run where group '0' has another size
    must not be served a graph cached by this one (seen on GPUs: 2 ranks given 8's graph)."""
    from tests.fx_helpers import fake_group

    keys = []
    for world in (8, 2):
        with fake_group(world):
            keys.append(DitronPass().uuid())
    assert keys[0] != keys[1]
    with fake_group(8):
        assert DitronPass().uuid() == keys[0]


def test_fx_graph_cache_serves_a_rewritten_graph():
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    def layer(x, w):
        return F.linear(all_gather(x, 0, "0"), w)

    x, w = torch.randn(4, 8), torch.randn(16, 8)
    with fake_group(2), fresh_cache():
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            graph_pass.reports.clear()
            torch.compile(layer, backend="ditron")(x, w)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1
        # the second compile came from the cache, the pass did not rerun, and the report says so
        assert [(r.candidates, r.from_cache) for r in graph_pass.reports] == [((), True)]


def test_backend_registered_once_through_the_entry_point():
    import importlib
    import pkgutil

    import ditron_inductor
    from torch._dynamo.backends.registry import lookup_backend

    for mod in pkgutil.walk_packages(ditron_inductor.__path__, "ditron_inductor."):
        if ".tests" not in mod.name and mod.name != "ditron_inductor.demo":
            try:
                importlib.import_module(mod.name)
            except ImportError:
                pass  # modules that need CUDA-only packages
    assert lookup_backend("ditron") is ditron_backend
