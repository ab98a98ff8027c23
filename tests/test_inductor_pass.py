"""ditron as Inductor passes (ditron_inductor.inductor_pass), for frameworks that compile with
backend="inductor": what each call returns and installs. The same ops and numbers as
backend="ditron" on 2 ranks: tests/test_e2e_gloo.py's attention_inductor_pass check."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import ditron_inductor
from ditron_inductor.config import OptionError
from ditron_inductor.lowering.graph_pass import DitronPass


def test_the_post_grad_pass_carries_its_options_in_its_uuid():
    default, fused = ditron_inductor.post_grad_pass(), ditron_inductor.post_grad_pass(
        {"ditron.plan": "fused"})
    assert isinstance(default, DitronPass) and isinstance(default, CustomGraphPass)
    assert fused.options.force_plan == "fused"
    assert default.uuid() != fused.uuid()
    off = ditron_inductor.post_grad_pass({"ditron.enabled": False})
    assert not isinstance(off, DitronPass) and off.uuid() == "ditron off"


def test_options_are_checked_when_the_pass_is_made(monkeypatch):
    with pytest.raises(OptionError, match="not a ditron option: 'max_autotune'"):
        ditron_inductor.post_grad_pass({"max_autotune": True})
    with pytest.raises(OptionError, match="ditron.plan"):
        ditron_inductor.pre_grad_pass({"ditron.plan": "fastest"})
    monkeypatch.setenv("DITRON_PLAN", "reference")
    assert ditron_inductor.post_grad_pass().options.force_plan == "reference"


def test_install_keeps_the_configured_passes_and_runs_ditron_once():
    def user_post(graph):
        return None

    user_post.uuid = lambda: "user"
    with inductor_config.patch(post_grad_custom_post_pass=user_post, pre_grad_custom_pass=None):
        ditron_inductor.install()
        ditron_inductor.install()
        post = inductor_config.post_grad_custom_post_pass
        assert isinstance(post, DitronPass) and post.user_pass is user_post
        assert post.uuid()[2] == "user"
        assert inductor_config.pre_grad_custom_pass.user_pass is None


def test_backend_inductor_under_installed_rewrites_dynamos_graph(caplog):
    def attention(q):
        mask = torch.ones(8, 8, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    q = torch.randn(1, 2, 8, 4)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="ditron"), ditron_inductor.installed():
        out = torch.compile(attention, backend="inductor")(q)
    torch.testing.assert_close(out, attention(q))
    lines = [r.getMessage() for r in caplog.records]
    assert any("1 causal -> is_causal=True" in line for line in lines), lines
    assert any(line.endswith("forward: no collective + matmul candidates") for line in lines), lines
    # installed() restores Inductor's config
    assert not isinstance(inductor_config.post_grad_custom_post_pass, DitronPass)
