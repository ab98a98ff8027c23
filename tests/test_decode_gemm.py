"""The decode GEMM (templates/gemv.py): its numbers under the Triton interpreter on odd shapes,
and where it is taken (the graph rewrite, the all-reduce plans, the runtime's GEMM)."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ditron_inductor import config
from ditron_inductor.lowering.decode_gemm import rewrite_decode_mms
from ditron_inductor.lowering.graph_pass import DitronPass
from ditron_inductor.runtime.gemv import (ROWS, GemvConfig, config_for, decode_mm,
                                          decode_mm_group)
from ditron_inductor.scheduler.choose import choose_device_plan
from ditron_inductor.scheduler.decide import with_options
from ditron_inductor.scheduler.decode_gemm import gemv_applies, mm_not_rewritten
from ditron_inductor.scheduler.plan import GEMV, AllReducePlan
from ditron_inductor.scheduler.task import MATMUL_ALL_REDUCE_RMSNORM, matmul_collective_task


@pytest.mark.parametrize("M,K,N", [(1, 100, 37), (3, 257, 64), (16, 64, 33), (1, 8, 1)])
# bfloat16 tl.dot is wrong under the interpreter (numpy has no bfloat16): float16 stands in
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_mm_matches_torch(M, K, N, dtype):
    gen = torch.Generator().manual_seed(M * 1000 + K + N)
    a = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(N, K, generator=gen).to(dtype)  # a linear layer's weight
    out = decode_mm(a, w.t(), GemvConfig(block_n=16, block_k=64, num_warps=4))
    ref = a.float() @ w.float().t()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and out.shape == (M, N)
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.parametrize("N", [37, 1500, 2100])  # each measured launch config's range
def test_decode_mm_default_config_per_width(N):
    gen = torch.Generator().manual_seed(N)
    a, w = torch.randn(1, 300, generator=gen), torch.randn(N, 300, generator=gen)
    torch.testing.assert_close(decode_mm(a, w.t()), a @ w.t(), rtol=1e-4, atol=1e-4)


def test_config_for_narrow_outputs_reads_longer_k_slices():
    assert config_for(1, 512) == GemvConfig(block_n=4, block_k=2048, num_warps=16)  # k/v, TP 2
    assert config_for(1, 2048) == GemvConfig(block_n=8, block_k=2048, num_warps=16)  # q, TP 2
    assert config_for(1, 4096) == GemvConfig()  # o, down: 8 x 1024 on 8 warps
    assert config_for(4, 512) == config_for(16, 4096) == ROWS


def test_decode_mm_empty_k_is_zeros():
    out = decode_mm(torch.randn(2, 0), torch.randn(5, 0).t())
    assert torch.equal(out, torch.zeros(2, 5))


def test_gemv_applies_says_why_not():
    a, w = torch.randn(2, 8), torch.randn(4, 8)
    assert gemv_applies(a, w.t()) is None
    assert "rows" in gemv_applies(torch.randn(17, 8), w.t())
    assert "K stride" in gemv_applies(a, w.t().contiguous())
    assert "dtypes" in gemv_applies(a, w.t().to(torch.float16))
    assert "2-D" in gemv_applies(a, torch.randn(4, 9).t())


# ------------------------------------------------------------------ where the template is taken


def fake_cuda(*shape, dtype=torch.bfloat16):
    return FakeTensor(MODE, torch.empty(*shape, device="meta", dtype=dtype), torch.device("cuda"))


MODE = FakeTensorMode()


def mm_graph(a_val, w_val) -> torch.fx.Graph:
    """x @ w.t() as Inductor's post-grad graph has it: mm(x, permute(w))."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"], w.meta["val"] = a_val, w_val
    wt = g.call_function(torch.ops.aten.permute.default, (w, [1, 0]))
    wt.meta["val"] = w_val.t()
    mm = g.call_function(torch.ops.aten.mm.default, (x, wt))
    mm.meta["val"] = a_val @ w_val.t()
    g.output(mm)
    return g


def targets(g: torch.fx.Graph) -> list:
    return [n.target for n in g.nodes if n.op == "call_function"]


@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (16, torch.bfloat16),
                                        (1, torch.float32)])
def test_a_decode_mm_on_cuda_becomes_decode_mm(rows, dtype):
    g = mm_graph(fake_cuda(rows, 64, dtype=dtype), fake_cuda(32, 64, dtype=dtype))
    assert rewrite_decode_mms(g) == ["mm_default"]
    assert targets(g) == [torch.ops.aten.permute.default, torch.ops.ditron.decode_mm.default]
    (call,) = [n for n in g.nodes if n.target is torch.ops.ditron.decode_mm.default]
    assert call.meta["val"].shape == (rows, 32)
    g.lint()


@pytest.mark.parametrize("a_val,w_val,why", [
    (lambda: fake_cuda(17, 64), lambda: fake_cuda(32, 64), "17 rows (more than 16)"),
    (lambda: fake_cuda(2, 64, dtype=torch.float32), lambda: fake_cuda(32, 64, dtype=torch.float32),
     "TF32"),
    (lambda: torch.empty(1, 64), lambda: torch.empty(32, 64), "on cpu, not CUDA"),
    (lambda: fake_cuda(1, 64, dtype=torch.float8_e4m3fn),
     lambda: fake_cuda(32, 64, dtype=torch.float8_e4m3fn), "dtypes"),
])
def test_other_mms_stay_and_the_rule_says_why(a_val, w_val, why):
    a, w = a_val(), w_val()
    assert why in mm_not_rewritten(a, w.t())
    g = mm_graph(a, w)
    assert rewrite_decode_mms(g) == []
    assert torch.ops.aten.mm.default in targets(g)


def test_a_weight_stored_k_major_stays():
    a, b = fake_cuda(1, 64), fake_cuda(64, 32)  # [K, N] row-major: the template's loads stride
    assert "K stride" in mm_not_rewritten(a, b)


@pytest.mark.parametrize("on", [True, False])
def test_the_pass_rewrites_under_the_option(on):
    g = mm_graph(fake_cuda(1, 64), fake_cuda(32, 64))
    DitronPass(config.Options(decode_gemm=on))(g)
    assert (torch.ops.ditron.decode_mm.default in targets(g)) is on


def shared_rows_graph(widths, weight_from_product=False) -> torch.fx.Graph:
    """A decode step's q/k/v as the post-grad graph has them: each product its own view of the
    normed rows, each weight permuted right before its mm (after the first product); with
    `weight_from_product`, the last weight is computed from the first product (a chain)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = fake_cuda(1, 1, 64)
    weights = [g.placeholder(f"w{i}") for i in range(len(widths))]
    outs = []
    for i, (w, n) in enumerate(zip(weights, widths)):
        w.meta["val"] = fake_cuda(n, 64)
        rows = g.call_function(torch.ops.aten.view.default, (x, [1, 64]))
        rows.meta["val"] = x.meta["val"].view(1, 64)
        source = w
        if weight_from_product and i == len(widths) - 1:
            source = g.call_function(torch.ops.aten.add.Tensor, (w, outs[0]))
            source.meta["val"] = w.meta["val"]
        wt = g.call_function(torch.ops.aten.permute.default, (source, [1, 0]))
        wt.meta["val"] = w.meta["val"].t()
        mm = g.call_function(torch.ops.aten.mm.default, (rows, wt))
        mm.meta["val"] = rows.meta["val"] @ wt.meta["val"]
        outs.append(mm)
    g.output(tuple(outs))
    return g


@pytest.mark.parametrize("widths, launches", [((32, 8, 8), [3]), ((48, 48), [2]),
                                               ((16,) * 4, [3])])
def test_products_of_the_same_rows_share_a_launch_under_the_option(widths, launches):
    g = shared_rows_graph(widths)
    DitronPass(config.Options())(g)  # on by default
    g.lint()
    groups = [n for n in g.nodes if n.target is torch.ops.ditron.decode_mm_group.default]
    assert [len(n.args[1]) for n in groups] == launches
    singles = [n for n in g.nodes if n.target is torch.ops.ditron.decode_mm.default]
    assert len(singles) == len(widths) - sum(launches)  # the 4th of 4 goes alone
    out = [n for n in g.nodes if n.op == "output"][0].args[0]
    assert [tuple(o.meta["val"].shape) for o in out] == [(1, n) for n in widths]
    assert groups[0].meta["val"][0].shape == (1, widths[0])
    plain = shared_rows_graph(widths)
    DitronPass(config.Options(decode_gemm_groups=False))(plain)  # off: one launch each
    assert targets(plain).count(torch.ops.ditron.decode_mm.default) == len(widths)


def test_a_weight_computed_from_a_product_is_not_grouped_with_it():
    g = shared_rows_graph((32, 8, 8), weight_from_product=True)
    DitronPass(config.Options(decode_gemm_groups=True))(g)
    g.lint()
    (group,) = [n for n in g.nodes if n.target is torch.ops.ditron.decode_mm_group.default]
    assert len(group.args[1]) == 2 and targets(g).count(torch.ops.ditron.decode_mm.default) == 1


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("widths", [(37, 5, 64), (20, 33)])
def test_decode_mm_group_matches_torch(M, widths):
    gen = torch.Generator().manual_seed(M + sum(widths))
    a = torch.randn(M, 100, generator=gen)
    ws = [torch.randn(n, 100, generator=gen) for n in widths]
    outs = decode_mm_group(a, [w.t() for w in ws], GemvConfig(block_n=16, block_k=64,
                                                               num_warps=4))
    for out, w in zip(outs, ws):
        torch.testing.assert_close(out, a @ w.t(), rtol=1e-4, atol=1e-4)
    # the op off CUDA: torch.mm each
    for out, w in zip(torch.ops.ditron.decode_mm_group(a, [w.t() for w in ws]), ws):
        torch.testing.assert_close(out, a @ w.t())


def one_row_all_reduce_task(m=1, dtype=torch.bfloat16):
    a, b = torch.empty(m, 2048, dtype=dtype), torch.empty(4096, 2048, dtype=dtype).t()
    task = matmul_collective_task(MATMUL_ALL_REDUCE_RMSNORM, a, b, None, [], 0, "sum", "0", 2)
    return dataclasses.replace(task, device_type="cuda")


def test_a_one_row_all_reduce_plan_takes_the_template():
    task = one_row_all_reduce_task()
    plan, _ = choose_device_plan(task, cuda_graphs=True)
    assert isinstance(plan, AllReducePlan) and plan.gemm == "cublas"
    chosen = with_options(plan, task)
    assert chosen.gemm == GEMV and "gemm=gemv" in chosen.describe()
    assert with_options(plan).gemm == "cublas"  # no task: the plan as named
    assert with_options(plan, task, config.Options(decode_gemm=False)).gemm == "cublas"


def test_all_reduce_plans_of_more_rows_keep_cublas():
    task = one_row_all_reduce_task(m=16)
    plan, _ = choose_device_plan(task, cuda_graphs=True)
    assert with_options(plan, task).gemm != GEMV


def test_matmul_into_takes_the_template_where_asked_and_it_applies():
    from ditron_inductor.runtime import gemv
    from ditron_inductor.runtime.launch import matmul_into

    gen = torch.Generator().manual_seed(5)
    a, w = torch.randn(1, 96, generator=gen), torch.randn(40, 96, generator=gen)
    ref = a @ w.t()
    before = gemv.stats["decode_mm"]
    out = torch.empty(1, 40)
    matmul_into(a, w.t(), None, out, decode=True)
    assert gemv.stats["decode_mm"] == before + 1
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    bias = torch.randn(40, generator=gen)
    matmul_into(a, w.t(), bias, out, decode=True)  # a bias: cuBLAS (addmm)
    matmul_into(a, w.t().contiguous(), None, out, decode=True)  # [K, N] row-major: cuBLAS
    assert gemv.stats["decode_mm"] == before + 1


def test_decode_mm_op_off_cuda_is_torch_mm():
    a, w = torch.randn(1, 16), torch.randn(8, 16)
    assert torch.equal(torch.ops.ditron.decode_mm(a, w.t()), torch.mm(a, w.t()))
