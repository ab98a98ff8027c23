"""FP8 on GPUs: ditron.all_gather_scaled_mm's fused plan (the float8 bytes gathered over symmetric
memory, torch._scaled_mm per group of chunks) against its reference, on 1, 2 and 4 ranks, random
data, tensorwise scales (rowwise and Triton plans decline: the reference serves them, which the
test also checks), and the compiled path with DITRON_PLAN=fused; likewise
scaled_mm_reduce_scatter's copy-engine plan (_scaled_mm per rank's rows), tensorwise and rowwise.
scaled_mm_all_reduce has no fused plan: compiled with DITRON_PLAN=fused, its site stays
_scaled_mm + NCCL.

Run on the GPU machine (needs sm_89+ for float8 _scaled_mm): pytest -m gpu tests/gpu/test_fp8_gpu.py
"""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.no_multicast import keep_multicast_off

from .ranks import init_rank, report_and_close, spawn_ranks
from .test_fused_gpu import _check, _free_port

pytestmark = pytest.mark.gpu
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16

keep_multicast_off()


def _plan(world, m, k, n, op="all_gather_scaled_mm", **params) -> str:
    from ditron_inductor.scheduler.decide import plan_for
    from ditron_inductor.scheduler.task import Task

    task = Task(op=op, group_name="", world_size=world, m=m, k=k, ns=(n,),
                dtype=E4M3, device_type="cuda", out_dtype=BF16, scales="tensorwise",
                reduce_op=None if op == "all_gather_scaled_mm" else "sum")
    return plan_for(task, **params).encode()


def _fp8(gen, *shape, dtype=E4M3):
    return (torch.randn(*shape, generator=gen, device="cuda") * 8).to(dtype)


def _cases(group_name, world, gen):
    from ditron_inductor.ops import all_gather_scaled_mm_reference
    from ditron_inductor.runtime.all_gather import stats

    for rows, k, ns in ((64, 256, (384,)), (130, 512, (256, 208)), (16, 4096, (1024,))):
        for a_dtype in (E4M3, E5M2):  # e5m2: the backward's gradient
            for params, fused in ((dict(), True), (dict(groups=[1, 1]), True),
                                  (dict(copy_streams=2), True), (dict(gemm="triton"), False)):
                a = _fp8(gen, rows, k, dtype=a_dtype)
                ws = [_fp8(gen, n, k).t() for n in ns]  # column-major, as _scaled_mm takes them
                s_a = torch.rand((), generator=gen, device="cuda") + 0.5
                s_bs = [torch.rand((), generator=gen, device="cuda") + 0.5 for _ in ns]
                bs = [None] + [torch.randn(n, generator=gen, device="cuda").to(BF16)
                               for n in ns[1:]]
                plan = _plan(world, rows * world, k, ns[0], **params)
                served = stats["all_gather_scaled_mm"]
                out = torch.ops.ditron.all_gather_scaled_mm(a, s_a, ws, s_bs, bs, BF16, True, 0,
                                                            group_name, world, plan)
                ref = all_gather_scaled_mm_reference(a, s_a, ws, s_bs, bs, BF16, True, 0,
                                                     group_name, world)
                tag = f"AG fp8 rows={rows} k={k} ns={ns} {a_dtype} plan={params}"
                assert (stats["all_gather_scaled_mm"] > served) == fused, f"{tag}: fused path"
                assert torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)), tag
                for o, r in zip(out[1:], ref[1:]):
                    assert o.dtype == BF16, tag
                    _check(tag, o, r, tol=1e-2)
    # rowwise scales: the fused plan declines, the reference serves
    a, w = _fp8(gen, 64, 256), _fp8(gen, 128, 256).t()
    s_a = torch.rand(64, 1, generator=gen, device="cuda") + 0.5
    s_b = torch.rand(1, 128, generator=gen, device="cuda") + 0.5
    served = stats["all_gather_scaled_mm"]
    plan = _plan(world, 64 * world, 256, 128)
    out = torch.ops.ditron.all_gather_scaled_mm(a, s_a, [w], [s_b], [None], BF16, False, 0,
                                                group_name, world, plan)
    ref = all_gather_scaled_mm_reference(a, s_a, [w], [s_b], [None], BF16, False, 0, group_name,
                                         world)
    assert stats["all_gather_scaled_mm"] == served
    _check("AG fp8 rowwise", out[1], ref[1], tol=1e-2)


def _scales(gen, m, n, rowwise):
    if rowwise:
        return (torch.rand(m, 1, generator=gen, device="cuda") + 0.5,
                torch.rand(1, n, generator=gen, device="cuda") + 0.5)
    return tuple(torch.rand((), generator=gen, device="cuda") + 0.5 for _ in range(2))


def _scatter_cases(group_name, world, gen):
    """scaled_mm_reduce_scatter: the copy-engine plan with cuBLAS (both reductions) serves,
    tensorwise and rowwise (each rank's rows with their scales)."""
    from ditron_inductor.ops import scaled_mm_reduce_scatter_reference
    from ditron_inductor.runtime.reduce_scatter import stats

    op = "scaled_mm_reduce_scatter"
    for m, k, n in ((64 * world, 256, 384), (128 * world, 1024, 4096), (16 * world, 512, 256)):
        for rowwise, terms in ((False, 1), (True, 1), (False, 2)):  # 2: a sum (ScaledSum)
            for params, fused in ((dict(), True), (dict(reduce="torch"), True),
                                  (dict(reduce="triton"), True)):
                a = [_fp8(gen, m, k * (t + 1)) for t in range(terms)]  # the terms' K differ
                b = [_fp8(gen, n, k * (t + 1)).t() for t in range(terms)]
                s_a, s_b = zip(*(_scales(gen, m, n, rowwise) for _ in range(terms)))
                bias = None if rowwise else torch.randn(n, generator=gen, device="cuda").to(BF16)
                args = (a, b, list(s_a), list(s_b), bias, BF16, not rowwise, [], 0, "sum",
                        group_name, world)
                served = stats[op]
                out = torch.ops.ditron.scaled_mm_reduce_scatter(
                    *args, _plan(world, m, k, n, op, **params))
                ref = scaled_mm_reduce_scatter_reference(*args)
                tag = f"RS fp8 {m}x{k}x{n} rowwise={rowwise} terms={terms} plan={params}"
                assert (stats[op] > served) == fused, f"{tag}: fused path"
                assert out.dtype == BF16 and out.shape == (m // world, n), tag
                _check(tag, out, ref, tol=1e-2)


def _compiled_case(world, gen) -> str:
    """torch.compile(backend="ditron") with DITRON_PLAN=fused on funcol fp8 code: the gather's
    and the scatter's fused plans run (the scheduler chooses no unmeasured fp8 plan on its own);
    the all-reduce stays _scaled_mm + NCCL, its reason in the graph's report."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from ditron_inductor.lowering import graph_pass
    from ditron_inductor.runtime import all_gather, reduce_scatter

    g = dist.group.WORLD

    def ag(x, s_x, w, s_w):
        return torch._scaled_mm(funcol.all_gather_tensor(x, 0, g), w, s_x, s_w,
                                out_dtype=BF16, use_fast_accum=True)

    def rs(h, s_h, w, s_w):
        return funcol.reduce_scatter_tensor(
            torch._scaled_mm(h, w, s_h, s_w, out_dtype=BF16, use_fast_accum=True), "sum", 0, g)

    def ar(h, s_h, w, s_w):
        return funcol.all_reduce(torch._scaled_mm(h, w, s_h, s_w, out_dtype=BF16), "sum", g)

    x, w = _fp8(gen, 256, 1024), _fp8(gen, 2048, 1024).t()
    h, w2 = _fp8(gen, 256 * world, 2048), _fp8(gen, 1024, 2048).t()
    s_x, s_w, s_h, s_w2 = (torch.rand((), generator=gen, device="cuda") + 0.5 for _ in range(4))
    cases = [("AG", ag, (x, s_x, w, s_w), all_gather.stats, "all_gather_scaled_mm"),
             ("RS", rs, (h, s_h, w2, s_w2), reduce_scatter.stats, "scaled_mm_reduce_scatter"),
             ("AR", ar, (h, s_h, w2, s_w2), None, "scaled_mm_all_reduce")]
    for name, fn, args, stats, op in cases:
        served = stats[op] if stats else 0
        got = torch.compile(fn, backend="ditron", dynamic=False,
                            options={"ditron.plan": "fused"})(*args)
        if stats:
            assert stats[op] > served, f"the compiled {name} graph did not run the plan"
        else:
            (candidate,) = [c for r in graph_pass.reports for c in r.candidates if c.op == op]
            assert not candidate.fused, f"the compiled {name} graph fused {op}"
        _check(f"compiled {name} fp8", got, fn(*args), tol=1e-2)
    return "ok"


def _worker(rank, world, port, result_dir):
    import torch.distributed as dist

    init_rank(rank, world, port)
    try:
        gen = torch.Generator(device="cuda")
        gen.manual_seed(4321 + rank)
        _cases(dist.group.WORLD.group_name, world, gen)
        _scatter_cases(dist.group.WORLD.group_name, world, gen)
        # world 1: the scheduler leaves a graph alone (nothing to communicate)
        status = f"ok compiled={_compiled_case(world, gen) if world > 1 else 'n/a'}"
        from ditron_inductor import runtime

        runtime.shutdown()
    except Exception:  # noqa: BLE001 - report, then fail the test from the parent
        status = "FAIL\n" + traceback.format_exc()
    report_and_close(result_dir, rank, status)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_scaled_mm_ops_fused(world, tmp_path):
    """The fp8 ops' fused plans against their references (one spawn per world size)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 _scaled_mm needs sm_89 or newer")
    spawn_ranks(_worker, (world, _free_port(), str(tmp_path)), world)
    reports = [open(tmp_path / f"rank{r}.txt").read() for r in range(world)]
    failures = [t for t in reports if t.startswith("FAIL")]
    assert not failures, failures[0]
