"""Every suite shape's plan, pinned at world sizes 2, 4 and 8, as the runtime runs it: the
scheduler's choice with every default resolved, unprompted and with the fused plan forced; and
the decision at each site of the Llama-3-8B graphs at TP 2 and 4: from the plans measured there
(scheduler/evidence/measured_plans.json), and from the link model alone (no measured row), each
as the logs of runs of the real model took it.

Re-pin (only for a change meant to change the plans): `python -m tests.test_plan_choices >
tests/plan_choices.json`, and say why in the commit."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import pytest
import torch

from ditron_inductor import config
from ditron_inductor.scheduler import evidence
from ditron_inductor.scheduler.candidates import candidate_plan
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
                dtype=torch.bfloat16, device_type="cuda", dim_size=m,
                reduce_op=None if op == ALL_GATHER_MATMUL else "sum")


def resolved(task: Task, cuda_graphs: bool, forced: str = "") -> str:
    """The decision as one line: the plan the runtime runs, every default resolved."""
    d = decide(task, config.Options(force_plan=forced, cuda_graphs=cuda_graphs))
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
            for op, m, k, n in AG_RS_SUITE:
                out[f"{op} {m}x{k}x{n} w{world}"] = resolved(_task(op, world, m, k, n), False,
                                                              forced)
            for op in (MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE_RMSNORM):
                for k in AR_KS:
                    for m in AR_MS:
                        for graphs in (False, True):
                            key = f"{op} {m}x{k}x8192 w{world} {'graphs' if graphs else 'eager'}"
                            out[key] = resolved(_task(op, world, m, k, 8192), graphs, forced)
    return out


PINNED = pathlib.Path(__file__).with_name("plan_choices.json")

# The sites of the Llama-3-8B graphs at TP 2 (hidden 4096, intermediate 14336, heads 32/8, vocab
# 128256; training B 1 S 8192, prefill S 4096 and 8192), each as the ditron log of a 2-GPU run
# described it, with the decision taken from the evidence now: the fused and the refused sites
# of the real model, pinned without GPUs.
AG, RS, ARN = ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE_RMSNORM
LLAMA_TP2_SITES = [
    # training, forward: q/k/v and gate/up gathers, o and down scatters, lm_head's gather
    (dict(op=AG, m=8192, k=4096, ns=(2048, 512, 512)), False, "cublas_each_first_ready"),
    (dict(op=RS, m=8192, k=2048, ns=(4096,), dim=1), False, "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(7168, 7168)), False, "cublas_each_first_ready_beside"),
    (dict(op=RS, m=8192, k=7168, ns=(4096,), dim=1), False, "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(64128,)), False, "cublas_each_first_ready_beside"),
    # training, backward: lm_head's input gradient, down's and o's output gradients gathered,
    # gate/up's and q/k/v's input gradients each a scatter of a sum of products
    (dict(op=RS, m=8192, k=64128, ns=(4096,), dim=1), False, "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(7168,)), False, "cublas_each_first_ready_beside"),
    (dict(op=RS, m=8192, k=14336, ns=(4096,), dim=1, terms=2), False,
     "cublas_triton_reduce"),
    (dict(op=AG, m=8192, k=4096, ns=(2048,)), False, "cublas_each_first_ready"),
    (dict(op=RS, m=8192, k=3072, ns=(4096,), dim=1, terms=3), False,
     "cublas_triton_reduce"),
    # prefill: o's and down's all-reduce with the residual add and the next RMSNorm, launched
    # eagerly and under CUDA graphs
    (dict(op=ARN, m=4096, k=2048, ns=(4096,)), False, "copy_engine chunks=2"),
    (dict(op=ARN, m=4096, k=7168, ns=(4096,)), False, "copy_engine chunks=2"),
    (dict(op=ARN, m=4096, k=2048, ns=(4096,)), True, "copy_engine chunks=4"),
    (dict(op=ARN, m=4096, k=7168, ns=(4096,)), True, "copy_engine chunks=4"),
    (dict(op=ARN, m=8192, k=2048, ns=(4096,)), False, "copy_engine chunks=4"),
    (dict(op=ARN, m=8192, k=7168, ns=(4096,)), False, "copy_engine chunks=4"),
]
# The training sites' plans from the link model alone, as a 2-GPU run before the measured rows
# took them (its log names them).
LLAMA_TP2_TRAIN_MODEL = ["cublas_1_3_4", "cublas_triton_reduce", "tri_tma_128x256",
                         "cublas_triton_reduce", "tri_tma_128x256", "nccl_cublas",
                         "tri_tma_128x256", "cublas_triton_reduce", "cublas_1_3_4",
                         "cublas_triton_reduce"]


# The training sites at TP 4 (rows 8192 everywhere: the [S, H] activations of B 1, S 8192), with
# the plan the link model took and the plan taken from the rows measured per site, each as the
# log of a 4-GPU run took it.
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
                dim_size=site["m"], reduce_op="sum" if reduces else None, **site)


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


@pytest.fixture
def no_measured_rows(monkeypatch):
    """The link model alone decides: no measured AG/RS row stands for any shape."""
    monkeypatch.setattr(evidence, "nearest_measured", lambda *args: None)


def test_llama_tp2_training_sites_from_the_link_model_alone(no_measured_rows):
    """The plans the run before the measured rows took (its log says which)."""
    lines = _logged_lines()
    with fake_group(2):
        for (site, graphs, _), model_plan in zip(LLAMA_TP2_SITES, LLAMA_TP2_TRAIN_MODEL):
            task = _llama_task(site)
            assert resolved(task, graphs) == model_plan, task.describe()
            logged = _logged(task, lines)
            assert all(model_plan in line or model_plan == "nccl_cublas" for line in logged)


def _logged(task: Task, lines: list[str]) -> list[str]:
    """The log lines of the task's decision. Older logs name a sum of matmul products "N matmuls
    concatenated along K, copies ... elements" (the rewrite concatenated the operands then)."""
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
def test_llama_tp4_training_sites_decide_as_the_runs_did(site, model_plan, measured_plan,
                                                          monkeypatch):
    """From the rows measured at 4 ranks (as a 4-GPU run took them, its log lines naming the
    4-rank measurement), and with no measured row the link model's (as an earlier run did)."""
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
        monkeypatch.setattr(evidence, "nearest_measured", lambda *args: None)
        assert resolved(task, False) == model_plan


@pytest.mark.parametrize("kind,forced", [("chosen", ""), ("forced", "fused")])
def test_plans_stay_as_pinned(kind, forced):
    pinned = json.loads(PINNED.read_text())[kind]
    now = choices(forced)
    assert {key: now[key] for key in pinned if now[key] != pinned[key]} == {}
    assert now.keys() == pinned.keys()


if __name__ == "__main__":
    print(json.dumps({"chosen": choices(), "forced": choices("fused")}, indent=1))
