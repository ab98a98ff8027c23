"""lowering/causal_mask.py: SDPA calls whose mask is a constant causal (or empty) one take
`is_causal=True` (or no mask) in the dynamo graph; every other mask stays, with its reason.

Graphs are the ones dynamo hands a backend (captured, not compiled); each rewritten graph is run
against the one it came from on the same inputs."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from ditron_inductor.lowering import causal_mask
from ditron_inductor.lowering.causal_mask import CAUSAL, NO_MASK, classify, rewrite_causal_masks
from tests.fx_helpers import checked_rewrite, dynamo_graph

L, S, E = 8, 8, 16  # queries, keys, head size


def qkv(batch: int = 2, heads: int = 2, queries: int = L, keys: int = S):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(batch, heads, queries, E, generator=gen),
            torch.randn(batch, heads, keys, E, generator=gen),
            torch.randn(batch, heads, keys, E, generator=gen))


def sdpa_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in causal_mask.SDPA]


def rewritten(fn, *args) -> tuple[list, torch.fx.GraphModule]:
    """(MaskSites, the rewritten graph), after checking it computes what the original does."""
    return checked_rewrite(rewrite_causal_masks, fn, *args)


def hf_style_causal(q, k, v):
    # what Hugging Face's sdpa_mask builds under torch.compile: index tensors compared
    q_idx = torch.arange(q.shape[-2])[None, None, :, None]
    kv_idx = torch.arange(k.shape[-2])[None, None, None, :]
    mask = (q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx)).expand(q.shape[0], -1, -1,
                                                                            -1)
    first = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(first, k, v, mask)  # the mask positional, shared


def test_causal_mask_becomes_is_causal_and_its_computation_goes():
    sites, gm = rewritten(hf_style_causal, *qkv())
    assert [s.became for s in sites] == [CAUSAL, CAUSAL]
    assert sites[0].describe() == (f"attention {sites[0].node}: mask [2x1x{L}x{S}] is causal -> "
                                   "is_causal=True, no mask")
    for call in sdpa_calls(gm):
        assert causal_mask.call_arg(call, 3, "attn_mask") is None
        assert causal_mask.call_arg(call, 5, "is_causal") is True
    left = {n.op for n in gm.graph.nodes} - {"placeholder", "output"}
    assert left == {"call_function"} and len(gm.graph.nodes) == 3 + 2 + 1  # no arange, no mask


def test_float_causal_mask_and_empty_masks():
    def float_causal(q, k, v):
        bias = torch.zeros(L, S).masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1),
                                             float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def empty(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(q.shape[0], 1, 1, S,
                                                                            dtype=torch.bool))
    assert [s.became for s in rewritten(float_causal, *qkv())[0]] == [CAUSAL]
    (site,), gm = rewritten(empty, *qkv())
    assert site.became == NO_MASK and site.describe().endswith("masks nothing -> no mask")
    (call,) = sdpa_calls(gm)
    assert causal_mask.call_arg(call, 3, "attn_mask") is None and not causal_mask.call_arg(call, 5,
                                                                                   "is_causal")


def test_decode_step_mask_masks_nothing():
    # one query against one key (a decode-shaped step without a cache): "causal" masks nothing
    sites, _ = rewritten(hf_style_causal, *qkv(batch=4, queries=1, keys=1))
    assert [s.became for s in sites] == [NO_MASK, NO_MASK]


@pytest.mark.parametrize("name, build, reason", [
    ("sliding window", lambda q, k: torch.ones(L, S, dtype=torch.bool).tril() &
     torch.ones(L, S, dtype=torch.bool).triu(-2), "neither causal nor empty"),
    ("causal, aligned bottom-right", lambda q, k: torch.ones(L, S + 4, dtype=torch.bool).tril(4),
     "neither causal nor empty"),
    ("a padding input", lambda q, k: (k.sum(-1) > 0)[:, :, None, :], "depends on the graph input"),
])
def test_other_masks_are_kept_with_their_reason(name, build, reason):
    keys = S + 4 if "bottom-right" in name else S

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, k))
    (site,), gm = rewritten(attend, *qkv(keys=keys))
    assert site.became is None and reason in site.reason, site
    assert "kept: " + site.reason in site.describe()
    (call,) = sdpa_calls(gm)
    assert isinstance(causal_mask.call_arg(call, 3, "attn_mask"), torch.fx.Node)


def test_mask_changed_in_place_is_kept():
    # Evaluating the mask's own computation would miss the in-place change: x.fill_ turns the
    # causal mask into one that masks nothing, and the rewrite must not call it causal.
    def attend(q, k, v):
        allowed = torch.ones(L, S, dtype=torch.bool)
        mask = allowed.tril()
        mask.fill_(True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (site,), _ = rewritten(attend, *qkv())
    assert site.became is None and "in place" in site.reason, site


def test_masks_of_dynamic_shapes_are_kept():
    # the sequence length is a symbol: no value to evaluate the mask at
    gm, _ = dynamo_graph(hf_style_causal, *qkv(), dynamic=True)
    sites = rewrite_causal_masks(gm)
    assert [(s.became, s.reason) for s in sites] == [(None, "dynamic shapes")] * 2
    assert sites[0].describe().endswith("kept: dynamic shapes")


def test_random_masks_are_kept():
    # evaluated once, a random mask would be frozen: (rand < 2) is all True every call, but the
    # pass cannot know which random masks stay what they were at compile time
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.rand(L, S) < 2.0)
    gm, _ = dynamo_graph(attend, *qkv())
    (site,) = rewrite_causal_masks(gm)
    assert site.became is None and "draws random numbers" in site.reason, site


def test_too_large_masks_are_not_evaluated(monkeypatch):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.ones(L, S, dtype=torch.bool).tril())
    monkeypatch.setattr(causal_mask, "MAX_MASK_ELEMENTS", L * S - 1)
    (site,), _ = rewritten(attend, *qkv())
    assert site.became is None and f"over the {L * S - 1} this pass evaluates" in site.reason


def test_classify():
    causal = torch.ones(L, S, dtype=torch.bool).tril()
    assert classify(causal, L, S) == CAUSAL
    assert classify(causal[None, None].expand(2, 3, L, S), L, S) == CAUSAL
    assert classify(torch.ones(L, S + 2, dtype=torch.bool).tril(), L, S + 2) == CAUSAL  # top-left
    assert classify(torch.ones(1, S, dtype=torch.bool), L, S) == NO_MASK
    assert classify(torch.zeros(L, S), L, S) == NO_MASK
    assert classify(torch.full((L, S), 0.5), L, S) is None  # a bias, not a mask
    assert classify(causal.T, L, S) is None
    assert classify(torch.arange(L * S).reshape(L, S), L, S) is None  # integers are no mask


def test_backend_rewrites_hugging_face_llama_and_logs_it(caplog):
    # The tiny Llama of the end-to-end tests: under torch.compile (torch < 2.14) Hugging Face
    # hands SDPA a mask; through the backend it runs is_causal=True, with the numbers of eager
    # (which skips the mask itself).
    pytest.importorskip("transformers")
    from tests import llama_tp

    model = llama_tp.build_llama(llama_tp.llama_config(layers=2))
    ids = llama_tp.tokens(2, 8, 128, seed=0)
    want = model(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="ditron"):
        got = torch.compile(model, backend="ditron")(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    lines = [r.getMessage() for r in caplog.records]
    if torch.__version__ < "2.14":  # pytorch#176499 lets Hugging Face skip the mask itself
        assert any(line.endswith(": 2 attention call(s) with a mask: 2 causal -> is_causal=True, "
                                 "0 masking nothing -> no mask, 0 kept") for line in lines), lines
    torch._dynamo.reset()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ditron"):
        off = torch.compile(model, backend="ditron", options={"ditron.causal_mask": False})
        torch.testing.assert_close(off(input_ids=ids, labels=ids).logits, want.logits,
                                   rtol=1e-4, atol=1e-5)
    assert not any("attention call(s) with a mask" in r.getMessage() for r in caplog.records)


def test_backend_keeps_the_masks_of_dynamic_shapes(caplog):
    # a second sequence length makes dynamo compile the shapes as symbols: the masks stay, the
    # model runs as Inductor runs it
    pytest.importorskip("transformers")
    from tests import llama_tp

    model = llama_tp.build_llama(llama_tp.llama_config(layers=1))
    ids = llama_tp.tokens(2, 8, 128, seed=0)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="ditron"):
        got = torch.compile(model, backend="ditron", dynamic=True)(input_ids=ids).logits
    torch.testing.assert_close(got, model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    lines = [r.getMessage() for r in caplog.records]
    assert not any(r.levelno >= logging.WARNING for r in caplog.records), lines
    if torch.__version__ < "2.14":
        assert any(line.endswith("kept: dynamic shapes") for line in lines), lines
