"""A mixture-of-experts layer under expert parallelism, written as torchtitan writes it, and a tiny
MoE model of such layers, for the end-to-end and capture tests (CPU ranks over gloo).

Each rank holds its own tokens and `experts // world` whole experts (rank r: experts
r * E_local ... (r + 1) * E_local - 1). One forward:

1. route: router logits, softmax, top-k experts per token and their scores;
2. sort the (token, expert) pairs by expert (stable): sorting by global expert id also groups
   them by the rank that owns the expert;
3. exchange the per-expert counts with an `all_to_all_single` of the counts (rank-major on the
   receiver: [source rank][local expert]), and read the split sizes of both all-to-alls back to
   the host (`.tolist()`: unbacked SymInts under torch.compile with
   `capture_scalar_outputs`, a graph break without);
4. dispatch: `all_to_all_single` of the sorted rows with those split sizes;
5. permute the received rows from rank-major to expert-major (stable: per expert, source rank
   order, then the sender's order) and run the local experts, SwiGLU, as grouped GEMMs
   (`torch._grouped_mm` with cumulative offsets; bfloat16 only under torch.compile on CPU in
   torch 2.13) or as a loop of per-expert matmuls over the split rows;
6. un-permute, combine: the reverse `all_to_all_single`, then un-sort and sum each token's
   top-k outputs weighted by its scores.

`EXPERTS_GROUPED_MM` / `EXPERTS_LOOP` pick step 5's form. Routing can be forced (`route`) to
make odd cases: an expert that gets no token, every token on one rank's experts.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

# the received rows' expert-major order (shared with ditron's transformers EP adapter)
from ditron_inductor.transformers_ep import expert_major_order

EXPERTS_GROUPED_MM = "grouped_mm"
EXPERTS_LOOP = "loop"

# (logits [T, E]) -> logits: replaces the router's scores, to force a routing
Route = Callable[[torch.Tensor], torch.Tensor]


class ExpertParallelMoE(nn.Module):
    """One MoE layer; `forward(x [T, dim]) -> [T, dim]` on this rank's T tokens."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int,
                 group: dist.ProcessGroup, experts_form: str = EXPERTS_GROUPED_MM,
                 route: Optional[Route] = None):
        super().__init__()
        world = group.size()
        if experts % world:
            raise ValueError(f"{experts} experts do not divide over {world} ranks")
        self.experts, self.local_experts, self.top_k = experts, experts // world, top_k
        self.group, self.world, self.experts_form, self.route = group, world, experts_form, route
        rank = group.rank()
        # the same full weights on every rank (the caller seeds), this rank's experts kept
        self.router = nn.Linear(dim, experts, bias=False)
        local = slice(rank * self.local_experts, (rank + 1) * self.local_experts)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim)[local] / dim ** 0.5)  # gate
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim)[local] / dim ** 0.5)  # up
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden)[local] / hidden ** 0.5)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, dim = x.shape
        logits = self.router(x)
        if self.route is not None:
            logits = self.route(logits)
        scores, chosen = torch.topk(F.softmax(logits.float(), dim=-1), self.top_k, dim=-1)

        # 2. the (token, expert) pairs sorted by expert
        chosen = chosen.view(-1)
        order = torch.argsort(chosen, stable=True)
        send_counts = torch.zeros(self.experts, dtype=torch.int64, device=x.device)
        send_counts = send_counts.scatter_add(0, chosen, torch.ones_like(chosen))

        # 3. counts exchange and split sizes
        with torch.no_grad():
            recv_counts = all_to_all_single(send_counts, None, None, self.group)
            recv_counts = recv_counts.view(self.world, self.local_experts)
            input_splits = send_counts.view(self.world, -1).sum(1).tolist()
            output_splits = recv_counts.sum(1).tolist()

        # 4. dispatch
        received = all_to_all_single_autograd(x[order // self.top_k], output_splits,
                                              input_splits, self.group)

        # 5. rank-major -> expert-major, the experts
        by_expert = expert_major_order(recv_counts, sum(output_splits))
        per_expert = recv_counts.sum(0)
        out = self.run_experts(received[by_expert], per_expert)
        unpermuted = torch.empty_like(out).index_put((by_expert,), out)

        # 6. combine, un-sort, weighted sum over each token's top-k
        returned = all_to_all_single_autograd(unpermuted, input_splits, output_splits,
                                              self.group)
        pairs = torch.empty_like(returned).index_put((order,), returned)
        pairs = pairs.view(tokens, self.top_k, dim)
        return (pairs * scores.unsqueeze(-1).to(pairs.dtype)).sum(1)

    def run_experts(self, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each local expert on its rows (`rows` expert-major, `per_expert` counts)."""
        if self.experts_form == EXPERTS_GROUPED_MM:
            offsets = torch.cumsum(per_expert, 0, dtype=torch.int32)
            gate = torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=offsets)
            up = torch._grouped_mm(rows, self.w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offsets)
        outs = []
        for e, piece in enumerate(torch.split(rows, per_expert.tolist())):
            h = F.silu(piece @ self.w1[e].t()) * (piece @ self.w3[e].t())
            outs.append(h @ self.w2[e].t())
        return torch.cat(outs)


class TinyMoEModel(nn.Module):
    """Embedding, `layers` pre-norm residual MoE blocks, a final norm and an output head: the
    shape of an MoE transformer without attention (replicated weights but the experts)."""

    def __init__(self, vocab: int, dim: int, hidden: int, experts: int, top_k: int, layers: int,
                 group: dist.ProcessGroup, experts_form: str = EXPERTS_GROUPED_MM):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.RMSNorm(dim) for _ in range(layers))
        self.moes = nn.ModuleList(ExpertParallelMoE(dim, hidden, experts, top_k, group,
                                                    experts_form) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(self.norm(h))
