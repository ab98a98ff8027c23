"""Every suite shape's plan, pinned at world sizes 2, 4 and 8, as the runtime runs it: the
scheduler's choice with every default resolved, unprompted and with the fused plan forced; and
the decision at each site of the Llama-3-8B graphs at TP 2 and 4: from the plans measured there
(scheduler/measured_plans.json), and from the link model alone as the earlier runs took it."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import pytest
import torch

from ditron_inductor import config
from ditron_inductor.scheduler.cost_model import candidate_plan
from ditron_inductor.scheduler.decide import decide, with_options
from ditron_inductor.scheduler.task import (
    ALL_GATHER_MATMUL,
    MATMUL_ALL_REDUCE,
    MATMUL_ALL_REDUCE_RMSNORM,
    MATMUL_REDUCE_SCATTER,
    Task,
)
from tests import REPO_ROOT
from tests.fx_helpers import fake_group

WORLDS = (2, 4, 8)
AG_RS_SUITE = [(ALL_GATHER_MATMUL, 8192, 8192, 7168), (ALL_GATHER_MATMUL, 8192, 8192, 1280),
               (ALL_GATHER_MATMUL, 4096, 8192, 4096), (ALL_GATHER_MATMUL, 16384, 8192, 3584),
               (MATMUL_REDUCE_SCATTER, 8192, 3584, 8192), (MATMUL_REDUCE_SCATTER, 8192, 1024, 8192),
               (MATMUL_REDUCE_SCATTER, 16384, 3584, 8192)]
AR_MS = (1, 8, 16, 32, 128, 256, 512, 1024, 2048, 8192, 16384)
AR_KS = (3584, 1024)


def _task(op, world, m, k, n) -> Task:
    return Task(op=op, group_name="0", world_size=world, m=m, k=k, ns=(n,),
                dtype=torch.bfloat16, device_type="cuda", dim_size=m, has_bias=(False,),
                reduce_op=None if op == ALL_GATHER_MATMUL else "sum",
                has_residual=op == MATMUL_ALL_REDUCE_RMSNORM)


def resolved(task: Task, cuda_graphs: bool) -> str:
    """The decision as one line: the plan the runtime runs, every default resolved."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"triton.cudagraphs": cuda_graphs}):
        d = decide(task)
    if not d.fuse:
        return "nccl_cublas"
    plan = d.plan
    if plan.impl == "reference":
        return "reference"
    if task.op in (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER):
        # the label names the candidate; the plan is that candidate, every default resolved
        assert dataclasses.replace(plan, predicted_ms=()) == with_options(
            candidate_plan(task, plan.label)), plan
        return plan.label
    parts = [plan.algo]
    if plan.algo == "copy_engine":
        parts.append(f"chunks={plan.chunks}")
    if plan.overlap:
        parts += ["overlap", plan.gemm, f"chunks={plan.chunks}", f"progs={plan.progs}"]
    elif plan.progs:
        parts.append(f"progs={plan.progs}")
    parts += [f"{key}={getattr(plan, key)}" for key in ("block", "warps") if getattr(plan, key)]
    return " ".join(parts)


def choices(forced: str = "") -> dict:
    out = {}
    for world in WORLDS:
        with fake_group(world):
            saved, config.force_plan = config.force_plan, forced
            try:
                for op, m, k, n in AG_RS_SUITE:
                    out[f"{op} {m}x{k}x{n} w{world}"] = resolved(_task(op, world, m, k, n), False)
                for op in (MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM):
                    for k in AR_KS:
                        for m in AR_MS:
                            for graphs in (False, True):
                                mode = "graphs" if graphs else "eager"
                                key = f"{op} {m}x{k}x8192 w{world} {mode}"
                                out[key] = resolved(_task(op, world, m, k, 8192), graphs)
            finally:
                config.force_plan = saved
    return out


PINNED = pathlib.Path(__file__).with_name("plan_choices.json")

# The sites of the Llama-3-8B graphs at TP 2 (hidden 4096, intermediate 14336, heads 32/8, vocab
# 128256; training B 1 S 8192, prefill S 4096 and 8192), each as the ditron log of the 2x H200
# run described it (benchmarks/results/e2e_llama_h200x2_train_prefill.json), with the decision it
# took there: the fused and the refused sites of the real model, pinned without GPUs. The
# all-reduce sites are decided by the world-1 compute table (scheduler/measured.py) since, and
# take the same decisions.
AG, RS, ARN = ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE_RMSNORM
# The training sites' plans come from the device-time rows (session 45: the device spins while
# the host queues the timed calls); the rows timed with the host's queueing had left gate/up's
# gather and lm_head's input gradient to NCCL and fused lm_head's gather.
LLAMA_TP2_SITES = [
    # training, forward: q/k/v and gate/up gathers, o and down scatters, lm_head's gather. The
    # gathers: my shard's buffer copy and a barrier before the GEMM since session 52
    # (all_gather_h100x2_ready_before_gemm.md; before: tri_tma_128x256, cublas_1_1_2_4,
    # cublas_1_3_4_s2 and tri_tma_128x256); since the 2x H200 rows of session 53, gate/up's,
    # lm_head's and down's output gradient's with the barrier beside the GEMM of my rows
    # (fused_h200x2_llama8b_ag_barrier_8192.md: lm_head 5.909 ms against NCCL + cuBLAS's 6.054;
    # on 2x H100 lm_head's had been left, under the 2% margin)
    (dict(op=AG, m=8192, k=4096, ns=(2048, 512, 512)), False, "cublas_each_first_ready"),
    (dict(op=RS, m=8192, k=2048, ns=(4096,), dim=1), False, "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(7168, 7168)), False, "cublas_each_first_ready_beside"),
    (dict(op=RS, m=8192, k=7168, ns=(4096,), dim=1), False, "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(64128,)), False, "cublas_each_first_ready_beside"),
    # training, backward: lm_head's input gradient, the gradients of down's and o's outputs
    # gathered, gate/up's and q/k/v's input gradients as one scatter of a sum of products each
    # (the logs before session 54 name them "concatenated along K": _logged matches them). The
    # scatters from the 2x H200 rows of session 55 (fused_h200x2_llama8b_rs_terms_8192.md, the
    # sums timed by their terms): lm_head's input gradient with the Triton reduction (5.606 ms,
    # plain cuBLAS 5.706, NCCL + cuBLAS 5.832; before: cublas)
    (dict(op=RS, m=8192, k=64128, ns=(4096,), dim=1), False, "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(7168,)), False, "cublas_each_first_ready_beside"),
    (dict(op=RS, m=8192, k=14336, ns=(4096,), dim=1, terms=2), False,
     "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(2048,)), False, "cublas_each_first_ready"),
    (dict(op=RS, m=8192, k=3072, ns=(4096,), dim=1, terms=3), False,
     "cublas_triton_reduce"),
    # prefill: o's and down's all-reduce with the residual add and the next RMSNorm; launched
    # eagerly (as the H200 run did: left at S 4096, push beside the Triton GEMM at 8192) the
    # copy-engine plan since session 49 (2x H100: all_reduce_h100x2_copy_engine.md), under CUDA
    # graphs (push beside the Triton GEMM before) since session 50, with twice the chunks
    # (all_reduce_h100x2_copy_engine_graphs.md)
    (dict(op=ARN, m=4096, k=2048, ns=(4096,)), False, "copy_engine chunks=2"),
    (dict(op=ARN, m=4096, k=7168, ns=(4096,)), False, "copy_engine chunks=2"),
    (dict(op=ARN, m=4096, k=2048, ns=(4096,)), True, "copy_engine chunks=4"),
    (dict(op=ARN, m=4096, k=7168, ns=(4096,)), True, "copy_engine chunks=4"),
    (dict(op=ARN, m=8192, k=2048, ns=(4096,)), False, "copy_engine chunks=4"),
    (dict(op=ARN, m=8192, k=7168, ns=(4096,)), False, "copy_engine chunks=4"),
]
# The training sites' plans as the 2x H200 run took them, from the link model (fitted at 4 and 8
# ranks) before the plans measured at these shapes on 2 ranks (fused_h200x2_llama8b_sites.md)
# took over: what ditron.measured_plans=False still gives.
LLAMA_TP2_TRAIN_MODEL = ["cublas_1_3_4", "cublas_triton_reduce", "tri_tma_128x256",
                         "cublas_triton_reduce", "tri_tma_128x256", "nccl_cublas",
                         "tri_tma_128x256", "cublas_triton_reduce", "cublas_1_3_4",
                         "cublas_triton_reduce"]


# The training sites at TP 4 (rows 8192 everywhere: the [S, H] activations of B 1, S 8192), with
# the plan the link model took (4x H200, session 27, e2e_llama_h200x4_train.json, run 1: fusions
# only 1.034-1.055x Inductor's step over 9 runs) and the plan taken from the rows measured per
# site on 4x H200 as device time (session 55, fused_h200x4_llama8b_sites_spin_8192.json, with
# the all-gathers that copy my shard and pass a barrier before the GEMM: the step with them 49.692
# and 49.793 ms against the model's 49.953 and 50.104 and Inductor's 53.240 and 53.297,
# e2e_llama_h200x4_train_h200_rows_{1,2}.json; with session 46's 4x H100 rows, which left the
# gathers of q/k/v and o's output gradient to NCCL, 51.307 against the model's 51.183,
# e2e_llama_h200x4_train_s55.json). The 4-rank rows timed with the host's queueing (session 27)
# had made the step 0.48 ms slower than the model's; they are not in measured_plans.json.
LLAMA_TP4_TRAIN = [
    # site, the link model's plan, the measured plan
    (dict(op=AG, m=8192, k=4096, ns=(1024, 256, 256)), "cublas_each",
     "cublas_each_first_ready_beside"),
    (dict(op=RS, m=8192, k=1024, ns=(4096,), dim=1), "cublas_triton_reduce",
     "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(3584, 3584)), "tri_tma_128x256", "tri_tma_128x256_ready"),
    (dict(op=RS, m=8192, k=3584, ns=(4096,), dim=1), "cublas_triton_reduce",
     "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(32064,)), "tri_tma_128x256", "tri_tma_128x256"),
    (dict(op=RS, m=8192, k=32064, ns=(4096,), dim=1), "cublas_triton_reduce",
     "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(3584,)), "tri_tma_128x256", "tri_tma_128x256_ready"),
    (dict(op=RS, m=8192, k=7168, ns=(4096,), dim=1, terms=2),
     "cublas_triton_reduce", "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(1024,)), "cublas_1_2_5", "cublas_each_first_ready"),
    (dict(op=RS, m=8192, k=1536, ns=(4096,), dim=1, terms=3),
     "cublas_triton_reduce", "cublas_triton_reduce"),
]


def _llama_task(site: dict, world: int = 2) -> Task:
    reduces = site["op"] != ALL_GATHER_MATMUL
    # B 1: the rows gathered or scattered are the sequence's, whichever dim holds them
    return Task(group_name="0", world_size=world, dtype=torch.bfloat16, device_type="cuda",
                dim_size=site["m"], reduce_op="sum" if reduces else None,
                has_bias=(False,) * len(site["ns"]),
                has_residual=site["op"] == MATMUL_ALL_REDUCE_RMSNORM, **site)


@functools.cache
def _logged_lines() -> tuple[str, ...]:
    logged = json.loads((REPO_ROOT / "benchmarks" / "results"
                         / "e2e_llama_h200x2_train_prefill.json").read_text())
    return tuple(line for run in logged["runs"] for line in run["ditron_log"])


@pytest.mark.parametrize("site, cuda_graphs, expected", LLAMA_TP2_SITES)
def test_llama_tp2_sites_decide_as_pinned(site, cuda_graphs, expected):
    task = _llama_task(site)
    # the Task is the one the pass built from the graph: the log printed it so
    assert _logged(task, _logged_lines()), task.describe()
    with fake_group(2):
        assert resolved(task, cuda_graphs) == expected


def test_llama_tp2_training_sites_from_the_link_model_alone():
    """ditron.measured_plans=False: the plans the 2x H200 run took (its log says which)."""
    lines = _logged_lines()
    saved, config.measured_plans = config.measured_plans, False
    try:
        with fake_group(2):
            for (site, graphs, _), model_plan in zip(LLAMA_TP2_SITES, LLAMA_TP2_TRAIN_MODEL):
                task = _llama_task(site)
                assert resolved(task, graphs) == model_plan, task.describe()
                logged = _logged(task, lines)
                assert all(model_plan in line or model_plan == "nccl_cublas" for line in logged)
    finally:
        config.measured_plans = saved


def _logged(task: Task, lines: list[str]) -> list[str]:
    """The log lines of the task's decision. A sum of matmul products reads as such since
    session 54; the logs before name the same sites "N matmuls concatenated along K, copies ...
    elements" (the rewrite concatenated the operands then)."""
    head = task.describe()
    if task.terms > 1:
        head = head.split(", ")[0]
        return [line for line in lines if f": {head}, {task.terms} matmul" in line]
    return [line for line in lines if f": {head} " in line]


def _decision_in(line: str, plan: str) -> bool:
    """Whether a log line of the site's decision names this plan (or NCCL + cuBLAS kept)."""
    return (f"fused plan {plan}:" in line if plan != "nccl_cublas"
            else " not fused: " in line)


@pytest.mark.parametrize("site, model_plan, measured_plan", LLAMA_TP4_TRAIN)
def test_llama_tp4_training_sites_decide_as_the_runs_did(site, model_plan, measured_plan):
    """From the rows measured at 4 ranks (as the 4x H200 run took them, its log lines naming the
    4-rank measurement), and with ditron.measured_plans=False the link model's (as the 4x H200
    run of session 27 took them)."""
    task = _llama_task(site, world=4)
    results = REPO_ROOT / "benchmarks" / "results"
    measured_log = json.loads((results / "e2e_llama_h200x4_train_h200_rows_1.json")
                              .read_text())["ditron_log"]
    lines = [line for line in _logged(task, measured_log) if "measured on 4 ranks" in line]
    assert lines and all(_decision_in(line, measured_plan) for line in lines), task.describe()
    model_log = json.loads((results / "e2e_llama_h200x4_train.json")
                           .read_text())["runs"][0]["result"]["ditron_log"]
    lines = _logged(task, model_log)
    assert lines and all(_decision_in(line, model_plan) for line in lines), task.describe()
    with fake_group(4):
        assert resolved(task, False) == measured_plan
        saved, config.measured_plans = config.measured_plans, False
        try:
            assert resolved(task, False) == model_plan
        finally:
            config.measured_plans = saved


@pytest.mark.parametrize("kind,forced", [("chosen", ""), ("forced", "fused")])
def test_plans_stay_as_pinned(kind, forced):
    pinned = json.loads(PINNED.read_text())[kind]
    now = choices(forced)
    assert {key: now[key] for key in pinned if now[key] != pinned[key]} == {}
    assert now.keys() == pinned.keys()


if __name__ == "__main__":  # re-pin (only for a change meant to change the plans)
    print(json.dumps({"chosen": choices(), "forced": choices("fused")}, indent=1))
