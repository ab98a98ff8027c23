"""Hugging Face Llama through `backend="ditron"` on 2 CPU ranks over gloo, tiny config.

One launch compiles the model under the two TP plans of `llama_tp` (sequence-parallel training
at B 1 and B 2, plain TP inference) and returns, per compiled graph, every candidate site the
pass found (fused, or left alone and why), with the numbers against eager:
- training (sequence parallel, B 1): 20 AdamW steps on the same data with ditron and eager;
  ditron's loss curve, its first loss and gradients against eager's (ditron against Inductor
  alone: test_fp8.py's and test_bench_e2e_moe.py's steps);
- sequence parallel, B 2: one step, loss and gradients against eager;
- sequence parallel with vocabulary-sharded logits (`loss_parallel`, the loss outside the compiled
  model): ditron's 20 steps against eager's with gathered logits;
- inference (plain TP): logits against eager.
On CPU the ditron ops run their reference path, which still tests the rewrite: a wrong rewrite
changes the numbers.

The ranks return arrays as numpy (a tensor would travel as a shared-memory handle that dies with
its rank). The tests pin each graph's sites in order. Node names in the reasons lose their numeric suffix
(`add_21` -> `add`), so the pins do not depend on how many nodes came before.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

import numpy as np
import pytest
import torch

from tests import REPO_ROOT
from tests.distributed import launched_once

pytest.importorskip("transformers")

THIS = "tests.test_llama_e2e"
ROOT = str(REPO_ROOT)
E2E_SCRIPT = os.path.join(ROOT, "benchmarks", "e2e_llama.py")  # the end-to-end benchmark
RANK_ENV = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
WORLD = 2
SEQ = 16
STEPS = 20
GRADS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
         "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight")

AG, RS, AR = "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"
AGS, SRS = "all_gather_scaled_mm", "scaled_mm_reduce_scatter"

# ------------------------------------------------------------------------------------ rank side


def _sites(start: int) -> dict[str, list[tuple[str, bool, str]]]:
    """{forward/backward: [(op, fused, reason), ...]} of the graphs compiled since `start`."""
    from ditron_inductor.lowering import graph_pass

    sites: dict = {}
    for report in list(graph_pass.reports)[start:]:
        kind = report.graph.split()[-1]
        sites.setdefault(kind, []).extend(
            (c.task.split()[0], c.fused, re.sub(r"\b([a-z_]+?)_\d+\b", r"\1", c.reason))
            for c in report.candidates)
    return sites


def _tasks(start: int) -> list[str]:
    """The Task of every site of the graphs compiled since `start`, as the log prints it."""
    from ditron_inductor.lowering import graph_pass

    return [c.task for report in list(graph_pass.reports)[start:] for c in report.candidates]


def _train(model_fn, compile_with, batch: int, steps: int, vocab: int,
           loss_parallel: bool = False):
    """Losses of `steps` AdamW steps, the gradients of GRADS after the first, and the sites the
    ditron pass reported while compiling."""
    from ditron_inductor.lowering import graph_pass
    from tests.llama_tp import local, next_token_loss, tokens, train_loss

    model = model_fn()
    run = model if compile_with is None else torch.compile(model, backend=compile_with,
                                                            dynamic=False)
    loss_fn = None
    if loss_parallel:  # the loss compiled on its own, with the model's backend (as torchtitan)
        loss_fn = next_token_loss if compile_with is None else torch.compile(
            next_token_loss, backend=compile_with, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = len(graph_pass.reports)
    params = dict(model.named_parameters())
    losses, grads = [], {}
    for step in range(steps):
        loss = train_loss(run, tokens(batch, SEQ, vocab, seed=step), loss_fn)
        if step == 0:
            grads = {name: local(params[name].grad).detach().numpy().copy() for name in GRADS}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "sites": _sites(start), "tasks": _tasks(start)}


def _infer(model_fn, compile_with, vocab: int):
    from ditron_inductor.lowering import graph_pass
    from tests.llama_tp import tokens

    model = model_fn().eval()
    run = model if compile_with is None else torch.compile(model, backend=compile_with,
                                                            dynamic=False)
    start = len(graph_pass.reports)
    with torch.no_grad():
        logits = run(input_ids=tokens(2, SEQ, vocab, seed=0)).logits
    return {"logits": logits.numpy().copy(), "sites": _sites(start)}


def llama_ranks(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.llama_tp import (
        SEQUENCE_PARALLEL,
        TENSOR_PARALLEL,
        build_llama,
        llama_config,
        loss_of,
        parallelize,
        tokens,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    config = llama_config()
    vocab = config.vocab_size

    def model(plan, loss_parallel=False):
        return lambda: parallelize(build_llama(config), plan, mesh, loss_parallel=loss_parallel)

    sp, tp = model(SEQUENCE_PARALLEL), model(TENSOR_PARALLEL)
    sp_lp = model(SEQUENCE_PARALLEL, loss_parallel=True)
    return {
        "unsharded_loss": loss_of(build_llama(config), tokens(1, SEQ, vocab, seed=0)).item(),
        "train": {backend or "eager": _train(sp, backend, 1, STEPS, vocab)
                  for backend in ("ditron", None)},
        "sp_b2": {backend or "eager": _train(sp, backend, 2, 1, vocab)
                  for backend in ("ditron", None)},
        "loss_parallel": {"ditron": _train(sp_lp, "ditron", 1, STEPS, vocab, loss_parallel=True)},
        "infer": {backend or "eager": _infer(tp, backend, vocab) for backend in ("ditron", None)},
    }


# ------------------------------------------------------------------------------------ test side


# the one launch the tests below share
_rank_results = launched_once(f"{THIS}:llama_ranks", WORLD, timeout_s=900, env=RANK_ENV)


FUSED = "reference plan (decomposed collective + matmul)"  # on CPU every fused op runs it


# Per layer, forward: the attention input's gather feeds q/k/v (one op), o_proj's output is
# reduce-scattered, the MLP input's gather feeds gate/up, down_proj's output is reduce-scattered;
# then lm_head's input gather, and its output's gather (the logits replicated), which the input
# gather's op holds already. Backward, from the last layer: the gradient of lm_head's input is
# reduce-scattered (its matmul fused), each reduce-scattered output's gradient is gathered into
# the down/o input gradient matmul (fused; the weight gradient reads the gathered output), and
# the input gradients of gate/up and of q/k/v, sums of two and three matmul products, are
# reduce-scattered by one op each, which takes the products' operands as its terms.
LOSS_PARALLEL_SITES = {
    "forward": [(AG, True, FUSED), (RS, True, FUSED), (AG, True, FUSED), (RS, True, FUSED)] * 2
    + [(AG, True, FUSED)],
    "backward": [(RS, True, FUSED)]
    + [(AG, True, FUSED), (RS, True, FUSED), (AG, True, FUSED), (RS, True, FUSED)] * 2,
}
SEQUENCE_PARALLEL_SITES = {
    **LOSS_PARALLEL_SITES, "forward": LOSS_PARALLEL_SITES["forward"] + [
        ("matmul_all_gather", False, "mm already belongs to an earlier ditron op")]}
SUMS_PER_LAYER = ["2 matmul products summed", "3 matmul products summed"]
# Inference: o_proj's and down_proj's all-reduce, each with the residual add and the RMSNorm
# that follows (the next norm of the layer, or the model's final norm); lm_head's gathered logits.
TENSOR_PARALLEL_SITES = {"forward": [(AR + "_rmsnorm", True, FUSED)] * 4
                         + [("matmul_all_gather", True, FUSED)]}


@pytest.mark.slow
@pytest.mark.parametrize("workload, expected", [
    ("train", SEQUENCE_PARALLEL_SITES),
    ("sp_b2", SEQUENCE_PARALLEL_SITES),
    # no logits' gather
    ("loss_parallel", LOSS_PARALLEL_SITES),
    ("infer", TENSOR_PARALLEL_SITES),
])
def test_every_site_fused_or_left_alone_with_its_reason(workload, expected):
    for rank, res in enumerate(_rank_results()):
        got = res[workload]["ditron"]["sites"]
        assert got == expected, f"rank {rank}, {workload}: sites\n{got}\nexpected\n{expected}"


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["train", "sp_b2"])
def test_sequence_parallel_sites_take_the_layout_of_the_fused_kernels(workload):
    # B 1: each rank's rows are one block of [S, H]. B 2: they interleave in [B*S, H], so every
    # gather and scatter runs on rank-major rows that the graph permutes (lowering/reorder.py);
    # on GPUs the fused kernels serve both.
    reordered = "rank-major rows reordered in the graph"
    for res in _rank_results():
        tasks = res[workload]["ditron"]["tasks"]
        # the logits' gather (on the vocabulary dim, no rows to reorder) is held by lm_head's AG
        gathered = [t for t in tasks if t.startswith("matmul_all_gather")]
        assert len(gathered) == 1 and gathered[0].endswith(" dim=2"), tasks
        tasks = [t for t in tasks if not t.startswith("matmul_all_gather")]
        assert len(tasks) == 18, tasks
        assert all((reordered in t) == (workload == "sp_b2") for t in tasks), tasks
        sums = [s for t in tasks for s in SUMS_PER_LAYER if s in t]
        assert sums == SUMS_PER_LAYER * 2, tasks


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["train", "sp_b2"])
def test_first_step_loss_and_gradients_match_eager(workload):
    for res in _rank_results():
        ditron, eager = res[workload]["ditron"], res[workload]["eager"]
        assert ditron["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-5)
        for name in GRADS:
            np.testing.assert_allclose(ditron["grads"][name], eager["grads"][name],
                                       rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_tensor_parallel_matches_the_unsharded_model():
    # The plans themselves: TP on 2 ranks computes the loss of the model on one process.
    for res in _rank_results():
        assert res["train"]["eager"]["losses"][0] == pytest.approx(res["unsharded_loss"], rel=1e-5)


@pytest.mark.slow
def test_training_loss_curve_matches_eager():
    for res in _rank_results():
        ditron, eager = res["train"]["ditron"]["losses"], res["train"]["eager"]["losses"]
        assert len(ditron) == STEPS
        np.testing.assert_allclose(ditron, eager, rtol=1e-5)
        assert len(set(ditron)) > 1, "the loss never changed: the optimizer did not step"


@pytest.mark.slow
def test_loss_parallel_training_matches_gathered_logits():
    # The same training with the loss over vocabulary shards (DTensor's loss_parallel) instead
    # of over gathered logits: the same losses, step by step, and the same first gradients.
    for res in _rank_results():
        sharded, gathered = res["loss_parallel"]["ditron"], res["train"]["eager"]
        np.testing.assert_allclose(sharded["losses"], gathered["losses"], rtol=1e-5)
        for name in GRADS:
            np.testing.assert_allclose(sharded["grads"][name], gathered["grads"][name],
                                       rtol=1e-4, atol=1e-6, err_msg=name)


def test_loss_parallel_needs_the_sequence_parallel_plan():
    from tests.llama_tp import TENSOR_PARALLEL, parallelize

    with pytest.raises(ValueError, match="loss_parallel=True: the sequence_parallel plan only"):
        parallelize(torch.nn.Linear(2, 2), TENSOR_PARALLEL, mesh=None, loss_parallel=True)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
@pytest.mark.parametrize("world, bf16", [
    (2, set()),
    # k/v's shards of 8 rows: torch._scaled_mm takes no dim that is not a multiple of 16, so
    # they stay bf16, and so does the attention input they read (gathered before any cast)
    (4, {"self_attn", "self_attn.k_proj", "self_attn.v_proj"}),
])
def test_fp8_plan_takes_float8_styles_where_the_shards_allow(world, bf16):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from tests.llama_tp import (
        SEQUENCE_PARALLEL,
        build_llama,
        float8_layer_plan,
        layer_plan,
        llama_config,
    )

    model = build_llama(llama_config())  # q 64 rows, k and v 32, 2 layers
    plain = layer_plan(SEQUENCE_PARALLEL, ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    plan = float8_layer_plan(model, SEQUENCE_PARALLEL, plain, world, "tensorwise")
    float8 = {name for name, style in plan.items() if isinstance(
        style, (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput))}
    assert float8 == set(plain) - bf16 - {"input_layernorm", "post_attention_layernorm"}
    assert all(isinstance(plan[n], SequenceParallel)
               for n in ("input_layernorm", "post_attention_layernorm"))
    for block in model.model.layers:
        assert {n for n in plain if isinstance(block.get_submodule(n), Float8Linear)} == \
            float8 - {"self_attn", "mlp"}
    assert not isinstance(model.lm_head, Float8Linear)
    with pytest.raises(ValueError, match="fp8='rowwise': expected one of tensorwise"):
        float8_layer_plan(model, SEQUENCE_PARALLEL, plain, world, "rowwise")


def test_benchmark_fp8_is_training_only(capsys):
    e2e = _benchmark()
    assert e2e.parse_args(["--fp8", "tensorwise"]).workloads == "train"
    assert e2e.parse_args([]).workloads == "train,prefill,decode"
    with pytest.raises(SystemExit):
        e2e.parse_args(["--fp8", "tensorwise", "--workloads", "train,decode"])
    assert "--fp8: the train workload only, not --workloads train,decode" in \
        capsys.readouterr().err


@pytest.mark.parametrize("diff, async_tp, verdict", [
    (1e-3, 0.2, None),  # within float8's tolerance: nothing said
    (0.2, 0.2, "within"),  # as far as async TP lies from Inductor (2x H200, fp8 training)
    (0.2, 0.01, "BEYOND"),  # async TP agrees with Inductor, ditron does not
    (0.1, None, "BEYOND")])  # no other contender to compare with
def test_benchmark_fp8_report_flags_numbers_beyond_float8s_tolerance(capsys, diff, async_tp,
                                                                     verdict):
    e2e = _benchmark()
    others = {} if async_tp is None else {"inductor_async_tp": async_tp}
    row = {"workload": "train", "shape": "B 1, S 16", "mode": e2e.EAGER_LAUNCH, "failed": {},
           "ms": {"inductor": 2.0, "ditron": 1.0}, "ditron_graphs": [],
           "ditron_max_diff": {"loss": 0.0, "model.norm.weight": diff},
           "diff_baseline": "inductor", "others_max_diff": others}
    e2e.report({"rows": [row], "ditron_log": [], "world": 2,
                "contenders": ["inductor", "ditron"]}, ["--device", "cpu", "--fp8", "tensorwise"])
    out = capsys.readouterr().out
    assert "fp32, decoder linear layers fp8 tensorwise (torchao)" in out
    flagged = f"ditron's numbers differ from inductor's by {diff:.1e} of the largest magnitude"
    assert (flagged in out) == (verdict is not None), out
    if verdict:
        assert f"(more than 0.02), {verdict} the other contenders' own difference" in out, out
        assert ("inductor_async_tp 2.0e-01" in out) == (async_tp == 0.2), out


@pytest.mark.slow
def test_inference_logits_match_eager():
    for res in _rank_results():
        np.testing.assert_allclose(res["infer"]["ditron"]["logits"],
                                   res["infer"]["eager"]["logits"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_benchmark_smoke_run(tmp_path):
    # benchmarks/e2e_llama.py in its CPU mode, kept short: one decode shape, eager against ditron
    # (which brings ditron fusions-only along), so that the script cannot rot; its training
    # workload runs in test_benchmark_fp8_training.
    import json
    import subprocess
    import sys

    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, E2E_SCRIPT, "--device", "cpu",
         "--tiny", "--workloads", "decode", "--decode-batches", "2",
         "--contenders", "eager,ditron", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| decode (TP) | B 2, S 1 |" in proc.stdout, proc.stdout
    assert "| eager ms | ditron ms | ditron fusions only (mask, decode-GEMM and GQA rewrites off) ms |" in proc.stdout
    assert "-> ditron.matmul_all_reduce_rmsnorm" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["shape"]) for r in rows] == [("decode (TP)", "B 2, S 1")]
    for r in rows:
        assert r["failed"] == {} and set(r["ms"]) == {"eager", "ditron", "ditron_keep_mask"}, r
        assert all(v > 0 for v in r["ms"].values())
        assert sum(g["ditron_ops"] for g in r["ditron_graphs"]) > 0, r
        assert r["diff_baseline"] == "eager" and max(r["ditron_max_diff"].values()) < 1e-4, r


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_benchmark_fp8_training(tmp_path):
    # --fp8 tensorwise, one layer: the decoder's linear layers in torchao float8 under its float8
    # TP styles; ditron's step against eager float8's (gloo gathers the float8 bytes for eager)
    import json
    import subprocess
    import sys

    out = tmp_path / "fp8.json"
    proc = subprocess.run(
        [sys.executable, E2E_SCRIPT, "--device", "cpu", "--tiny", "--layers", "1", "--fp8",
         "tensorwise", "--contenders", "eager,ditron", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 layers, fp32, decoder linear layers fp8 tensorwise (torchao)" in proc.stdout
    (r,) = json.loads(out.read_text())["rows"]
    assert r["workload"] == "train (sequence parallel, loss parallel, fp8 tensorwise)", r
    assert r["failed"] == {} and r["nonfinite"] == [], r
    fused = {}
    for g in r["ditron_graphs"]:  # ditron's model and loss graphs, forward and backward
        fused.setdefault(g["graph"].split()[-1], []).extend(g["fused_ops"])
    # forward: q/k/v and gate/up from one float8 gather each, o and down reduce-scattered;
    # lm_head stays bf16. Backward: lm_head's input gradient, the float8 gathers of o's and
    # down's output gradients, each followed by the reduce-scatter of the input gradient of
    # q/k/v (resp. gate/up): a sum of _scaled_mm products, each with its scales, as terms
    assert fused == {"forward": [AGS, SRS, AGS, SRS, AG],
                     "backward": [RS, AGS, SRS, AGS, SRS]}, fused
    assert sum(g["left_alone"] for g in r["ditron_graphs"]) == 0, r["ditron_graphs"]
    assert r["diff_baseline"] == "eager" and set(r["ditron_max_diff"]) >= {"loss"}, r
    assert max(r["ditron_max_diff"].values()) < _benchmark().FP8_MAX_DIFF, r["ditron_max_diff"]
    assert "differ from eager's by more than" not in proc.stdout


@pytest.mark.slow
def test_benchmark_no_comm_bound(tmp_path, capsys):
    # --no-comm: one process, a fake group of 2 ranks: the TP 2 step without communication, for
    # eager, Inductor and ditron without its collective patterns (its attention-mask rewrite);
    # PyTorch's async TP is dropped: its fused ops need real peers.
    import json
    import subprocess
    import sys

    out = tmp_path / "bound.json"
    proc = subprocess.run(
        [sys.executable, E2E_SCRIPT, "--device", "cpu", "--tiny", "--no-comm", "--world", "2",
         "--workloads", "decode", "--decode-batches", "2", "--profile-host", "2", "--json",
         str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world 2 without communication" in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert result["no_comm"] and result["world"] == 2
    assert result["contenders"] == ["eager", "inductor", "ditron"]
    (r,) = result["rows"]
    assert r["failed"] == {} and set(r["ms"]) == set(r["host_ms"]) == {"eager", "inductor",
                                                                       "ditron"}
    assert sum(g["ditron_ops"] for g in r["ditron_graphs"]) == 0 and r["spread"] >= 0
    assert r["ditron_max_diff"] == {}  # the collectives are this rank's own: nothing to compare
    assert r["nonfinite"] == [], r
    assert "not fused: pattern matmul_all_reduce is disabled" in proc.stdout, proc.stdout
    # a decode-shaped step's mask (one query, one key) masks nothing
    assert ": 2 attention call(s) with a mask: 0 causal -> is_causal=True, 2 masking nothing -> " \
        "no mask, 0 kept" in proc.stdout, proc.stdout
    assert "decode (TP) B 2, S 1 eager launch: inductor, cProfile of 2 calls" in proc.stdout
    assert "function calls" in r["host_profile"]["inductor"]
    with pytest.raises(SystemExit) as bad:
        _benchmark().parse_args(["--device", "cpu", "--no-comm", "--contenders",
                                 "inductor_async_tp"])
    assert bad.value.code == 2
    assert ("--no-comm: --contenders must include one of eager, inductor, ditron, "
            "ditron_keep_mask") in capsys.readouterr().err


@functools.cache
def _benchmark():
    """benchmarks/e2e_llama.py as a module, for its pure functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_llama", E2E_SCRIPT)
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    return e2e


def test_benchmark_bound_columns(tmp_path):
    # --bound-json: the no-comm run's Inductor time beside each row, and the ceiling it sets
    import json

    e2e = _benchmark()
    key = ("prefill (TP)", "B 1, S 4096", e2e.EAGER_LAUNCH)
    bound = tmp_path / "bound.json"
    bound.write_text(json.dumps({"no_comm": True, "world": 2, "rows": [
        {"workload": key[0], "shape": key[1], "mode": key[2],
         "ms": {"eager": 5.0, "inductor": 6.0, "ditron": 6.5}}]}))
    assert e2e.no_comm_bounds(str(bound), 2) == {key: (6.0, "inductor")}  # compiled, fastest
    with pytest.raises(SystemExit, match="not the JSON of a --no-comm run at world 4"):
        e2e.no_comm_bounds(str(bound), 4)
    row = {"workload": key[0], "shape": key[1], "mode": key[2], "no_comm_ms": 6.0,
           "no_comm_by": "inductor",
           "ms": {"inductor": 7.5, "ditron": 7.0}, "spread": 0.04,
           "host_ms": {"inductor": 7.4, "ditron": 1.2}, "failed": {}, "ditron_graphs": [],
           "ditron_max_diff": {}}
    lines = e2e.table([row], ["inductor", "ditron"]).splitlines()
    assert "| no-comm bound ms | ceiling (Inductor / bound) |" in lines[0]
    assert lines[2].startswith("| prefill (TP) | B 1, S 4096 | eager launch | 7.500 | 7.000 | "
                               "6.000 (inductor) | 1.25x | 4% | 7.400 / 1.200 | 1.07x |"), lines[2]
    unbounded = {k: v for k, v in row.items() if not k.startswith("no_comm")}
    assert "no-comm" not in e2e.table([unbounded], ["inductor", "ditron"])


def test_benchmark_flags_non_finite_numbers():
    # a contender whose step ran over NaN is flagged, whatever the mode
    e2e = _benchmark()
    checks = {"inductor": {"loss": torch.tensor(float("nan")), "g": torch.ones(2)},
              "ditron": {"loss": torch.tensor(1.0), "g": torch.tensor([1.0, float("inf")])},
              "eager": {"loss": torch.tensor(1.0), "g": torch.ones(2)}}
    timing = {"ms": {}, "host_ms": {}, "spread": 0.0}
    for no_comm in (True, False):
        r = e2e.row("train", "B 1, S 16", e2e.EAGER_LAUNCH, timing, checks, [], {}, no_comm)
        assert r["nonfinite"] == ["ditron", "inductor"], r


def test_benchmark_flags_finite_but_wrong_numbers():
    # a contender far from the baseline (the SM-pull all-gathers' weights: 3.5e+02 away) is
    # flagged; rounding apart (2e-2) is not; without communication nothing is compared
    e2e = _benchmark()
    base = {"loss": torch.tensor(2.0), "w": torch.tensor([1.0, -2.0])}
    checks = {"inductor": base,
              "ditron": {"loss": torch.tensor(2.0), "w": torch.tensor([1.0, -1.96])},
              "ditron_keep_mask": {"loss": torch.tensor(2.0), "w": torch.tensor([700.0, -2.0])}}
    timing = {"ms": {}, "host_ms": {}, "spread": 0.0}
    r = e2e.row("train", "B 1, S 16", e2e.EAGER_LAUNCH, timing, checks, [], {}, False)
    assert r["wrong"] == ["ditron_keep_mask"] and r["nonfinite"] == [], r
    checks["ditron"] = checks.pop("ditron_keep_mask")
    assert e2e.row("train", "B 1, S 16", e2e.EAGER_LAUNCH, timing, checks, [], {},
                   False)["wrong"] == ["ditron"]
    assert e2e.row("train", "B 1, S 16", e2e.EAGER_LAUNCH, timing, checks, [], {},
                   True)["wrong"] == []


def test_benchmark_names_the_contender_of_a_large_spread():
    e2e = _benchmark()
    row = {"spread": 2.85, "spreads": {"inductor": 0.02, "ditron": 2.85}}
    assert e2e.spread_text(row) == "285% (ditron)"
    assert e2e.spread_text({"spread": 0.04, "spreads": {"inductor": 0.04}}) == "4%"
    assert e2e.spread_text({"spread": 0.3}) == "30%"  # a row from before the per-contender spreads
    assert e2e.spread_text({}) == "-"


def test_benchmark_no_comm_collectives_write_their_outputs():
    # --no-comm's fake group leaves collective outputs unwritten; local_collectives writes them
    # from the local input (run apart: the kernels it registers stay for the process)
    import subprocess
    import sys

    code = f"""
import importlib.util, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore
spec = importlib.util.spec_from_file_location("e2e", {E2E_SCRIPT!r})
e2e = importlib.util.module_from_spec(spec)
spec.loader.exec_module(e2e)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
e2e.local_collectives()
g, x = dist.group.WORLD, torch.arange(1.0, 9.0).reshape(4, 2)
assert torch.equal(funcol.all_gather_tensor(x, 0, g).wait(), torch.cat([x, x]))
assert torch.equal(funcol.reduce_scatter_tensor(x, "sum", 0, g).wait(), x[:2])
assert torch.equal(funcol.all_reduce(x, "sum", g).wait(), x)
out = torch.zeros(8, 2)
torch.ops._c10d_functional.all_gather_into_tensor_out(x, 2, g.group_name, out=out)
assert torch.equal(out, torch.cat([x, x]))
def step(x):
    return (funcol.all_gather_tensor(x, 0, g) * 2).sum() + funcol.all_reduce(x, "sum", g).sum()
assert torch.compile(step, backend="inductor")(x).item() == 4 * 36 + 36
print("written")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "written" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("name, kind", [
    ("ag_gemm_kernel", "ditron"), ("lamport_all_kernel", "ditron"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>(Flash_fwd_params)",
     "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)",
     "attention"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>>",
     "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "other"),
])
def test_benchmark_kernel_kinds(name, kind):
    # --profile-device sorts each kernel by its name; ditron's come from its Triton functions
    assert _benchmark().kernel_kind(name) == kind


def test_benchmark_kernel_times_skip_annotations():
    # the profiler's events: two kernels (one on each of two streams, overlapping), a host op and
    # the optimizer's record_function range, which the device's timeline shows too
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               device_time_total=end - start,
                               time_range=SimpleNamespace(start=start, end=end))
    events = [event("nvjet_tst_128x256", 0, 3000), event("ncclDevKernel_AllGather", 1000, 5000),
              event("aten::mm", 0, 100, device=DeviceType.CPU),
              event("Optimizer.step#AdamW.step", 0, 9000, annotation=True)]
    times = _benchmark().kernel_times(events, calls=2)
    assert (times["gemm"], times["nccl"], times["other"], times["busy"]) == (1.5, 2.0, 0.0, 2.5)
    # the GEMM alone before the all-gather starts, the all-gather alone after the GEMM ends
    assert (times["alone"]["gemm"], times["alone"]["nccl"]) == (0.5, 1.0)
    assert sum(times["alone"].values()) == 1.5
    assert times["top"] == [["ncclDevKernel_AllGather", "nccl", 2.0],
                            ["nvjet_tst_128x256", "gemm", 1.5]]
    assert (times["idle"], times["gaps"]) == (0.0, [])
    # an idle stretch after the all-gather, before a copy: by the kernels around it, per call
    events.append(event("Memcpy PtoP", 6000, 7000))
    times = _benchmark().kernel_times(events, calls=2)
    assert (times["idle"], times["gaps"]) == (0.5, [["ncclDevKernel_AllGather", "Memcpy PtoP",
                                                     0.5, 0.5]])


def test_benchmark_device_profile_table(capsys):
    e2e = _benchmark()
    assert e2e.busy([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17  # overlaps count once
    assert e2e.busy([]) == 0
    # a copy beside a GEMM (hidden), then alone (exposed); two NCCL kernels back to back and
    # overlapping each other (one kind: still alone); a GEMM starting as a copy ends
    only = e2e.alone([(0, 10, "gemm"), (5, 14, "copy"), (20, 25, "nccl"), (22, 30, "nccl"),
                      (30, 31, "copy"), (31, 33, "gemm")])
    assert (only["gemm"], only["copy"], only["nccl"], only["other"]) == (7, 5, 10, 0)
    assert e2e.alone([]) == dict.fromkeys(e2e.PROFILE_KINDS, 0.0)
    # idle between a GEMM and the copy after it, twice; none where a kernel covers the time;
    # the kernel that ended last borders the gap, not the one that started last
    gaps = e2e.idle_gaps([(0, 10, "gemm"), (2, 4, "short"), (12, 13, "copy"), (13, 20, "gemm"),
                          (25, 26, "copy"), (26, 30, "nccl")])
    assert gaps == {("gemm", "copy"): [7, 2]}
    assert e2e.idle_gaps([]) == {}
    kinds = {kind: 0.0 for kind in e2e.PROFILE_KINDS}
    row = {"workload": "prefill (TP)", "shape": "B 1, S 4096", "mode": e2e.EAGER_LAUNCH,
           "ms": {"inductor": 7.5},
           "device_profile": {"inductor": {**kinds, "busy": 7.25, "gemm": 5.5, "nccl": 1.0,
                                           "top": [["nvjet_tst_128x256", "gemm", 1.25]]}}}
    lines = e2e.device_table([row], 3).splitlines()
    assert lines[0].startswith("Device time per call by kernel kind (torch profiler, 3 calls")
    assert lines[2] == ("| workload | shape | mode | contender | step ms | busy ms | ditron ms | "
                        "nccl ms | attention ms | gemm ms | optimizer ms | copy ms | other ms |")
    assert lines[4] == ("| prefill (TP) | B 1, S 4096 | eager launch | inductor | 7.500 | 7.250 | "
                        "0.000 | 1.000 | 0.000 | 5.500 | 0.000 | 0.000 | 0.000 |")
    assert lines[5:] == ["", "prefill (TP) B 1, S 4096 eager launch, inductor: the longest kernels",
                         "     1.250 ms  gemm      nvjet_tst_128x256"]
    # with the idle stretches (older profiles have none: no such lines)
    row["device_profile"]["inductor"].update(idle=0.25, gaps=[["nvjet", "Memcpy", 0.2, 1.5]])
    assert e2e.device_table([row], 3).splitlines()[8:] == [
        "  idle 0.250 ms per call between its first kernel and its last, most between (count "
        "per call):", "     0.200 ms    1.5x  nvjet  ->  Memcpy"]
    # and every rank's idle with its widest gaps (profiles before session 53 have none)
    row["device_profile"]["inductor"]["ranks"] = [
        {"idle": 0.25, "gaps": [["nvjet", "Memcpy", 0.2, 1.5]]},
        {"idle": 0.5, "gaps": [["nvjet", "reduce_slots_kernel", 0.45, 8.0]]}]
    assert e2e.device_table([row], 3).splitlines()[10:] == [
        "  rank 0: idle 0.250 ms per call, most between:",
        "     0.200 ms    1.5x  nvjet  ->  Memcpy",
        "  rank 1: idle 0.500 ms per call, most between:",
        "     0.450 ms    8.0x  nvjet  ->  reduce_slots_kernel"]
    # since session 54 each rank also carries its span, busy time and kinds: which rank runs longer
    row["device_profile"]["inductor"]["ranks"][1].update(kinds, span=7.75, busy=7.25, gemm=5.75)
    assert e2e.device_table([row], 3).splitlines()[12] == (
        "  rank 1: idle 0.500 ms per call (span 7.750, busy 7.250; ditron 0.000, nccl 0.000, "
        "attention 0.000, gemm 5.750, optimizer 0.000, copy 0.000, other 0.000), most between:")
    del row["device_profile"]["inductor"]["ranks"]
    del row["device_profile"]["inductor"]["idle"], row["device_profile"]["inductor"]["gaps"]
    # with the time each kind runs alone (older profiles have none: no such table)
    row["device_profile"]["inductor"]["alone"] = {**kinds, "gemm": 4.5, "nccl": 0.75}
    lines = e2e.device_table([row], 3).splitlines()
    assert lines[6].startswith("Device time per call in which only that kind runs")
    assert lines[8].startswith("| workload | shape | mode | contender | ditron alone ms | "
                               "nccl alone")
    assert lines[10] == ("| prefill (TP) | B 1, S 4096 | eager launch | inductor | 0.000 | 0.750 | "
                         "0.000 | 4.500 | 0.000 | 0.000 | 0.000 |")
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device", "cpu", "--profile-device", "2"])
    assert "--profile-device: CUDA kernels only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--profile-trace", "traces"])
    assert "--profile-trace: the traces of --profile-device's calls" in capsys.readouterr().err
