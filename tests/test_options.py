"""ditron's options: each through `torch.compile(..., options=)` and through its environment
variable, each bad value's error, the off switch, and the options in the pass's cache key."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import get_hash_for_files

from ditron_inductor import config
from ditron_inductor.backend import inductor_patches
from ditron_inductor.lowering import graph_pass
from ditron_inductor.lowering.graph_pass import DitronPass
from tests import REPO_ROOT
from tests.fx_helpers import all_gather, fake_group

# option key, environment variable, a value as the user writes it, the Options field it sets
GOOD = [
    ("ditron.enabled", "DITRON_ENABLED", "0", "enabled", False),
    ("ditron.patterns", "DITRON_PATTERNS", "all_gather_matmul, matmul_all_reduce", "patterns",
     frozenset({"all_gather_matmul", "matmul_all_reduce"})),
    ("ditron.plan", "DITRON_PLAN", "reference", "force_plan", "reference"),
    ("ditron.plan", "DITRON_PLAN", "fused", "force_plan", "fused"),
    ("ditron.plan", "DITRON_PLAN", "auto", "force_plan", ""),
    ("ditron.symm_mem_backend", "DITRON_SYMM_MEM_BACKEND", "nvshmem", "symm_mem_backend",
     "nvshmem"),
    ("ditron.wait_timeout_s", "DITRON_WAIT_TIMEOUT_S", "2.5", "wait_timeout_s", 2.5),
    ("ditron.wait_timeout_s", "DITRON_WAIT_TIMEOUT_S", "auto", "wait_timeout_s", None),
    ("ditron.log_all_ranks", "DITRON_LOG_ALL_RANKS", "1", "log_all_ranks", True),
    ("ditron.causal_mask", "DITRON_CAUSAL_MASK", "off", "causal_mask", False),
    ("ditron.decode_gemm", "DITRON_DECODE_GEMM", "false", "decode_gemm", False),
    ("ditron.gqa_packing", "DITRON_GQA_PACKING", "0", "gqa_packing", False),
    ("ditron.decode_gemm_groups", "DITRON_DECODE_GEMM_GROUPS", "0", "decode_gemm_groups", False),
    ("ditron.cuda_graphs", "DITRON_CUDA_GRAPHS", "1", "cuda_graphs", True),
    ("ditron.cuda_graphs", "DITRON_CUDA_GRAPHS", "off", "cuda_graphs", False),
    ("ditron.cuda_graphs", "DITRON_CUDA_GRAPHS", "auto", "cuda_graphs", None),
]

# option key, environment variable, bad value, the error's text after "<name>=<value!r>: "
BAD = [
    ("ditron.enabled", "DITRON_ENABLED", "maybe", "expected a boolean (1/0, true/false)"),
    ("ditron.patterns", "DITRON_PATTERNS", "all_gather_matmul,mm_rs",
     "unknown pattern(s) mm_rs; allowed: a comma-separated subset of all_gather_matmul, "
     "matmul_reduce_scatter, matmul_all_reduce, matmul_all_reduce_rmsnorm, matmul_all_gather, "
     "grouped_mm_all_reduce, grouped_mm_all_reduce_rmsnorm, all_to_all_grouped_mm, grouped_mm_all_to_all, all_gather_scaled_mm, "
     "scaled_mm_reduce_scatter, scaled_mm_all_reduce"),
    ("ditron.plan", "DITRON_PLAN", "bogus", "allowed values are auto, reference, fused"),
    ("ditron.symm_mem_backend", "DITRON_SYMM_MEM_BACKEND", "xyz",
     "allowed values are auto, nvshmem, torch"),
    ("ditron.wait_timeout_s", "DITRON_WAIT_TIMEOUT_S", "abc",
     "expected auto or a number of seconds >= 0 (0: unbounded)"),
    ("ditron.wait_timeout_s", "DITRON_WAIT_TIMEOUT_S", "-1",
     "expected auto or a number of seconds >= 0 (0: unbounded)"),
    ("ditron.log_all_ranks", "DITRON_LOG_ALL_RANKS", "2", "expected a boolean (1/0, true/false)"),
    ("ditron.causal_mask", "DITRON_CAUSAL_MASK", "sometimes",
     "expected a boolean (1/0, true/false)"),
    ("ditron.decode_gemm", "DITRON_DECODE_GEMM", "cublas", "expected a boolean (1/0, true/false)"),
    ("ditron.cuda_graphs", "DITRON_CUDA_GRAPHS", "always",
     "expected auto or a boolean (1/0, true/false)"),
    ("ditron.gqa_packing", "DITRON_GQA_PACKING", "repeat", "expected a boolean (1/0, true/false)"),
    ("ditron.decode_gemm_groups", "DITRON_DECODE_GEMM_GROUPS", "qkv",
     "expected a boolean (1/0, true/false)"),
]


def pass_options(options: dict) -> config.Options:
    return inductor_patches(None, options)["post_grad_custom_post_pass"].options


@pytest.mark.parametrize("key,var,value,field,want", GOOD)
def test_each_option_through_options_and_through_its_variable(key, var, value, field, want):
    if field == "enabled":  # off: no pass in the patches at all
        assert "post_grad_custom_post_pass" not in inductor_patches(None, {key: value})
        assert inductor_patches(None, {key: True})["post_grad_custom_post_pass"].options.enabled
    else:
        assert getattr(pass_options({key: value}), field) == want
    assert getattr(config.from_env({var: value}), field) == want


@pytest.mark.parametrize("key,var,value,text", BAD)
def test_each_bad_value_is_an_error_naming_option_value_and_allowed(key, var, value, text):
    with pytest.raises(config.OptionError) as through_options:
        inductor_patches(None, {key: value})
    assert str(through_options.value) == f"{key}={value!r}: {text}"
    with pytest.raises(config.OptionError) as through_env:
        config.from_env({var: value})
    assert str(through_env.value) == f"{var}={value!r}: {text}"


def test_unknown_ditron_key_names_the_known_ones():
    with pytest.raises(config.OptionError) as error:
        inductor_patches(None, {"ditron_plan": "fused", "ditron.plna": "fused"})
    assert str(error.value) == (
        "unknown option 'ditron.plna'; ditron's options are ditron.enabled, ditron.patterns, "
        "ditron.plan, ditron.symm_mem_backend, ditron.wait_timeout_s, ditron.log_all_ranks, "
        "ditron.causal_mask, ditron.decode_gemm, ditron.gqa_packing, ditron.cuda_graphs, "
        "ditron.decode_gemm_groups")


def test_options_win_over_the_environment_and_inductor_keys_pass_through(monkeypatch):
    monkeypatch.setenv("DITRON_PLAN", "reference")
    monkeypatch.setenv("DITRON_WAIT_TIMEOUT_S", "3")
    patches = inductor_patches(None, {"ditron.plan": "fused", "epilogue_fusion": False})
    assert patches["epilogue_fusion"] is False
    assert not any(k.startswith("ditron.") for k in patches)
    options = patches["post_grad_custom_post_pass"].options
    assert (options.force_plan, options.wait_timeout_s) == ("fused", 3.0)


def test_bad_option_through_torch_compile_is_the_option_error_itself():
    torch._dynamo.reset()
    with pytest.raises(config.OptionError, match=r"^ditron.plan='bogus': allowed values are"):
        torch.compile(lambda x: x + 1, backend="ditron",
                      options={"ditron.plan": "bogus"})(torch.ones(2))


def _traceback_lines(script: str, env: dict) -> list[str]:
    """What a user sees where `script` stops at an exception (a fresh process: its own
    environment at import, no pytest frames above the user's call)."""
    env = {k: v for k, v in {**os.environ, **env}.items() if k != "TORCH_LOGS"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    return proc.stderr.splitlines()


def test_bad_option_message_comes_in_the_first_lines_not_under_dynamo():
    # The traceback starts at the backend (Dynamo's 80-odd lines of frames cut): above the
    # message only the user's call, Dynamo's compile_wrapper and the backend's raise
    lines = _traceback_lines("""
        import torch
        torch.compile(lambda x: x + 1, backend="ditron",
                      options={"ditron.plan": "fastest"})(torch.ones(2))
    """, {})
    message = ("ditron_inductor.config.OptionError: ditron.plan='fastest': allowed values are "
               "auto, reference, fused")
    assert message in lines[:12], "\n".join(lines)
    assert not [line for line in lines if "convert_frame.py" in line], "\n".join(lines)


def test_bad_variable_fails_the_first_compile_with_its_name():
    lines = _traceback_lines("""
        import torch
        torch.compile(lambda x: x + 1, backend="ditron")(torch.ones(2))
    """, {"DITRON_WAIT_TIMEOUT_S": "abc"})
    message = ("ditron_inductor.config.OptionError: DITRON_WAIT_TIMEOUT_S='abc': expected auto "
               "or a number of seconds >= 0 (0: unbounded)")
    assert message in lines[:12], "\n".join(lines)


def layer(x, w):
    return F.linear(all_gather(x, 0, "0"), w)


def compile_layer(options: dict) -> list:
    from torch._inductor.utils import fresh_cache

    graph_pass.reports.clear()
    torch._dynamo.reset()
    with fresh_cache():  # a graph served from an earlier run's cache would skip the pass
        torch.compile(layer, backend="ditron", options=options)(torch.randn(4, 8),
                                                                torch.randn(16, 8))
    return [(c.task.split()[0], c.fused, c.reason) for r in graph_pass.reports
            for c in r.candidates]


def test_per_compile_options_reach_the_pass_and_the_off_switch_skips_it():
    before = config.defaults()
    with fake_group(2):
        assert compile_layer({"ditron.patterns": "matmul_reduce_scatter"}) == [
            ("all_gather_matmul", False,
             "pattern all_gather_matmul is disabled (ditron.patterns / DITRON_PATTERNS)")]
        assert compile_layer({"ditron.plan": "fused"}) == [
            ("all_gather_matmul", True, "reference plan (decomposed collective + matmul): "
             "plan=fused forced, but the fused kernels run on CUDA only, not cpu")]
        assert compile_layer({"ditron.enabled": False}) == []
        assert config.defaults() == before  # a compile's options end with it


def test_pass_uuid_differs_per_option_that_changes_graphs():
    default = config.Options()
    changed = [config.Options(**{field: want}) for _, _, _, field, want in GOOD
               if field not in ("enabled", "log_all_ranks") and want != getattr(default, field)]
    keys = {DitronPass(options).uuid() for options in changed} | {DitronPass(default).uuid()}
    assert len(keys) == len(changed) + 1


@pytest.mark.parametrize("option", [o for o in config.TABLE if o.changes_graphs])
def test_each_option_that_changes_graphs_enters_the_pass_cache_key(option):
    # a graph compiled with a rewrite on must not be served from Inductor's cache to a compile
    # with it off
    default = config.Options()
    value = getattr(default, option.field)
    other = {bool: lambda v: not v, frozenset: lambda v: frozenset(list(v)[:1]),
             float: lambda v: v + 1.0, str: lambda v: "fused" if v != "fused" else "reference",
             type(None): lambda v: True}[type(value)](value)
    if option.key == "symm_mem_backend":
        other = "torch"
    flipped = dataclasses.replace(default, **{option.field: other})
    assert flipped.cache_key() != default.cache_key()


def test_the_readme_option_table_is_the_declared_one():
    readme = (REPO_ROOT / "README.md").read_text()
    assert config.readme_with_table(readme) == readme, (
        "README's option table is stale: python -m ditron_inductor.config --readme README.md")
    for option in config.TABLE:
        assert (f"`{option.name}`" in readme) != option.debug, option.name


def test_the_pass_uuid_covers_the_evidence_tables(tmp_path, monkeypatch):
    """Every source and data file of the package enters the uuid: a changed table changes it."""
    package = tmp_path / "ditron_inductor"
    (package / "lowering").mkdir(parents=True)
    (package / "scheduler" / "evidence").mkdir(parents=True)
    table = package / "scheduler" / "evidence" / "measured_plans.json"
    table.write_text('{"rows": []}')
    monkeypatch.setattr(graph_pass, "__file__", str(package / "lowering" / "graph_pass.py"))
    assert str(table) in graph_pass._source_files()
    before = DitronPass(config.Options()).uuid()
    table.write_text('{"rows": [1]}')
    get_hash_for_files.cache_clear()  # torch hashes a tuple of files once per process
    assert DitronPass(config.Options()).uuid() != before
    real = pathlib.Path(config.__file__).parent
    monkeypatch.undo()
    files = graph_pass._source_files()
    for name in ("scheduler/evidence/measured_plans.json", "scheduler/evidence/link.json",
                 "scheduler/evidence/world1_compute.json", "scheduler/evidence.py",
                 "scheduler/policy.py", "scheduler/precision.py", "runtime/all_reduce.py"):
        assert str(real / name) in files, name
