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
  prefill   plain TP, tokens rows: o's and down's all-reduce with the residual and RMSNorm;
            launched eagerly, lm_head's logits gathered along the vocabulary.
  decode    the same at decode batch sizes (tokens = the batch).
"""

from __future__ import annotations

import dataclasses

import torch

from ditron_inductor.calibrate import LLAMA, Llama, llama_sites
from ditron_inductor.scheduler.task import Task

LlamaDims, MODELS = Llama, LLAMA  # the model sizes, the package's (ditron_inductor/calibrate.py)
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
    # Whether the site's graph multiplies by the Linear weights' transposes: a forward site's
    # `mm(x, permute(W))` hands the op a [K, N] view of a [N, K] weight (strides (1, K)); a
    # backward one (an output-gradient gather, an input-gradient scatter) the weight itself,
    # contiguous [K, N].
    weights_transposed: bool = True

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
    """The package's sites (calibrate.llama_sites: the calibration measures the same), each with
    its workload."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: one of {WORKLOADS}")
    return [Site(s.name, workload, s.task, s.graphs, s.term_ks, s.transposed)
            for s in llama_sites(model, world, workload, tokens, cuda_graphs)]
