"""Hugging Face Llama under tensor parallelism, as users apply it: the model, the two TP plans and
one training step, shared by the end-to-end tests (tiny config, gloo) and
`benchmarks/e2e_llama.py` (Llama-3-8B layer sizes, NCCL).

Plans (`parallelize_module` on a 1-D mesh):
- `sequence_parallel`: the torchtitan training plan. The residual stream is sharded on the
  sequence (`Shard(1)`); each norm runs on its shard (`SequenceParallel`); attention and MLP
  gather it (`PrepareModuleInput` to `Replicate`) before the column-parallel q/k/v and gate/up
  and the row-parallel o/down reduce-scatter it back (`RowwiseParallel(output_layouts=Shard(1))`);
  the embedding's output is scattered on the sequence and lm_head gathers it.
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


def parallelize(model: torch.nn.Module, plan: str, mesh) -> torch.nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if plan == SEQUENCE_PARALLEL:
        top = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1), use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
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
    parallelize_module(model, mesh, top)
    for block in model.model.layers:
        parallelize_module(block, mesh, layer)
    return model


def tokens(batch: int, seq: int, vocab: int, *, seed: int, device: str = "cpu") -> torch.Tensor:
    """The same token ids on every rank (tensor parallelism splits weights, not the batch)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A DTensor's shard on this rank (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t
