"""End to end: an MoE model under expert parallelism, one training step (forward, loss, backward),
every contender in one run: what the fused MoE ops gain in a model, not beside it.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 benchmarks/e2e_moe.py --out benchmarks/results/e2e_moe_h100x2
    torchrun --nproc-per-node 2 benchmarks/e2e_moe.py --device cpu --tiny --out /tmp/e2e_moe

Model: tests/moe_ep.py's TinyMoEModel (an embedding, --layers pre-norm residual MoE blocks as
torchtitan writes them: router top-k, the pairs sorted by expert, the counts exchanged, the
split sizes read to the host as unbacked SymInts (`capture_scalar_outputs`), all_to_all_single,
SwiGLU experts as torch._grouped_mm, the reverse all_to_all_single, the weighted sum; a final norm
and a small head), bf16, at the expert layers of bench_moe.py (--model: its experts per rank, so
the model has world x as many), --tokens per rank, random init (the experts differ per rank, the
rest is the same on every rank).
Contenders (each `torch.compile(model, dynamic=False)`, the step's loss a sum over the head):
  inductor               Inductor;
  ditron                 backend="ditron" as a user writes it: the scheduler's plans (today
                         NCCL all-to-all + grouped GEMM at both MoE ops: moe_not_fused);
  ditron_fused           every MoE op's fused plan (ditron.plan=fused): the dispatch and the
                         combine on symmetric memory where they serve;
  ditron_fused_combine   the combine's fused plan alone (ditron.patterns: the combine's), the
                         dispatch left to NCCL;
  inductor_transformers_ep  (--hf) Inductor on the model with transformers' own exchange
                         (ep_implementation "all_to_all", which does not compile: its expert
                         layers run eagerly; ditron_inductor/transformers_ep.py), what a
                         transformers user gets today; the others run ep_implementation "ditron".
--hf mixtral|qwen3_moe: transformers' MixtralForCausalLM / Qwen3MoeForCausalLM (attention and
all) at the layer's expert sizes, --layers decoder layers, batches of --seq tokens, its experts
spread over the ranks by its own EP plan (tests/hf_moe_ep.py), instead of tests/moe_ep.py's
model.
Per contender: the step's median time (bench_fused.bench_on: CUDA events, --reps of --iters
steps after a sync of every rank, the maximum over ranks; the host's clock on CPU), the ditron
ops its graphs hold (forward and backward), the fused MoE calls a step made (runtime/moe.stats:
the others declined and ran their reference: NCCL all-to-all + grouped GEMM; the notes say
why, runtime/launch.declined), and the first step's loss and gradients (the router's, an
expert weight's, the head's) against Inductor's: the largest difference over the largest
magnitude; with --profile CALLS (CUDA), the device's busy and idle ms a step and its longest
kernels. Writes <out>.json ({meta, rows}) and <out>.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_fused import bench_on, max_over_ranks, ranks_meta, write_tables  # noqa: E402
from benchmarks.bench_moe import LAYERS, close_group, init_group  # noqa: E402
from benchmarks.bench_moe_ep import kernel_profile, profile_note  # noqa: E402
from benchmarks.e2e_llama import max_diff  # noqa: E402
from ditron_inductor.patterns import GROUPED_MM_ALL_TO_ALL, MOE_PATTERNS  # noqa: E402
from ditron_inductor.lowering import graph_pass  # noqa: E402
from ditron_inductor.runtime import launch, moe  # noqa: E402

CONTENDERS = ("inductor", "ditron", "ditron_fused", "ditron_fused_combine",
              "inductor_transformers_ep")
DITRON_OPTIONS = {"ditron": {}, "ditron_fused": {"ditron.plan": "fused"},
                  "ditron_fused_combine": {"ditron.plan": "fused",
                                           "ditron.patterns": GROUPED_MM_ALL_TO_ALL}}
GRADS = ("moes.0.router.weight", "moes.0.w2", "head.weight")
HF_GRADS = ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.down_proj",
            "lm_head.weight")
# --hf: attention beside the experts (heads of 128), a short sequence per batch row
HF_ATTENTION = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=128)
VOCAB = 512  # the head stays small beside the experts
# of the largest magnitude: bf16 rounding between right answers stays below this (0.019 between
# transformers' exchange and ditron's on the tiny Mixtral, CPU); a row sent to the wrong expert
# or token is off by about the whole magnitude
DIFFERS = 5e-2


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/e2e_moe")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="the tiny layer, few tokens (smoke run)")
    ap.add_argument("--model", default="mixtral", choices=sorted(LAYERS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", default="2048,8192", help="tokens per rank")
    ap.add_argument("--hf", choices=("mixtral", "qwen3_moe"),
                    help="transformers' model of this kind under its expert parallelism "
                         "(ep_implementation ditron; inductor_transformers_ep: its own), at "
                         "--model's layer sizes, instead of tests/moe_ep.py's")
    ap.add_argument("--seq", type=int, default=1024, help="--hf: tokens per batch row")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="CUDA: also profile CALLS steps of each contender (busy and idle ms a "
                         "step, the longest kernels; bench_moe_ep.kernel_profile)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.model, args.layers, args.tokens, args.iters, args.reps = "tiny", 1, "16", 1, 2
        args.seq = 8
    names = args.contenders.split(",")
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        ap.error(f"--contenders: {sorted(unknown)} not among {CONTENDERS}")
    if not args.hf and "inductor_transformers_ep" in names:
        args.contenders = ",".join(n for n in names if n != "inductor_transformers_ep")
    return args


def build_model(args, group, device):
    """TinyMoEModel at the layer's sizes, initialised on the device (not through its full
    expert weights on the host): shared weights from one seed on every rank, each rank's experts
    from a seed of its own."""
    from tests.moe_ep import TinyMoEModel

    layer = LAYERS[args.model]
    world = group.size()
    with torch.device("meta"):
        model = TinyMoEModel(VOCAB, layer.hidden, layer.inter, layer.experts * world,
                             layer.top_k, args.layers, group)
    model = model.to_empty(device=device)
    shared = torch.Generator(device=device).manual_seed(0)
    own = torch.Generator(device=device).manual_seed(1 + group.rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                gen = own if name.split(".")[-1] in ("w1", "w2", "w3") else shared
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return model.to(torch.bfloat16), layer


def build_hf_model(args, group, device, ep_implementation: str):
    """transformers' --hf model at the layer's sizes (tests/hf_moe_ep.py: random init from one
    seed, the experts spread over the ranks by its EP plan)."""
    from tests import hf_moe_ep

    try:
        import transformers.distributed.expert_parallel  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"--hf needs transformers' expert parallelism (transformers 5.x): "
                         f"{exc}") from exc
    layer = LAYERS[args.model]
    inter = "intermediate_size" if args.hf == "mixtral" else "moe_intermediate_size"
    attention = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8) if (
        args.model == "tiny") else HF_ATTENTION
    cfg = hf_moe_ep.config(args.hf, layer.experts * group.size(), layer.top_k,
                           vocab_size=VOCAB, hidden_size=layer.hidden,
                           num_hidden_layers=args.layers,
                           max_position_embeddings=max(args.seq, 64), **{inter: layer.inter},
                           **attention)
    return hf_moe_ep.build(cfg, args.hf, ep_implementation, group.size(), device=device), layer


def compiled(contender: str, model):
    if contender in ("inductor", "inductor_transformers_ep"):
        return torch.compile(model, dynamic=False)
    options = DITRON_OPTIONS[contender]
    if not options:  # as a user writes it
        return torch.compile(model, backend="ditron", dynamic=False)
    return torch.compile(model, backend="ditron", options=options, dynamic=False)


def step(model, ids):
    """One training step's work: forward, a scalar loss, backward (no optimizer)."""
    model.zero_grad(set_to_none=True)
    out = model(ids)
    loss = getattr(out, "logits", out).float().square().mean()
    loss.backward()
    return loss


def fused_calls() -> int:
    return sum(moe.stats[op] for op in MOE_PATTERNS)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run(args, group) -> list[dict]:
    device = torch.device(args.device if args.device == "cpu" else "cuda")
    if args.hf:
        model, layer = build_hf_model(args, group, device, "ditron")
        models = {c: model for c in CONTENDERS}
        if "inductor_transformers_ep" in args.contenders.split(","):
            models["inductor_transformers_ep"] = build_hf_model(args, group, device,
                                                                "all_to_all")[0]
        grads = HF_GRADS
    else:
        model, layer = build_model(args, group, device)
        models, grads = {c: model for c in CONTENDERS}, GRADS
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",") if t]:
        gen = torch.Generator().manual_seed(100 + tokens + group.rank())
        shape = (max(1, tokens // args.seq), min(tokens, args.seq)) if args.hf else (tokens,)
        inputs = [(torch.randint(0, VOCAB, shape, generator=gen).to(device),)
                  for _ in range(2)]
        name = f"{layer.name} (transformers {args.hf})" if args.hf else layer.name
        row = dict(model=name, experts=layer.experts * group.size(), layers=args.layers,
                   tokens=inputs[0][0].numel(), ms={}, ditron_ops={}, fused_calls={}, diff={},
                   declined={}, notes={}, profiles={})
        reference = None
        for contender in args.contenders.split(","):
            torch._dynamo.reset()
            fn = compiled(contender, models[contender])
            params = dict(models[contender].named_parameters())
            try:
                before, declined = fused_calls(), collections.Counter(launch.declined)
                graph_pass.reports.clear()  # the graphs this contender's first step compiles
                loss = step(fn, *inputs[0])
                row["fused_calls"][contender] = max_over_ranks(fused_calls() - before)
                # the ops the runtime declined in that step, by reason (alike on every rank)
                row["declined"][contender] = dict(launch.declined - declined)
                row["ditron_ops"][contender] = [c.op for r in graph_pass.reports
                                                for c in r.candidates if c.fused]
                got = [loss.detach()] + [local(params[n].grad).detach().clone() for n in grads]
                if reference is None:
                    reference = (contender, got)
                else:
                    row["diff"][contender] = max_over_ranks(max(
                        max_diff(a, b) for a, b in zip(got, reference[1])))
                    if row["diff"][contender] > DIFFERS:
                        row["notes"][contender] = (f"differs from {reference[0]} by "
                                                   f"{row['diff'][contender]:.2e}")
                row["ms"][contender] = bench_on(args.device, lambda ids: step(fn, ids), inputs,
                                                args.iters, args.reps)
                if args.profile and args.device == "cuda":
                    row["profiles"][contender] = kernel_profile(
                        lambda ids: step(fn, *ids), inputs, args.profile)
            except Exception as exc:  # noqa: BLE001 - a contender that fails is reported
                row["notes"][contender] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        if dist.get_rank() == 0:
            print(f"{layer.name} {tokens} tokens: {row['ms']} {row['notes']}", flush=True)
        rows.append(row)
    return rows


def report(rows: list[dict], args, argv) -> None:
    meta = ranks_meta("e2e_moe.py", argv, args.device, model=args.model, layers=args.layers)
    contenders = args.contenders.split(",")
    base = contenders[0]
    head = (["model", "experts", "layers", "tokens/rank"] + [f"{c} ms" for c in contenders]
            + [f"{c} / {base}" for c in contenders[1:]]
            + ["ditron ops in the graphs", "fused MoE calls a step", "notes"])
    lines = [f"# MoE training step on {meta['world']} ranks ({meta['device']}): forward, loss, "
             "backward", "", f"- command: `{meta['command']}`",
             f"- torch {meta['torch']}, {meta['date']}", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        ms = r["ms"]
        cells = [f"{ms[c]:.3f}" if c in ms else "-" for c in contenders]
        ratios = [f"{ms[c] / ms[base]:.3f}" if c in ms and base in ms else "-"
                  for c in contenders[1:]]
        calls = ", ".join(f"{c} {int(n)}" for c, n in r["fused_calls"].items() if n)
        ops = ", ".join(f"{c} {len(o)}" for c, o in r["ditron_ops"].items() if o)
        notes = "; ".join([f"{c}: {v}" for c, v in r["notes"].items()]
                          + [f"{c}: declined at runtime: " + ", ".join(
                              f"{n} x {why}" for why, n in reasons.items())
                             for c, reasons in r["declined"].items() if reasons]
                          + [f"{c}: {profile_note(t)}" for c, t in r["profiles"].items()])
        lines.append("| " + " | ".join([r["model"], str(r["experts"]), str(r["layers"]),
                                        str(r["tokens"])] + cells + ratios
                                       + [ops or "none", calls or "none", notes or "-"]) + " |")
    write_tables(args.out, meta, rows, lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    init_group(args.device, launched=True)
    torch._dynamo.config.capture_scalar_outputs = True  # the split sizes, as torchtitan has them
    # every contender's graphs compiled here, so that the ditron pass reports their ops (a graph
    # Inductor's caches serve skips the pass)
    torch._inductor.config.force_disable_caches = True
    rows = run(args, dist.group.WORLD)
    if dist.get_rank() == 0:
        report(rows, args, argv)
    close_group(args.device)


if __name__ == "__main__":
    main()
