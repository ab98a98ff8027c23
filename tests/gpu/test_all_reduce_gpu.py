"""Fused GEMM + all-reduce (+ residual + RMSNorm) vs the reference on GPUs: 2, 4 and 8 ranks, bf16
and fp16, random data, M from 1 to 8192, each plan forced (push after the GEMM or beside it:
cuBLAS in row chunks or the persistent GEMM that raises READY per chunk; push_all, lamport,
lamport_all, copy_engine, other block sizes) and the runtime's default, K per rank 1024 and 3584,
N 8192 and a smaller N, residual and norm variants (both roundings), many calls in a row,
under torch.cuda.graph capture + replay, and a decode step compiled with backend="ditron" and
mode="reduce-overhead"; the grouped-GEMM ops' computed input through each plan, eager and
captured. Every case asserts that the fused path served it (or, where a plan cannot take it,
that it declined).

Run on the GPU machine: pytest -m gpu tests/gpu/test_all_reduce_gpu.py
(DITRON_AR_QUICK=1: a subset of the shapes, for a short device budget, the prefill plans at
M 7, 257 and 2048 only unless DITRON_AR_OVERLAP_ALL_M=1; DITRON_AR_COMPILED_ONLY=1: only the
compiled decode step under Inductor's CUDA graphs). Rank 0 prints one line per eager case.
"""

from __future__ import annotations

import os
import time
import traceback

import pytest
import torch

from .ranks import init_rank, report_and_close, spawn_ranks
from .test_fused_gpu import _check, _free_port, _plan

AR = "matmul_all_reduce_rmsnorm"

pytestmark = pytest.mark.gpu

QUICK = os.environ.get("DITRON_AR_QUICK", "0") == "1"
MS = (1, 7, 32, 128, 256, 257, 2048) if QUICK else (1, 7, 32, 128, 256, 257, 2048, 8192)
# the prefill plans (push beside the GEMM), quick: M below one GEMM tile, one above, prefill
OVERLAP_MS = MS if os.environ.get("DITRON_AR_OVERLAP_ALL_M", "0") == "1" or not QUICK \
    else (7, 257, 2048)
SHAPES_KN = ((1024, 1000), (3584, 8192)) if QUICK else ((1024, 1000), (1024, 8192), (3584, 8192))
PLANS = ({}, {"algo": "push"},
         {"algo": "push", "overlap": True, "chunks": 4, "progs": 16},
         {"algo": "push", "overlap": True, "gemm": "triton", "chunks": 4, "progs": 16},
         {"algo": "push", "block": 512, "progs": 7}, {"algo": "push_all"},
         {"algo": "lamport"}, {"algo": "lamport", "block": 512, "progs": 7},
         {"algo": "lamport_all"}, {"algo": "copy_engine"}, {"algo": "copy_engine", "chunks": 3})
# DITRON_AR_TEST_ALGOS=copy_engine,...: the eager and graph cases of those algorithms alone
ALGOS = [a for a in os.environ.get("DITRON_AR_TEST_ALGOS", "").split(",") if a]
if ALGOS:
    PLANS = tuple(p for p in PLANS if p.get("algo", "default") in ALGOS)
EPS = 1e-6
START = time.time()


def _variants(n, dtype, dev, gen, m):
    """(residual, norm weight, weight_in_fp32) triples: plain all-reduce, norm without residual,
    residual + norm in both roundings."""
    res = torch.randn(m, n, generator=gen, device=dev, dtype=dtype)
    w = (torch.rand(n, generator=gen, device=dev) + 0.5)
    return [(None, None, False), (None, w.to(dtype), False), (res, w.to(dtype), False),
            (res, w, True)]


def _call(a, b, bias, residual, weight, w_fp32, group_name, world, plan):
    from ditron_inductor.ops import (
        matmul_all_reduce_reference,
        matmul_all_reduce_rmsnorm_reference,
    )

    if weight is None:
        out = torch.ops.ditron.matmul_all_reduce([a], [b], bias, [], "sum", group_name, world,
                                                 plan)
        return (out,), (matmul_all_reduce_reference([a], [b], bias, [], "sum", group_name,
                                                    world),)
    out = torch.ops.ditron.matmul_all_reduce_rmsnorm(a, b, bias, [], residual, weight, EPS,
                                                     w_fp32, "sum", group_name, world, plan)
    ref = matmul_all_reduce_rmsnorm_reference(a, b, bias, [], residual, weight, EPS, w_fp32,
                                              "sum", group_name, world)
    return out, ref


def _eager_cases(group_name, world, dtype, gen, calls):
    from ditron_inductor.runtime.all_reduce import stats

    dev = torch.device("cuda")
    for k, n in SHAPES_KN:
        for m in MS:
            if m >= 2048 and n < 8192:
                continue  # large M with the small N adds nothing but time
            b = torch.randn(k, n, generator=gen, device=dev, dtype=dtype) / k ** 0.5
            bias = torch.randn(n, generator=gen, device=dev, dtype=dtype)
            for plan_params in PLANS:
                if plan_params.get("algo") in ("push_all", "lamport_all") and m > 256:
                    continue  # kernels for the smallest M: W times the traffic
                if plan_params.get("overlap") and m not in OVERLAP_MS:
                    continue  # prefill plans
                if torch.distributed.get_rank() == 0:  # where a run that timed out had got to
                    print(f"  {time.time() - START:.0f} s: {dtype} k={k} n={n} m={m} "
                          f"plan={plan_params}", flush=True)
                plan = _plan(AR, world, m, k, n, **plan_params)
                for vi, (residual, weight, w_fp32) in enumerate(_variants(n, dtype, dev, gen, m)):
                    for call in range(calls):
                        a = torch.randn(m, k, generator=gen, device=dev, dtype=dtype)
                        before = sum(stats.values())
                        out, ref = _call(a, b, bias if call % 2 else None, residual, weight,
                                         w_fp32, group_name, world, plan)
                        tag = (f"AR m={m} k={k} n={n} {dtype} plan={plan_params} variant={vi} "
                               f"call={call}")
                        assert sum(stats.values()) == before + 1, f"{tag}: fused path not served"
                        for o, r in zip(out, ref):
                            _check(tag, o, r)


GROUPED, GROUPED_NORM = "grouped_mm_all_reduce", "grouped_mm_all_reduce_rmsnorm"
TRITON_BESIDE = {"algo": "push", "overlap": True, "gemm": "triton", "chunks": 4, "progs": 16}


def _grouped_call(x, residual, weight, w_fp32, group_name, world, plan):
    from ditron_inductor.ops import (
        grouped_mm_all_reduce_reference,
        grouped_mm_all_reduce_rmsnorm_reference,
    )

    if weight is None:
        return ((torch.ops.ditron.grouped_mm_all_reduce(x, "sum", group_name, world, plan),),
                (grouped_mm_all_reduce_reference(x, "sum", group_name, world),))
    args = (x, residual, weight, EPS, w_fp32, "sum", group_name, world)
    return (torch.ops.ditron.grouped_mm_all_reduce_rmsnorm(*args, plan),
            grouped_mm_all_reduce_rmsnorm_reference(*args))


def _grouped_cases(group_name, world, dtype, gen, calls):
    """The grouped-GEMM ops: a computed [1, M, N] tensor (the experts' weighted sum) reduced by
    every plan but the Triton GEMM beside push, which has no product to compute and declines
    (its reference gives the numbers); each variant of _variants, `calls` calls on new inputs."""
    from ditron_inductor.runtime.all_reduce import stats

    dev = torch.device("cuda")
    for n in (1000, 4096):
        for m in (1, 7, 128, 257, 2048):
            for plan_params in PLANS:
                if plan_params.get("algo") in ("push_all", "lamport_all") and m > 256:
                    continue
                for vi, (residual, weight, w_fp32) in enumerate(_variants(n, dtype, dev, gen, m)):
                    op = GROUPED if weight is None else GROUPED_NORM
                    plan = _plan(op, world, m, 1, n, **plan_params)
                    for call in range(calls):
                        x = torch.randn(1, m, n, generator=gen, device=dev, dtype=dtype)
                        before = sum(stats.values())
                        out, ref = _grouped_call(x, None if residual is None else
                                                 residual.view(1, m, n), weight, w_fp32,
                                                 group_name, world, plan)
                        tag = (f"{op} m={m} n={n} {dtype} plan={plan_params} variant={vi} "
                               f"call={call}")
                        served = sum(stats.values()) - before
                        assert served == (plan_params != TRITON_BESIDE), f"{tag}: served {served}"
                        for o, r in zip(out, ref):
                            assert o.shape == r.shape == x.shape, tag
                            _check(tag, o, r)


def _grouped_graph_case(group_name, world, gen, m, plan_params, n=4096, replays=4):
    """The grouped-GEMM op + norm captured in a CUDA graph after eager warm-ups, replayed on new
    tensors copied into the captured input (its copy into the buffer is part of the graph)."""
    from ditron_inductor.ops import grouped_mm_all_reduce_rmsnorm_reference
    from ditron_inductor.runtime.all_reduce import stats

    dev, dtype = torch.device("cuda"), torch.bfloat16
    plan = _plan(GROUPED_NORM, world, m, 1, n, **plan_params)
    x, residual = (torch.randn(m, n, generator=gen, device=dev, dtype=dtype) for _ in range(2))
    weight = torch.rand(n, generator=gen, device=dev, dtype=dtype) + 0.5
    args = (x, residual, weight, EPS, False, "sum", group_name, world)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.ops.ditron.grouped_mm_all_reduce_rmsnorm(*args, plan)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    served = sum(stats.values())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, y = torch.ops.ditron.grouped_mm_all_reduce_rmsnorm(*args, plan)
    assert sum(stats.values()) == served + 1, "the captured call did not take the fused path"
    for replay in range(replays):
        x.copy_(torch.randn(m, n, generator=gen, device=dev, dtype=dtype))
        graph.replay()
        ref = grouped_mm_all_reduce_rmsnorm_reference(*args)
        tag = f"grouped graph m={m} plan={plan_params} replay={replay}"
        _check(tag + " h", h, ref[0])
        _check(tag + " y", y, ref[1])


def _captured(group_name, world, dtype, gen, m, k, n, plan_params, warmups=3):
    """One matmul + all-reduce + RMSNorm call with the plan on random inputs, warmed up outside
    capture (contexts, compiled kernels), then captured in a CUDA graph: (graph, its outputs
    (h, y), the inputs (a, b, residual, weight), the plan text, the calls the fused path had
    served before the capture)."""
    from ditron_inductor.runtime.all_reduce import stats

    dev = torch.device("cuda")
    plan = _plan(AR, world, m, k, n, **plan_params)
    a = torch.randn(m, k, generator=gen, device=dev, dtype=dtype)
    b = torch.randn(k, n, generator=gen, device=dev, dtype=dtype) / k ** 0.5
    residual = torch.randn(m, n, generator=gen, device=dev, dtype=dtype)
    weight = torch.rand(n, generator=gen, device=dev, dtype=dtype) + 0.5

    def step():
        return torch.ops.ditron.matmul_all_reduce_rmsnorm(a, b, None, [], residual, weight, EPS,
                                                          False, "sum", group_name, world, plan)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    served = sum(stats.values())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs, (a, b, residual, weight), plan, served


def _graph_case(group_name, world, dtype, gen, m, plan_params, replays=5):
    """Capture one call (plus the reference on the same stream for comparison) in a CUDA graph,
    then replay it on new inputs copied into the captured tensors."""
    from ditron_inductor.ops import matmul_all_reduce_rmsnorm_reference
    from ditron_inductor.runtime.all_reduce import stats

    k, n = 1024, 8192
    graph, (h, y), (a, b, residual, weight), plan, served = _captured(
        group_name, world, dtype, gen, m, k, n, plan_params)
    assert sum(stats.values()) == served + 1, "the captured call did not take the fused path"
    for replay in range(replays):
        a.copy_(torch.randn(m, k, generator=gen, device=a.device, dtype=dtype))
        residual.copy_(torch.randn(m, n, generator=gen, device=a.device, dtype=dtype))
        graph.replay()
        ref = matmul_all_reduce_rmsnorm_reference(a, b, None, [], residual, weight, EPS, False,
                                                  "sum", group_name, world)
        tag = f"graph m={m} {dtype} plan={plan_params} replay={replay}"
        _check(tag + " h", h, ref[0])
        _check(tag + " y", y, ref[1])
        if replay % 2:  # eager calls between replays share the context and its device epoch
            out, ref = _call(a, b, None, residual, weight, False, group_name, world, plan)
            _check(tag + " eager", out[1], ref[1])


def _compiled_decode_case(world, dtype, gen, steps=6):
    """What a server runs: torch.compile(backend="ditron", mode="reduce-overhead") on two decode
    layers (row-parallel linear, all-reduce, residual add, RMSNorm, the second layer's residual
    being the first's sum). The pass must fuse both layers (the scheduler fuses these sizes only
    under CUDA graphs), and Inductor's CUDA-graph replays must match eager."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    from ditron_inductor.runtime.all_reduce import stats

    dev, group = torch.device("cuda"), dist.group.WORLD
    m, k, n = 4, 1024, 8192
    w1 = torch.randn(n, k, generator=gen, device=dev, dtype=dtype) / k ** 0.5
    w2 = torch.randn(n, n, generator=gen, device=dev, dtype=dtype) / n ** 0.5
    norm_w = torch.rand(n, generator=gen, device=dev, dtype=dtype) + 0.5

    def rmsnorm(h):
        h32 = h.float()
        return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype) * norm_w

    def step(x, residual):
        h1 = funcol.all_reduce(F.linear(x, w1), "sum", group) + residual
        h2 = funcol.all_reduce(F.linear(rmsnorm(h1), w2), "sum", group) + h1
        return rmsnorm(h2)

    # The GPU machine runs from a checkout, without the entry point (the CPU tests check
    # backend="ditron"): the same backend function, passed directly.
    from ditron_inductor.backend import ditron_backend

    compiled = torch.compile(step, backend=ditron_backend, mode="reduce-overhead")
    before = stats["matmul_all_reduce_rmsnorm"]
    with torch.no_grad():
        for i in range(steps):
            x = torch.randn(m, k, generator=gen, device=dev, dtype=dtype)
            residual = torch.randn(m, n, generator=gen, device=dev, dtype=dtype)
            out = compiled(x, residual).clone()  # a replay's output lives in the graph's pool
            _check(f"compiled decode step {i}", out, step(x, residual))
    # each layer's op runs from Python in the warm-up and recording calls, not in replays
    assert stats["matmul_all_reduce_rmsnorm"] - before >= 4, (
        f"the compiled decode step took the fused path "
        f"{stats['matmul_all_reduce_rmsnorm'] - before} times (TORCH_LOGS=ditron tells why)")


def _worker(rank, world, port, calls, result_dir):
    import torch.distributed as dist

    init_rank(rank, world, port)
    status = "ok"
    try:
        from ditron_inductor.runtime.all_reduce import stats

        os.environ.setdefault("DITRON_WAIT_TIMEOUT_S", "20")  # the plans' bound (plan_for)
        group_name = dist.group.WORLD.group_name
        gen = torch.Generator(device="cuda")
        gen.manual_seed(4321 + rank)
        everything = os.environ.get("DITRON_AR_COMPILED_ONLY", "0") != "1"
        for dtype in (torch.bfloat16, torch.float16) if everything else ():
            _eager_cases(group_name, world, dtype, gen, calls)
        if everything:
            _grouped_cases(group_name, world, torch.bfloat16, gen, calls)
        os.environ["DITRON_WAIT_TIMEOUT_S"] = "0"  # no host checks inside a captured graph
        graph_cases = ((1, {}), (32, {}), (128, {}), (2048, {}), (1, {"algo": "push"}),
                       (128, {"algo": "push"}),
                       (2048, {"algo": "push", "overlap": True, "chunks": 8}),
                       (2048, {"algo": "push", "overlap": True, "gemm": "triton"}),
                       (1, {"algo": "push_all"}), (7, {"algo": "push_all"}),
                       (1, {"algo": "lamport_all"}), (7, {"algo": "lamport_all"}),
                       (32, {"algo": "lamport"}), (128, {"algo": "lamport"}),
                       (2048, {"algo": "copy_engine"}), (257, {"algo": "copy_engine", "chunks": 3}))
        for m, plan_params in graph_cases if everything else ():
            if not ALGOS or plan_params.get("algo", "default") in ALGOS:
                _graph_case(group_name, world, torch.bfloat16, gen, m, plan_params)
        grouped_graphs = ((1, {}), (128, {}), (2048, {"algo": "copy_engine"}))
        for m, plan_params in grouped_graphs if everything and not ALGOS else ():
            _grouped_graph_case(group_name, world, gen, m, plan_params)
        if world > 1:  # at world size 1 the scheduler fuses nothing, which the case asserts
            _compiled_decode_case(world, torch.bfloat16, gen)
        status = f"ok stats={dict(stats)}"
        from ditron_inductor import runtime

        runtime.shutdown()
    except Exception:  # noqa: BLE001 - report, then fail the test from the parent
        status = "FAIL\n" + traceback.format_exc()
    report_and_close(result_dir, rank, status)


def _run(world, tmp_path, calls=int(os.environ.get("DITRON_TEST_CALLS", "3"))):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    spawn_ranks(_worker, (world, _free_port(), calls, str(tmp_path)), world)
    reports = [open(tmp_path / f"rank{r}.txt").read() for r in range(world)]
    print("\n".join(f"rank {r}: {t.splitlines()[0]}" for r, t in enumerate(reports)))
    failures = [t for t in reports if t.startswith("FAIL")]
    assert not failures, failures[0]


@pytest.mark.parametrize("world", [1, 2, 4, 8])  # 1: every plan's kernels on a one-GPU machine
def test_all_reduce_fused(world, tmp_path):
    _run(world, tmp_path)
