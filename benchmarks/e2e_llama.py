"""End to end: Hugging Face Llama under tensor parallelism, every contender in one run.

On a GPU machine (bf16, Llama-3-8B layer sizes, 4 layers, TP over all local GPUs):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 benchmarks/e2e_llama.py --json benchmarks/results/e2e_llama_h200x2.json

(the script sets those three variables itself when they are unset: NVLink multicast objects are
never created). Smoke run on CPU, 2 gloo ranks that the script spawns itself, tiny config:

    python benchmarks/e2e_llama.py --device cpu --tiny

FP8 training (`--fp8 tensorwise`, the train workload only; needs torchao): the decoder layers'
linear layers train as torchao's `Float8Linear` under its float8 TP styles (`tests/llama_tp.py`,
`float8_layer_plan`: which layers, which stay bf16 and why), for every contender, so that the
float8 all-gathers and `_scaled_mm`s meet ditron's fp8 ops; the numbers are checked against
Inductor's float8 step as in bf16. On 2 GPUs, as the scheduler decides (no fp8 plan chosen yet)
and with the fp8 plans forced:

    torchrun --nproc-per-node 2 benchmarks/e2e_llama.py --workloads train --fp8 tensorwise \\
        --contenders inductor,inductor_async_tp,ditron --json benchmarks/results/e2e_llama_fp8_h100x2.json
    DITRON_PLAN=fused torchrun --nproc-per-node 2 benchmarks/e2e_llama.py --workloads train \\
        --fp8 tensorwise --contenders inductor,inductor_async_tp,ditron \\
        --json benchmarks/results/e2e_llama_fp8_h100x2_fused.json

Model: `transformers.LlamaForCausalLM` from a `LlamaConfig` (sizes, layer count on the command
line), random init, the same on every rank; the TP plans of `tests/llama_tp.py`.
Workloads:
- train: one training step (forward, loss, backward, AdamW step: fused, as torchtitan runs it,
  or --optimizer foreach), sequence-parallel plan (torchtitan's), B x S tokens; the logits stay
  sharded on the vocabulary and the loss runs under DTensor's `loss_parallel()` after the
  model, compiled on its own as the model is, as torchtitan's default (`--no-loss-parallel`:
  lm_head gathers the logits and the model computes the loss inside its compiled graph);
- prefill: plain TP (all-reduce after o_proj and down_proj), B 1, S in --prefill-seqs, eager
  launch and `mode="reduce-overhead"` (CUDA graphs);
- decode: decode-shaped steps (S 1, no KV cache), B in --decode-batches, both modes
  (`generate()` with a static KV cache: `e2e_decode.py`).
Contenders: eager, Inductor, Inductor + PyTorch async TP (`_micro_pipeline_tp` with symmetric memory
enabled for the group; CUDA only), ditron, and beside ditron always ditron_keep_mask (ditron with
its causal-mask, decode-GEMM and GQA-packing rewrites off, "fusions only": what the collective
fusion alone gains, so the effects are never mixed); where named,
ditron_keep_mask_b (fusions only with the ditron options of --b-options on top: a change's effect
on the step, timed in one process beside fusions only, where runs in separate processes differ by
~1%). Timing: random token ids, warm-up, then --reps interleaved repetitions (each contender in turn) of --iters calls,
or of as many as take --min-ms (5 decode steps of 0.7 ms spread by 30% between runs); CUDA events on
GPU; the median over repetitions, the maximum over ranks; the spread of the repetitions ((max - min)
/ median, the largest over contenders and ranks: differences smaller than it are noise); and the
host's time per call (near the device's: the step is bound by the host). Checks: the training loss
and a few gradients after the first step, and the logits, against Inductor's (same init, same data).
Per compiled ditron graph: the number of `torch.ops.ditron.*` calls; under reduce-overhead, the
graphs each contender's Inductor declined to capture (they run eagerly); and each line the `ditron`
logger wrote at INFO (one per match: fused with the plan's reason, or not and why). Prints a
markdown table; `--json PATH` writes the rows, the ditron lines and the command.

The bound (`--no-comm`): one process on one device, a fake process group of --world ranks (every
collective returns at once; the functional ones write their outputs from the local input, see
`local_collectives`), eager, Inductor and ditron without its collective patterns (what is left of
it: the causal-mask rewrite), no comparison of numbers, but a row flags a contender whose loss,
gradients or logits are not finite (a GEMM over NaN runs faster than over the step's values).
Its times are the step at TP --world shapes without any communication, what hiding all of it
could reach; set beside Inductor's time with communication they bound what overlap can gain (it
hides the collectives; it does not shorten the compute). Runs on a one-GPU machine:

    python benchmarks/e2e_llama.py --no-comm --world 2 --json benchmarks/results/e2e_llama_h200x1_no_comm_w2.json

Given that JSON (`--bound-json PATH`), a run with communication adds two columns: the bound (the
fastest compiled contender without communication) and the ceiling, Inductor's time over the bound
(`scripts/device_check.sh e2e_llama` runs both).

`--profile-device CALLS` adds each contender's device time by kernel kind (GEMM, attention,
collectives, ditron's kernels, optimizer, copies, other), the time each kind runs alone (nothing
of another kind beside it: exposed communication, for collectives and copies) and the longest
kernels: what bounds a step; and each rank's idle time between kernels with its widest gaps (a
stream waiting on a late peer idles on one rank, a transfer's tail on every rank).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import faulthandler
import functools
import importlib.util
import json
import logging
import math
import os
import signal
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ditron_inductor import clean_exit  # noqa: E402
from tests import llama_tp  # noqa: E402

# ditron_keep_mask: ditron with its causal-mask, decode-GEMM and GQA rewrites off (what overlap
# alone gains);
# ditron_keep_mask_b: fusions only with --b-options on top (B_OPTIONS)
CONTENDERS = ("eager", "inductor", "inductor_async_tp", "ditron", "ditron_keep_mask",
              "ditron_keep_mask_b")
B_OPTIONS: dict = {}  # --b-options, parsed: the ditron options of ditron_keep_mask_b
WORKLOADS = ("train", "prefill", "decode")
GRADS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
         "model.norm.weight")
EAGER_LAUNCH, CUDA_GRAPHS = "eager launch", "reduce-overhead"
NO_COMM_CONTENDERS = ("eager", "inductor", "ditron", "ditron_keep_mask")
# ditron's graph rewrites that are not fusions, off: what fusing communication alone gains
FUSIONS_ONLY = {"ditron.causal_mask": False, "ditron.decode_gemm": False,
                "ditron.gqa_packing": False}
CONTENDER_TITLES = {"ditron_keep_mask":
                    "ditron fusions only (mask, decode-GEMM and GQA rewrites off)",
                    "ditron_keep_mask_b": "fusions only + --b-options"}
# --fp8: ditron's loss and gradients within this of the baseline's largest magnitude, else the
# report says how far, beside how far the other contenders lie: any change of rounding upstream
# flips e5m2 gradient elements, so two right answers can lie 0.2 apart (2x H200, 4 layers)
FP8_MAX_DIFF = 2e-2
FP8_SPREAD_SLACK = 1.25  # ditron's difference within 1.25x the other contenders' is theirs too
# A contender this far from the baseline (of the largest magnitude) computed something else: right
# answers lie 0.01-0.2 apart here, fp8 included; the SM-pull all-gathers' finite but wrong weights
# (4x H200, session 27) lay 3.5 to 3.5e+02 away
WRONG_DIFF = 0.5
SPREAD_NAMED = 0.10  # a spread beyond 10% names the contender it came from


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="tiny config and shapes (hidden 64, 2 layers, S 16): a smoke run")
    p.add_argument("--world", type=int, default=2,
                   help="ranks to spawn when not launched by torchrun (CPU smoke run), or the "
                        "fake group's size with --no-comm")
    p.add_argument("--no-comm", action="store_true",
                   help="the bound: one process, a fake group of --world ranks whose collectives "
                        "move nothing (each writes its output from the local input); eager, "
                        "Inductor and ditron without its collective patterns; numbers only "
                        "checked for being finite")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--workloads", default=None,
                   help=f"default: {','.join(WORKLOADS)}; with --fp8: train")
    p.add_argument("--fp8", choices=llama_tp.FLOAT8_RECIPES, default=None,
                   help="training in float8: the decoder layers' linear layers as torchao's "
                        "Float8Linear under its float8 TP styles (tests/llama_tp.py, "
                        "float8_layer_plan); train workload only")
    p.add_argument("--contenders", default=",".join(c for c in CONTENDERS
                                                     if not c.startswith("ditron_keep_mask")),
                   help="ditron brings ditron_keep_mask (fusions only) along, but with "
                        "--no-comm; ditron_keep_mask_b runs where named")
    p.add_argument("--b-options", default="",
                   help="ditron_keep_mask_b's ditron options over fusions only, KEY=VALUE pairs "
                        "separated by ';', e.g. 'ditron.decode_gemm_groups=0'")
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                   help="AdamW's implementation in the training step (torchtitan's default: "
                        "fused)")
    p.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="training: vocabulary-sharded logits and loss (torchtitan's default)")
    p.add_argument("--train-batch", type=int, default=1)
    p.add_argument("--train-seq", type=int, default=8192)
    p.add_argument("--prefill-seqs", default="4096,8192")
    p.add_argument("--decode-batches", default="1,8,32,64,128")
    p.add_argument("--modes", default=f"{EAGER_LAUNCH},{CUDA_GRAPHS}",
                   help="for prefill and decode (training always launches eagerly)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-ms", type=float, default=20.0,
                   help="each timed repetition runs at least this long (more calls than --iters)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--profile-host", type=int, default=0, metavar="CALLS",
                   help="after timing, cProfile this many calls of each contender: where the "
                        "host's time per call goes (printed after the table, rank 0)")
    p.add_argument("--profile-device", type=int, default=0, metavar="CALLS",
                   help="after timing, the torch profiler over this many calls of each "
                        "contender: device ms per call by kernel kind (GEMM, attention, "
                        "collectives, ...) and the time some kernel runs (CUDA only)")
    p.add_argument("--profile-trace", default=None, metavar="DIR",
                   help="with --profile-device: each rank writes the profiler's Chrome trace of "
                        "each contender here (WORKLOAD_CONTENDER_rankR.json.gz)")
    p.add_argument("--bound-json", default=None,
                   help="the JSON of a --no-comm run of the same sizes: adds the bound columns")
    if p.parse_known_args(argv)[0].tiny:  # new defaults; options given still win
        p.set_defaults(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2, vocab=128,
                       train_seq=16, prefill_seqs="16", decode_batches="1,4", warmup=1, iters=1,
                       reps=2)
    args = p.parse_args(argv)
    if args.workloads is None:
        args.workloads = "train" if args.fp8 else ",".join(WORKLOADS)
    for option, allowed in (("contenders", CONTENDERS), ("workloads", WORKLOADS),
                            ("modes", (EAGER_LAUNCH, CUDA_GRAPHS))):
        bad = [v for v in getattr(args, option).split(",") if v not in allowed]
        if bad:
            p.error(f"--{option}: {', '.join(map(repr, bad))} not among {', '.join(allowed)}")
    if args.fp8 and set(args.workloads.split(",")) != {"train"}:
        p.error(f"--fp8: the train workload only, not --workloads {args.workloads} (torchao's "
                "float8 training recipe: float8 inference is its quantize_ API, not run here)")
    if args.fp8 and importlib.util.find_spec("torchao") is None:
        p.error("--fp8: torchao is not installed (pip install torchao)")
    chosen = args.contenders.split(",")
    if ("ditron_keep_mask_b" in chosen) != bool(args.b_options):
        p.error("--b-options and the contender ditron_keep_mask_b go together")
    B_OPTIONS.clear()
    B_OPTIONS.update(b_options(p, args.b_options))
    # without communication ditron fuses nothing: there, fusions only is Inductor
    if "ditron" in chosen and "ditron_keep_mask" not in chosen and not args.no_comm:
        args.contenders += ",ditron_keep_mask"
    if args.device == "cpu" and args.profile_device:
        p.error("--profile-device: CUDA kernels only (--device cuda)")
    if args.profile_trace and not args.profile_device:
        p.error("--profile-trace: the traces of --profile-device's calls (give it)")
    if args.device == "cpu":  # no CUDA graphs, no symmetric memory
        args.modes = EAGER_LAUNCH
        args.contenders = ",".join(c for c in args.contenders.split(",")
                                   if c != "inductor_async_tp")
    if args.no_comm:  # PyTorch's fused ops need peers that are there (ditron's: see compiled)
        args.contenders = ",".join(c for c in args.contenders.split(",") if c in NO_COMM_CONTENDERS)
        if not args.contenders:
            p.error(f"--no-comm: --contenders must include one of {', '.join(NO_COMM_CONTENDERS)}")
    return args


def b_options(p: argparse.ArgumentParser, text: str) -> dict:
    """--b-options' 'ditron.KEY=VALUE;...' as options, each checked as torch.compile would."""
    from ditron_inductor import backend, config

    options = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, sep, value = item.partition("=")
        if not sep or not key.startswith(config.PREFIX):
            p.error(f"--b-options: {item!r} is not {config.PREFIX}KEY=VALUE")
        options[key.strip()] = value.strip()
    try:
        backend.inductor_patches(None, options)
    except config.OptionError as error:
        p.error(f"--b-options: {error}")
    return options


# ---------------------------------------------------------------------------------- contenders


def compiled(contender: str, model, mode: str, group_name: str, no_comm: bool = False):
    """The callable a contender runs for `model` (a module, or the loss function): the model
    itself (eager) or a compiled wrapper. Without communication (a fake group) ditron matches no
    collective (`ditron.patterns` empty): its fused ops need peers, and their reference plans
    would time what no GPU run takes; what is left is its rewrite of the attention masks."""
    from torch._inductor import list_mode_options

    cuda_graphs = "reduce-overhead" if mode == CUDA_GRAPHS else None
    if contender == "eager":
        return model
    if contender == "inductor":
        return torch.compile(model, mode=cuda_graphs, dynamic=False)
    if contender == "inductor_async_tp":
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group_name)
        options = {**(list_mode_options(cuda_graphs) if cuda_graphs else {}),
                   "_micro_pipeline_tp": True}
        return torch.compile(model, options=options, dynamic=False)
    if contender in ("ditron", "ditron_keep_mask", "ditron_keep_mask_b"):
        options = {**(FUSIONS_ONLY if "keep_mask" in contender else {}),
                   **(B_OPTIONS if contender.endswith("_b") else {}),
                   **({"ditron.patterns": ""} if no_comm else {})}
        if not options:  # as a user writes it
            return torch.compile(model, backend="ditron", mode=cuda_graphs, dynamic=False)
        # torch.compile takes a mode or options, not both
        options.update(list_mode_options(cuda_graphs) if cuda_graphs else {})
        return torch.compile(model, backend="ditron", options=options, dynamic=False)
    raise ValueError(f"--contenders: {contender!r} is not one of {', '.join(CONTENDERS)}")


class Timer:
    """(device ms, host ms) per call of `fn`, over `iters` calls: CUDA events on GPU, and the
    host's time from the first call to the last call's return (the two agree where the host
    cannot run ahead of the device: a host-bound step)."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def __call__(self, fn, iters: int) -> tuple[float, float]:
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            host = (time.perf_counter() - t0) * 1e3 / iters
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters, host
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / iters
        return ms, ms


def interleaved(fns: dict, timer: Timer, args, label: str) -> dict:
    """{"ms": {contender: median ms per call}, "host_ms": {contender: the host's}, "spread"}, each
    the maximum over ranks: warm-up, then --reps rounds in which each contender runs its calls in
    turn: --iters, or as many as take --min-ms. label: the workload and shape, naming the traces
    of --profile-trace."""
    for fn in fns.values():
        for _ in range(args.warmup):
            fn()
    # every rank makes the same number of calls: each holds collectives the others wait on
    once = torch.tensor([timer(fn, 1)[0] for fn in fns.values()], dtype=torch.float64,
                        device=timer.device)
    dist.all_reduce(once, op=dist.ReduceOp.MIN)
    iters = {name: max(args.iters, math.ceil(args.min_ms / max(ms, 1e-3)))
             for name, ms in zip(fns, once.cpu().tolist())}
    times, host = {name: [] for name in fns}, {name: [] for name in fns}
    for _ in range(args.reps):
        for name, fn in fns.items():
            ms, host_ms = timer(fn, iters[name])
            times[name].append(ms)
            host[name].append(host_ms)
    stats = torch.tensor([[statistics.median(t), statistics.median(host[n]),
                           (max(t) - min(t)) / statistics.median(t)] for n, t in times.items()],
                         dtype=torch.float64, device=timer.device).reshape(len(fns), 3)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    medians, host_medians, spreads = stats.cpu().T.tolist()
    timing = {"ms": dict(zip(fns, medians)), "host_ms": dict(zip(fns, host_medians)),
              "spread": max(spreads, default=0.0), "spreads": dict(zip(fns, spreads))}
    if args.profile_host:
        timing["host_profile"] = {name: host_profile(fn, args.profile_host, timer)
                                  for name, fn in fns.items()}
    if args.profile_device:
        rank = 0 if args.no_comm else dist.get_rank()
        profiles = {name: device_profile(fn, args.profile_device, timer, args.profile_trace and
                                         os.path.join(args.profile_trace,
                                                      f"{label}_{name}_rank{rank}.json.gz"))
                    for name, fn in fns.items()}
        # every rank's idle and widest gaps beside rank 0's whole profile: a stream that waits
        # on a late peer idles on one rank only, a transfer's tail on all of them (--no-comm:
        # one process, whose fake group carries no objects)
        own = {name: {"gaps": p["gaps"][:RANK_GAPS],
                      **{k: p[k] for k in ("span", "busy", "idle", "split") + PROFILE_KINDS}}
               for name, p in profiles.items()}
        if args.no_comm:
            ranks = [own]
        else:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, own)
        for name, profile in profiles.items():
            profile["ranks"] = [r[name] for r in ranks]
        timing["device_profile"] = profiles
    return timing


def host_profile(fn, calls: int, timer: Timer, top: int = 40) -> str:
    """cProfile's top entries by cumulative time over `calls` calls of `fn`."""
    return top_entries(cprofile(fn, calls, timer), top)


def cprofile(fn, calls: int, timer: Timer):
    """cProfile's `pstats.Stats` over `calls` calls of `fn`."""
    import cProfile
    import pstats

    timer.sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    timer.sync()
    return pstats.Stats(prof)


def top_entries(stats, top: int = 40, sort: str = "cumulative") -> str:
    import io

    stats.stream = text = io.StringIO()
    stats.sort_stats(sort).print_stats(top)
    return text.getvalue()


# A device profile's kernel kinds, the first match of the lower-cased name winning; ditron's own
# kernels (the Triton functions of ditron_inductor.templates) come first, and what matches nothing
# (Inductor's fused elementwise and reduction kernels: norms, rotary embedding, the loss) is other.
KERNEL_KINDS = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "attention", "sdpa")),
                ("gemm", ("gemm", "gemv", "splitkreduce", "nvjet", "cutlass", "xmma",
                          "triton_tem_")),
                ("optimizer", ("multi_tensor_apply", "foreach")), ("copy", ("memcpy", "memset")))
PROFILE_KINDS = ("ditron",) + tuple(kind for kind, _ in KERNEL_KINDS) + ("other",)
TOP_KERNELS = 12  # the kernels a device profile names, by their time
TOP_GAPS = 10  # the idle intervals it names, by the kernels around them, by their time
RANK_GAPS = 3  # of them, per rank
# A step's device time in parts (`step_split`): GEMV/GEMM, attention, collectives, small ops (the
# rest: Inductor's fused pointwise and reduction kernels, copies), idle. Each kernel kind's part;
# ditron's kernels take the part of the template module that defines them (every module named:
# tests/test_decode_split.py checks it), the all-reduces with their residual and RMSNorm whole.
STEP_PARTS = ("gemm", "attention", "collectives", "small", "idle")
KIND_PARTS = {"nccl": "collectives", "attention": "attention", "gemm": "gemm", "optimizer": "small",
              "copy": "small", "other": "small"}
DITRON_PARTS = {"gemv": "gemm", "grouped_gemm": "gemm", "ag_gemm": "gemm", "gemm_ready": "gemm",
                "decode_attention": "attention", "all_reduce": "collectives",
                "all_reduce_lamport": "collectives", "all_reduce_push": "collectives",
                "reduce": "collectives", "transfer": "collectives", "flags": "collectives",
                "moe_routes": "collectives", "schedule": "collectives"}


@functools.cache
def ditron_kernels() -> dict:
    """{Triton function name: the ditron_inductor.templates module defining it (its last name)}."""
    import importlib
    import inspect
    import pkgutil

    from ditron_inductor import templates

    kernels = {}
    for info in pkgutil.iter_modules(templates.__path__):
        module = importlib.import_module(f"{templates.__name__}.{info.name}")
        # a @triton.jit function, compiled or interpreted (TRITON_INTERPRET=1), wraps it as .fn
        kernels.update((v.fn.__name__, v.fn.__module__.rsplit(".", 1)[-1])
                       for v in vars(module).values() if inspect.isfunction(getattr(v, "fn", None)))
    return kernels


def kernel_kind(name: str) -> str:
    if name in ditron_kernels():
        return "ditron"
    lower = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lower for m in marks)), "other")


def step_part(name: str) -> str:
    """The part of a step's device time (STEP_PARTS but idle) a kernel of this name takes."""
    kind = kernel_kind(name)
    return DITRON_PARTS[ditron_kernels()[name]] if kind == "ditron" else KIND_PARTS[kind]


def step_split(spans, calls: int) -> dict:
    """{part: device ms per call} over the (start, end, name) spans (us) of the kernels and
    copies of `calls` calls: each part the time of its kernels; "span": the first kernel's start
    to the last one's end; "busy": the time some kernel runs (the union: kernels overlapping
    count once); idle: span - busy; "overlap": what the parts but idle sum past busy (kernels on
    different streams at once)."""
    spans, ms = list(spans), dict.fromkeys(STEP_PARTS[:-1], 0.0)
    for start, end, name in spans:
        ms[step_part(name)] += end - start
    ms["span"] = (max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
                  if spans else 0.0)
    ms["busy"] = busy((start, end) for start, end, _ in spans)
    ms["idle"] = ms["span"] - ms["busy"]
    ms["overlap"] = sum(ms[part] for part in STEP_PARTS[:-1]) - ms["busy"]
    return {key: t / 1e3 / calls for key, t in ms.items()}


def busy(spans) -> float:
    """The length of the union of (start, end) spans: the time some kernel runs."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def alone(spans) -> dict:
    """{kind: the time in which kernels of that kind run and none of another kind does} over
    (start, end, kind) spans: what nothing hides (for NCCL and copies: exposed communication)."""
    edges = sorted((t, step, kind) for start, end, kind in spans
                   for t, step in ((start, 1), (end, -1)))  # at one time, ends first
    running, out, last = collections.Counter(), dict.fromkeys(PROFILE_KINDS, 0.0), None
    for t, step, kind in edges:
        kinds = [k for k, n in running.items() if n > 0]
        if len(kinds) == 1:
            out[kinds[0]] += t - last
        running[kind] += step
        last = t
    return out


def idle_gaps(spans) -> dict:
    """Where the device idles between the first kernel and the last of (start, end, name) spans:
    the intervals in which no kernel or copy runs on any stream, by the kernel that ended last
    before each and the one that starts it: {(before, after): [time, count]}. A stream waiting
    on a flag (ditron's waits on a peer) or on the host (launches late) idles alike; NCCL waits
    for a late peer inside its kernel (busy)."""
    gaps: dict = {}
    reach, before = -math.inf, None
    for start, end, name in sorted(spans):
        if before is not None and start > reach:
            gap = gaps.setdefault((before, name), [0.0, 0])
            gap[0] += start - reach
            gap[1] += 1
        if end > reach:
            reach, before = end, name
    return gaps


def device_profile(fn, calls: int, timer: Timer, trace: str | None = None) -> dict:
    """The profile of `calls` calls of `fn` (`kernel_times`); trace: where to write the
    profiler's Chrome trace (gzipped), if given."""
    from torch.profiler import ProfilerActivity, profile

    timer.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if trace:
        os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
        prof.export_chrome_trace(trace)
    return kernel_times(prof.events(), calls)


def kernel_times(events, calls: int) -> dict:
    """{kind: device ms per call} over the kernels and copies among the profiler's `events`;
    "busy": the time some kernel runs (kernels on different streams overlap, so the kinds may sum
    past it; a step longer than it waited on the host); "span": from the first kernel's start to
    the last one's end; "split": the parts of `step_split`; "top": the kernels that took longest,
    with kind and ms. A user annotation (a record_function range such as
    "Optimizer.step#AdamW.step") is on the device's timeline too, spanning the kernels it
    launched: not a kernel, not counted."""
    from torch.autograd import DeviceType

    kernels = [e for e in events
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    ms, by_name = dict.fromkeys(PROFILE_KINDS, 0.0), {}
    for e in kernels:
        per_call = e.device_time_total / 1e3 / calls
        ms[kernel_kind(e.name)] += per_call
        by_name[e.name] = by_name.get(e.name, 0.0) + per_call
    split = step_split(((e.time_range.start, e.time_range.end, e.name) for e in kernels), calls)
    ms["busy"], ms["span"] = split["busy"], split["span"]
    only = alone((e.time_range.start, e.time_range.end, kernel_kind(e.name)) for e in kernels)
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    gaps = idle_gaps((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    widest = sorted(gaps.items(), key=lambda item: -item[1][0])[:TOP_GAPS]
    return {**ms, "split": split, "alone": {kind: t / 1e3 / calls for kind, t in only.items()},
            "top": [[name[:120], kernel_kind(name), round(t, 4)] for name, t in top],
            "idle": sum(t for t, _ in gaps.values()) / 1e3 / calls,
            "gaps": [[before[:80], after[:80], round(t / 1e3 / calls, 4), n / calls]
                     for (before, after), (t, n) in widest]}


def ditron_graphs(start: int) -> list[dict]:
    """The graphs the ditron pass saw since `start`: name and ditron ops (fused candidates, and
    the op each became)."""
    from ditron_inductor.lowering import graph_pass

    return [{"graph": r.graph, "ditron_ops": sum(c.fused for c in r.candidates),
             "left_alone": sum(not c.fused for c in r.candidates),
             "fused_ops": [c.op for c in r.candidates if c.fused]}
            for r in list(graph_pass.reports)[start:]]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of the reference."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# ------------------------------------------------------------------------------------ workloads


def train_rows(args, config, mesh, timer, group_name) -> list[dict]:
    from ditron_inductor.lowering import graph_pass

    ids = [llama_tp.tokens(args.train_batch, args.train_seq, config.vocab_size, seed=s,
                           device=args.device) for s in range(2)]
    steps, checks, graphs, failed = {}, {}, [], {}
    for name in args.contenders.split(","):
        def setup(name=name):
            model = llama_tp.parallelize(llama_tp.build_llama(config, dtype=args.dtype,
                                                              device=args.device),
                                         llama_tp.SEQUENCE_PARALLEL, mesh,
                                         loss_parallel=args.loss_parallel, fp8=args.fp8)
            run = compiled(name, model, EAGER_LAUNCH, group_name, args.no_comm)
            loss_fn = (compiled(name, llama_tp.next_token_loss, EAGER_LAUNCH, group_name,
                                args.no_comm) if args.loss_parallel else None)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5,
                                    **{args.optimizer: True})
            params = dict(model.named_parameters())
            start = len(graph_pass.reports)
            # the checked step (compiles)
            loss = llama_tp.train_loss(run, ids[0], loss_fn)
            checks[name] = {"loss": loss.float(),
                            **{g: llama_tp.local(params[g].grad).detach().clone() for g in GRADS}}
            opt.step()
            opt.zero_grad(set_to_none=True)
            if name == "ditron":
                graphs[:] = ditron_graphs(start)

            def step(box=[0]):
                box[0] += 1
                llama_tp.train_loss(run, ids[box[0] % 2], loss_fn)
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step
        if (step := guarded(name, setup, failed)) is not None:
            steps[name] = step
    shape = f"B {args.train_batch}, S {args.train_seq}"
    timing = interleaved(steps, timer, args, f"train_b{args.train_batch}_s{args.train_seq}")
    workload = (f"train (sequence parallel{', loss parallel' if args.loss_parallel else ''}"
                f"{f', fp8 {args.fp8}' if args.fp8 else ''})")
    return [row(workload, shape, EAGER_LAUNCH, timing, checks, graphs, failed, args.no_comm)]


def guarded(name: str, setup, failed: dict):
    """setup() (build, compile, the checked first call), or None with the error kept in `failed`:
    a contender that fails leaves the others' figures. Every rank compiles the same graphs, so a
    compile error is raised on every rank alike."""
    try:
        return setup()
    except Exception as e:  # noqa: BLE001 - reported in the table
        failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        # the table keeps the first line; the whole error (Dynamo's says which function and why)
        # goes to the log, once
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"{name} failed:", file=sys.stderr)
            traceback.print_exc()
        return None


def inference_rows(workload: str, shapes: list[tuple[int, int]], args, config, mesh, timer,
                   group_name) -> list[dict]:
    from torch._dynamo.utils import counters

    from ditron_inductor.lowering import graph_pass

    model = llama_tp.parallelize(llama_tp.build_llama(config, dtype=args.dtype,
                                                      device=args.device),
                                 llama_tp.TENSOR_PARALLEL, mesh).eval()
    rows = []
    for batch, seq in shapes:
        ids = llama_tp.tokens(batch, seq, config.vocab_size, seed=0, device=args.device)
        for mode in args.modes.split(","):
            torch._dynamo.reset()
            fns, checks, graphs, failed, skips = {}, {}, [], {}, {}
            for name in args.contenders.split(","):
                def setup(name=name):
                    run = compiled(name, model, mode, group_name, args.no_comm)

                    def call():
                        with torch.no_grad():
                            return run(input_ids=ids, logits_to_keep=1).logits
                    start = len(graph_pass.reports)
                    skipped = counters["inductor"]["cudagraph_skips"]
                    checks[name] = {"logits": call().float().clone()}
                    skips[name] = counters["inductor"]["cudagraph_skips"] - skipped
                    if name == "ditron":
                        graphs[:] = ditron_graphs(start)
                    return call
                if (call := guarded(name, setup, failed)) is not None:
                    fns[name] = call
            timing = interleaved(fns, timer, args, f"prefill_{mode}_b{batch}_s{seq}")
            rows.append(row(workload, f"B {batch}, S {seq}", mode, timing, checks, graphs, failed,
                            args.no_comm))
            if mode == CUDA_GRAPHS:  # a graph Inductor would not capture runs eagerly instead
                rows[-1]["cudagraph_skips"] = skips
    return rows


def row(workload: str, shape: str, mode: str, timing: dict, checks: dict, graphs: list,
        failed: dict, no_comm: bool) -> dict:
    baseline = "inductor" if "inductor" in checks else "eager"
    ditron, base = checks.get("ditron"), checks.get(baseline)
    # without communication the collectives' outputs are this rank's own: nothing to compare
    diffs = ({k: max_diff(ditron[k], base[k]) for k in base}
             if ditron and base and not no_comm else {})
    # the other contenders' largest difference from the baseline: how far two right answers
    # lie apart here (fp8 training: e5m2 gradients flip with any change of rounding upstream)
    others = ({name: max(max_diff(c[k], base[k]) for k in base) for name, c in checks.items()
               if name not in (baseline, "ditron")} if base and not no_comm else {})
    # a step over NaN or inf runs other arithmetic (a GEMM over NaN runs faster): not the step
    nonfinite = sorted(name for name, values in checks.items()
                       if not all(bool(torch.isfinite(v).all()) for v in values.values()))
    # finite but wrong numbers: not the step either
    wrong = sorted(name for name, diff in {"ditron": max(diffs.values(), default=0.0),
                                           **others}.items() if diff > WRONG_DIFF)
    return {"workload": workload, "shape": shape, "mode": mode, **timing,
            "ditron_max_diff": diffs, "diff_baseline": baseline, "others_max_diff": others,
            "ditron_graphs": graphs, "failed": failed, "nonfinite": nonfinite, "wrong": wrong}


# ------------------------------------------------------------------------------------- reporting


def no_comm_bounds(path: str, world: int) -> dict:
    """{(workload, shape, mode): (ms, contender)} of a --no-comm run's JSON at this world size:
    its fastest compiled contender (Inductor, or ditron whose graph needs less compute)."""
    with open(path) as f:
        result = json.load(f)
    if not result.get("no_comm") or result.get("world") != world:
        raise SystemExit(f"--bound-json {path}: not the JSON of a --no-comm run at world {world}")
    bounds = {}
    for r in result["rows"]:
        compiled_ms = [(ms, name) for name, ms in r["ms"].items() if name != "eager"]
        if compiled_ms:
            bounds[r["workload"], r["shape"], r["mode"]] = min(compiled_ms)
    return bounds


def table(rows: list[dict], contenders: list[str]) -> str:
    bounded = any("no_comm_ms" in r for r in rows)
    head = (["workload", "shape", "mode"]
            + [f"{CONTENDER_TITLES.get(c, c)} ms" for c in contenders]
            + (["no-comm bound ms", "ceiling (Inductor / bound)"] if bounded else [])
            + ["spread", "host ms per call", "ditron vs Inductor", "ditron vs async TP",
               "ditron ops per graph", "ditron's max diff (vs Inductor, else eager)"])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        ms = r["ms"]

        def speedup(other):
            if "ditron" not in ms or other not in ms:
                return "-"
            return f"{ms[other] / ms['ditron']:.2f}x"
        ops = ", ".join(f"{g['graph'].split()[-1]} {g['ditron_ops']}" for g in r["ditron_graphs"])
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in r["ditron_max_diff"].items())
        cells = ([r["workload"], r["shape"], r["mode"]]
                 + [f"{ms[c]:.3f}" if c in ms else "failed" if c in r["failed"] else "-"
                    for c in contenders]
                 + ([f"{r['no_comm_ms']:.3f} ({r['no_comm_by']})" if "no_comm_ms" in r else "-",
                     f"{ms['inductor'] / r['no_comm_ms']:.2f}x"
                     if "no_comm_ms" in r and "inductor" in ms else "-"] if bounded else [])
                 + [spread_text(r),
                    " / ".join(f"{r['host_ms'][c]:.3f}" for c in contenders
                               if c in r.get("host_ms", {})) or "-"]
                 + [speedup("inductor"), speedup("inductor_async_tp"), ops or "-", diffs or "-"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_text(r: dict) -> str:
    """The largest spread of the row's repetitions, naming its contender where it is beyond
    SPREAD_NAMED (4x H200 had 253-285% spreads from one repetition of one contender)."""
    if "spread" not in r:
        return "-"
    worst = max(r.get("spreads", {}).items(), key=lambda item: item[1], default=None)
    named = f" ({worst[0]})" if worst and worst[1] > SPREAD_NAMED else ""
    return f"{r['spread']:.0%}{named}"


def fp8_verdict(r: dict) -> str:
    """Nothing ("") where ditron's numbers lie within FP8_MAX_DIFF of the baseline's; else how
    far, beside how far the other contenders lie (float8 training on 2x H200: Inductor's async
    TP 0.2 of the largest weight gradient from Inductor, as far as ditron)."""
    worst = max(r["ditron_max_diff"].values(), default=0.0)
    if worst <= FP8_MAX_DIFF:
        return ""
    others = r.get("others_max_diff", {})
    spread = max(others.values(), default=0.0)
    listed = ", ".join(f"{name} {v:.1e}" for name, v in others.items()) or "none to compare"
    where = ("within" if worst <= FP8_SPREAD_SLACK * spread else "BEYOND")
    return (f"ditron's numbers differ from {r['diff_baseline']}'s by {worst:.1e} of the largest "
            f"magnitude (more than {FP8_MAX_DIFF}), {where} the other contenders' own "
            f"difference from it ({listed})")


def gap_lines(gaps: list) -> list[str]:
    """One line per idle stretch of a profile: time and count per call, the kernels around it."""
    return [f"  {t:8.3f} ms  {n:5.1f}x  {before}  ->  {after}" for before, after, t, n in gaps]


def device_table(rows: list[dict], calls: int) -> str:
    """Each profiled contender's step beside its device time by kernel kind."""
    head = ["workload", "shape", "mode", "contender", "step ms", "busy ms",
            *(f"{kind} ms" for kind in PROFILE_KINDS)]
    lines = [f"Device time per call by kernel kind (torch profiler, {calls} calls; busy: some "
             "kernel runs; kinds on different streams overlap)", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        for name, ms in r.get("device_profile", {}).items():
            cells = [r["workload"], r["shape"], r["mode"], name, f"{r['ms'][name]:.3f}",
                     *(f"{ms[k]:.3f}" for k in ("busy",) + PROFILE_KINDS)]
            lines.append("| " + " | ".join(cells) + " |")
    profiles = [(r, name, ms["alone"]) for r in rows
                for name, ms in r.get("device_profile", {}).items() if "alone" in ms]
    if profiles:
        head = ["workload", "shape", "mode", "contender", *(f"{k} alone ms" for k in PROFILE_KINDS)]
        lines += ["", "Device time per call in which only that kind runs (nothing of another kind "
                  "beside it: for nccl and copy, the communication left exposed)", "",
                  "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        lines += ["| " + " | ".join([r["workload"], r["shape"], r["mode"], name,
                                     *(f"{only[k]:.3f}" for k in PROFILE_KINDS)]) + " |"
                  for r, name, only in profiles]
    for r in rows:
        for name, ms in r.get("device_profile", {}).items():
            lines.append(f"\n{r['workload']} {r['shape']} {r['mode']}, {name}: the longest kernels")
            lines += [f"  {t:8.3f} ms  {kind:9} {kernel}" for kernel, kind, t in ms["top"]]
            if "gaps" in ms:
                lines.append(f"  idle {ms['idle']:.3f} ms per call between its first kernel and "
                             "its last, most between (count per call):")
                lines += gap_lines(ms["gaps"])
            for rank, other in enumerate(ms.get("ranks", ())):
                kinds = ", ".join(f"{k} {other[k]:.3f}" for k in PROFILE_KINDS if k in other)
                lines.append(f"  rank {rank}: idle {other['idle']:.3f} ms per call"
                             + (f" (span {other['span']:.3f}, busy {other['busy']:.3f}; "
                                f"{kinds})" if "span" in other else "") + ", most between:")
                lines += gap_lines(other["gaps"])
    return "\n".join(lines)


class Lines(logging.Handler):
    """Keeps what the `ditron` logger writes (one line per match at INFO)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


# ------------------------------------------------------------------------------------------ main


def run(rank: int, world_size: int, argv=None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from ditron_inductor.log_names import LOGGER_NAME

    args = parse_args(argv)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    # Every contender compiles each shape once; the model's code objects hold them all.
    torch._dynamo.config.cache_size_limit = 64
    lines = Lines()
    ditron_log = logging.getLogger(LOGGER_NAME)
    ditron_log.addHandler(lines)
    ditron_log.setLevel(min(ditron_log.getEffectiveLevel(), logging.INFO))

    mesh = init_device_mesh(args.device, (world_size,))
    if args.fp8 and args.device == "cpu" and not args.no_comm:
        gloo_float8_gathers()
    group_name = mesh.get_group().group_name
    config = llama_tp.llama_config(args.hidden, args.intermediate, args.heads, args.kv_heads,
                                   args.layers, args.vocab)
    timer = Timer(args.device)
    workloads = args.workloads.split(",")
    rows = []
    if "train" in workloads:
        rows += train_rows(args, config, mesh, timer, group_name)
    if "prefill" in workloads:
        shapes = [(1, int(s)) for s in args.prefill_seqs.split(",")]
        rows += inference_rows("prefill (TP)", shapes, args, config, mesh, timer, group_name)
    if "decode" in workloads:
        shapes = [(int(b), 1) for b in args.decode_batches.split(",")]
        rows += inference_rows("decode (TP)", shapes, args, config, mesh, timer, group_name)
    ditron_log.removeHandler(lines)
    return {"rows": rows, "ditron_log": lines.lines, "world": world_size,
            "contenders": args.contenders.split(",")}


def report(result: dict, argv: list[str]) -> None:
    args = parse_args(argv)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.bound_json:
        bounds = no_comm_bounds(args.bound_json, result["world"])
        for r in result["rows"]:
            if (key := (r["workload"], r["shape"], r["mode"])) in bounds:
                r["no_comm_ms"], r["no_comm_by"] = bounds[key]
    world = (f"world {result['world']} without communication (a fake group: the collectives "
             f"move nothing, outputs from the local input)" if args.no_comm
             else f"world {result['world']}")
    print(f"\n## Llama e2e: {world}, {device}, hidden {args.hidden}, "
          f"intermediate {args.intermediate}, heads {args.heads}/{args.kv_heads}, "
          f"{args.layers} layers, {'bf16' if args.device == 'cuda' else 'fp32'}"
          f"{f', decoder linear layers fp8 {args.fp8} (torchao)' if args.fp8 else ''}\n")
    print(table(result["rows"], result["contenders"]))
    for r in result["rows"]:
        for name, error in r["failed"].items():
            print(f"\n{r['workload']} {r['shape']} {r['mode']}: {name} failed: {error}")
        if args.fp8 and (verdict := fp8_verdict(r)):
            print(f"\n{r['workload']} {r['shape']} {r['mode']}: {verdict}")
        if r.get("nonfinite"):
            print(f"\n{r['workload']} {r['shape']} {r['mode']}: non-finite loss, gradients or "
                  f"logits from {', '.join(r['nonfinite'])}: their times are not the step's")
        if r.get("wrong"):
            print(f"\n{r['workload']} {r['shape']} {r['mode']}: WRONG numbers from "
                  f"{', '.join(r['wrong'])} (more than {WRONG_DIFF} of the largest magnitude away "
                  f"from {r['diff_baseline']}'s): their times are not the step's")
        for name, text in r.get("host_profile", {}).items():
            print(f"\n{r['workload']} {r['shape']} {r['mode']}: {name}, cProfile of "
                  f"{args.profile_host} calls:\n{text}")
        for name, n in r.get("cudagraph_skips", {}).items():
            if n:
                print(f"\n{r['workload']} {r['shape']} {r['mode']}: {name}: Inductor skipped CUDA "
                      f"graphs {n} times (TORCH_LOGS=cudagraphs says why)")
    if args.profile_device:
        print("\n" + device_table(result["rows"], args.profile_device))
    print("\nditron, one line per match (rank 0):")
    for line in result["ditron_log"]:
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.argv[0]] + argv), "device": device,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "torch": torch.__version__, "no_comm": args.no_comm, **result}, f,
                      indent=1)


_KERNEL_LIBRARIES = []  # the torch.library.Library objects of register_collectives, kept alive


def register_collectives(kernels: dict, devices: tuple) -> None:
    """{op name: kernel} for `_c10d_functional`'s ops on `devices`, in this process only."""
    lib = torch.library.Library("_c10d_functional", "IMPL")
    _KERNEL_LIBRARIES.append(lib)
    for name, kernel in kernels.items():
        for device in devices:
            lib.impl(name, kernel, device)


def gloo_float8_gathers() -> None:
    """CPU with --fp8: the functional all-gathers move a float8 tensor as its bytes. gloo has no
    float8 dtypes ("Invalid scalar type" at the wait), so eager's and Inductor's float8 gathers
    (torchao's sequence parallelism) fail on CPU ranks, while ditron's reference gathers the
    bytes itself; here each contender gathers what NCCL would (synchronous c10d calls)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from ditron_inductor.ops import FLOAT8_DTYPES

    def gather_out(input, group_size, group_name, *, out):
        input = input.contiguous()
        if input.dtype in FLOAT8_DTYPES:
            input = input.view(torch.uint8)
        dist.all_gather_into_tensor(out.view(input.dtype), input,
                                    group=_resolve_process_group(group_name))
        return out

    def gather(input, group_size, group_name):
        out = input.new_empty((group_size * input.shape[0], *input.shape[1:]))
        return gather_out(input, group_size, group_name, out=out)
    register_collectives({"all_gather_into_tensor": gather,
                          "all_gather_into_tensor_out": gather_out}, ("CPU",))


def local_collectives() -> None:
    """--no-comm: the functional collectives write their outputs from this rank's input.

    The fake group's collectives return at once and leave their outputs unwritten: the gathered
    activations, and all that is computed from them, hold stale bits, NaN among them, and a GEMM
    over NaN or zeros runs about 10% faster on H200 than over the step's values. Here an
    all-gather repeats its input, a reduce-scatter keeps its input's first chunk and an
    all-reduce its input: finite values of the step's own scale, for a local copy each, which a
    real collective writes locally too. Registered for CPU and CUDA tensors, in this process
    only."""
    def gather(input, group_size, group_name):
        return input.repeat(group_size, *[1] * (input.dim() - 1))

    def gather_out(input, group_size, group_name, *, out):  # written in place: one pass
        out.view(group_size, *input.shape).copy_(input.expand(group_size, *input.shape))
        return out

    def scatter(input, reduce_op, group_size, group_name):
        return input.chunk(group_size)[0].clone()

    kernels = {
        "all_gather_into_tensor": gather,
        "all_gather_into_tensor_out": gather_out,
        "all_gather_into_tensor_coalesced": lambda inputs, group_size, group_name:
            [gather(t, group_size, group_name) for t in inputs],
        "reduce_scatter_tensor": scatter,
        "reduce_scatter_tensor_out": lambda input, reduce_op, group_size, group_name, *, out:
            out.copy_(input.chunk(group_size)[0]),
        "reduce_scatter_tensor_coalesced": lambda inputs, reduce_op, group_size, group_name:
            [scatter(t, reduce_op, group_size, group_name) for t in inputs],
        "all_reduce": lambda input, reduce_op, group_name: input.clone(),
        "all_reduce_": lambda input, reduce_op, group_name: input,
        "all_reduce_coalesced": lambda inputs, reduce_op, group_name: [t.clone() for t in inputs],
        "all_reduce_coalesced_": lambda inputs, reduce_op, group_name: inputs,
    }
    register_collectives(kernels, ("CPU", "CUDA"))


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # a run that does not exit: SIGUSR1 to a rank (not to torchrun) prints where its threads wait
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.no_comm:  # rank 0 of a group whose other ranks never exist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
        local_collectives()
        report(run(0, args.world, argv), argv)
        dist.destroy_process_group()
        return
    if args.bound_json:  # fail before the run, not after it
        no_comm_bounds(args.bound_json, int(os.environ.get("WORLD_SIZE", args.world)))
    launch(run, report, args, argv)


def launch(run_rank, report_result, args, argv: list[str]) -> None:
    """Under torchrun: `run_rank(rank, world, argv)` on each rank, rank 0 reporting; on CPU
    without it, --world gloo ranks spawned here, which import `run_rank` by name (a module-level
    function of the script), rank 0's result reported (e2e_llama.py and e2e_decode.py)."""
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        result = run_rank(dist.get_rank(), dist.get_world_size(), argv)
        rank, start = dist.get_rank(), time.perf_counter()
        if rank == 0:
            report_result(result, argv)
        clean_exit.release_cuda_graphs()  # also where no contender compiled with ditron
        dist.destroy_process_group()
        print(f"rank {rank}: report and process-group teardown took "
              f"{time.perf_counter() - start:.1f} s; exiting", file=sys.stderr, flush=True)
        return
    if args.device == "cuda":
        sys.exit("--device cuda: launch with torchrun --nproc-per-node W (see the module docs)")
    from tests.distributed import run_ranks

    results = run_ranks(run_rank, args.world, args=(argv,), timeout_s=1800,
                        env={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                             "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"})
    report_result(results[0], argv)


if __name__ == "__main__":
    main()
