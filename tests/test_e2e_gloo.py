"""End to end on CPU ranks over gloo: `torch.compile(backend="ditron")` against eager.

Each launch of W ranks runs a group of checks (a launch costs a torch import per rank and the
ranks share the cores); every check compiles its function, runs forward and backward on random
float32 data, compares outputs and gradients with eager, and records which ditron ops the pass
produced (`graph_pass.reports`) so a test fails if the pass silently stops fusing. The ranks
return their findings and the pytest tests below assert on them, one test per check.

The FX graph and AOT autograd caches are off in the ranks: a cached graph skips the post-grad
pass and so its report.
"""

from __future__ import annotations

import collections
import functools
import traceback
import warnings
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import REPO_ROOT
from tests.distributed import run_ranks

AG = "all_gather_matmul"
RS = "matmul_reduce_scatter"
AR = "matmul_all_reduce"
AR_NORM = "matmul_all_reduce_rmsnorm"
MAG = "matmul_all_gather"
RTOL, ATOL = 1e-4, 1e-5
THIS = "tests.test_e2e_gloo"
RANK_ENV = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
TIMEOUT_S = 300
# torch 2.11's Dynamo does not put funcol.all_gather_tensor(x, gather_dim != 0) in a graph at all
# (torch._dynamo.explain: 0 graphs; the gather runs eagerly), so nothing reaches the pass there.
GATHER_DIM_TRACED = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
NEEDS_GATHER_DIM = {"ag_dim1", "ag_dim1_single", "ag_qkv", "mag_dim2"}

# ------------------------------------------------------------------------------------ rank side


def _reports_since(start: int) -> list:
    from ditron_inductor.lowering import graph_pass

    return [
        (r.graph, [(c.task, c.fused, c.reason) for c in r.candidates])
        for r in list(graph_pass.reports)[start:]
    ]


def _close(what: str, got, want) -> Optional[str]:
    try:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    except AssertionError as e:
        return f"{what}: {e}"
    return None


def _fwd_bwd(fn: Callable, inputs: list, grads: bool = True, compiled: Optional[Callable] = None,
             dynamic: tuple[int, int] = ()) -> list[str]:
    """Run fn eagerly and compiled on copies of `inputs`; compare outputs and input grads.
    `dynamic=(i, d)`: mark dim d of input i dynamic for the compiled run."""
    # Static shapes unless asked: without dynamic=False a recompile for new sizes would turn
    # dynamic on its own, and what a check covers would depend on the checks before it.
    compiled = compiled or torch.compile(fn, backend="ditron", dynamic=False)

    def run(f):
        xs = [x.detach().clone().requires_grad_(grads and x.is_floating_point()) for x in inputs]
        if dynamic and f is compiled:
            torch._dynamo.mark_dynamic(xs[dynamic[0]], dynamic[1])
        out = f(*xs)
        if grads:
            out.backward(_upstream(out))
        return out.detach(), [x.grad for x in xs]

    out_e, grads_e = run(fn)
    out_c, grads_c = run(compiled)
    errors = [_close("output", out_c, out_e)]
    errors += [_close(f"grad of input {i}", gc, ge) for i, (gc, ge) in enumerate(zip(grads_c, grads_e))]
    return [e for e in errors if e]


def _upstream(out: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


def _run_checks(checks: dict[str, Callable[[], list[str]]]) -> dict:
    """{name: {"errors": [...], "reports": [...]}}; one check's failure does not stop the others
    (the checks run the same collectives in the same order on every rank either way)."""
    from ditron_inductor.lowering import graph_pass

    results = {}
    for name, check in checks.items():
        start = len(graph_pass.reports)
        try:
            errors = check()
        except Exception:  # noqa: BLE001 - reported to the test process
            errors = [traceback.format_exc()]
        results[name] = {"errors": errors, "reports": _reports_since(start)}
    return results


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# Plain functional-collective code. Activations differ per rank so the gather matters.
def funcol_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_tensor is deprecated
    g = dist.group.WORLD
    B, S, H, N = 2, 4, 16, 24
    x = _randn(B, S, H, seed=100 + rank)
    w, b = _randn(N, H, seed=1), _randn(N, seed=2)

    def ag_dim0_bias(x, w, b):
        return F.linear(funcol.all_gather_tensor(x, 0, g), w, b)

    def ag_dim1(x, w):
        return F.linear(funcol.all_gather_tensor(x, 1, g), w)

    def ag_dim1_single(x, w, b):  # the non-deprecated spelling (torch >= 2.13)
        return F.linear(funcol.all_gather_single(x, 1, g), w, b)

    def ag_qkv(x, wq, wk, wv, bq):
        y = funcol.all_gather_tensor(x, 1, g)
        q, k, v = F.linear(y, wq, bq), F.linear(y, wk), F.linear(y, wv)
        return torch.cat([q, k * 2.0, v.relu()], dim=-1)

    def rs(dim, op):
        def f(x, w, b):
            return funcol.reduce_scatter_tensor(F.linear(x, w, b), op, dim, g)
        return f

    def rs_sum_of_matmuls(x1, w1, x2, w2):  # the input gradient of q/k/v, gate/up
        return funcol.reduce_scatter_tensor(F.linear(x1, w1) + F.linear(x2, w2), "sum", 1, g)

    def ar(x, w):
        return funcol.all_reduce(F.linear(x, w), "sum", g)

    def mag(dim):  # a column-parallel layer's output gathered (lm_head: dim 2)
        def f(x, w, b):
            return funcol.all_gather_tensor(F.linear(x, w, b), dim, g)
        return f

    def ar_rmsnorm(norm):  # inference: row-parallel layer, residual add, RMSNorm
        def f(x, w, res, nw):
            h = funcol.all_reduce(F.linear(x, w), "sum", g) + res
            return torch.cat([h, norm(h, nw)], dim=-1)
        return f

    def rmsnorm_hf(h, nw):  # Hugging Face Llama: round, then scale
        h32 = h.float()
        return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype) * nw

    def rmsnorm_fp32_weight(h, nw):  # scale in float32, then round
        h32 = h.float()
        return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6) * nw).to(h.dtype)

    def rmsnorm_functional(h, nw):
        return F.rms_norm(h, (N,), nw, 1e-5)

    def two_layers(x, w, res, nw, w2):  # the second layer's residual is the first's sum
        h1 = funcol.all_reduce(F.linear(x, w), "sum", g) + res
        h2 = funcol.all_reduce(F.linear(rmsnorm_hf(h1, nw), w2), "sum", g) + h1
        return rmsnorm_hf(h2, nw)

    bf16 = [t.to(torch.bfloat16) for t in (x, w, _randn(B, S, N, seed=6), _randn(N, seed=7))]
    w2 = _randn(N, N, seed=8).to(torch.bfloat16)
    xw = _randn(B, S * world_size, H, seed=200 + rank)  # rows that a reduce-scatter splits
    wq, wk, wv = (_randn(N, H, seed=s) for s in (3, 4, 5))
    checks = {
        "ag_dim0_bias": lambda: _fwd_bwd(ag_dim0_bias, [x, w, b]),
        "ag_dim1": lambda: _fwd_bwd(ag_dim1, [x, w]),
        "ag_qkv": lambda: _fwd_bwd(ag_qkv, [x, wq, wk, wv, b]),
        "rs_dim0_sum": lambda: _fwd_bwd(rs(0, "sum"), [_randn(B * world_size, S, H, seed=rank), w, b]),
        "rs_dim1_sum": lambda: _fwd_bwd(rs(1, "sum"), [xw, w, b]),
        # funcol's reduce-scatter has no backward for avg: forward only.
        "rs_dim1_avg": lambda: _fwd_bwd(rs(1, "avg"), [xw, w, b], grads=False),
        "rs_sum_of_matmuls": lambda: _fwd_bwd(rs_sum_of_matmuls, [
            xw, w, _randn(B, S * world_size, 8, seed=210 + rank), _randn(N, 8, seed=9)]),
        "ar_sum": lambda: _fwd_bwd(ar, [x, w]),
        "mag_dim0_bias": lambda: _fwd_bwd(mag(0), [x, w, b]),
        "mag_dim2": lambda: _fwd_bwd(mag(2), [x, w, b]),
        "ar_rmsnorm_hf": lambda: _fwd_bwd(ar_rmsnorm(rmsnorm_hf), bf16, grads=False),
        "ar_rmsnorm_fp32_weight": lambda: _fwd_bwd(ar_rmsnorm(rmsnorm_fp32_weight), bf16,
                                                   grads=False),
        "ar_rmsnorm_functional": lambda: _fwd_bwd(ar_rmsnorm(rmsnorm_functional), bf16,
                                                  grads=False),
        "ar_rmsnorm_two_layers": lambda: _fwd_bwd(two_layers, bf16 + [w2], grads=False),
    }
    if hasattr(funcol, "all_gather_single"):
        checks["ag_dim1_single"] = lambda: _fwd_bwd(ag_dim1_single, [x, w, b])
    if world_size > 2:
        checks = {name: check for name, check in checks.items() if name in FOUR_RANK_CHECKS}
    return _run_checks(checks)


# Expected fused ops per graph; a graph with no candidates at all has no report.
FUNCOL_EXPECTED = {
    "ag_dim0_bias": {"forward": [AG], "backward": [RS]},
    "ag_dim1": {"forward": [AG], "backward": [RS]},
    "ag_dim1_single": {"forward": [AG], "backward": [RS]},
    # backward: the input gradient, a sum of the three matmul products, reduce-scattered
    "ag_qkv": {"forward": [AG], "backward": [RS]},
    "rs_dim0_sum": {"forward": [RS], "backward": [AG]},
    "rs_dim1_sum": {"forward": [RS], "backward": [AG]},
    "rs_dim1_avg": {"forward": [RS]},
    # one op over the sum's terms; backward: the gathered output
    # gradient feeds both input gradients
    "rs_sum_of_matmuls": {"forward": [RS], "backward": [AG]},
    "ar_sum": {"forward": [AR]},
    # backward: the gradient reduce-scattered, then its matmuls (no ditron op)
    "mag_dim0_bias": {"forward": [MAG]},
    "mag_dim2": {"forward": [MAG]},
    "ar_rmsnorm_hf": {"forward": [AR_NORM]},
    "ar_rmsnorm_fp32_weight": {"forward": [AR_NORM]},
    "ar_rmsnorm_functional": {"forward": [AR_NORM]},
    "ar_rmsnorm_two_layers": {"forward": [AR_NORM, AR_NORM]},
}
# On 4 ranks, the checks whose rewrite depends on the world size: the rank-major reorders of a
# gather or scatter on dim 1 (one piece per rank), a sum's terms, and one all-reduce + norm.
FOUR_RANK_CHECKS = ("ag_dim1", "ag_qkv", "rs_dim1_sum", "rs_sum_of_matmuls", "ar_rmsnorm_hf",
                    "mag_dim2")


# DTensor tensor-parallel plans.
class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    """Sequence-parallel norm, then Q/K/V (colwise) -> causal attention -> O (rowwise)."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        y = self.norm(x)
        b, s, _ = y.shape
        q, k, v = (p(y).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, s, -1))


def _compare_module(model: nn.Module, x: torch.Tensor) -> list[str]:
    """Eager vs compiled on the same (parallelized) module: output, input grad, parameter grads."""
    compiled = torch.compile(model, backend="ditron")

    def run(m):
        model.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        out = m(xi)
        out.backward(_upstream(out))
        params = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                  for n, p in model.named_parameters()}
        return out.detach(), xi.grad, params

    out_e, xg_e, pg_e = run(model)
    out_c, xg_c, pg_c = run(compiled)
    errors = [_close("output", out_c, out_e), _close("input grad", xg_c, xg_e)]
    errors += [_close(f"grad of {n}", pg_c[n], pg_e[n]) for n in pg_e]
    return [e for e in errors if e]


def dtensor_ranks(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module)

    mesh = DeviceMesh("cpu", list(range(world_size)))
    B, S, D = 2, 4 * world_size, 32

    def mlp():
        torch.manual_seed(0)  # the same full weights on every rank before sharding
        model = parallelize_module(MLP(D, 64), mesh, {
            "up": ColwiseParallel(), "gate": ColwiseParallel(), "down": RowwiseParallel()})
        return _compare_module(model, _randn(B, S, D, seed=5))  # replicated input

    def sequence_parallel_attention():
        torch.manual_seed(0)
        return parallelize_module(Attention(D, 8), mesh, {
            "norm": SequenceParallel(),
            "q": ColwiseParallel(input_layouts=Shard(1)),
            "k": ColwiseParallel(input_layouts=Shard(1)),
            "v": ColwiseParallel(input_layouts=Shard(1)),
            "o": RowwiseParallel(output_layouts=Shard(1)),
        })

    def attention():
        return _compare_module(sequence_parallel_attention(),
                               _randn(B, S // world_size, D, seed=300 + rank))  # Shard(1)

    def attention_inductor_pass():
        # backend="inductor" under ditron_inductor.installed() against backend="ditron": the same
        # candidates with the same decisions and reasons, the same numbers bit for bit
        import contextlib

        import ditron_inductor
        from ditron_inductor.lowering import graph_pass

        x = _randn(B, S // world_size, D, seed=300 + rank)
        runs = {}
        for backend in ("ditron", "inductor"):
            torch._dynamo.reset()  # the "attention" check compiled the same code
            model = sequence_parallel_attention()
            start = len(graph_pass.reports)
            with ditron_inductor.installed() if backend == "inductor" else contextlib.nullcontext():
                xi = x.detach().clone().requires_grad_()
                out = torch.compile(model, backend=backend)(xi)
                out.backward(_upstream(out))
            grads = [xi.grad] + [p.grad.full_tensor() for p in model.parameters()]
            runs[backend] = (out.detach(), grads, _reports_since(start))
        (out_d, grads_d, reports_d), (out_i, grads_i, reports_i) = runs["ditron"], runs["inductor"]
        errors = []
        if [c for _, c in reports_i] != [c for _, c in reports_d]:
            errors.append(f"candidates differ:\n{_describe(reports_i)}\nagainst backend='ditron':"
                          f"\n{_describe(reports_d)}")
        if _fused_ops(reports_i) != DTENSOR_EXPECTED["attention"]:
            errors.append(f"fused ops {_fused_ops(reports_i)}:\n{_describe(reports_i)}")
        if not torch.equal(out_i, out_d):
            errors.append("the output differs from backend='ditron''s")
        errors += [f"gradient {i} differs from backend='ditron''s"
                   for i, (gi, gd) in enumerate(zip(grads_i, grads_d)) if not torch.equal(gi, gd)]
        return errors

    checks = {"mlp": mlp, "attention": attention}
    if world_size == 2:
        checks["attention_inductor_pass"] = attention_inductor_pass
    return _run_checks(checks)


DTENSOR_EXPECTED = {
    # Rowwise down all-reduces its output in the forward; in the backward, gate and up each
    # all-reduce their own (partial) input grad.
    "mlp": {"forward": [AR], "backward": [AR, AR]},
    # The sequence-parallel norm output is gathered once for Q, K and V; O reduce-scatters on the
    # sequence dim. Backward: O's input grad gathers the output grad; Q, K and V each reduce-scatter
    # their input grad.
    "attention": {"forward": [AG, RS], "backward": [AG, RS, RS, RS]},
}


# Dynamic M: one compile serves several token counts.
def dynamic_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._dynamo.utils import counters

    warnings.filterwarnings("ignore", category=FutureWarning)
    g = dist.group.WORLD
    H, N = 16, 32
    w1, b1, w2 = _randn(N, H, seed=1), _randn(N, seed=2), _randn(H, N, seed=3)

    def block(x, w1, b1, w2):  # sequence-parallel in, sequence-parallel out
        y = F.gelu(F.linear(funcol.all_gather_tensor(x, 1, g), w1, b1))
        return funcol.reduce_scatter_tensor(F.linear(y, w2), "sum", 1, g)

    def check():
        compiled = torch.compile(block, backend="ditron")
        errors = []
        before = counters["stats"]["unique_graphs"]
        for s in (4, 6, 10):
            x = _randn(2, s, H, seed=400 + rank + s)
            errors += [f"S={s}: {e}" for e in _fwd_bwd(block, [x, w1, b1, w2], compiled=compiled,
                                                       dynamic=(0, 1))]
        graphs = counters["stats"]["unique_graphs"] - before
        if graphs != 1:
            errors.append(f"dynamo compiled {graphs} graphs for 3 sizes (expected 1: no recompile)")
        return errors

    return _run_checks({"dynamic_m": check})


# Bad input: no process group, world size 1, a group the process does not know.
def bad_input_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    def plain(x, w1, w2):
        return F.linear(F.gelu(F.linear(x, w1)), w2)

    def no_process_group():
        assert not dist.is_initialized()
        args = [_randn(8, 16, seed=1), _randn(32, 16, seed=2), _randn(16, 32, seed=3)]
        errors = _fwd_bwd(plain, args)
        torch._dynamo.reset()
        ditron = torch.compile(plain, backend="ditron")(*args)
        torch._dynamo.reset()
        inductor = torch.compile(plain, backend="inductor")(*args)
        if not torch.equal(ditron, inductor):
            errors.append("ditron and inductor results differ bitwise on a graph with nothing to fuse")
        return errors

    def world_size_one():
        import torch.distributed._functional_collectives as funcol

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        warnings.filterwarnings("ignore", category=FutureWarning)

        def f(x, w):  # dim 0: on one rank a dim-1 gather traces to a clone, not a candidate
            return F.linear(funcol.all_gather_tensor(x, 0, dist.group.WORLD), w)

        return _fwd_bwd(f, [_randn(2, 4, 16, seed=1), _randn(8, 16, seed=2)])

    def unknown_group():
        x, w = _randn(4, 8, seed=1), _randn(8, 8, seed=2)
        try:
            torch.ops.ditron.all_gather_matmul(x, [w], [None], 0, "no_such_group", 2,
                                               '{"impl": "reference"}')
        except RuntimeError as e:
            return [] if "no_such_group" in str(e) else [f"error does not name the group: {e}"]
        return ["no error for an unknown group"]

    return _run_checks({"no_process_group": no_process_group, "world_size_one": world_size_one,
                        "unknown_group": unknown_group})


# The launcher itself: a rank's exception comes back with its traceback, a hang times out.
def raising_rank(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for a rank that never comes: the launcher must not


def hanging_rank(rank: int, world_size: int) -> None:
    import time

    time.sleep(600)


# ------------------------------------------------------------------------------------ test side


@functools.lru_cache(maxsize=None)
def _launch(name: str, world_size: int, init: bool = True):
    """Each launch runs once per pytest session; the tests of its checks share it."""
    try:
        return run_ranks(f"{THIS}:{name}", world_size, timeout_s=TIMEOUT_S, env=RANK_ENV,
                         init_process_group=init)
    except Exception as e:  # noqa: BLE001 - every test of the launch reports it
        return e


def _results(name: str, world_size: int, check: str, init: bool = True) -> list[dict]:
    ranks = _launch(name, world_size, init)
    if isinstance(ranks, Exception):
        raise ranks
    return [r[check] for r in ranks]


def _fused_ops(reports: list) -> dict[str, list[str]]:
    fused: dict[str, list[str]] = collections.defaultdict(list)
    for graph, candidates in reports:
        kind = graph.split()[-1]
        fused[kind] += sorted(task.split()[0] for task, ok, _ in candidates if ok)
    return {k: sorted(v) for k, v in fused.items() if v}


def _describe(reports: list) -> str:
    return "\n".join(f"  {graph}: {task} -> {'fused' if ok else 'not fused'} ({why})"
                     for graph, candidates in reports for task, ok, why in candidates) or "  (none)"


def _assert_check(ranks: list[dict], expected: Optional[dict]) -> None:
    for rank, res in enumerate(ranks):
        assert not res["errors"], f"rank {rank}:\n" + "\n".join(res["errors"])
        if expected is not None:
            want = {k: sorted(v) for k, v in expected.items() if v}
            got = _fused_ops(res["reports"])
            assert got == want, (f"rank {rank}: fused ops {got}, expected {want}; candidates:\n"
                                 + _describe(res["reports"]))


@pytest.mark.slow
@pytest.mark.parametrize("world_size, check", [(2, c) for c in sorted(FUNCOL_EXPECTED)]
                         + [(4, c) for c in FOUR_RANK_CHECKS])
def test_functional_collectives(world_size, check):
    import torch.distributed._functional_collectives as funcol

    if check == "ag_dim1_single" and not hasattr(funcol, "all_gather_single"):
        pytest.skip("this torch has no all_gather_single")
    if check in NEEDS_GATHER_DIM and not GATHER_DIM_TRACED:
        pytest.xfail("this torch does not trace all_gather_tensor(gather_dim=1) into a graph")
    _assert_check(_results("funcol_ranks", world_size, check), FUNCOL_EXPECTED[check])


@pytest.mark.slow
@pytest.mark.parametrize("check", sorted(DTENSOR_EXPECTED))
def test_dtensor_tensor_parallel(check):
    # 2 ranks: the functional-collective checks above take the same patterns to 4 ranks, and a
    # 4-rank launch of these modules costs more than a minute of the suite's 2 cores
    _assert_check(_results("dtensor_ranks", 2, check), DTENSOR_EXPECTED[check])


@pytest.mark.slow
def test_inductor_backend_with_ditron_passes_matches_the_ditron_backend():
    _assert_check(_results("dtensor_ranks", 2, "attention_inductor_pass"), None)


@pytest.mark.slow
def test_dynamic_m_one_compile():
    if not GATHER_DIM_TRACED:
        pytest.xfail("this torch does not trace all_gather_tensor(gather_dim=1) into a graph")
    ranks = _results("dynamic_ranks", 2, "dynamic_m")
    # One forward and one backward compile for all sizes, each with its fused ops.
    _assert_check(ranks, {"forward": [AG, RS], "backward": [AG, RS]})
    for res in ranks:
        assert [g.split()[-1] for g, _ in res["reports"]] == ["forward", "backward"], res["reports"]
        # B 2 with a symbolic sequence: the permuting views infer it (-1), so every site runs
        # on rank-major rows
        tasks = [task for _, candidates in res["reports"] for task, _, _ in candidates]
        assert all("rank-major rows reordered" in t for t in tasks), tasks


@pytest.mark.slow
@pytest.mark.parametrize("check", ["no_process_group", "world_size_one", "unknown_group"])
def test_bad_input(check):
    ranks = _results("bad_input_ranks", 1, check, init=False)
    _assert_check(ranks, None)
    if check == "no_process_group":
        assert all(candidates == [] for _, candidates in ranks[0]["reports"]), \
            "a graph with no collective got a candidate"
    if check == "world_size_one":
        (graph, candidates), = [r for r in ranks[0]["reports"] if r[0].endswith("forward")]
        assert [(ok, why) for _, ok, why in candidates] == [
            (False, "world size 1: there is nothing to communicate")], candidates


@pytest.mark.slow
def test_demo_runs_and_passes():
    import subprocess
    import sys

    from ditron_inductor import demo

    proc = subprocess.run([sys.executable, "-m", "ditron_inductor.demo", "--device", "cpu"],
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert demo.PASS_LINE in proc.stdout, out
    assert "-> torch.ops.ditron." in proc.stdout, out  # at least one subgraph was fused


def run_exit_program(*args: str, timeout_s: float = 600) -> str:
    """Run tests/exit_program.py with the ditron log on; assert that every rank exited 0."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_LOGS": "+ditron"}
    if "cuda" in args:  # GPU ranks run the compiled kernels whatever this process interprets
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "tests.exit_program", *args],
                          env=env, capture_output=True, text=True, timeout=timeout_s,
                          cwd=REPO_ROOT)
    out = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0 and "exit codes [0, 0]" in proc.stdout, out
    assert "terminate called" not in proc.stderr, out
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("shutdown", ["destroy", "none"])
def test_program_exits_cleanly_with_the_log_on(shutdown):
    # one program per way to shut down (a second run of the same compile added ~45 s to CI)
    out = run_exit_program("--shutdown", shutdown)
    assert "rank 0: 4 ditron ops" in out, out


def test_exit_program_async_tp_needs_cuda_inference():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tests.exit_program",
                           "--async-tp"], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--async-tp: with --device cuda --workload infer only" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_inference_program_exits_cleanly():
    # the plain-TP pair under reduce-overhead (no CUDA graphs on CPU): one all-reduce op
    out = run_exit_program("--shutdown", "destroy", "--workload", "infer")
    assert "rank 0: 1 ditron ops" in out, out


@pytest.mark.slow
def test_launcher_reraises_rank_exception():
    from tests.distributed import RankError

    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed.*raising_rank.*boom from rank 1"):
        run_ranks(f"{THIS}:raising_rank", 2, timeout_s=60)


@pytest.mark.slow
def test_launcher_times_out_on_hang():
    import time

    from tests.distributed import RankTimeout

    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0, 1\] of 2 did not finish within 5 s"):
        run_ranks(f"{THIS}:hanging_rank", 2, timeout_s=5)
    assert time.monotonic() - start < 30
