"""transformers' expert parallelism in a form torch.compile captures whole, so that the ditron
backend fuses its all-to-alls with the experts' grouped GEMMs.

transformers' "all_to_all" `EPImplementation` runs eagerly: Dynamo must break the graph at
`if tokens.shape[0] == 0` (an unbacked SymInt), inside the experts' `_use_local_dtensor_params`
context manager, where it cannot. `register()` adds "ditron": torchtitan's exchange
(tests/moe_ep.py), with no data-dependent branch; experts it does not serve run "all_to_all".

    ditron_inductor.transformers_ep.register()
    model = AutoModelForCausalLM.from_pretrained(
        name, distributed_config=DistributedConfig(ep_size=2, ep_implementation="ditron"))
    torch._dynamo.config.capture_scalar_outputs = True
    model = torch.compile(model, backend="ditron")
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed._functional_collectives as funcol

from .log_names import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)

NAME = "ditron"


def expert_major_order(recv_counts: torch.Tensor, rows) -> torch.Tensor:
    """The indices of the `rows` received rank-major in expert-major order (by source rank
    within an expert), from the counts [source rank, local expert]."""
    world, local = recv_counts.shape
    expert_of_row = torch.arange(local, device=recv_counts.device).repeat(world)
    expert_of_row = expert_of_row.repeat_interleave(recv_counts.reshape(-1), output_size=rows)
    return torch.argsort(expert_of_row, stable=True)


def unserved(experts, tp_size: int) -> str:
    """Why the experts run transformers' all_to_all instead ("" if served)."""
    if tp_size > 1:
        return f"tensor parallelism inside the expert group (tp_size {tp_size})"
    if getattr(experts, "has_bias", False):
        return "experts with a bias"
    if getattr(experts, "has_post_expert_norm", False):
        return "a norm after the experts"
    return ""


def grouped_linear(experts, rows: torch.Tensor, weight: torch.Tensor,
                   offsets: torch.Tensor) -> torch.Tensor:
    """rows @ each expert's weight, stored [E, out, in] (or [E, in, out], is_transposed)."""
    if not getattr(experts, "is_transposed", False):
        weight = weight.transpose(-2, -1)
    return torch._grouped_mm(rows.to(weight.dtype), weight, offs=offsets)


def experts_swiglu(experts, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The local experts on their expert-major rows: up (and gate), the activation, down."""
    if getattr(experts, "has_gate", True):
        h = experts._apply_gate(grouped_linear(experts, rows, experts.gate_up_proj, offsets))
    else:
        h = experts.act_fn(grouped_linear(experts, rows, experts.up_proj, offsets))
    return grouped_linear(experts, h, experts.down_proj, offsets)


@functools.cache
def implementation():
    """The EPImplementation class (transformers imported here, not with ditron_inductor)."""
    from transformers.distributed.expert_parallel import AllToAllEP

    class DitronAllToAllEP(AllToAllEP):
        """transformers' all_to_all exchange, capturable (see the module doc)."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            self.experts = experts
            self.why_not = unserved(experts, tp_mesh.size())
            if self.why_not:
                log.info("ditron EP: %s: transformers' all_to_all runs", self.why_not)

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            if self.why_not:
                return super().__call__(hidden_states, top_k_index, top_k_weights)
            group, world = self.ep_mesh.get_group(), self.ep_mesh.size()
            local = self.num_local_experts
            tokens, dim = hidden_states.shape
            top_k = top_k_index.shape[-1]
            expert_ids = top_k_index.reshape(-1)
            order = torch.argsort(expert_ids, stable=True)
            send_counts = torch.zeros(world * local, dtype=torch.int64,
                                      device=hidden_states.device)
            send_counts = send_counts.scatter_add(0, expert_ids, torch.ones_like(expert_ids))
            with torch.no_grad():
                recv_counts = funcol.all_to_all_single(send_counts, None, None, group)
                recv_counts = recv_counts.view(world, local)
                input_splits = send_counts.view(world, local).sum(1).tolist()
                output_splits = recv_counts.sum(1).tolist()
            received = funcol.all_to_all_single_autograd(hidden_states[order // top_k],
                                                         output_splits, input_splits, group)
            by_expert = expert_major_order(recv_counts, sum(output_splits))
            offsets = torch.cumsum(recv_counts.sum(0), 0, dtype=torch.int32)
            out = experts_swiglu(self.experts, received[by_expert], offsets)
            unpermuted = torch.empty_like(out).index_put((by_expert,), out)
            returned = funcol.all_to_all_single_autograd(unpermuted, input_splits,
                                                         output_splits, group)
            pairs = torch.empty_like(returned).index_put((order,), returned)
            pairs = pairs.view(tokens, top_k, dim)
            # in the weights' dtype (the router's float32), as transformers weighs them; its
            # ep_forward casts the sum back
            return (pairs * top_k_weights.unsqueeze(-1)).sum(1)

    return DitronAllToAllEP


def register() -> None:
    """`ep_implementation="ditron"` in transformers' DistributedConfig (idempotent)."""
    from transformers.distributed.expert_parallel import EPImplementationInterface

    EPImplementationInterface.register(NAME, implementation())
