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

With `fp8` the decoder layers' linear layers train in torchao's float8 under its float8 TP styles
(`float8_layer_plan`): the float8 all-gathers and `_scaled_mm`s of `tests/test_fp8.py`.

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
                local_params: bool = False, fp8: Optional[str] = None) -> torch.nn.Module:
    """`plan` applied to `model` on `mesh`; with `fp8` (a torchao recipe: "tensorwise") the
    decoder layers' linear layers train in float8 first (`float8_layer_plan`)."""
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
    if local_params and (plan != TENSOR_PARALLEL or fp8):
        raise ValueError(f"local_params=True: the {TENSOR_PARALLEL} plan only, without fp8, not "
                         f"{plan!r}{' with fp8' if fp8 else ''}")
    if plan == SEQUENCE_PARALLEL:
        top = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1), use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                        use_local_output=False) if loss_parallel
                        else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())),
        }
    elif plan == TENSOR_PARALLEL:
        top = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    else:
        raise ValueError(f"plan={plan!r}: expected one of {', '.join(PLANS)}")
    layer = layer_plan(plan, ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    if fp8:
        layer = float8_layer_plan(model, plan, layer, mesh.size(), fp8)
    # Every rank built the same weights (`build_llama`): each keeps its own shard of them, with
    # no broadcast or scatter from rank 0, which a fake group (the benchmark's --no-comm) would
    # leave unwritten: parameters of stale bits, NaN among them.
    apply = apply_locally if local_params else functools.partial(parallelize_module,
                                                                 src_data_rank=None)
    apply(model, mesh, top)
    for block in model.model.layers:
        apply(block, mesh, layer)
    return model


def layer_plan(plan: str, colwise, rowwise, prepare_input) -> dict:
    """The plan of one decoder layer, its linear layers and inputs under the given styles
    (`ColwiseParallel`, `RowwiseParallel`, `PrepareModuleInput` or torchao's float8 ones)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    if plan == SEQUENCE_PARALLEL:
        layer = {
            "input_layernorm": SequenceParallel(),
            "self_attn": prepare_input(input_kwarg_layouts={"hidden_states": Shard(1)},
                                       desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.o_proj": rowwise(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.down_proj": rowwise(output_layouts=Shard(1), use_local_output=False),
        }
    else:
        layer = {"self_attn.o_proj": rowwise(), "mlp.down_proj": rowwise()}
    for name in COLUMN_PARALLEL:
        layer[name] = colwise()
    return layer


COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                   "mlp.up_proj")
FLOAT8_RECIPES = ("tensorwise",)  # torchao's float8 TP styles gather float8 of one scale only


def float8_layer_plan(model: torch.nn.Module, plan: str, layer: dict, world: int,
                      recipe: str) -> dict:
    """torchao float8 training of the decoder layers, as torchtitan applies it; returns the
    `layer` plan with torchao's float8 styles where it converted. Each linear layer of the plan
    that `torch._scaled_mm` can serve becomes a `Float8Linear` (`convert_to_float8_training`,
    `recipe` scaling) in every block of `model`, under `Float8ColwiseParallel` /
    `Float8RowwiseParallel`; a module input prepared for column-parallel layers that are all
    float8 is cast before its all-gather (`PrepareFloat8ModuleInput`), so that the gather moves
    float8, once for q/k/v and once for gate/up.

    What stays in the model's dtype: the embedding and the norms (torchao converts `nn.Linear`
    only), lm_head (its logits feed the loss, vocabulary-parallel under loss_parallel:
    torchtitan leaves it out of float8 too), and a linear layer whose shard on a rank has a dim
    that is not a multiple of 16 (`torch._scaled_mm` rejects it), with the input preparation of
    its module."""
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"fp8={recipe!r}: expected one of {', '.join(FLOAT8_RECIPES)}")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    float8 = layer_plan(plan, Float8ColwiseParallel, Float8RowwiseParallel,
                        PrepareFloat8ModuleInput)
    first = model.model.layers[0]  # every block has the same shapes

    def shard_fits(name: str) -> bool:
        out_features, in_features = first.get_submodule(name).weight.shape
        if isinstance(layer[name], ColwiseParallel):
            out_features //= world
        else:
            in_features //= world
        return out_features % 16 == 0 and in_features % 16 == 0
    converted = {name for name, style in layer.items()
                 if isinstance(style, (ColwiseParallel, RowwiseParallel)) and shard_fits(name)}

    def readers(name: str) -> set:
        """The column-parallel layers that read a module's prepared input."""
        return {c for c in COLUMN_PARALLEL if c.startswith(name + ".")}
    prepared = {name for name in layer if readers(name) and readers(name) <= converted}
    config = Float8LinearConfig.from_recipe_name(recipe)
    for block in model.model.layers:
        convert_to_float8_training(block, config=config,
                                   module_filter_fn=lambda module, fqn: fqn in converted)
    return {name: float8[name] if name in converted | prepared else style
            for name, style in layer.items()}


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
