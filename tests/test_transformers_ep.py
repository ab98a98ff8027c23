"""transformers' MoE models under its expert parallelism on 2 CPU ranks over gloo
(ditron_inductor/transformers_ep.py): with ep_implementation="ditron" a tiny Mixtral and a tiny
Qwen3-MoE compile whole under `torch.compile(backend="ditron")`, forward and backward, every
MoE layer's dispatch and combine rewritten into ditron ops (on CPU their reference runs), and
the logits and gradients match transformers' own "all_to_all" exchange run eagerly (bf16: within
BF16_TOL of the largest magnitude; a row sent to the wrong expert or token is off by the whole
magnitude). transformers' own exchange does not compile whole (the module doc says why: Dynamo
breaks its graph): that is checked too, on Mixtral's forward, so that the note goes when
transformers changes; Qwen3-MoE's own exchange compiled by ditron runs right, fuses nothing and
logs a reason for every collective it leaves."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from tests import ditron_log
from tests.distributed import run_ranks
from tests.test_e2e_gloo import RANK_ENV
from tests.test_moe_gloo import _far

pytest.importorskip("transformers.distributed.expert_parallel")

THIS = "tests.test_transformers_ep"
DISPATCH, COMBINE = "all_to_all_grouped_mm", "grouped_mm_all_to_all"
BF16_TOL = 2e-2
KINDS = ("mixtral", "qwen3_moe")
SIZES = {"mixtral": dict(intermediate_size=48), "qwen3_moe": dict(moe_intermediate_size=48,
                                                                  intermediate_size=64)}
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _step(model, ids):
    """Logits and the gradients of a router and of this rank's experts, after a backward."""
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    logits.float().square().mean().backward()
    mlp = model.model.layers[0].mlp
    grads = [mlp.gate.weight.grad, mlp.experts.gate_up_proj.grad, mlp.experts.down_proj.grad]
    return [logits.detach()] + [g.to_local() if hasattr(g, "to_local") else g for g in grads]


def ep_ranks(rank: int, world: int) -> dict:
    from ditron_inductor.lowering import graph_pass
    from tests import hf_moe_ep

    warnings.filterwarnings("ignore")
    torch._dynamo.config.capture_scalar_outputs = True  # the split sizes, unbacked SymInts
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    results = {}
    for kind in KINDS:
        cfg = hf_moe_ep.config(kind, 4, 2, **COMMON, **SIZES[kind])
        want = _step(hf_moe_ep.build(cfg, kind, "all_to_all", world), ids)
        torch._dynamo.reset()
        graph_pass.reports.clear()
        model = hf_moe_ep.build(cfg, kind, "ditron", world)
        got = _step(torch.compile(model, backend="ditron", dynamic=False), ids)
        errors = []
        for name, a, b in zip(("logits", "router grad", "gate_up grad", "down grad"), got, want):
            errors += _far(f"{kind} {name}", a, b, BF16_TOL)
        fused = {r.graph.split()[-1]: sorted(c.op for c in r.candidates if c.fused)
                 for r in graph_pass.reports if r.candidates}
        results[kind] = {"errors": errors, "fused": fused}
        if kind == "qwen3_moe":
            results["own_exchange"] = _own_exchange(cfg, kind, world, ids, want)
        results[f"{kind}_all_reduce"] = _all_reduce_ep(cfg, kind, world)
        if kind == "mixtral":  # Dynamo alone (no backend compiles) on transformers' exchange
            torch._dynamo.reset()
            own = hf_moe_ep.build(cfg, kind, "all_to_all", world)
            results["own_exchange_breaks"] = torch._dynamo.explain(own)(ids).graph_break_count
    return results


def _own_exchange(cfg, kind: str, world: int, ids, want: list) -> dict:
    """transformers' own exchange compiled by ditron (Dynamo breaks it into several graphs): its
    numbers against the same exchange run eagerly, the ditron ops of every graph, the reasons of
    the collectives left, and how many of those have no line of their own in the log."""
    from ditron_inductor.lowering import graph_pass
    from tests import hf_moe_ep

    torch._dynamo.reset()
    graph_pass.reports.clear()
    with ditron_log.captured() as lines:
        model = hf_moe_ep.build(cfg, kind, "all_to_all", world)
        got = _step(torch.compile(model, backend="ditron", dynamic=False), ids)
    reports = list(graph_pass.reports)
    errors = []
    for name, a, b in zip(("logits", "router grad", "gate_up grad", "down grad"), got, want):
        errors += _far(f"{kind} own exchange {name}", a, b, BF16_TOL)
    return {"errors": errors, "graphs": len(reports),
            "fused": sorted(c.op for r in reports for c in r.candidates if c.fused),
            "left": sorted({ditron_log.reason(c) for r in reports for c in r.left}),
            "unexplained": ditron_log.unexplained(reports, lines)}


def _all_reduce_ep(cfg, kind: str, world: int) -> dict:
    """transformers' inference EP (ep_implementation="all_reduce", what its default runs without
    gradients where the ranks share a batch): every rank runs its own experts on the same batch
    and an all-reduce sums the partial outputs. Compiled by ditron, inference: the logits against the same model run
    eagerly, the ditron ops of every graph, the reasons of the collectives left."""
    from ditron_inductor.lowering import graph_pass
    from tests import hf_moe_ep

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model = hf_moe_ep.build(cfg, kind, "all_reduce", world)
    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        graph_pass.reports.clear()
        with ditron_log.captured() as lines:
            got = torch.compile(model, backend="ditron", dynamic=False)(ids).logits
    reports = list(graph_pass.reports)
    return {"errors": _far(f"{kind} all_reduce EP logits", got, want, BF16_TOL),
            "fused": [sorted(c.op for c in r.candidates if c.fused) for r in reports],
            "left": sorted({ditron_log.reason(c) for r in reports for c in r.left}),
            "unexplained": ditron_log.unexplained(reports, lines)}


@functools.lru_cache(maxsize=None)
def _launch():
    try:
        return run_ranks(f"{THIS}:ep_ranks", 2, timeout_s=300, env=RANK_ENV)
    except Exception as e:  # noqa: BLE001 - every test of the launch reports it
        return e


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_ditron_ep_compiles_whole_and_matches_transformers(kind):
    ranks = _launch()
    if isinstance(ranks, Exception):
        raise ranks
    layers = [DISPATCH, DISPATCH, COMBINE, COMBINE]  # 2 MoE layers
    for rank, res in enumerate(ranks):
        assert res["own_exchange_breaks"] > 0, "transformers' exchange compiles whole now"
        res = res[kind]
        assert not res["errors"], f"rank {rank}: " + "\n".join(res["errors"])
        # one forward and one backward graph, each MoE layer's two ops rewritten
        assert res["fused"] == {"forward": layers, "backward": layers}, res["fused"]


@pytest.mark.slow
def test_transformers_own_exchange_leaves_every_collective_with_a_reason():
    """Qwen3-MoE under its EP plan with transformers' own exchange, compiled by ditron: Dynamo
    breaks the layer at the exchanged counts, so no all-to-all shares a graph with its grouped
    GEMM and nothing is fused; the numbers match the same exchange run eagerly, and every
    collective left in every graph has its line in the log."""
    ranks = _launch()
    if isinstance(ranks, Exception):
        raise ranks
    for rank, res in enumerate(ranks):
        own = res["own_exchange"]
        assert not own["errors"], f"rank {rank}: " + "\n".join(own["errors"])
        assert own["graphs"] > 2 and own["fused"] == [], own
        assert own["left"] and own["unexplained"] == 0, own


def test_unserved_experts_keep_transformers_exchange():
    from types import SimpleNamespace

    from ditron_inductor.transformers_ep import unserved

    assert unserved(SimpleNamespace(has_bias=False), 1) == ""
    assert unserved(SimpleNamespace(has_bias=True), 1) == "experts with a bias"
    assert unserved(SimpleNamespace(has_post_expert_norm=True), 1) == "a norm after the experts"
    assert "tp_size 2" in unserved(SimpleNamespace(), 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_inference_ep_all_reduce_takes_the_grouped_mm_ops(kind):
    """Each MoE layer's all-reduce of its experts' partial outputs is one grouped-GEMM op, with
    the residual add and the next norm (the second layer's: the final norm), and the logits
    match the eager model's."""
    ranks = _launch()
    if isinstance(ranks, Exception):
        raise ranks
    for rank, res in enumerate(ranks):
        res = res[f"{kind}_all_reduce"]
        assert not res["errors"], f"rank {rank}: " + "\n".join(res["errors"])
        assert res["fused"] == [["grouped_mm_all_reduce_rmsnorm"] * 2], res
        assert res["unexplained"] == 0, res
