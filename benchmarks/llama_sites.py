"""The collective + matmul sites of Llama under tensor parallelism, as the pass finds them: one
`Site` per candidate (op, per-rank matmul shape), for a model size, TP degree and workload.

    sites("8b", world=2, workload="train", tokens=8192)  # the 10 sites of a training step
    sites("70b", world=8, workload="prefill", tokens=4096)  # o's and down's all-reduce + norm

Workloads (tests/llama_tp.py has the TP plans; tests/test_plan_choices.py pins the decisions
taken at the Llama-3-8B TP 2 sites on 2x H200, whose Tasks these reproduce):
  train     sequence parallel, B x S = tokens rows: forward q/k/v and gate/up gathers (one op
            with several weights each), o's and down's scatters, lm_head's gather; backward
            lm_head's input-gradient scatter, the gathers of down's and o's output gradients,
            gate/up's and q/k/v's input gradients as one scatter of a sum of 2 and 3 matmuls
            (the op takes each term's operands as they are: nothing copied).
  prefill   plain TP, tokens rows: o's and down's all-reduce with the residual and RMSNorm.
  decode    the same at decode batch sizes (tokens = the batch).
"""

from __future__ import annotations

import dataclasses

import torch

from ditron_inductor.scheduler.task import (
    ALL_GATHER_MATMUL,
    MATMUL_ALL_REDUCE_RMSNORM,
    MATMUL_REDUCE_SCATTER,
    Task,
)


@dataclasses.dataclass(frozen=True)
class LlamaDims:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 128256
    head_dim: int = 128


MODELS = {
    "8b": LlamaDims(hidden=4096, intermediate=14336, heads=32, kv_heads=8),
    "70b": LlamaDims(hidden=8192, intermediate=28672, heads=64, kv_heads=8),
    "tiny": LlamaDims(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, head_dim=16),
}
WORKLOADS = ("train", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class Site:
    """One candidate of the pass: `name` (the layer and direction), the Task the scheduler
    decides on at the TP degree (task.world_size), whether the graph runs under CUDA graphs."""

    name: str
    workload: str
    task: Task
    cuda_graphs: bool = False
    term_ks: tuple[int, ...] = ()  # a sum of matmul products: each one's K (they add up to K)

    @property
    def weights_transposed(self) -> bool:
        """Whether the site's graph multiplies by the Linear weights' transposes: a forward
        site's `mm(x, permute(W))` hands the op a [K, N] view of a [N, K] weight (strides
        (1, K)); a backward one (an output-gradient gather, an input-gradient scatter) the
        weight itself, contiguous [K, N]."""
        return "grad" not in self.name

    def weights(self, device, dtype) -> list[torch.Tensor]:
        """Random right operands [K, N_i], one per weight of the task, laid out as the site's
        graph holds them (weights_transposed), scaled by 1 / sqrt(K)."""
        k = self.task.k
        if self.weights_transposed:
            return [(torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5).t()
                    for n in self.task.ns]
        return [torch.randn(k, n, device=device, dtype=dtype) / k ** 0.5 for n in self.task.ns]


def sites(model: str, world: int, workload: str, tokens: int,
          cuda_graphs: bool = False) -> list[Site]:
    d = MODELS[model]
    h, kv = d.hidden, d.kv_heads * d.head_dim
    q_cols, kv_cols, mlp_cols, vocab_cols = h // world, kv // world, d.intermediate // world, \
        d.vocab // world

    def task(op, k, ns, terms=1):
        return Task(op=op, group_name="0", world_size=world, m=tokens, k=k, ns=tuple(ns),
                    dtype=torch.bfloat16, device_type="cuda",
                    dim=0 if op == ALL_GATHER_MATMUL or workload != "train" else 1,
                    dim_size=tokens, reduce_op=None if op == ALL_GATHER_MATMUL else "sum",
                    has_bias=(False,) * len(ns), has_residual=op == MATMUL_ALL_REDUCE_RMSNORM,
                    terms=terms)

    if workload == "train":
        ag, rs = ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER
        found = [
            ("q/k/v gather", task(ag, h, (q_cols, kv_cols, kv_cols))),
            ("o scatter", task(rs, q_cols, (h,))),
            ("gate/up gather", task(ag, h, (mlp_cols, mlp_cols))),
            ("down scatter", task(rs, mlp_cols, (h,))),
            ("lm_head gather", task(ag, h, (vocab_cols,))),
            ("lm_head input-grad scatter", task(rs, vocab_cols, (h,))),
            ("down output-grad gather", task(ag, h, (mlp_cols,))),
            ("gate/up input-grad scatter", task(rs, 2 * mlp_cols, (h,), terms=2),
             (mlp_cols, mlp_cols)),
            ("o output-grad gather", task(ag, h, (q_cols,))),
            ("q/k/v input-grad scatter", task(rs, q_cols + 2 * kv_cols, (h,), terms=3),
             (q_cols, kv_cols, kv_cols)),
        ]
    elif workload in ("prefill", "decode"):
        arn = MATMUL_ALL_REDUCE_RMSNORM
        found = [("o all-reduce + norm", task(arn, q_cols, (h,))),
                 ("down all-reduce + norm", task(arn, mlp_cols, (h,)))]
    else:
        raise ValueError(f"workload {workload!r}: one of {WORKLOADS}")
    return [Site(name, workload, t, cuda_graphs, *parts) for name, t, *parts in found]
