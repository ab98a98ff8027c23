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
  column-parallel with its logits gathered.

The residual stream of the sequence-parallel plan stays a DTensor (`use_local_output=False`) so
the model sees its global shape: Hugging Face derives the position ids and the causal mask from
`inputs_embeds.shape[1]`.
"""

from __future__ import annotations

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


def parallelize(model: torch.nn.Module, plan: str, mesh, *,
                loss_parallel: bool = False) -> torch.nn.Module:
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
    parallelize_module(model, mesh, top, src_data_rank=None)
    for block in model.model.layers:
        parallelize_module(block, mesh, layer, src_data_rank=None)
    return model


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
