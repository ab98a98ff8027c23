"""The fuse / no-fuse decision and its reasons, and the plans it carries into the graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ditron_inductor import config
from ditron_inductor.scheduler import decide as decide_module
from ditron_inductor.scheduler.decide import decide
from ditron_inductor.scheduler.plan import FUSED, REFERENCE, AllGatherPlan, decode
from ditron_inductor.scheduler.task import (
    ALL_GATHER_MATMUL,
    ALL_GATHER_SCALED_MM,
    MATMUL_ALL_REDUCE,
    MATMUL_REDUCE_SCATTER,
    Task,
)
from tests.fx_helpers import fake_group

AG = Task(op=ALL_GATHER_MATMUL, group_name="0", world_size=4, m=8192, k=8192, ns=(7168,),
          dtype=torch.bfloat16, device_type="cuda", dim_size=8192)
RS = Task(op=MATMUL_REDUCE_SCATTER, group_name="0", world_size=4, m=8192, k=3584, ns=(8192,),
          dtype=torch.bfloat16, device_type="cpu", dim=1, dim_size=6, reduce_op="sum")


@pytest.fixture
def group4():
    with fake_group(4) as g:
        yield g


def test_world_size_1_is_never_fused():
    with fake_group(1):
        d = decide(dataclasses.replace(AG, world_size=1))
    assert not d.fuse and d.reason == "world size 1: there is nothing to communicate"


def test_unsupported_dtype(group4):
    d = decide(dataclasses.replace(AG, dtype=torch.int8))
    assert not d.fuse and d.reason == "dtype torch.int8 is not supported"


def test_scatter_dim_that_does_not_divide(group4):
    d = decide(RS)
    assert not d.fuse
    assert d.reason == "scatter dim 1 of size 6 does not divide by world size 4"
    assert decide(dataclasses.replace(RS, dim_size=8)).fuse


def test_unknown_group(group4):
    d = decide(dataclasses.replace(AG, group_name="no-such-group"))
    assert not d.fuse and d.reason == "process group 'no-such-group' is not known in this process"
    # all_reduce carries no group size: the matcher gives 0 for a group it cannot resolve
    d = decide(dataclasses.replace(AG, op=MATMUL_ALL_REDUCE, group_name="gone", world_size=0))
    assert not d.fuse and d.reason == "process group 'gone' is not known in this process"


def test_group_of_another_size(group4):
    d = decide(dataclasses.replace(AG, world_size=8))
    assert not d.fuse and d.reason == "process group '0' has 4 ranks, the collective says 8"


def test_no_process_group_at_all():
    d = decide(AG)
    assert not d.fuse and d.reason == "torch.distributed is not initialised"


def test_cpu_tasks_get_the_reference_plan(group4):
    d = decide(dataclasses.replace(AG, device_type="cpu"))
    assert d.fuse and d.plan.impl == REFERENCE


def test_cuda_plan_comes_from_choose_device_plan(group4, monkeypatch):
    plan = AllGatherPlan(label="tri", copy_streams=2)
    monkeypatch.setattr(decide_module, "choose_device_plan", lambda task, **kw: (plan, "predicted win"))
    d = decide(AG)
    assert d.fuse and d.reason == "predicted win"
    assert d.plan == decide_module.with_options(plan) and d.plan.copy_streams == 2

    monkeypatch.setattr(decide_module, "choose_device_plan", lambda task, **kw: (None, "no gain"))
    d = decide(AG)
    assert not d.fuse and d.reason == "no gain"


def test_decode_rmsnorm_is_fused_only_under_cuda_graphs(group4):
    """The GEMM + all-reduce + RMSNorm kernel measured a gain only when replayed in a CUDA graph
    (mode="reduce-overhead"), which the decision reads from Inductor's config."""
    from torch._inductor import config as inductor_config

    from ditron_inductor.scheduler.task import MATMUL_ALL_REDUCE_RMSNORM

    decode = dataclasses.replace(AG, op=MATMUL_ALL_REDUCE_RMSNORM, m=32, k=3584, ns=(8192,),
                                 reduce_op="sum")
    with inductor_config.patch({"triton.cudagraphs": False}):
        d = decide(decode)
    assert not d.fuse and "eagerly" in d.reason
    with inductor_config.patch({"triton.cudagraphs": True}):
        d = decide(decode)
        assert d.fuse and d.plan.impl == FUSED and d.plan.algo == "lamport"  # 4 ranks
        assert not decide(dataclasses.replace(decode, m=32769)).fuse  # above OVERLAP_MAX_M
        one_row = dataclasses.replace(decode, m=1)
        assert decide(one_row).plan.algo == "lamport_all"  # measured on 4 ranks
        from ditron_inductor.scheduler.policy import all_reduce_params

        # the group is of 4 ranks (decide checks it): the parameters alone for 8
        assert all_reduce_params(dataclasses.replace(one_row, world_size=8))["algo"] == "push_all"


def test_prefill_all_reduce_overlaps_the_gemm_where_measured(group4):
    """Above FUSED_MAX_M the plan is push beside the persistent GEMM (measured on 4 ranks):
    under CUDA graphs from M=513 to 32768, eagerly only from M=8192 (host time hidden), more
    push SMs for a short GEMM; never on more ranks than measured, nor above M=32768."""
    from torch._inductor import config as inductor_config

    from ditron_inductor.scheduler.task import MATMUL_ALL_REDUCE

    prefill = dataclasses.replace(AG, op=MATMUL_ALL_REDUCE, m=2048, k=3584, ns=(8192,),
                                  reduce_op="sum")
    with inductor_config.patch({"triton.cudagraphs": True}):
        d = decide(prefill)
        assert d.fuse and "beside the GEMM" in d.reason
        assert (d.plan.overlap, d.plan.gemm, d.plan.progs) == (True, "triton", 16)
        assert decide(dataclasses.replace(prefill, k=1024)).plan.progs == 32
        assert decide(dataclasses.replace(prefill, m=512)).plan.algo == "push"
        assert decide(dataclasses.replace(prefill, m=32768)).plan.overlap
        assert not decide(dataclasses.replace(prefill, m=32769)).fuse
        assert not decide(dataclasses.replace(prefill, world_size=8)).fuse
    with inductor_config.patch({"triton.cudagraphs": False}):
        assert not decide(prefill).fuse
        for m in (8192, 32768):
            d = decide(dataclasses.replace(prefill, m=m))
            assert d.fuse and "eager" in d.reason and d.plan.overlap
        assert not decide(dataclasses.replace(prefill, m=32769)).fuse


def test_push_beside_the_gemm_leaves_what_outlasts_the_gemm():
    """The push beside the GEMM hides its ring's bytes only while the GEMM runs: with a short
    GEMM (Llama-3-8B's o_proj at TP 4, K 1024) what its bandwidth beside the GEMM leaves over is
    exposed, and the prediction lands near the 1.018 ms measured on 4 GPUs at M 16384 under
    CUDA graphs (counting only the last chunk predicted 0.61); with a long one (down_proj, K
    3584) only the last chunk's share is."""
    from ditron_inductor.scheduler import evidence, link_model
    from ditron_inductor.scheduler.choose import fused_plan
    from ditron_inductor.scheduler.plan import family
    from ditron_inductor.scheduler.task import MATMUL_ALL_REDUCE_RMSNORM

    o_proj = dataclasses.replace(AG, op=MATMUL_ALL_REDUCE_RMSNORM, m=16384, k=1024, ns=(4096,),
                                 reduce_op="sum")
    c = evidence.link(4)
    ring_ms = 2 * 3 / 4 * 16384 * 4096 * 2 / (c["nccl_ar_busbw_gbps"] * 1e6)
    for task, outlasts in ((o_proj, True), (dataclasses.replace(o_proj, k=3584), False)):
        plan = fused_plan(task)
        assert plan.overlap, plan
        world1 = evidence.world1_costs(task.op, family(plan), True, task.m_hint, task.k,
                                       task.n_total)
        costs = link_model.all_reduce_costs(task, plan, c, world1.fused_ms, world1.unfused_ms)
        last_chunk = ring_ms / plan.chunks + c["fused_latency_ms"]
        if outlasts:
            assert costs.fused_exposed > last_chunk + 0.2
            assert abs(costs.fused - 1.018) < 0.1 * 1.018, costs.describe()
        else:
            assert costs.fused_exposed == pytest.approx(last_chunk)


def test_prefill_all_reduce_on_two_ranks_takes_the_copy_engine():
    """On 2 ranks the copy-engine plan: launched eagerly from 4096 rows on (below, the host's
    time per call lost the Llama prefill) with M / 2048 row chunks at N 4096, under CUDA graphs
    from 2048 rows on with M / 1024 (2 to 8 both, twice as many at N 8192; below 2048 rows, push
    beside the GEMM); on 4 ranks (W - 1 partials out of each rank) never."""
    from torch._inductor import config as inductor_config

    from ditron_inductor.scheduler.task import MATMUL_ALL_REDUCE_RMSNORM

    prefill = dataclasses.replace(AG, op=MATMUL_ALL_REDUCE_RMSNORM, world_size=2, m=4096,
                                  k=7168, ns=(4096,), reduce_op="sum")
    with fake_group(2), inductor_config.patch({"triton.cudagraphs": False}):
        d = decide(prefill)
        assert d.fuse and (d.plan.algo, d.plan.chunks) == ("copy_engine", 2), d.reason
        assert "copies beside the GEMM's row chunks" in d.reason
        chunks = {m: decide(dataclasses.replace(prefill, m=m)).plan.chunks
                  for m in (8192, 16384, 65536)}
        assert chunks == {8192: 4, 16384: 8, 65536: 8}
        assert decide(dataclasses.replace(prefill, ns=(8192,))).plan.chunks == 4
        d = decide(dataclasses.replace(prefill, m=2048))
        assert not d.fuse and "host time" in d.reason
        # rows wider than its sum kernel holds, or buffers past 32-bit offsets: the runtime
        # would decline, so the scheduler does not take it (push's bounds then apply)
        assert not decide(dataclasses.replace(prefill, ns=(16384 + 8,))).fuse
        assert not decide(dataclasses.replace(prefill, m=2 ** 18)).fuse
        assert decide(dataclasses.replace(prefill, ns=(16384,))).plan.algo == "copy_engine"
    with fake_group(2), inductor_config.patch({"triton.cudagraphs": True}):
        chunks = {m: decide(dataclasses.replace(prefill, m=m)).plan for m in
                  (2048, 4096, 8192, 16384)}
        assert {m: (p.algo, p.chunks) for m, p in chunks.items()} == {
            2048: ("copy_engine", 2), 4096: ("copy_engine", 4), 8192: ("copy_engine", 8),
            16384: ("copy_engine", 8)}
        # chunks by the partial's size: at N 8192 (Llama-3-70B) twice as many per row
        wide = {m: decide(dataclasses.replace(prefill, m=m, ns=(8192,))).plan.chunks
                for m in (2048, 4096)}
        assert wide == {2048: 4, 4096: 8}
        d = decide(dataclasses.replace(prefill, m=1024, k=2048))  # o_proj's K: push predicted
        assert d.fuse and d.plan.algo == "push" and d.plan.overlap, d.reason  # faster there
    with fake_group(4), inductor_config.patch({"triton.cudagraphs": False}):
        assert not decide(dataclasses.replace(prefill, world_size=4)).fuse
        d = decide(dataclasses.replace(prefill, world_size=4, m=8192))
        assert d.fuse and d.plan.algo == "push"
    with fake_group(4), inductor_config.patch({"triton.cudagraphs": True}):
        d = decide(dataclasses.replace(prefill, world_size=4))
        assert d.fuse and d.plan.algo == "push"


def test_forced_plans(group4, monkeypatch):
    monkeypatch.setattr(decide_module, "choose_device_plan", lambda task, **kw: (None, "no gain"))
    forced = decide(AG, config.Options(force_plan="fused")).plan
    # the forced plan is complete at compile time: the task's best candidate
    assert forced.impl == FUSED and forced.label == "tri_tma_128x256"
    assert decide(AG, config.Options(force_plan="reference")).plan.impl == REFERENCE


def test_plans_carry_the_runtime_options(group4):
    """The options the runtime needs are read once, at compile time, into the plan."""
    plan = decide(AG, config.Options(force_plan="fused", wait_timeout_s=2.5,
                                     symm_mem_backend="torch")).plan
    assert (plan.wait_timeout_s, plan.symm_mem_backend) == (2.5, "torch")
    assert decide(AG, config.Options(force_plan="fused")).plan.wait_timeout_s is None  # auto


def test_every_rank_decides_the_same():
    tasks = [AG, RS, dataclasses.replace(RS, dim_size=8),
             dataclasses.replace(AG, op=MATMUL_ALL_REDUCE, reduce_op="sum")]
    decisions = []
    for rank in (0, 3):
        with fake_group(4, rank=rank):
            decisions.append([decide(t) for t in tasks])
    assert decisions[0] == decisions[1]


def test_plan_survives_the_graph_as_text():
    from ditron_inductor.scheduler.plan import (
        REFERENCE_PLAN,
        AllReducePlan,
        GroupedMmPlan,
        ReduceScatterPlan,
        from_params,
    )

    plans = [from_params(AllGatherPlan, {"gemm": "cublas", "groups": [1, 3, 4], "block_m": 64},
                         label="x", wait_timeout_s=1.0, predicted_ms=(("fused", 1.0),)),
             ReduceScatterPlan(reduce="triton").for_world(8),
             AllReducePlan(algo="push", overlap=True).for_world(4), GroupedMmPlan(rows=False),
             REFERENCE_PLAN]
    for plan in plans:
        assert decode(plan.encode()) == plan
    assert decode(plans[0].encode()) is decode(plans[0].encode())  # decoded once per text
    assert plans[0].tile.block_m == 64 and plans[0].groups == (1, 3, 4)
    assert decode(REFERENCE_PLAN.encode()).impl == REFERENCE
    assert "groups=1,3,4" in plans[0].describe() and "predicted" in plans[0].describe()
    assert not decode(plans[3].encode()).rows and "rows=False" in plans[3].describe()


def test_unknown_plan_parameter_is_named():
    from ditron_inductor.scheduler.plan import ReduceScatterPlan, from_params

    with pytest.raises(ValueError, match=r"ReduceScatterPlan: unknown parameter\(s\) \['algo'\]"):
        from_params(ReduceScatterPlan, {"algo": "push"})


def test_task_description_names_shapes_and_group():
    assert AG.describe() == "all_gather_matmul M=8192 K=8192 N=7168 bfloat16 world=4 group=0"


def test_rank_chunks_contiguous_follows_the_layout():
    from ditron_inductor.scheduler import task as tasks

    w = torch.empty(64, 32)
    task = tasks.all_gather_matmul_task
    assert task(torch.empty(4, 64), [w], [None], 0, "0", 8).rank_chunks_contiguous
    assert task(torch.empty(1, 4, 64), [w], [None], 1, "0", 8).rank_chunks_contiguous
    assert not task(torch.empty(2, 4, 64), [w], [None], 1, "0", 8).rank_chunks_contiguous
    rs = tasks.matmul_collective_task
    assert rs(MATMUL_REDUCE_SCATTER, torch.empty(16, 64), w, None, [1, 16, 32], 1, "sum", "0",
              8).rank_chunks_contiguous
    assert not rs(MATMUL_REDUCE_SCATTER, torch.empty(32, 64), w, None, [2, 16, 32], 1, "sum",
                  "0", 8).rank_chunks_contiguous


def test_cuda_tasks_without_a_fused_kernel_keep_nccl_and_cublas():
    from ditron_inductor.scheduler.choose import choose_device_plan

    plan, why = choose_device_plan(dataclasses.replace(AG, dim=1, rank_chunks_contiguous=False))
    assert plan is None and "interleaves" in why
    plan, why = choose_device_plan(dataclasses.replace(AG, op=MATMUL_ALL_REDUCE, m=65536,
                                                       reduce_op="sum"), cuda_graphs=True)
    assert plan is None and "M=65536 > 32768: no fused kernel measured a gain" in why
    # [1, S, H] gathered on dim 1 is planned like a dim-0 gather
    same_rows = dataclasses.replace(AG, dim=1, rank_chunks_contiguous=True)
    assert choose_device_plan(same_rows) == choose_device_plan(AG)



def test_the_rewrites_copies_count_against_the_fused_plans():
    """Rows reordered around the op: the fused plans pay their copies. A sum of matmul products:
    the unfused graph pays the pointwise sum of the terms' products, the fused plans a read of
    their output rows per further term (cuBLAS accumulating, beta = 1), and only the plans with
    cuBLAS GEMMs take it."""
    from ditron_inductor.scheduler.choose import choose_device_plan
    from ditron_inductor.scheduler.ranking import predicted as predict
    from ditron_inductor.scheduler.evidence import link as calibration

    copied = dataclasses.replace(AG, dim=1, rows_reordered=True, copy_elems=8192 * 7168)
    assert copied.describe() == ("all_gather_matmul M=8192 K=8192 N=7168 bfloat16 world=4 group=0 "
                                 "dim=1, rank-major rows reordered in the graph, copies 58720256 "
                                 "elements")
    copy_ms = 2 * 8192 * 7168 * 2 / (calibration(4)["copy_gbps"] * 1e6)
    before, after = predict(AG), predict(copied)
    assert after["nccl_cublas"] == before["nccl_cublas"]
    assert after["tri_tma_128x256"] == pytest.approx(before["tri_tma_128x256"] + copy_ms)
    plan, _ = choose_device_plan(copied)
    assert plan is not None and plan.label == choose_device_plan(AG)[0].label
    plan, why = choose_device_plan(dataclasses.replace(copied, copy_elems=64 * 8192 * 8192))
    assert plan is None and why.startswith("no predicted gain")

    rs = dataclasses.replace(RS, device_type="cuda")
    summed = dataclasses.replace(rs, terms=3)
    sum_ms = 4 * 8192 * 8192 * 2 / (calibration(4)["copy_gbps"] * 1e6)
    assert predict(summed)["nccl_cublas"] == pytest.approx(predict(rs)["nccl_cublas"] + sum_ms)
    accumulate_ms = 2 * 8192 * 8192 * 2 / (calibration(4)["copy_gbps"] * 1e6)
    assert predict(summed)["cublas"] == pytest.approx(predict(rs)["cublas"] + accumulate_ms)
    assert set(predict(summed)) == set(predict(rs)) == {"nccl_cublas", "cublas",
                                                        "cublas_triton_reduce"}
    plan, _ = choose_device_plan(summed)
    assert plan is not None and plan.label == "cublas_triton_reduce"


def test_calibration_by_world_picks_what_was_measured_best():
    """Each world size is planned with the constants measured nearest to it: on 4 ranks the
    measured best plan of every suite shape of a 4-GPU table (the persistent Triton AG for the
    long GEMMs, cuBLAS on each chunk as it lands for the short ones, the cuBLAS-chunk RS), on 8
    the plans of the 8-GPU live table (three shapes left to NCCL + cuBLAS)."""
    from ditron_inductor.scheduler.choose import choose_device_plan
    from ditron_inductor.scheduler.evidence import link as calibration
    from ditron_inductor.scheduler.evidence import link_calibrations

    assert calibration(2) is calibration(4) is link_calibrations()[4]
    assert calibration(6) is calibration(16) is link_calibrations()[8]
    suite = [(AG, 8192, 8192, 7168), (AG, 8192, 8192, 1280), (AG, 4096, 8192, 4096),
             (AG, 16384, 8192, 3584), (RS, 8192, 3584, 8192), (RS, 8192, 1024, 8192),
             (RS, 16384, 3584, 8192)]

    def picks(world):
        plans = [choose_device_plan(dataclasses.replace(
            task, world_size=world, m=m, k=k, ns=(n,), device_type="cuda"))[0]
            for task, m, k, n in suite]
        return [p.label if p else "nccl_cublas" for p in plans]

    assert picks(4) == ["tri_tma_128x256", "cublas_each", "cublas_1_1_2_4", "tri_tma_128x256"] \
        + ["cublas_triton_reduce"] * 3
    assert picks(8) == ["tri_tma_128x256", "nccl_cublas", "nccl_cublas", "tri_tma_128x256",
                        "cublas_triton_reduce", "nccl_cublas", "cublas_triton_reduce"]


def test_moe_ops_keep_the_graph_on_cuda_unless_a_fused_plan_is_forced(group4, monkeypatch):
    """The scheduler keeps NCCL + torch._grouped_mm at the MoE ops on CUDA (not measured faster
    in a model); DITRON_PLAN=fused rewrites them into their fused plans (what e2e_moe.py's
    ditron_fused contenders measure: before, the forced plan was ignored there)."""
    from ditron_inductor.scheduler.choose import moe_not_fused
    from ditron_inductor.scheduler.plan import FUSED, GroupedMmPlan, decode, family
    from ditron_inductor.scheduler.task import all_to_all_grouped_mm_task

    x, w = torch.empty(16, 32, dtype=torch.bfloat16), torch.empty(2, 32, 64, dtype=torch.bfloat16)
    dispatch = all_to_all_grouped_mm_task(x, [3, 5, 0, 8], [4, 4, 4, 4], None, [w, w], None, "0",
                                          4)
    assert dispatch.describe() == ("all_to_all_grouped_mm M=16 K=32 N=64,64 bfloat16 world=4 "
                                   "group=0 experts=2 tokens=16")
    assert decide(dispatch).plan.impl == REFERENCE  # on CPU
    on_cuda = dataclasses.replace(dispatch, device_type="cuda")
    d = decide(on_cuda)
    assert (d.fuse, d.reason) == (False, moe_not_fused("all_to_all_grouped_mm"))
    d = decide(on_cuda, config.Options(force_plan="fused"))
    assert d.fuse and d.reason == "fused plan forced (ditron.plan / DITRON_PLAN=fused)"
    assert family(d.plan) == "grouped_mm" and d.plan.impl == FUSED
    assert decide(on_cuda, config.Options(force_plan="reference")).plan.impl == REFERENCE
    # a plan named for it (the world-1 benchmark, the GPU tests): the grouped GEMM's family
    from ditron_inductor.scheduler.decide import plan_for

    plan = plan_for(on_cuda)  # the default tile: 128 x 256, rows and weights through TMA
    assert isinstance(plan, GroupedMmPlan) and (plan.block_m, plan.block_n) == (128, 256)
    assert plan.tma_a and plan.tma_b
    assert decode(plan.encode()) == plan and family(plan) == "grouped_mm"
    # the combine on several ranks: the dispatch's default plan
    from ditron_inductor.scheduler.task import grouped_mm_all_to_all_task

    combine = dataclasses.replace(grouped_mm_all_to_all_task(
        [torch.empty(16, 64, dtype=torch.bfloat16)], [torch.empty(2, 64, 32, dtype=torch.bfloat16)],
        None, None, False, [4, 4, 4, 4], [3, 5, 0, 8], "0", 4), device_type="cuda")
    assert plan_for(combine) == plan_for(dataclasses.replace(combine, world_size=1)) == plan
    declining = plan_for(on_cuda, min_rows=4096)
    assert declining.min_rows == 4096 and decode(declining.encode()) == declining
    assert plan_for(combine).min_rows == 0  # no token count declines where a plan is named
    # the runtime takes the tile and the dispatch's GEMM engine by the rows per expert, unless
    # a tile is named
    assert plan.small_expert_rows == declining.small_expert_rows == 128
    assert plan.library_rows == declining.library_rows == 128
    assert plan.library_combine_rows == declining.library_combine_rows == 160
    assert plan.library_below_rows == declining.library_below_rows == 256
    named = plan_for(on_cuda, block_m=64, warps=4)
    assert named.small_expert_rows == named.library_rows == named.library_combine_rows == 0
    assert named.library_below_rows == 0


def test_matmul_all_gather_keeps_the_graph_on_cuda_unless_a_fused_plan_is_forced(group4):
    """No measured row (the shipped tables hold none): cuBLAS + NCCL on CUDA, the reference op
    on CPU; forced, the fused plan's GEMM in row chunks by M."""
    from ditron_inductor.runtime.matmul_all_gather import chunk_bounds
    from ditron_inductor.scheduler.plan import MatmulAllGatherPlan
    from ditron_inductor.scheduler.task import MATMUL_ALL_GATHER, matmul_collective_task

    a, b = torch.empty(4096, 4096, dtype=torch.bfloat16), torch.empty(4096, 64128,
                                                                       dtype=torch.bfloat16)
    task = matmul_collective_task(MATMUL_ALL_GATHER, a, b, None, [2, 2048, 64128], 2, None, "0",
                                  4)
    assert task.describe() == ("matmul_all_gather M=4096 K=4096 N=64128 bfloat16 world=4 "
                               "group=0 dim=2")
    assert decide(task).plan.impl == REFERENCE  # on CPU
    on_cuda = dataclasses.replace(task, device_type="cuda")
    d = decide(on_cuda)
    assert not d.fuse and "has no measured row near this shape on 4 ranks" in d.reason
    d = decide(on_cuda, config.Options(force_plan="fused"))
    assert d.fuse and isinstance(d.plan, MatmulAllGatherPlan) and d.plan.chunks == 4
    assert decode(d.plan.encode()) == d.plan
    assert decide(dataclasses.replace(on_cuda, m=1536), config.Options(force_plan="fused")
                  ).plan.chunks == 1
    # chunks start on a multiple of 128 rows where the rows allow; none is empty
    assert chunk_bounds(4096, 4) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    assert chunk_bounds(1000, 4) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert chunk_bounds(6, 4) == [(0, 2), (2, 4), (4, 6)]
    assert chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("rows, experts, small_expert_rows, block_m", [
    (128 * 8, 8, 128, 64), (128 * 8 + 1, 8, 128, 128), (16, 128, 128, 64), (16, 128, 0, 128),
    (64, 0, 128, 128)])
def test_the_grouped_gemm_takes_64_row_tiles_where_experts_get_few_rows(rows, experts,
                                                                        small_expert_rows,
                                                                        block_m):
    """Up to the plan's rows per local expert the small-expert tile (64 x 256, 4 warps), above
    them the default 128 x 256; a plan that names its tile (0) keeps it."""
    from ditron_inductor.scheduler.plan import GroupedMmPlan

    plan = GroupedMmPlan(small_expert_rows=small_expert_rows, site="layers.0").for_rows(rows,
                                                                                       experts)
    assert plan.block_m == block_m and plan.site == "layers.0"
    assert (plan.block_n, plan.warps) == ((256, 4) if block_m == 64 else (256, 8))


@pytest.mark.parametrize("rows, experts, stored, engine", [
    (128 * 8, 8, True, "torch"), (128 * 8 - 1, 8, True, "triton"), (300 * 8, 8, True, "torch"),
    (128 * 8, 8, False, "triton"), (128 * 8 + 1, 8, False, "torch"),
    (256 * 8 - 1, 8, False, "torch"), (256 * 8, 8, False, "triton"), (64, 0, True, "triton"),
    (64, 0, False, "triton")])
def test_the_dispatch_runs_torchs_grouped_gemm_by_rows_per_expert(rows, experts, stored,
                                                                  engine):
    """A dispatch that stores its rows output (training) runs torch._grouped_mm once every row
    landed from the plan's library_rows rows per local expert; one that stores none
    (inference) above small_expert_rows and below library_below_rows; elsewhere the Triton
    tiles that wait for their rows."""
    from ditron_inductor.scheduler.plan import GroupedMmPlan

    plan = GroupedMmPlan(small_expert_rows=128, library_rows=128, library_below_rows=256,
                         rows=stored, site="layers.0").for_rows(rows, experts)
    assert plan.dispatch_gemm == engine and plan.site == "layers.0"
    assert plan.block_m == (64 if experts and rows <= 128 * experts else 128)
    assert plan.combine_gemm == "triton"


@pytest.mark.parametrize("rows, experts, stored, engine", [
    (160 * 8, 8, True, "torch"), (160 * 8, 8, False, "torch"), (160 * 8 - 1, 8, True, "triton"),
    (64, 0, True, "triton")])
def test_a_combine_with_many_rows_per_expert_runs_torchs_grouped_gemm(rows, experts, stored,
                                                                      engine):
    """From the plan's library_combine_rows rows per local expert the combine runs
    torch._grouped_mm, in training and inference graphs alike; below, the Triton tiles. Between
    the two thresholds (128 and 160 rows) a training graph's dispatch runs the library, its
    combine the tiles."""
    from ditron_inductor.scheduler.plan import GroupedMmPlan

    plan = GroupedMmPlan(library_rows=128, library_combine_rows=160, rows=stored,
                         site="layers.0").for_rows(rows, experts)
    assert plan.combine_gemm == engine and plan.site == "layers.0"
    assert plan.dispatch_gemm == ("torch" if stored and experts else "triton")


@pytest.mark.parametrize("op", [ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE])
def test_float32_on_cuda_keeps_nccl_and_cublas(op):
    """The fused kernels compute in bf16/fp16 (float8 operands for the scaled ops): a float32
    task on CUDA is left to NCCL + cuBLAS with the reason, where it used to get a plan the runtime
    then declined; forced plans too. On CPU it still takes the reference plan (the tests' path)."""
    from torch._inductor import config as inductor_config

    fp32 = dataclasses.replace(AG, op=op, world_size=2, m=2048, dim=0, dim_size=2048,
                               reduce_op="sum", dtype=torch.float32)
    # under CUDA graphs the all-reduce is fused at this size, the others launched eagerly
    graphs = op == MATMUL_ALL_REDUCE
    with fake_group(2), inductor_config.patch({"triton.cudagraphs": graphs}):
        assert decide(dataclasses.replace(fp32, dtype=torch.bfloat16)).fuse
        d = decide(fp32)
        assert not d.fuse and d.reason.startswith("dtype torch.float32: the fused kernels compute")
        assert not decide(fp32, config.Options(force_plan="fused")).fuse
        cpu = decide(dataclasses.replace(fp32, device_type="cpu"))
        scaled = dataclasses.replace(fp32, op=ALL_GATHER_SCALED_MM, dtype=torch.float8_e4m3fn,
                                     out_dtype=torch.float32)
        assert decide(scaled).reason.startswith("dtype torch.float8_e4m3fn -> torch.float32:")
        bf16_out = decide(dataclasses.replace(scaled, out_dtype=torch.bfloat16))
        assert not bf16_out.reason.startswith("dtype")
    assert cpu.fuse and cpu.plan.impl == REFERENCE


def test_all_gather_and_reduce_scatter_decline_under_cuda_graphs(group4):
    """Their epochs are host values, so the runtime runs them eagerly only: a graph replayed from
    a CUDA graph keeps NCCL + cuBLAS there (rather than the op's reference inside the graph)."""
    for task in (AG, dataclasses.replace(RS, device_type="cuda", dim=0, dim_size=8192)):
        assert decide(task, config.Options(cuda_graphs=False)).fuse
        d = decide(task, config.Options(cuda_graphs=True))
        assert not d.fuse and "run eagerly only" in d.reason
