"""transformers' MoE models (Mixtral, Qwen3-MoE) under its expert parallelism, built from a config
(random init, the same on every rank) without from_pretrained: the model's own EP plan applied
with `transformers.distributed.expert_parallel.apply_expert_parallelism` over a (tp 1, ep W) mesh,
for the tests (CPU ranks over gloo) and benchmarks/e2e_moe.py (--hf)."""

from __future__ import annotations

import torch

# kind -> (config class, model class) names in transformers
MODELS = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"),
          "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def config(kind: str, experts: int, top_k: int, **sizes):
    import transformers

    cls = getattr(transformers, MODELS[kind][0])
    experts_key = "num_local_experts" if kind == "mixtral" else "num_experts"
    return cls(**{experts_key: experts, "num_experts_per_tok": top_k, **sizes})


def ep_plan(model, layers: int) -> dict:
    """The model's EP plan (its config's base_model_ep_plan), layer by layer, full names."""
    prefix = model.base_model_prefix
    plan = {}
    for pattern, style in model.config.base_model_ep_plan.items():
        for i in range(layers):
            plan[f"{prefix}.{pattern.replace('*', str(i))}"] = style
    return plan


def build(cfg, kind: str, ep_implementation: str, world: int, dtype=torch.bfloat16,
          device="cpu", seed: int = 0):
    """The model with its experts spread over `world` ranks, tokens exchanged by
    `ep_implementation` ("all_to_all": transformers' own; "ditron": ditron_inductor.transformers_ep,
    registered here; "all_reduce": transformers' inference EP, where every rank holds the same
    batch, so its batch group, the tp mesh it is given, is the EP group)."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from ditron_inductor import transformers_ep

    transformers_ep.register()
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, MODELS[kind][1])(cfg).to(dtype)
    mesh = init_device_mesh(device if isinstance(device, str) else device.type, (1, world),
                            mesh_dim_names=("tp", "ep"))
    batch_mesh = mesh["ep"] if ep_implementation == "all_reduce" else mesh["tp"]
    return apply_expert_parallelism(model, mesh["ep"], batch_mesh,
                                    ep_plan(model, cfg.num_hidden_layers),
                                    ep_implementation=ep_implementation)
