"""lowering/sequence_shard.py: plain TP's all-reduces as a reduce-scatter and an all-gather, the
residual stream between them sharded on rows.

The graph-level tests trace a layer's tail with functional collectives (fake tensors, no process
group: the group's size is given) and check what the pass finds and how it rewrites. Two launches
over gloo then compile with the option on, where the ops' reference paths compute the rewritten
graph: a layer's tail on 4 CPU ranks, and Hugging Face Llama under plain TP on 2 (its logits
against eager's).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ditron_inductor.lowering import sequence_shard
from ditron_inductor.lowering.nodes import is_call
from tests.distributed import launched_once

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
ROWS, HIDDEN, WORLD = 32, 64, 2


def _layer_tail(extra=None):
    """A row-parallel matmul's all-reduce, the residual add, the RMSNorm and the next matmul;
    `extra(h, y, other, w_col)` returns the outputs instead (`other`: a rank-local input)."""
    def tail(x, w_row, w_col, embedded, norm_weight, other):
        partial = torch.mm(x, w_row).view(1, ROWS, HIDDEN)
        h = embedded + c10d.wait_tensor(c10d.all_reduce(partial, "sum", "0"))
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
        if extra is not None:
            return extra(h, y, other, w_col)
        return (torch.mm(y.view(ROWS, HIDDEN), w_col),)
    args = (torch.randn(ROWS, 16), torch.randn(16, HIDDEN), torch.randn(HIDDEN, 8),
            torch.randn(1, ROWS, HIDDEN), torch.randn(HIDDEN), torch.randn(ROWS, 16))
    return make_fx(tail, tracing_mode="fake")(*args).graph


def _regions(graph):
    return sequence_shard.find_regions(graph, lambda group_name: WORLD)


def _calls(graph, target):
    return [n for n in graph.nodes if is_call(n, target)]


def test_residual_add_and_norm_run_on_this_ranks_rows():
    graph = _layer_tail()
    (region,) = _regions(graph)
    assert region.problem is None and (region.rows, region.world_size) == (ROWS, WORLD)
    assert [n.name for n in region.members] == [
        "wait_tensor", "add", "pow_1", "mean", "add_1", "rsqrt", "mul", "mul_1", "view_1"]
    assert [n.name for n in region.gathered_values()] == ["mul_1"]  # the norm's output, once

    sequence_shard.rewrite_region(graph, region)
    graph.lint()
    assert not _calls(graph, c10d.all_reduce.default)
    (scatter,) = _calls(graph, c10d.reduce_scatter_tensor.default)
    assert list(scatter.args[0].meta["val"].shape) == [ROWS, HIDDEN]
    assert scatter.args[1:] == ("sum", WORLD, "0")
    add = next(n for n in graph.nodes if n.name == "add")
    assert list(add.meta["val"].shape) == [ROWS // WORLD, HIDDEN]
    # the embedded rows every rank holds: this rank's rows of them, taken at run time
    (taken,) = _calls(graph, torch.ops.ditron.rank_rows.default)
    assert taken.args[1:] == (WORLD, "0") and add.args[0] is taken
    assert list(taken.args[0].meta["val"].shape) == [ROWS, HIDDEN]
    # the next matmul reads the gathered rows; the norm's weight is read as it was
    (gather,) = _calls(graph, c10d.all_gather_into_tensor.default)
    assert gather.args[0].name == "mul_1" and gather.args[1:] == (WORLD, "0")
    (mm,) = [n for n in _calls(graph, aten.mm.default) if n.name == "mm_1"]
    assert mm.args[0].args[0] is gather and list(mm.meta["val"].shape) == [ROWS, 8]
    assert list(next(n for n in graph.nodes if n.name == "mean").meta["val"].shape) == [
        ROWS // WORLD, 1]


def test_layer_norm_runs_on_this_ranks_rows():
    """LayerNorm as Inductor's decomposition leaves it (var_mean over the last dim, its two
    items): the variance and mean of this rank's rows, the normalised rows gathered once."""
    from torch._inductor.decomposition import select_decomp_table

    def tail(x, w_row, w_col, embedded, norm_weight, norm_bias):
        partial = torch.mm(x, w_row).view(1, ROWS, HIDDEN)
        h = embedded + c10d.wait_tensor(c10d.all_reduce(partial, "sum", "0"))
        y = torch.nn.functional.layer_norm(h, (HIDDEN,), norm_weight, norm_bias, 1e-5)
        return (torch.mm(y.view(ROWS, HIDDEN), w_col),)
    args = (torch.randn(ROWS, 16), torch.randn(16, HIDDEN), torch.randn(HIDDEN, 8),
            torch.randn(1, ROWS, HIDDEN), torch.randn(HIDDEN), torch.randn(HIDDEN))
    graph = make_fx(tail, tracing_mode="fake",
                    decomposition_table=select_decomp_table())(*args).graph
    (region,) = _regions(graph)
    assert region.problem is None
    assert [n.name for n in region.members] == [
        "wait_tensor", "add", "var_mean", "getitem", "getitem_1", "add_1", "rsqrt", "sub", "mul",
        "mul_1", "add_2", "view_1"]
    assert [n.name for n in region.gathered_values()] == ["add_2"]  # after the bias, once

    sequence_shard.rewrite_region(graph, region)
    graph.lint()
    (stats,) = _calls(graph, aten.var_mean.correction)
    assert [list(v.shape) for v in stats.meta["val"]] == [[ROWS // WORLD, 1]] * 2
    assert stats.args[1] == [-1] and stats.kwargs["keepdim"]
    (gather,) = _calls(graph, c10d.all_gather_into_tensor.default)
    assert gather.args[0].name == "add_2"


def test_a_variance_over_the_rows_reads_the_gathered_rows():
    """var_mean over the rows' dim is no row-by-row reduction: it reads the whole value."""
    def tail(x, w_row, w_col, embedded, norm_weight, other):
        partial = torch.mm(x, w_row).view(1, ROWS, HIDDEN)
        h = embedded + c10d.wait_tensor(c10d.all_reduce(partial, "sum", "0"))
        var, mean = torch.ops.aten.var_mean.correction(h, [1], correction=0, keepdim=True)
        return (torch.mm(((h - mean) * var).view(ROWS, HIDDEN), w_col),)
    args = (torch.randn(ROWS, 16), torch.randn(16, HIDDEN), torch.randn(HIDDEN, 8),
            torch.randn(1, ROWS, HIDDEN), torch.randn(HIDDEN), torch.randn(ROWS, 16))
    (region,) = _regions(make_fx(tail, tracing_mode="fake")(*args).graph)
    assert "var_mean" not in [n.name for n in region.members]
    assert [(reader.name, value.name) for reader, value, _ in region.gathers
            if reader.name == "var_mean"] == [("var_mean", "add")]


def test_a_graph_output_of_the_residual_keeps_the_all_reduce():
    # a training forward saves h for the backward: one more gather than all-reduces
    graph = _layer_tail(lambda h, y, other, w: (torch.mm(y.view(ROWS, HIDDEN), w), h))
    (region,) = _regions(graph)
    assert [n.name for n in region.gathered_values()] == ["mul_1", "add"]
    why = sequence_shard.why_kept(region)
    assert why.startswith("2 values would be gathered for 1 all-reduce(s)"), why


def test_a_rank_local_operand_is_not_sliced():
    # h + (a matmul of this rank's weight shard): not the same on every rank, so the sum runs on
    # the gathered rows (the all-reduce's result, gathered back), not on slices
    def extra(h, y, other, w):
        local = torch.mm(other, torch.ones(16, HIDDEN)).view(1, ROWS, HIDDEN)
        return (h + local,)
    graph = _layer_tail(extra)
    (region,) = _regions(graph)
    assert [n.name for n in region.gathered_values()] == ["add"]
    assert [r.name for r, _, _ in region.gathers] == ["add_2"]
    assert "add_2" not in [n.name for n in region.members]


def test_the_last_rows_are_summed_from_the_ranks_holding_them():
    # the logits of the last token only (logits_to_keep=1): row 31 of 32, on rank 1
    graph = _layer_tail(lambda h, y, other, w: (torch.mm(y[:, -1:, :].reshape(1, HIDDEN), w),))
    (region,) = _regions(graph)
    assert region.gathers == []
    ((piece, operand, row_dims, dim, start, length),) = region.slices
    assert (operand.name, row_dims, dim, start, length) == ("mul_1", [1, ROWS], 1, ROWS - 1, 1)
    sequence_shard.rewrite_region(graph, region)
    graph.lint()
    (held,) = _calls(graph, torch.ops.ditron.held_rows.default)
    assert held.args[0].name == "mul_1" and held.args[1:] == ([1, ROWS], 1, ROWS - 1, 1, WORLD,
                                                                "0")
    (summed,) = _calls(graph, c10d.all_reduce.default)
    assert summed.args == (held, "sum", "0")
    assert not _calls(graph, c10d.all_gather_into_tensor.default)


@pytest.mark.parametrize("rank, expected_rows", [(0, [15, None]), (1, [None, 15])])
def test_held_rows_are_a_ranks_share_of_the_slice(rank, expected_rows, monkeypatch):
    # [B 2, S 16] rows on 2 ranks: the last token of sequence 0 is row 15 (rank 0's 15th), of
    # sequence 1 row 31 (rank 1's 15th); each rank gives its own and zeros for the other's
    from ditron_inductor import ops

    class Group:
        def rank(self):
            return rank
    monkeypatch.setattr(ops, "check_group", lambda group_name, world_size: None)
    monkeypatch.setattr(ops, "_resolve_process_group", lambda group_name: Group())
    shard = torch.randn(16, 8)
    got = torch.ops.ditron.held_rows(shard, [2, 16], 1, 15, 1, 2, "0")
    for row, local in zip(got, expected_rows):
        torch.testing.assert_close(row, shard[local] if local is not None else torch.zeros(8))


def test_rows_that_do_not_divide_among_the_ranks_are_not_a_region():
    assert sequence_shard.find_regions(_layer_tail(), lambda group_name: 3) == []


# ------------------------------------------- when it keeps the all-reduces (CUDA, Llama-3-8B)


def _attention_input(world: int, rows: int):
    """o_proj's all-reduce, the residual add, the RMSNorm and q/k/v (Llama-3-8B under TP
    `world`), traced on CUDA fake tensors: the shapes the scheduler decides on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    hidden, q_cols, kv_cols = 4096, 4096 // world, 1024 // world

    def tail(x, w_o, embedded, norm_weight, wq, wk, wv):
        h = embedded + c10d.wait_tensor(c10d.all_reduce(
            torch.mm(x, w_o).view(1, rows, hidden), "sum", "0"))
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight).view(
            rows, hidden)
        return torch.mm(y, wq), torch.mm(y, wk), torch.mm(y, wv)
    shapes = [(rows, q_cols), (q_cols, hidden), (1, rows, hidden), (hidden,), (hidden, q_cols),
              (hidden, kv_cols), (hidden, kv_cols)]
    with FakeTensorMode():
        args = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
        graph = make_fx(tail)(*args).graph
    (region,) = sequence_shard.find_regions(graph, lambda group_name: world)
    return region


@pytest.fixture
def decided_on_cuda(monkeypatch):
    """The scheduler decides as on a GPU machine, launched eagerly or replayed in a CUDA graph
    (the argument), with a process group "0" of the traced size."""
    from ditron_inductor import config
    from ditron_inductor.scheduler import decide

    monkeypatch.setattr(decide, "group_problem", lambda group_name, world_size: None)

    def replayed(cuda_graphs: bool):
        monkeypatch.setattr(config, "cuda_graphs", cuda_graphs)
    return replayed


def test_two_ranks_shard_the_attention_input_at_8192_rows(decided_on_cuda):
    decided_on_cuda(False)
    assert sequence_shard.why_kept(_attention_input(2, 8192)) is None


def test_q_k_v_gathered_by_nccl_keep_the_all_reduce(decided_on_cuda):
    # 4 ranks, 16384 rows: o_proj's reduce-scatter is fused, q/k/v's gather is not
    decided_on_cuda(False)
    why = sequence_shard.why_kept(_attention_input(4, 16384))
    assert why.startswith("the all-gather in front of mm_1, mm_2, mm_3 would not be fused: "), why


@pytest.mark.parametrize("world, rows", [(2, 4096), (4, 8192)])
def test_fewer_rows_per_rank_launched_eagerly_keep_the_all_reduce(world, rows, decided_on_cuda,
                                                                  monkeypatch):
    from ditron_inductor import config

    decided_on_cuda(False)
    why = sequence_shard.why_kept(_attention_input(world, rows))
    assert why == ("launched eagerly, the fused reduce-scatters and all-gathers cost more host "
                   "time than they save below 4096 rows per rank"), why
    monkeypatch.setattr(config, "force_plan", "fused")  # DITRON_PLAN=fused: as decide, forced
    assert sequence_shard.why_kept(_attention_input(world, rows)) is None
    monkeypatch.setattr(config, "force_plan", "")
    decided_on_cuda(True)
    assert sequence_shard.why_kept(_attention_input(world, 2 * rows)) == (
        "replayed from a CUDA graph, where the fused reduce-scatters do not run")


def test_a_gathered_value_read_by_no_matmul_takes_a_plain_gather():
    # no scheduler decision (none could be made here: no process group) for a graph output
    def extra(h, y, other, w):
        local = torch.mm(other, torch.ones(16, HIDDEN)).view(1, ROWS, HIDDEN)
        return (h + local,)
    (region,) = _regions(_layer_tail(extra))
    assert sequence_shard._gather_not_fused(region, region.gathered_values()[0]) is None


# ------------------------------------------------------- a layer's tail on 4 ranks over gloo


def layer_tail_ranks(rank: int, world_size: int) -> dict:
    """Two all-reduced matmuls with a residual add and a norm after each (RMSNorm, and LayerNorm
    with a bias), the norm's rows read by the next matmul and the last row by the logits'
    matmul, compiled with sequence sharding on 4 ranks: every rank's own slices (rank_rows), the
    last row summed from the ranks' shares (held_rows: rank 3's row, zeros from the others)."""
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)  # the same "replicated" tensors on every rank
    embedded, norm_weight = torch.randn(1, ROWS, HIDDEN, generator=gen), torch.randn(HIDDEN,
                                                                                      generator=gen)
    norm_bias = torch.randn(HIDDEN, generator=gen)
    w_col, w_out = torch.randn(HIDDEN, 16, generator=gen), torch.randn(HIDDEN, 8, generator=gen)
    x = torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(1 + rank))  # this rank's
    w_row = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(10 + rank))

    norms = {
        "rms": lambda h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight,
        "layer": lambda h: torch.nn.functional.layer_norm(h, (HIDDEN,), norm_weight, norm_bias),
    }
    from ditron_inductor.lowering import graph_pass

    results = {}
    for kind, norm in norms.items():
        def tail(x, w_row, w_col):
            h = embedded + c10d.wait_tensor(c10d.all_reduce(
                torch.mm(x, w_row).view(1, ROWS, HIDDEN), "sum", group))
            inner = torch.mm(norm(h).view(ROWS, HIDDEN), w_col)  # rank-local columns, as q/k/v
            h = h + c10d.wait_tensor(c10d.all_reduce(
                torch.mm(inner, w_row).view(1, ROWS, HIDDEN), "sum", group))
            return torch.mm(norm(h)[:, -1:, :].reshape(1, HIDDEN), w_out)

        torch._dynamo.reset()
        got = torch.compile(tail, backend="ditron", dynamic=False,
                            options={"ditron.sequence_shard": True})(x, w_row, w_col)
        results[kind] = {"got": got.numpy().copy(),
                         "expected": tail(x, w_row, w_col).numpy().copy(),
                         "ops": sorted(c.op for c in graph_pass.reports[-1].candidates)}
    return results


_ranks_w4 = launched_once(f"{__name__}:layer_tail_ranks", 4, timeout_s=300,
                          env={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_four_ranks_match_the_all_reduced_tail(norm):
    results = [ranks[norm] for ranks in _ranks_w4()]
    for res in results:
        # the two all-reduces reduce-scattered, the first norm's rows gathered into the matmul
        assert res["ops"] == ["all_gather_matmul", "matmul_reduce_scatter",
                              "matmul_reduce_scatter"], res["ops"]
        np.testing.assert_allclose(res["got"], res["expected"], rtol=1e-4, atol=1e-4)
    # the all-reduced value is the same on every rank, whatever its shard
    for res in results[1:]:
        np.testing.assert_allclose(res["got"], results[0]["got"], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- Llama on 2 ranks over gloo


def sharded_inference_ranks(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from ditron_inductor.log_names import LOGGER_NAME
    from ditron_inductor.lowering import graph_pass
    from tests.llama_tp import TENSOR_PARALLEL, build_llama, llama_config, parallelize, tokens

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    mesh = init_device_mesh("cpu", (world_size,))
    config = llama_config()
    results = {}
    cases = {"b2": (2, {}), "b1_last_token": (1, {"logits_to_keep": 1}),
             "b2_last_token": (2, {"logits_to_keep": 1}),
             "hidden_states_out": (1, {"output_hidden_states": True})}
    for case, (batch, kwargs) in cases.items():
        torch._dynamo.reset()
        model = parallelize(build_llama(config), TENSOR_PARALLEL, mesh).eval()
        ids = tokens(batch, 16, config.vocab_size, seed=0)
        run = torch.compile(model, backend="ditron", dynamic=False,
                            options={"ditron.sequence_shard": True, "ditron.log_all_ranks": True})
        start, first_line = len(graph_pass.reports), len(lines)
        with torch.no_grad():
            expected = model(input_ids=ids, **kwargs).logits
            got = run(input_ids=ids, **kwargs).logits
        results[case] = {
            "expected": expected.numpy().copy(), "got": got.numpy().copy(),
            "ops": sorted(c.op for r in list(graph_pass.reports)[start:] for c in r.candidates),
            "sharding": [line.split("sequence sharding: ", 1)[1] for line in lines[first_line:]
                         if "sequence sharding: " in line]}
    return results


_ranks = launched_once(f"{__name__}:sharded_inference_ranks", 2, timeout_s=600,
                       env={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})
RS, AG, AR_NORM = "matmul_reduce_scatter", "all_gather_matmul", "matmul_all_reduce_rmsnorm"


@pytest.mark.slow
@pytest.mark.parametrize("case, rows, ops, moved", [
    # 2 layers: o_proj and down_proj reduce-scattered; the gathers feed gate/up (both layers),
    # q/k/v (layer 1: layer 0's reads the embedding every rank holds) and lm_head
    ("b2", 32, [AG] * 4 + [RS] * 4, "4 value(s) gathered, 0 row slice(s) all-reduced"),
    # the last tokens' rows summed from the ranks that hold them: no lm_head gather (at B 2 the
    # two rows live on the two ranks)
    ("b1_last_token", 16, [AG] * 3 + [RS] * 4, "3 value(s) gathered, 1 row slice(s) all-reduced"),
    ("b2_last_token", 32, [AG] * 3 + [RS] * 4, "3 value(s) gathered, 1 row slice(s) all-reduced"),
])
def test_llama_plain_tp_sharded_matches_eager(case, rows, ops, moved):
    for result in _ranks():
        res = result[case]
        assert res["ops"] == ops, res["ops"]
        assert res["sharding"] == [
            f"4 all-reduce(s) of {rows} rows on 2 ranks -> reduce-scatters, the residual stream "
            f"on 1/2 of the rows, {moved}"]
        np.testing.assert_allclose(res["got"], res["expected"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_llama_hidden_states_out_keeps_the_all_reduces():
    for result in _ranks():
        res = result["hidden_states_out"]
        assert res["ops"] == [AR_NORM] * 4, res
        (line,) = res["sharding"]
        assert line.startswith("4 all-reduce(s) of 16 rows on 2 ranks kept: 5 values would be "
                               "gathered for 4 all-reduce(s)"), line
        np.testing.assert_allclose(res["got"], res["expected"], rtol=1e-4, atol=1e-5)
