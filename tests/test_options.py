"""ditron's options: each through `torch.compile(..., options=)` and through its environment
variable, each bad value's error, the off switch, and the options in the pass's cache key."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from ditron_inductor import config
from ditron_inductor.backend import inductor_patches
from ditron_inductor.lowering import graph_pass
from ditron_inductor.lowering.graph_pass import DitronPass
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
    ("ditron.log_all_ranks", "DITRON_LOG_ALL_RANKS", "1", "log_all_ranks", True),
    ("ditron.causal_mask", "DITRON_CAUSAL_MASK", "off", "causal_mask", False),
    ("ditron.measured_plans", "DITRON_MEASURED_PLANS", "0", "measured_plans", False),
    ("ditron.skip_plans", "DITRON_SKIP_PLANS", "cublas_accumulate, cublas_each", "skip_plans",
     frozenset({"cublas_accumulate", "cublas_each"})),
    ("ditron.decode_gemm", "DITRON_DECODE_GEMM", "false", "decode_gemm", False),
    ("ditron.gqa_packing", "DITRON_GQA_PACKING", "0", "gqa_packing", False),
    ("ditron.decode_gemm_groups", "DITRON_DECODE_GEMM_GROUPS", "0", "decode_gemm_groups", False),
    ("ditron.sequence_shard", "DITRON_SEQUENCE_SHARD", "on", "sequence_shard", True),
    ("ditron.cuda_graphs", "DITRON_CUDA_GRAPHS", "1", "cuda_graphs", True),
    ("ditron.cuda_graphs", "DITRON_CUDA_GRAPHS", "off", "cuda_graphs", False),
    ("ditron.cuda_graphs", "DITRON_CUDA_GRAPHS", "auto", "cuda_graphs", None),
]

# option key, environment variable, bad value, the error's text after "<name>=<value!r>: "
BAD = [
    ("ditron.enabled", "DITRON_ENABLED", "maybe", "expected a boolean (1/0, true/false)"),
    ("ditron.patterns", "DITRON_PATTERNS", "all_gather_matmul,mm_rs",
     "unknown pattern(s) mm_rs; allowed: a comma-separated subset of all_gather_matmul, "
     "matmul_reduce_scatter, matmul_all_reduce, matmul_all_reduce_rmsnorm, all_to_all_grouped_mm, "
     "grouped_mm_all_to_all, all_gather_scaled_mm, scaled_mm_reduce_scatter, "
     "scaled_mm_all_reduce"),
    ("ditron.plan", "DITRON_PLAN", "bogus", "allowed values are auto, reference, fused"),
    ("ditron.symm_mem_backend", "DITRON_SYMM_MEM_BACKEND", "xyz",
     "allowed values are auto, nvshmem, torch"),
    ("ditron.wait_timeout_s", "DITRON_WAIT_TIMEOUT_S", "abc",
     "expected a number of seconds >= 0 (0: unbounded)"),
    ("ditron.wait_timeout_s", "DITRON_WAIT_TIMEOUT_S", "-1",
     "expected a number of seconds >= 0 (0: unbounded)"),
    ("ditron.log_all_ranks", "DITRON_LOG_ALL_RANKS", "2", "expected a boolean (1/0, true/false)"),
    ("ditron.causal_mask", "DITRON_CAUSAL_MASK", "sometimes",
     "expected a boolean (1/0, true/false)"),
    ("ditron.measured_plans", "DITRON_MEASURED_PLANS", "model",
     "expected a boolean (1/0, true/false)"),
    ("ditron.decode_gemm", "DITRON_DECODE_GEMM", "cublas", "expected a boolean (1/0, true/false)"),
    ("ditron.cuda_graphs", "DITRON_CUDA_GRAPHS", "always",
     "expected auto or a boolean (1/0, true/false)"),
    ("ditron.gqa_packing", "DITRON_GQA_PACKING", "repeat", "expected a boolean (1/0, true/false)"),
    ("ditron.decode_gemm_groups", "DITRON_DECODE_GEMM_GROUPS", "qkv",
     "expected a boolean (1/0, true/false)"),
    ("ditron.sequence_shard", "DITRON_SEQUENCE_SHARD", "rows",
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


def test_an_unknown_plan_label_to_skip_is_an_error_at_the_compile():
    """ditron.skip_plans is checked against the scheduler's candidates where the compile starts
    (the options module imports no layer above it)."""
    with pytest.raises(config.OptionError) as error:
        inductor_patches(None, {"ditron.skip_plans": "cublas,fastest"})
    assert str(error.value) == (
        "ditron.skip_plans (DITRON_SKIP_PLANS): unknown plan label(s) fastest; allowed: labels of "
        "cost_model.AG_CANDIDATES and RS_CANDIDATES")
    assert config.from_env({"DITRON_SKIP_PLANS": "fastest"}).skip_plans == {"fastest"}


def test_unknown_ditron_key_names_the_known_ones():
    with pytest.raises(config.OptionError) as error:
        inductor_patches(None, {"ditron_plan": "fused", "ditron.plna": "fused"})
    assert str(error.value) == (
        "unknown option 'ditron.plna'; ditron's options are ditron.enabled, ditron.patterns, "
        "ditron.plan, ditron.symm_mem_backend, ditron.wait_timeout_s, ditron.log_all_ranks, "
        "ditron.causal_mask, ditron.measured_plans, ditron.skip_plans, ditron.decode_gemm, "
        "ditron.decode_gemm_groups, ditron.gqa_packing, ditron.sequence_shard, "
        "ditron.cuda_graphs")


def test_options_win_over_the_environment_and_inductor_keys_pass_through(monkeypatch):
    monkeypatch.setattr(config, "force_plan", "reference")  # as DITRON_PLAN=reference sets it
    monkeypatch.setattr(config, "wait_timeout_s", 3.0)
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
    message = ("ditron_inductor.config.OptionError: DITRON_WAIT_TIMEOUT_S='abc': expected a "
               "number of seconds >= 0 (0: unbounded)")
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
    before = config.current()
    with fake_group(2):
        assert compile_layer({"ditron.patterns": "matmul_reduce_scatter"}) == [
            ("all_gather_matmul", False,
             "pattern all_gather_matmul is disabled (ditron.patterns / DITRON_PATTERNS)")]
        assert compile_layer({"ditron.plan": "fused"}) == [
            ("all_gather_matmul", True, "reference plan (decomposed collective + matmul): "
             "plan=fused forced, but the fused kernels run on CUDA only, not cpu")]
        assert compile_layer({"ditron.enabled": False}) == []
        assert config.current() == before  # a compile's options end with it


def test_pass_uuid_differs_per_option_that_changes_graphs():
    default = config.Options()
    changed = [config.Options(**{field: want}) for _, _, _, field, want in GOOD
               if field not in ("enabled", "log_all_ranks") and want != getattr(default, field)]
    keys = {DitronPass(options).uuid() for options in changed} | {DitronPass(default).uuid()}
    assert len(keys) == len(changed) + 1


@pytest.mark.parametrize("field", ["causal_mask", "measured_plans", "decode_gemm",
                                   "decode_gemm_groups", "gqa_packing", "sequence_shard"])
def test_each_rewrite_option_enters_the_pass_cache_key(field):
    # a graph compiled with the rewrite on must not be served from Inductor's cache to a
    # compile with it off
    default = config.Options()
    flipped = dataclasses.replace(default, **{field: not getattr(default, field)})
    assert flipped.cache_key() != default.cache_key()
