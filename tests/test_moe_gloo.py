"""Expert parallelism end to end on 2 CPU ranks over gloo: the MoE layer of `tests/moe_ep.py` and
a tiny model of two such layers under `torch.compile(backend="ditron")`, forward and backward,
against eager and Inductor; odd routings; the ops' own autograd.

One launch runs every check (a launch costs a torch import per rank). The experts run as
`torch._grouped_mm`, which compiles on CPU in bfloat16 only (torch 2.13), so:
- against Inductor the numbers must be equal bit for bit: on CPU the ops' reference path runs
  the ATen kernels that Inductor's graph calls, and Inductor compiles the rest of both graphs
  alike;
- against eager, where Inductor rounds elsewhere, within BF16_TOL of the largest magnitude (a
  row sent to the wrong expert or back to the wrong token is off by the whole magnitude).
The split sizes come from `.tolist()`: unbacked SymInts under `capture_scalar_outputs`, the
form torchtitan compiles; the graph-break form is checked once.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_e2e_gloo import RANK_ENV, _describe, _fused_ops, _run_checks

THIS = "tests.test_moe_gloo"
DISPATCH, COMBINE = "all_to_all_grouped_mm", "grouped_mm_all_to_all"
BF16_TOL = 2e-2
TIMEOUT_S = 300
DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 32, 4, 2, 8

# ------------------------------------------------------------------------------------ rank side


def _far(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> list[str]:
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    scale = want.float().abs().max().item() if want.numel() else 0.0
    return [f"{what}: max error {err:.3g} > {tol} x max |eager| {scale:.3g}"] if err > tol * (
        scale or 1.0) else []


def _step(model, inputs: list) -> tuple:
    """Forward and backward: the output, the inputs' and the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = model(*xs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype))
    grads = [x.grad for x in xs if x.is_floating_point()]
    return out.detach(), grads + [p.grad for p in model.parameters()]


def _compare(model, inputs: list, inductor: bool = False, capture: bool = True,
             code: list = None) -> list[str]:
    """ditron against eager (and Inductor): outputs and gradients. `code` collects the
    generated code of the compiled graphs."""
    from torch._inductor.utils import run_and_get_code

    eager = _step(model, inputs)
    backends = ["ditron"] + (["inductor"] if inductor else [])
    got = {}
    for backend in backends:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, dynamic=False)
        with torch._dynamo.config.patch(capture_scalar_outputs=capture):
            got[backend], codes = run_and_get_code(lambda: _step(compiled, inputs))
        if backend == "ditron" and code is not None:
            code += codes
    names = ["output"] + [f"gradient {i}" for i in range(len(eager[1]))]
    errors = []
    for name, want, have in zip(names, [eager[0]] + eager[1],
                                [got["ditron"][0]] + got["ditron"][1]):
        errors += _far(name, have, want, BF16_TOL)
    if inductor:
        ind = [got["inductor"][0]] + got["inductor"][1]
        errors += [f"{name}: ditron differs from Inductor" for name, a, b in zip(
            names, [got["ditron"][0]] + got["ditron"][1], ind) if not torch.equal(a, b)]
    return errors


def _route_to(experts: list[int]):
    """A routing that picks among `experts` only (every rank's tokens)."""
    def route(logits):
        mask = torch.full((logits.shape[-1],), float("-inf"), dtype=logits.dtype)
        mask[experts] = 0.0
        return logits + mask
    return route


def moe_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from tests.moe_ep import ExpertParallelMoE, TinyMoEModel

    warnings.filterwarnings("ignore", category=UserWarning)
    g = dist.group.WORLD
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(rank)).bfloat16()

    def layer(route=None):
        torch.manual_seed(0)  # the same full weights on every rank, each keeps its experts
        return ExpertParallelMoE(DIM, HIDDEN, EXPERTS, TOP_K, g, route=route).bfloat16()

    def layer_check():
        code: list[str] = []
        errors = _compare(layer(), [x], inductor=True, code=code)
        for op in (DISPATCH, COMBINE):
            if not any(f"torch.ops.ditron.{op}.default" in c for c in code):
                errors.append(f"torch.ops.ditron.{op} is not in the generated code")
        return errors

    def model_check():
        torch.manual_seed(0)
        model = TinyMoEModel(64, DIM, HIDDEN, EXPERTS, TOP_K, 2, g).bfloat16()
        ids = torch.randint(0, 64, (TOKENS,), generator=torch.Generator().manual_seed(rank))
        return _compare(model, [ids])

    checks = {
        "layer": layer_check,
        # global expert 1 (rank 0's second) gets no token
        "empty_expert": lambda: _compare(layer(_route_to([0, 2, 3])), [x]),
        # every token to rank 0's experts: rank 1 receives nothing, rank 0 everything
        "one_rank": lambda: _compare(layer(_route_to([0, 1])), [x]),
        # Dynamo breaks the graph at .tolist(): the sizes are constants in the next graph
        "graph_break": lambda: _compare(layer(), [x], capture=False),
        "model": model_check,
        "ops_autograd": lambda: ops_autograd(rank, g),
    }
    return _run_checks(checks)


def ops_autograd(rank: int, g) -> list[str]:
    """The ops called eagerly in float32, their gradients through their autograd formulas,
    against the same sequence of functional collectives and grouped GEMMs. Rank 1 sends
    everything to rank 0 (so receives nothing) and rank 1's expert 1 gets no row."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from tests.moe_ep import expert_major_order

    torch.manual_seed(1)
    local, k, n = 2, 8, 16
    send_counts = torch.tensor([[3, 0], [2, 0]] if rank == 0 else [[4, 1], [0, 0]])
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=g)
    in_splits, out_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    rows = sum(out_splits)
    by_expert = expert_major_order(recv_counts, rows)
    offsets = torch.cumsum(recv_counts.sum(0), 0, dtype=torch.int32)
    x = torch.randn(sum(in_splits), k, generator=torch.Generator().manual_seed(10 + rank))
    w1, w3 = torch.randn(local, k, n), torch.randn(local, k, n)
    w2, w2b = torch.randn(local, n, k), torch.randn(local, n, k)
    plan = '{"impl": "reference"}'

    def with_ops(x, w1, w3, w2, w2b):
        received, h1, h3 = torch.ops.ditron.all_to_all_grouped_mm(
            x, out_splits, in_splits, by_expert, [w1, w3], offsets, g.group_name, 2, plan)
        back = torch.ops.ditron.grouped_mm_all_to_all(
            [torch.sigmoid(h1), h3], [w2, w2b], offsets, by_expert, False, in_splits,
            out_splits, g.group_name, 2, plan)
        return back, received

    def unfused(x, w1, w3, w2, w2b):
        received = funcol.all_to_all_single(x, out_splits, in_splits, g)[by_expert]
        h1, h3 = (torch._grouped_mm(received, w, offs=offsets) for w in (w1, w3))
        y = (torch._grouped_mm(torch.sigmoid(h1), w2, offs=offsets)
             + torch._grouped_mm(h3, w2b, offs=offsets))
        y = torch.zeros(rows, k).index_put((by_expert,), y)
        return funcol.all_to_all_single(y, in_splits, out_splits, g), received

    def grads(fn):
        inputs = [t.clone().requires_grad_() for t in (x, w1, w3, w2, w2b)]
        back, received = fn(*inputs)
        # the received rows' own gradient too: the dispatch's first output
        loss = (back * back.detach().sin()).sum() + (received * received.detach().cos()).sum()
        loss.backward()
        return [back.detach(), received.detach()] + [t.grad for t in inputs]

    names = ["combined rows", "received rows", "grad x", "grad w1", "grad w3", "grad w2",
             "grad w2b"]
    errors = []
    for name, a, b in zip(names, grads(with_ops), grads(unfused)):
        try:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        except AssertionError as e:
            errors.append(f"{name}: {e}")
    return errors


# ------------------------------------------------------------------------------------ test side


@functools.lru_cache(maxsize=None)
def _launch():
    try:
        return run_ranks(f"{THIS}:moe_ranks", 2, timeout_s=TIMEOUT_S, env=RANK_ENV)
    except Exception as e:  # noqa: BLE001 - every test of the launch reports it
        return e


def _results(check: str) -> list[dict]:
    ranks = _launch()
    if isinstance(ranks, Exception):
        raise ranks
    return [r[check] for r in ranks]


# The fused ops of each graph, sorted. Per MoE layer: the dispatch and the combine in the
# forward, and in the backward the output gradient dispatched, the input gradients combined.
LAYER = {"forward": [DISPATCH, COMBINE], "backward": [DISPATCH, COMBINE]}
EXPECTED = {
    "layer": LAYER,
    "empty_expert": LAYER,
    "one_rank": LAYER,
    "graph_break": LAYER,  # in the graph after the break
    "model": {"forward": [DISPATCH, DISPATCH, COMBINE, COMBINE],
              "backward": [DISPATCH, DISPATCH, COMBINE, COMBINE]},
    "ops_autograd": {},
}


@pytest.mark.slow
@pytest.mark.parametrize("check", list(EXPECTED))
def test_moe_expert_parallel(check):
    for rank, res in enumerate(_results(check)):
        assert not res["errors"], f"rank {rank}:\n" + "\n".join(res["errors"])
        got = _fused_ops(res["reports"])
        assert got == EXPECTED[check], (f"rank {rank}: fused ops {got}, expected "
                                        f"{EXPECTED[check]}; candidates:\n"
                                        + _describe(res["reports"]))
