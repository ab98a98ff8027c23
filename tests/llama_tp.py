"""Hugging Face Llama under tensor parallelism, as users apply it: the model, the two TP plans and
one training step, shared by the end-to-end tests (tiny config, gloo) and
`benchmarks/e2e_llama.py` (Llama-3-8B layer sizes, NCCL).

Plans (`parallelize_module` on a 1-D mesh):
- `sequence_parallel`: the torchtitan training plan. The residual stream is sharded on the
  sequence (`Shard(1)`); each norm runs on its shard (`SequenceParallel`); attention and MLP
  gather it (`PrepareModuleInput` to `Replicate`) before the column-parallel q/k/v and gate/up
  and the row-parallel o/down reduce-scatter it back (`RowwiseParallel(output_layouts=Shard(1))`);
  the embedding's output is scattered on the sequence and lm_head gathers it. Its logits are
  gathered too, or with `loss_parallel=True` (torchtitan's default) left sharded on the
  vocabulary for `train_loss` with `next_token_loss`.
- `tensor_parallel`: inference, no sequence parallelism. Column-parallel q/k/v and gate/up,
  row-parallel o/down (an all-reduce after each), embedding and norms replicated, lm_head
  column-parallel with its logits gathered. With `local_params=True` the same plan holds each
  rank's slices as plain tensors, the all-reduces and the logits' gather run as functional
  collectives in the layers' forward hooks (`apply_locally`): no DTensor for a compiled graph
  to unwrap at each call.

The residual stream of the sequence-parallel plan stays a DTensor (`use_local_output=False`) so
the model sees its global shape: Hugging Face derives the position ids and the causal mask from
`inputs_embeds.shape[1]`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

SEQUENCE_PARALLEL = "sequence_parallel"
TENSOR_PARALLEL = "tensor_parallel"
PLANS = (SEQUENCE_PARALLEL, TENSOR_PARALLEL)


def llama_config(hidden: int = 64, intermediate: int = 128, heads: int = 4, kv_heads: int = 2,
                 layers: int = 2, vocab: int = 128):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=16384,
                       use_cache=False, attn_implementation="sdpa")


def build_llama(config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> torch.nn.Module:
    """Random init, identical on every rank (the same seed), before any plan shards it; built
    on `device` (a CPU init of Llama-3-8B layer sizes takes long)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype)


def parallelize(model: torch.nn.Module, plan: str, mesh, *, loss_parallel: bool = False,
                local_params: bool = False) -> torch.nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if loss_parallel and plan != SEQUENCE_PARALLEL:
        raise ValueError(f"loss_parallel=True: the {SEQUENCE_PARALLEL} plan only, not {plan!r}")
    if local_params and plan != TENSOR_PARALLEL:
        raise ValueError(f"local_params=True: the {TENSOR_PARALLEL} plan only, not {plan!r}")
    if plan == SEQUENCE_PARALLEL:
        top = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1), use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                        use_local_output=False) if loss_parallel
                        else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())),
        }
        layer = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
    elif plan == TENSOR_PARALLEL:
        top = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
        layer = {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    else:
        raise ValueError(f"plan={plan!r}: expected one of {', '.join(PLANS)}")
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        layer[name] = ColwiseParallel()
    # Every rank built the same weights (`build_llama`): each keeps its own shard of them, with
    # no broadcast or scatter from rank 0, which a fake group (the benchmark's --no-comm) would
    # leave unwritten: parameters of stale bits, NaN among them.
    apply = apply_locally if local_params else functools.partial(parallelize_module,
                                                                 src_data_rank=None)
    apply(model, mesh, top)
    for block in model.model.layers:
        apply(block, mesh, layer)
    return model


def apply_locally(module: torch.nn.Module, mesh, plan: dict) -> None:
    """`parallelize_module(module, mesh, plan)` for inference, over plain tensors.

    Each linear layer of the plan keeps this rank's slice of its weight (the rows of a
    column-parallel layer, the columns of a row-parallel one: `distribute_tensor`'s shard, so
    the numbers are the DTensor plan's) as an ordinary parameter, and a forward hook runs on its
    output the collective the style's layouts ask for: an all-reduce after a row-parallel layer,
    an all-gather on the last dim after a column-parallel one whose output is replicated (on a
    mesh of one rank none, as DTensor runs none there). Other styles, and layers with a bias,
    are refused."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def all_reduce(layer, args, output):
        return funcol.all_reduce(output, "sum", group)

    def gather_last_dim(layer, args, output):
        # gathered on dim 0 and concatenated here: torch 2.11's all_gather_tensor on another dim
        # calls a function Dynamo will not trace (a graph break, an error under fullgraph), and
        # it has no all_gather_single
        gathered = funcol.all_gather_tensor(output.contiguous(), 0, group)
        return torch.cat(gathered.chunk(world, dim=0), dim=-1)

    # (style, input layouts, output layouts, local output) -> (the weight's sharded dim, the
    # collective on the output)
    served = {(ColwiseParallel, (Replicate(),), (Shard(-1),), True): (0, None),
              (ColwiseParallel, (Replicate(),), (Replicate(),), True): (0, gather_last_dim),
              (RowwiseParallel, (Shard(-1),), (Replicate(),), True): (1, all_reduce)}
    local = []
    for name, style in plan.items():
        layer = module.get_submodule(name)
        layouts = (type(style), style.input_layouts, style.output_layouts, style.use_local_output)
        if layouts not in served:
            raise ValueError(f"local params: {name}: {type(style).__name__} with input "
                             f"{style.input_layouts} and output {style.output_layouts} not served")
        if not isinstance(layer, torch.nn.Linear) or layer.bias is not None:
            raise ValueError(f"local params: {name}: a linear layer without bias only")
        local.append((layer, *served[layouts]))
    group, rank, world = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    for layer, dim, collective in local:
        weight = layer.weight.detach().chunk(world, dim)[rank].clone()
        layer.weight = torch.nn.Parameter(weight, requires_grad=layer.weight.requires_grad)
        if collective is not None and world > 1:  # on one rank the collectives are no-ops
            layer.register_forward_hook(collective)


def tokens(batch: int, seq: int, vocab: int, *, seed: int, device: str = "cpu") -> torch.Tensor:
    """The same token ids on every rank (tensor parallelism splits weights, not the batch)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss over logits and labels already shifted (`train_loss`): in
    float32, the mean over the labelled positions. On vocabulary-sharded logits under DTensor's
    `loss_parallel()` it runs on each rank's shard, compiled or not."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def train_loss(model, ids: torch.Tensor, loss_fn=None) -> torch.Tensor:
    """Forward, the next-token loss and backward; the loss, detached, on this rank.

    Without `loss_fn` Hugging Face computes the loss inside the model, over gathered logits.
    With it (`next_token_loss`, compiled or not, for a model that `parallelize` left with
    vocabulary-sharded logits) the loss runs after the model under DTensor's `loss_parallel()`,
    as torchtitan runs it: the whole model compiled with the loss inside fails in this torch
    ("Expected a DTensor tangent but got a plain Tensor")."""
    if loss_fn is None:
        loss = loss_of(model, ids)
        loss.backward()
        return loss.detach()
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    logits = model(input_ids=ids).logits
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]  # each position's next token; none for the last
    with loss_parallel():  # the backward too: it computes the logits' gradient
        loss = loss_fn(logits, labels)
        loss.backward()
    return local(loss.detach())


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A DTensor's shard on this rank (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t
