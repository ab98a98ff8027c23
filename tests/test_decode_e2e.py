"""Real decoding through `backend="ditron"`: Hugging Face Llama's `generate()` with a static KV
cache under tensor parallelism, on 2 CPU ranks over gloo, tiny config.

One launch runs `benchmarks/e2e_decode.py`'s ranks on its CPU smoke shape (B 2, prompt 8, 6 new
tokens) with eager and ditron, each with the DTensor parameters of the plain TP plan and with
local ones (`llama_tp.apply_locally`): greedy `generate()` (transformers compiles the decode
step with the backend), the bare decode step, and cProfile's host split. The tests check the
tokens against eager's, the sites the pass fused in the decode graph, that no decode step
compiles again, and the benchmark's report. On CPU the ditron ops run their reference path,
which still tests the rewrite: a wrong rewrite changes the tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import launched_once

pytest.importorskip("transformers")

THIS = "tests.test_decode_e2e"
RANK_ENV = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
ARGV = ["--device", "cpu", "--tiny", "--contenders", "eager,ditron", "--params", "dtensor,local",
        "--profile-host", "2"]
BATCH, NEW_TOKENS = 2, 6  # --tiny's
COMPILED = [("ditron", "dtensor"), ("ditron", "local")]
# o_proj's and down_proj's all-reduce in each of the 2 layers, with the residual add and the
# RMSNorm that follows, and lm_head's gathered logits: the decode step's graph is the prefill's
# at S 1
DECODE_SITES = ["matmul_all_reduce_rmsnorm"] * 4 + ["matmul_all_gather"]


def decode_ranks(rank: int, world_size: int) -> dict:
    from benchmarks import e2e_decode

    return e2e_decode.run(rank, world_size, ARGV)


_results = launched_once(f"{THIS}:decode_ranks", 2, timeout_s=600, env=RANK_ENV)


def _rows(result: dict) -> dict:
    return {(r["contender"], r["params"]): r for r in result["rows"]}


@pytest.mark.slow
def test_generate_tokens_match_eager():
    for rank, result in enumerate(_results()):
        rows = _rows(result)
        assert all(r["failed"] is None for r in rows.values()), rows
        eager = rows["eager", "dtensor"]["tokens"]
        assert len(eager) == BATCH and all(len(t) == NEW_TOKENS for t in eager), eager
        for key in COMPILED + [("eager", "local")]:
            assert rows[key]["tokens"] == eager, f"rank {rank}, {key}"
            assert rows[key]["reference"] == "eager/dtensor"
            assert rows[key]["first_difference"] is None
        # the timed calls (CUDA graph replays on GPUs) make the first call's tokens
        assert all(r["calls_unlike_first"] == 0 for r in rows.values()), rows
        # each step's greedy margin, kept by the first call: [B][N] in [0, 2]
        for r in rows.values():
            assert [len(m) for m in r["margins"]] == [NEW_TOKENS] * BATCH, r["margins"]
            assert all(0 <= x <= 2 for m in r["margins"] for x in m), r["margins"]


def test_a_difference_says_whether_it_is_a_near_tie():
    from benchmarks.e2e_decode import NEAR_TIE, first_difference

    reference = {"tokens": [[5, 6, 7], [1, 2, 3]], "margins": [[0.5, 0.5, 0.5], [0.5, 0.3, 0.5]]}
    same = {"tokens": [[5, 6, 7], [1, 2, 3]], "margins": [[0.5] * 3, [0.5] * 3]}
    assert first_difference(same, reference) is None
    tie = {"tokens": [[5, 6, 7], [1, 9, 3]], "margins": [[0.5] * 3, [0.5, NEAR_TIE / 2, 0.5]]}
    assert first_difference(tie, reference) == (
        "row 1, new token 1: 9 vs 2, a near tie (margins 1.0e-02 / 3.0e-01)")
    wrong = {"tokens": [[5, 6, 8], [1, 9, 3]], "margins": [[0.5] * 3, [0.5] * 3]}
    assert first_difference(wrong, reference) == (
        "row 0, new token 2: 8 vs 7, NOT a near tie (margins 5.0e-01 / 5.0e-01)")


@pytest.mark.slow
def test_decode_graph_fuses_the_all_reduce_sites():
    for result in _results():
        for key in COMPILED:
            (graph,) = _rows(result)[key]["ditron_graphs"]  # one graph: the decode step
            assert graph["graph"].endswith("forward"), graph
            assert graph["fused_ops"] == DECODE_SITES and graph["left_alone"] == 0, graph


@pytest.mark.slow
def test_decode_steps_do_not_recompile():
    # The cache position is a tensor of the static cache: the first generate() compiles one
    # graph for its decode steps, and no later step (generate() or the bare step on
    # generate()'s inputs) compiles another.
    for result in _results():
        rows = _rows(result)
        for key in COMPILED:
            assert (rows[key]["graphs_first_call"], rows[key]["graphs_later_calls"]) == (1, 0)
        for params in ("dtensor", "local"):
            assert rows["eager", params]["graphs_first_call"] == 0


def _graph_verdicts(marker: str) -> tuple[list[str], list[str]]:
    """Rank 0's ditron log, and its per-graph lines holding `marker`, without the graph name."""
    log = _results()[0]["ditron_log"]
    return log, [line.split(": ", 1)[1] for line in log if marker in line]


@pytest.mark.slow
def test_decode_masks_read_the_attention_mask():
    # generate() hands each step a [B, 1, 1, P + N] mask of the cache's filled positions, built
    # outside the graph: the causal-mask rewrite keeps it (it reads a graph input).
    log, verdicts = _graph_verdicts("attention call(s) with a mask")
    assert verdicts == ["2 attention call(s) with a mask: 0 causal -> is_causal=True, 0 masking "
                        "nothing -> no mask, 2 kept"] * len(COMPILED), log
    assert any("mask [2x1x1x14] kept: it depends on the graph input(s) l_kwargs_attention_mask_"
               in line for line in log), log


@pytest.mark.slow
def test_decode_attention_reads_each_kv_head_once():
    # 2 query heads per key/value head on each rank (--tiny: 4/2 heads, TP 2): each layer's SDPA
    # takes them as packed rows of one head (lowering/gqa_packing.py), and the tokens above
    # stay eager's
    log, verdicts = _graph_verdicts("on repeated keys/values")
    assert verdicts == ["2 attention call(s) on repeated keys/values: 2 packed (query heads as "
                        "rows), 0 kept"] * len(COMPILED), log


@pytest.mark.slow
def test_benchmark_report(tmp_path, capsys):
    from benchmarks import e2e_decode

    out = tmp_path / "decode.json"
    e2e_decode.report(_results()[0], ARGV + ["--json", str(out)])
    text = capsys.readouterr().out
    table = text[text.index("## Llama decode"):].splitlines()
    assert table[2].startswith("| B | prompt | new | params | contender | decode tokens/s |")
    rows = {tuple(line.split(" | ")[3:5]): line for line in table[4:]}
    assert set(rows) == {(p, c) for p in ("dtensor", "local") for c in ("eager", "ditron")}
    assert rows["dtensor", "eager"].endswith("| reference | 0 / 0 | - |")
    assert rows["local", "ditron"].endswith("| = eager/dtensor | 1 / 0 | forward 5 |")
    assert ("| outside AOTAutograd (Module call, Dynamo's guards) | AOTAutograd wrappers | "
            "Inductor's call |") in text
    assert "cProfile of 2 bare steps" in text and "cProfile of one generate() call" in text
    written = json.loads(out.read_text())
    assert written["world"] == 2 and len(written["rows"]) == 4
    assert all("tokens" not in r and r["tokens_per_s"] > 0 for r in written["rows"])
    for r in written["rows"]:
        split = r["host_profile"]["bare"]
        assert split["calls"] > 0 and split["ms"] > 0
        assert (split["aot_ms"] is None) == (r["contender"] == "eager")


def test_local_params_serve_the_tensor_parallel_plan_only():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from tests.llama_tp import SEQUENCE_PARALLEL, apply_locally, parallelize

    with pytest.raises(ValueError, match="local_params=True: the tensor_parallel plan only"):
        parallelize(None, SEQUENCE_PARALLEL, mesh=None, local_params=True)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    with pytest.raises(ValueError, match="local params: 0: RowwiseParallel .* not served"):
        apply_locally(layer, None, {"0": RowwiseParallel(output_layouts=Shard(1))})


def test_fusions_only_contender_is_ditron_with_its_other_rewrites_off():
    from benchmarks import e2e_decode

    config = e2e_decode.generation_config("ditron_fusions_only", 4, "cuda")
    compile_config = config.compile_config
    assert compile_config.backend == "ditron" and compile_config.mode is None
    assert compile_config.options == {"triton.cudagraphs": True, "ditron.causal_mask": False,
                                      "ditron.decode_gemm": False, "ditron.gqa_packing": False}
    groups = e2e_decode.generation_config("ditron_no_gemm_groups", 4, "cuda").compile_config
    assert groups.backend == "ditron" and groups.options == {
        "triton.cudagraphs": True, "ditron.decode_gemm_groups": False}
    plain = e2e_decode.generation_config("ditron", 4, "cuda").compile_config
    assert (plain.backend, plain.mode, plain.options) == ("ditron", "reduce-overhead", None)


def test_graph_contenders_compile_without_a_mode():
    """`+graph`: the step in StepGraph's CUDA graph, so no mode and no Inductor CUDA graphs
    (they would nest a graph in the capture); the contender's own options kept."""
    from benchmarks import e2e_decode

    for name, options in (("inductor+graph", None), ("ditron+graph", None),
                          ("ditron_fusions_only+graph", e2e_decode.e2e_llama.FUSIONS_ONLY)):
        compile_config = e2e_decode.generation_config(name, 4, "cuda").compile_config
        want_backend = "inductor" if name.startswith("inductor") else "ditron"
        assert (compile_config.backend, compile_config.mode, compile_config.options) == (
            want_backend, None, options), name
    with pytest.raises(ValueError, match="StepGraph is the step's CUDA graph"):
        e2e_decode.generation_config("ditron+graph", 4, "cuda", {"triton.cudagraphs": True})
    assert e2e_decode.parse_args(["--contenders", "inductor,ditron+graph"]).contenders
    with pytest.raises(SystemExit):  # eager has no compiled step to graph
        e2e_decode.parse_args(["--contenders", "eager+graph"])


def test_graph_contenders_decode_through_compile_decode():
    """`+graph`: generate() and the bare step take the step that `ditron_inductor.compile_decode`
    installs in the model's compiled-call hook, compiled with the contender's backend."""
    from benchmarks import e2e_decode
    from tests import llama_tp

    model = llama_tp.build_llama(llama_tp.llama_config(layers=1))
    ids = llama_tp.tokens(1, 4, model.config.vocab_size, seed=0)
    decoder = e2e_decode.Decoder(model, "inductor+graph", ids, 3, "cpu")
    step = model.get_compiled_call(decoder.config.compile_config)
    assert step is model.get_compiled_call(None)  # the hook's, whatever the config
    assert (model.generation_config.compile_config.backend,
            model.generation_config.compile_config.mode) == ("inductor", None)


def test_the_read_bound_counts_the_weights_but_the_embedding_and_the_kv_cache():
    from benchmarks import e2e_decode
    from tests import llama_tp

    config = llama_tp.llama_config()
    model = llama_tp.build_llama(config)
    table = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) \
        - table.numel() * table.element_size()
    head_dim = config.hidden_size // config.num_attention_heads
    # B 2, prompt 8, 4 new tokens: K and V of every layer up to position 8 + 4 / 2
    kv = 2 * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 10 * 4
    assert e2e_decode.bytes_per_step(model, 2, 8, 4) == weights + kv
    assert e2e_decode.read_bandwidth("cpu") is None  # no bound reported off CUDA
