"""lowering/gqa_packing.py: SDPA on repeated keys/values (grouped-query attention) takes the query
heads of each key/value head as rows, reading the keys and values as they are.

Graphs are the ones dynamo hands a backend (captured, not compiled); each rewritten graph is run
against the one it came from on random inputs, and through `backend="ditron"` against eager."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from ditron_inductor.lowering import causal_mask
from ditron_inductor.lowering.gqa_packing import MAX_PACKED_ROWS, pack_grouped_queries

from tests.fx_helpers import checked_rewrite, dynamo_graph

KV, D, L = 2, 8, 12  # key/value heads, head size, keys


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    # transformers.models.llama.modeling_llama.repeat_kv
    batch, kv, length, dim = x.shape
    if n == 1:
        return x
    x = x[:, :, None, :, :].expand(batch, kv, n, length, dim)
    return x.reshape(batch, kv * n, length, dim)


def repeat_kv_unsqueeze(x: torch.Tensor, n: int) -> torch.Tensor:
    batch, kv, length, dim = x.shape
    return x.unsqueeze(2).expand(batch, kv, n, length, dim).reshape(batch, kv * n, length, dim)


def inputs(batch: int = 3, n: int = 4, rows: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, KV * n, rows, D, generator=gen),
            torch.randn(batch, KV, L, D, generator=gen),
            torch.randn(batch, KV, L, D, generator=gen))


def keys_seen(batch: int, rows: int) -> torch.Tensor:
    """A decode step's mask: batch row b sees its first L - b keys (a static cache's valid
    part, ragged), every query row alike."""
    seen = torch.arange(L)[None, :] < (L - torch.arange(batch))[:, None]
    return seen[:, None, None, :].expand(batch, 1, rows, L)


def packed(fn, *args) -> tuple[list, torch.fx.GraphModule]:
    """(PackSites, the rewritten graph), after checking it computes what the original does."""
    return checked_rewrite(pack_grouped_queries, fn, *args)


def sdpa_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in causal_mask.SDPA]


def test_decode_step_reads_keys_once_per_kv_head():
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4),
                                              attn_mask=mask, scale=0.3)
    (site,), gm = packed(attend, *inputs(), keys_seen(3, 1))
    assert site.packed and site.group == 4, site
    assert site.describe() == (f"attention {site.node}: 4 query heads per key/value head packed "
                               "as rows, keys and values not repeated -> ditron.decode_attention")
    assert sdpa_calls(gm) == []
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.ditron.decode_attention.default]
    query, key, value, mask, scale = call.args
    assert (key.op, value.op) == ("placeholder", "placeholder")  # k and v as they came
    assert scale == 0.3
    assert not [n for n in gm.graph.nodes if n.target == "expand" and n.args[0] in (key, value)]
    assert call.meta["example_value"].shape == (3, KV, 4, D)  # the packed rows


@pytest.mark.parametrize("mask_kind", ["none", "bool [b,1,s,L]", "float [b,h,s,L]", "bool [s,L]",
                                       "float [b,1,1,L]"])
@pytest.mark.parametrize("rows", [1, 3])
def test_masks_and_query_rows(mask_kind, rows):
    batch, n = 2, 3
    gen = torch.Generator().manual_seed(1)
    masks = {
        "none": None,
        "bool [b,1,s,L]": keys_seen(batch, rows),
        "float [b,h,s,L]": torch.randn(batch, KV * n, rows, L, generator=gen),
        "bool [s,L]": (torch.rand(rows, L, generator=gen) > 0.3) | (torch.arange(L) == 0),
        "float [b,1,1,L]": torch.randn(batch, 1, 1, L, generator=gen),
    }
    mask = masks[mask_kind]  # every boolean one lets each row see key 0

    def attend(q, k, v, m):
        return F.scaled_dot_product_attention(q, repeat_kv_unsqueeze(k, n),
                                              repeat_kv_unsqueeze(v, n), attn_mask=m)
    (site,), _ = packed(attend, *inputs(batch, n, rows, seed=rows), mask)
    assert site.packed, site


@pytest.mark.parametrize("case, reason", [
    ("causal", "is_causal=True"),
    ("too many rows", f"over the {MAX_PACKED_ROWS}"),
    ("values not repeated", "values are not repeated"),
])
def test_calls_kept_with_their_reason(case, reason):
    n, rows = 4, (MAX_PACKED_ROWS // 4 + 1 if case == "too many rows" else 2)
    q, k, v = inputs(2, n, rows)
    v_full = torch.randn(2, KV * n, L, D)

    def attend(q, k, v, v_full):
        values = v_full if case == "values not repeated" else repeat_kv(v, n)
        return F.scaled_dot_product_attention(q, repeat_kv(k, n), values,
                                              is_causal=case == "causal")
    (site,), gm = packed(attend, q, k, v, v_full)
    assert not site.packed and reason in site.reason, site
    assert site.describe().startswith(f"attention {site.node}: kept: ")
    (call,) = sdpa_calls(gm)
    assert call.args[1].op == "call_method"  # the repeat stays


def test_a_call_that_needs_gradients_stays_sdpa_packed():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2))
    q, k, v = inputs(2, 2, 3)
    gm, example = dynamo_graph(attend, q.requires_grad_(), k, v)
    (site,) = pack_grouped_queries(gm)
    assert site.became == "SDPA" and site.describe().endswith("not repeated -> SDPA"), site
    (call,) = sdpa_calls(gm)
    assert call.args[1].op == "placeholder" and call.meta["example_value"].shape == (2, KV, 6, D)
    # the output and the gradients through the packed call are the original's
    (out,) = gm(*example)
    torch.testing.assert_close(out, attend(q, k, v))
    torch.testing.assert_close(torch.autograd.grad(out.square().sum(), q)[0],
                               torch.autograd.grad(attend(q, k, v).square().sum(), q)[0])


def test_no_repeat_no_site():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 1), repeat_kv(v, 1))
    q, k, v = inputs(2, 1, 1)
    assert packed(attend, q, k, v)[0] == []


def test_through_the_backend_with_its_log_and_option(caplog):
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4),
                                              attn_mask=mask).transpose(1, 2).reshape(3, 1, -1)
    args = (*inputs(), keys_seen(3, 1))
    expected = attend(*args)
    for on in (True, False):
        torch._dynamo.reset()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ditron"):
            got = torch.compile(attend, backend="ditron",
                                options={"ditron.gqa_packing": on})(*args)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        lines = [r.getMessage() for r in caplog.records if "repeated keys/values" in
                 r.getMessage()]
        assert lines == ([f"graph 0/0: 1 attention call(s) on repeated keys/values: 1 packed "
                          "(query heads as rows), 0 kept"] if on else []), lines
