"""Real decoding: Hugging Face Llama's `generate()` with a static KV cache under tensor
parallelism, Inductor against ditron, both under CUDA graphs (`mode="reduce-overhead"`).

On GPUs (bf16 unless `--dtype fp32`, Llama-3-8B layer sizes, 4 layers, TP over the GPUs torchrun
starts; one GPU is world 1):

    torchrun --nproc-per-node 1 benchmarks/e2e_decode.py \\
        --json benchmarks/results/e2e_decode_h100x1.json
    torchrun --nproc-per-node 2 benchmarks/e2e_decode.py --batches 1,4,16 --prompts 128,2048 \\
        --new-tokens 128,512 --json benchmarks/results/e2e_decode_h100x2.json

(the script sets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
where unset, as `e2e_llama.py` does). Smoke run on CPU, 2 gloo ranks that the script spawns
itself, tiny config, eager's tokens beside the compiled ones:

    python benchmarks/e2e_decode.py --device cpu --tiny

Model: `transformers.LlamaForCausalLM` from a `LlamaConfig` (sizes on the command line), random
init, the same on every rank, without an end-of-sequence token (every call makes all its new
tokens); the plain TP plan of `tests/llama_tp.py` (`tensor_parallel`: an all-reduce after o_proj
and down_proj, lm_head's logits gathered), with the DTensor parameters `parallelize_module`
leaves, or (`--params local`) each rank's slices as plain tensors and the plan's collectives as
functional collectives in forward hooks (`llama_tp.apply_locally`): nothing for a compiled graph
to unwrap at each call. `--params dtensor,local` runs both. Each contender and parameter kind
has its own model, so that its compiled step stays compiled while the others run.

Compilation is transformers' own: with a static cache `generate()` compiles the model's forward
for the decode steps (the prefill runs eagerly), here with a `CompileConfig` naming the
contender's backend, `mode="reduce-overhead"`, `fullgraph=True` (a graph break fails the
contender) and `dynamic=False`. The cache position is a tensor of the cache, so every step runs
one graph: the table counts the graphs Dynamo compiled during the first `generate()` (1) and
after it (0: each later step, of `generate()` or bare, replays it).

Contenders: eager, inductor, ditron, ditron_fusions_only (ditron with its rewrites that are not
fusions off: the causal mask, the decode GEMM of one-row matmuls, the GQA packing of the
attention; so that what fusing the all-reduces gains is told apart from what those gain), and
ditron_no_gemm_groups (ditron with `ditron.decode_gemm_groups` off: each one-row product its own
launch, to time that option). A compiled contender's name with `+graph` (e.g. `ditron+graph`)
compiles its step without "reduce-overhead" and replays the whole call from one CUDA graph of
`ditron_inductor.compile_decode` (a StepGraph), in `generate()` and in the bare step: no Dynamo
frame, AOTAutograd wrapper or CUDA-graph tree on the host at each step.

Per shape (batch B, prompt P, new tokens N) and contender:
- `generate()`, greedy: a `StaticCache` of P + N positions, made once and reset before each call
  (its tensors keep their addresses, which the CUDA graphs hold; a new cache per call, as
  `cache_implementation="static"` makes, would re-record them); a stopping criterion stamps the
  end of each step (CUDA events and the host's clock): decode tokens/s, B (N - 1) over the time
  from the first token to the last; each step's latency, median and p99 over --reps calls; the
  host's time per step (on CUDA generate() waits for the device at each step, to read whether
  every sequence has ended); the prefill (time to the first token, with generate()'s
  preamble). The first call compiles, then --warmup calls, then the timed ones, the
  contenders in turn; their tokens must be the first call's.
- the bare decode step: the compiled forward on the inputs `generate()` hands one step
  (`prepare_inputs_for_generation`: the same graph), called in a loop, the cache rewound before
  it overflows; device and host ms per step, as `e2e_llama.interleaved` times a call (the host
  does not wait for the device): the model's step without `generate()`'s loop.
- tokens: each contender's greedy tokens against eager's (where eager runs) or Inductor's, with
  DTensor parameters where they ran, token for token, the first difference named, with each
  side's margin there (the gap between its two largest logits over the largest's magnitude, kept
  by the first call): under NEAR_TIE on either side the difference is a near tie, which another
  summation order flips, else a wrong number.
`--profile-host N` profiles N bare steps and one `generate()` call with cProfile: host ms per step
split into the compiled call's parts (outside AOTAutograd: nn.Module's call, Dynamo's frame and
guards; AOTAutograd's runtime wrappers, where DTensor parameters are unwrapped; Inductor's call,
the CUDA graph replay) and generate()'s loop around it, with the Python calls per step, then
cProfile's top entries. `--skip-guard-eval` times the calls after the first with Dynamo running
only the guards that tell its graphs apart. `--compile-options JSON` compiles with those options
instead of `mode="reduce-overhead"` (e.g. Inductor's CUDA graphs without the trees).
`--profile-device N` (CUDA only: refused on CPU, which has no kernels to profile) runs the torch
profiler over N bare steps of each contender: the device time by kernel kind, and a step's split
(`split_table`): GEMV/GEMM (cuBLAS, the decode GEMM template, Triton matmuls), attention (SDPA's
kernels, the decode attention template), collectives (NCCL, ditron's all-reduces), small ops (the
rest: Inductor's fused pointwise and reduction kernels, copies) and idle (no kernel running), ms
per step and share of the step's device span, in the JSON as each row's `device_profile.split`.
Times are the maximum over ranks. `--json PATH` writes the rows, the ditron lines and the
command; a markdown table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import inspect
import itertools
import json
import logging
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.no_multicast import keep_multicast_off  # noqa: E402

keep_multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import e2e_llama  # noqa: E402
from tests import llama_tp  # noqa: E402

# ditron_fusions_only: ditron with its rewrites that are not fusions off (e2e_llama.FUSIONS_ONLY:
# the causal mask, the decode GEMM, the GQA packing), so the effects are told apart;
# ditron_no_gemm_groups: ditron with each one-row decode GEMM its own launch (the option
# ditron.decode_gemm_groups off), what the groups gain
CONTENDERS = ("eager", "inductor", "ditron", "ditron_fusions_only", "ditron_no_gemm_groups")
STEP_GRAPH = "+graph"  # a compiled contender's suffix: its whole step in StepGraph's CUDA graph
CONTENDER_OPTIONS = {"ditron_fusions_only": e2e_llama.FUSIONS_ONLY,
                     "ditron_no_gemm_groups": {"ditron.decode_gemm_groups": False}}
PARAMS = ("dtensor", "local")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODE = "reduce-overhead"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="tiny config and shapes (hidden 64, 2 layers, B 2, P 8, N 6), eager too: "
                        "a smoke run")
    p.add_argument("--world", type=int, default=2,
                   help="ranks to spawn when not launched by torchrun (CPU)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="the model's dtype: bf16 on CUDA, fp32 on CPU unless given (fp32 on "
                        "CUDA: greedy tokens without bf16's near ties)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompts", default="1024", help="prompt lengths")
    p.add_argument("--new-tokens", default="128")
    p.add_argument("--contenders", default="inductor,ditron")
    p.add_argument("--params", default="dtensor,local",
                   help="dtensor: the DTensor parameters of parallelize_module; local: plain "
                        "tensors, the collectives in forward hooks")
    p.add_argument("--skip-guard-eval", action="store_true",
                   help="time the calls after the first under torch.compiler.set_stance("
                        "skip_guard_eval_unsafe=True): Dynamo runs only the guards that tell "
                        "its compiled graphs apart (the timed calls' tokens are checked)")
    p.add_argument("--compile-options", type=json.loads, default=None, metavar="JSON",
                   help="compile with these options instead of mode=\"reduce-overhead\" (e.g. "
                        "'{\"triton.cudagraphs\": true, \"triton.cudagraph_trees\": false}': "
                        "Inductor's CUDA graphs without the trees)")
    p.add_argument("--warmup", type=int, default=1,
                   help="generate() calls after the first (which compiles), and bare steps, "
                        "before timing")
    p.add_argument("--reps", type=int, default=3, help="timed generate() calls per contender")
    p.add_argument("--iters", type=int, default=10,
                   help="bare steps per timed repetition (at least; see --min-ms)")
    p.add_argument("--min-ms", type=float, default=20.0,
                   help="each timed repetition of bare steps runs at least this long")
    p.add_argument("--profile-host", type=int, default=0, metavar="STEPS",
                   help="cProfile this many bare steps and one generate() call of each "
                        "contender: where the host's time per step goes")
    p.add_argument("--profile-device", type=int, default=0, metavar="STEPS",
                   help="the torch profiler over this many bare steps: device ms per step by "
                        "kernel kind and the step's split (GEMV/GEMM, attention, collectives, "
                        "small ops, idle); CUDA only")
    p.add_argument("--json", default=None, help="also write the results here")
    if p.parse_known_args(argv)[0].tiny:  # new defaults; options given still win
        p.set_defaults(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2, vocab=128,
                       batches="2", prompts="8", new_tokens="6", contenders="eager,inductor,ditron",
                       params="dtensor", warmup=0, reps=2, iters=2, min_ms=0.0)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    graphed = tuple(c + STEP_GRAPH for c in CONTENDERS if c != "eager")
    for option, allowed in (("contenders", CONTENDERS + graphed), ("params", PARAMS)):
        bad = [v for v in getattr(args, option).split(",") if v not in allowed]
        if bad:
            p.error(f"--{option}: {', '.join(map(repr, bad))} not among {', '.join(allowed)}")
    if min(int(n) for n in args.new_tokens.split(",")) < 2:
        p.error("--new-tokens: at least 2 (the first token comes from the prefill)")
    if args.device == "cpu" and args.profile_device:
        p.error("--profile-device: CUDA kernels only (--device cuda)")
    return args


# ------------------------------------------------------------------------------------ one run


def split_contender(contender: str) -> tuple[str, bool]:
    """(the contender without the suffix, whether its step replays from a StepGraph)."""
    if contender.endswith(STEP_GRAPH):
        return contender[:-len(STEP_GRAPH)], True
    return contender, False


def generation_config(contender: str, new_tokens: int, device: str, options=None):
    """Greedy, `new_tokens` tokens, the decode step compiled by transformers with the
    contender's backend (eager: not compiled), in mode "reduce-overhead" or with `options`
    (with the `+graph` suffix: neither, StepGraph is the step's CUDA graph)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    contender, step_graph = split_contender(contender)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, use_cache=True)
    if contender == "eager":
        config.disable_compile = True
        return config
    if step_graph:
        options = {**(options or {}), **CONTENDER_OPTIONS.get(contender, {})} or None
        if options and options.get("triton.cudagraphs"):
            raise ValueError(f"{contender}{STEP_GRAPH}: StepGraph is the step's CUDA graph; "
                             "compile options with triton.cudagraphs would nest another")
    elif contender in CONTENDER_OPTIONS:  # torch.compile takes a mode or options, not both
        from torch._inductor import list_mode_options

        options = {**(options or list_mode_options(MODE)), **CONTENDER_OPTIONS[contender]}
    config.compile_config = CompileConfig(backend="ditron" if contender.startswith("ditron")
                                          else contender,
                                          mode=None if options or step_graph else MODE,
                                          options=options, fullgraph=True, dynamic=False)
    # transformers compiles on accelerators only, unless told to
    config.compile_config._compile_all_devices = device == "cpu"
    return config


def rewind(cache, tokens: int) -> None:
    """The static cache `tokens` positions back, in place (its tensors keep their addresses):
    each layer's position counter, a device tensor the compiled step reads (transformers 5.17's
    static layers have no crop())."""
    for layer in cache.layers:
        layer.cumulative_length.sub_(tokens)


@functools.cache
def cache_keyword() -> str:
    """The keyword transformers takes the KV cache by: `cache` from 5.2x (5.24 here),
    `past_key_values` before (5.17 on the GPU machine, where `cache` fails generate())."""
    from transformers import LlamaForCausalLM

    forward = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


class StepClock:
    """A stopping criterion that stamps the end of each step of `generate()` (it runs once per
    new token, after the token's choice) and never stops it: CUDA events and the host's clock.
    (A logits processor would cost more: generate() inspects its signature at every step.)"""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.stamps: list = []

    def start(self) -> None:
        self.stamps = [self._stamp()]

    def _stamp(self):
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return event, time.perf_counter()

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        self.stamps.append(self._stamp())
        return False

    def intervals(self) -> tuple[list[float], list[float]]:
        """(device ms, host ms) from each stamp to the next: the prefill (with generate()'s
        preamble), then each decode step. On CPU both are the host's."""
        host = [(b[1] - a[1]) * 1e3 for a, b in itertools.pairwise(self.stamps)]
        if not self.cuda:
            return host, host
        self.stamps[-1][0].synchronize()
        return [a[0].elapsed_time(b[0]) for a, b in itertools.pairwise(self.stamps)], host


class Decoder:
    """One contender's model on one shape: `generate()` and the bare decode step, over a static
    cache of its own."""

    def __init__(self, model, contender: str, ids: torch.Tensor, new_tokens: int, device: str,
                 options=None):
        from transformers import StaticCache, StoppingCriteriaList

        self.model, self.ids, self.new_tokens = model, ids, new_tokens
        self.cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
        self.config = generation_config(contender, new_tokens, device, options)
        if split_contender(contender)[1]:
            # generate() and bare_step take the compiled call from the model's hook: the whole
            # call replayed from StepGraph's CUDA graph
            import ditron_inductor

            compiled = self.config.compile_config
            ditron_inductor.compile_decode(model, compiled.options, backend=compiled.backend,
                                           dynamic=compiled.dynamic)
        self.clock = StepClock(device == "cuda")
        self.criteria = StoppingCriteriaList([self.clock])
        self.tokens = None  # the first call's, which every later call must make

    def generate(self, margins: Margins | None = None) -> torch.Tensor:
        """The new tokens of one greedy `generate()` call, [B, N]; `margins` keeps each step's."""
        from transformers import LogitsProcessorList

        self.cache.reset()
        self.clock.start()
        processors = {"logits_processor": LogitsProcessorList([margins])} if margins else {}
        out = self.model.generate(self.ids, generation_config=self.config,
                                  stopping_criteria=self.criteria,
                                  **{cache_keyword(): self.cache}, **processors)
        new = out[:, self.ids.shape[1]:]
        if new.shape[1] != self.new_tokens:
            raise RuntimeError(f"generate() made {new.shape[1]} tokens, not {self.new_tokens}")
        return new

    def bare_step(self):
        """The forward `generate()` calls at a decode step, on the inputs it hands the first one,
        as a function to call in a loop: each call writes the next cache position; before the
        cache overflows it is rewound (in place: its addresses stay). Call after `generate()`."""
        prompt, room = self.ids.shape[1], self.new_tokens - 1
        batch = self.ids.shape[0]
        # as generate() builds them (the same keys, in its order: the same compiled graph)
        inputs = self.model.prepare_inputs_for_generation(
            self.ids[:, -1:], next_sequence_length=1, **{cache_keyword(): self.cache},
            attention_mask=torch.ones(batch, prompt + 1, dtype=torch.long,
                                      device=self.ids.device),
            position_ids=torch.full((batch, 1), prompt, device=self.ids.device),
            logits_to_keep=1, use_cache=True)
        forward = (self.model.__call__ if self.config.disable_compile
                   else self.model.get_compiled_call(self.config.compile_config))
        rewind(self.cache, room)  # back to the prompt: room for N - 1 steps
        calls = [0]

        def step():
            if calls[0] == room:
                rewind(self.cache, room)
                calls[0] = 0
            forward(**inputs, return_dict=True)
            calls[0] += 1
        return step


class Margins:
    """A logits processor that keeps each step's greedy margin per row, (largest - second
    largest logit) / |largest|, and changes no score. Only the first call of each contender
    carries it (generate() inspects a processor's signature at every step)."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        top = scores.float().topk(2, dim=-1).values
        self.steps.append((top[:, 0] - top[:, 1]) / top[:, 0].abs().clamp_min(1e-6))
        return scores

    def per_row(self) -> list[list[float]]:
        """[B][N]: row b's margin at new token n."""
        return torch.stack(self.steps, dim=1).tolist()


# a greedy choice this close is a near tie: bf16 logits of two summation orders differ by 1-2% of
# the largest (e2e_llama's prefill against Inductor: 1.1-1.7e-2)
NEAR_TIE = 2e-2


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def first_difference(row: dict, reference: dict) -> str | None:
    """None where the row's greedy tokens are the reference row's, else where they part first,
    with both margins there and whether that is a near tie."""
    for b, (got, want) in enumerate(zip(row["tokens"], reference["tokens"])):
        for n, (mine, theirs) in enumerate(zip(got, want)):
            if mine != theirs:
                margins = (row["margins"][b][n], reference["margins"][b][n])
                verdict = "a near tie" if min(margins) < NEAR_TIE else "NOT a near tie"
                return (f"row {b}, new token {n}: {mine} vs {theirs}, {verdict} (margins "
                        f"{margins[0]:.1e} / {margins[1]:.1e})")
    return None


def step_stats(device_ms: list[list[float]], host_ms: list[list[float]], batch: int) -> dict:
    """Each timed call's intervals (the prefill, then each decode step), the largest over ranks:
    the decode rate, the steps' latency and the prefill."""
    steps = [ms for call in device_ms for ms in call[1:]]
    return {
        "tokens_per_s": statistics.median(batch * (len(c) - 1) * 1e3 / sum(c[1:])
                                          for c in device_ms),
        "step_ms": statistics.median(steps),
        "step_p99_ms": (statistics.quantiles(steps, n=100, method="inclusive")[98]
                        if len(steps) > 1 else steps[0]),
        "step_host_ms": statistics.median(ms for call in host_ms for ms in call[1:]),
        "prefill_ms": statistics.median(c[0] for c in device_ms),
    }


def bytes_per_step(model, batch: int, prompt: int, new_tokens: int) -> int:
    """The bytes a decode step reads at the least, on this rank: every parameter but the
    embedding table (of which it reads a row per sequence), and the KV cache up to the mean
    position of the decode (K and V of each layer, this rank's heads, as the cache stores them)."""
    embedding = model.get_input_embeddings().weight
    weights = sum(llama_tp.local(p).numel() * p.element_size() for p in model.parameters()
                  if p is not embedding)
    cfg = model.config
    heads = cfg.num_key_value_heads // (dist.get_world_size() if dist.is_initialized() else 1)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    positions = prompt + new_tokens / 2
    kv = 2 * cfg.num_hidden_layers * batch * heads * head_dim * positions * embedding.element_size()
    return int(weights + kv)


@functools.lru_cache(maxsize=None)
def read_bandwidth(device: str) -> float | None:
    """Bytes per second this GPU reads from its memory (torch.sum of 2 GiB of bf16, the median
    of 20 timed calls after 3); None off CUDA, where the bound is not reported."""
    if device != "cuda":
        return None
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    timer = e2e_llama.Timer(device)
    timer(x.sum, 3)
    ms = statistics.median(timer(x.sum, 1)[0] for _ in range(20))
    return x.numel() * x.element_size() / (ms / 1e3)


def rank_max(values: list[list[float]], device: str) -> list[list[float]]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


# Where a compiled step's host time goes, by the functions cProfile sees (file, function):
# Dynamo's wrapper around the whole call (inside it nn.Module's call runs, then the frame Dynamo
# compiled: its guards, then AOTAutograd); AOTAutograd's runtime wrapper (it unwraps tensor
# subclasses: the DTensor parameters) around Inductor's compiled graph (its CUDA graph replay);
# generate()'s prefill, which a profile of generate() holds beside the decode steps.
COMPILED_CALL = ("torch/_dynamo/eval_frame.py", "compile_wrapper")
AOT_CALL = ("torch/_functorch/_aot_autograd/runtime_wrappers.py", "runtime_wrapper")
GRAPH_CALL = ("torch/_inductor/output_code.py", "__call__")
PREFILL = ("transformers/generation/utils.py", "_prefill")


def cumulative_ms(stats, where: tuple[str, str]) -> float | None:
    """cProfile's cumulative ms of the function `where` names (its costliest entry), or None."""
    file, function = where
    times = [entry[3] for (path, _, name), entry in stats.stats.items()
             if name == function and path.replace(os.sep, "/").endswith(file)]
    return max(times) * 1e3 if times else None


def host_split(stats, steps: int) -> dict:
    """Host ms per decode step from a cProfile over `steps` of them (a prefill it holds left
    out): all of it; outside the compiled call (generate()'s loop); the compiled call's parts
    outside AOTAutograd (nn.Module's call, Dynamo's frame and guards), in AOTAutograd's
    wrappers and in Inductor's call; None where a part is not there (eager). And the Python
    function calls per step (a prefill's too)."""
    ms = {name: cumulative_ms(stats, where) for name, where in
          (("compiled", COMPILED_CALL), ("aot", AOT_CALL), ("graph", GRAPH_CALL),
           ("prefill", PREFILL))}
    compiled, aot, graph = (None if ms[k] is None else ms[k] / steps
                            for k in ("compiled", "aot", "graph"))
    total = (stats.total_tt * 1e3 - (ms["prefill"] or 0.0)) / steps
    return {
        "ms": total,
        "outside_call_ms": None if compiled is None else total - compiled,
        "dynamo_ms": None if None in (compiled, aot) else compiled - aot,
        "aot_ms": None if None in (aot, graph) else aot - graph,
        "graph_ms": graph,
        "calls": stats.total_calls / steps,
    }


def host_profile(decoder: Decoder, step, steps: int, timer) -> dict:
    """cProfile over `steps` bare steps and over one generate() call (N - 1 decode steps)."""
    bare = e2e_llama.cprofile(step, steps, timer)
    whole = e2e_llama.cprofile(decoder.generate, 1, timer)
    return {"bare": host_split(bare, steps),
            "generate": host_split(whole, decoder.new_tokens - 1),
            "bare_top": e2e_llama.top_entries(bare, 30),
            "bare_self": e2e_llama.top_entries(bare, 30, sort="tottime"),
            "generate_top": e2e_llama.top_entries(whole, 30)}


def first_call(row: dict, model, ids: torch.Tensor, args):
    """The contender's first generate(), which compiles: its tokens, the graphs compiled, the
    graphs Inductor left out of CUDA graphs, ditron's sites; then --warmup more calls. The
    Decoder, or None with the error in row["failed"] (the other contenders run on)."""
    from torch._dynamo.utils import counters

    from ditron_inductor.lowering import graph_pass

    def setup():
        start, graphs = len(graph_pass.reports), compiled_graphs()
        skips = counters["inductor"]["cudagraph_skips"]
        decoder = Decoder(model, row["contender"], ids, row["new_tokens"], args.device,
                          args.compile_options)
        margins = Margins()
        decoder.tokens = decoder.generate(margins)
        row["tokens"], row["margins"] = decoder.tokens.tolist(), margins.per_row()
        row["graphs_first_call"] = compiled_graphs() - graphs
        row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
        if split_contender(row["contender"])[0].startswith("ditron"):
            row["ditron_graphs"] = e2e_llama.ditron_graphs(start)
        for _ in range(args.warmup):
            decoder.generate()
        return decoder
    failed, name = {}, f"B {row['batch']}, {row['contender']}"
    decoder = e2e_llama.guarded(name, setup, failed)
    row["failed"] = failed.get(name)
    return decoder


def timed_generates(decoders: dict, rows: dict, args, timer) -> dict:
    """{label: (device ms, host ms)}: each of --reps calls' intervals, the contenders in turn.
    Each row counts the graphs its calls compiled and the calls whose tokens were not its first
    call's."""
    times = {label: ([], []) for label in decoders}
    for _ in range(args.reps):
        for label, decoder in decoders.items():
            timer.sync()
            graphs = compiled_graphs()
            tokens = decoder.generate()
            rows[label]["graphs_later_calls"] += compiled_graphs() - graphs
            rows[label]["calls_unlike_first"] += not torch.equal(tokens, decoder.tokens)
            for kept, ms in zip(times[label], decoder.clock.intervals()):
                kept.append(ms)
    return {label: tuple(rank_max(ms, args.device) for ms in kept)
            for label, kept in times.items()}


def shape_rows(shape: tuple[int, int, int], models: dict, args, config, timer) -> list[dict]:
    """Every contender on one shape: its first generate() (it compiles: the tokens checked and
    the graphs counted), --reps timed calls in turn, then the bare steps."""
    batch, prompt, new_tokens = shape
    torch._dynamo.reset()
    ids = llama_tp.tokens(batch, prompt, config.vocab_size, seed=0, device=args.device)
    rows, decoders = {}, {}
    for (contender, params), model in models.items():
        label = f"{contender}/{params}"
        rows[label] = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens,
                       "contender": contender, "params": params}
        if (decoder := first_call(rows[label], model, ids, args)) is not None:
            decoders[label] = decoder
            rows[label].update(graphs_later_calls=0, calls_unlike_first=0)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=args.skip_guard_eval):
        times = timed_generates(decoders, rows, args, timer)
        steps = {label: decoder.bare_step() for label, decoder in decoders.items()}
        for label, step in steps.items():  # the first bare step: a graph of its own if any
            graphs = compiled_graphs()
            step()
            rows[label]["graphs_later_calls"] += compiled_graphs() - graphs
        # its cProfile of the bare steps is host_profile's, below; the device profile's ranks
        # are gathered over the process group (no fake group here), no traces written
        bare = e2e_llama.interleaved(
            steps, timer, argparse.Namespace(**{**vars(args), "profile_host": 0,
                                                "no_comm": False, "profile_trace": None}),
            f"decode_b{batch}_p{prompt}")
        for label, decoder in decoders.items():
            row = rows[label]
            row.update(step_stats(*times[label], batch))
            row.update(bare_ms=bare["ms"][label], bare_host_ms=bare["host_ms"][label],
                       bare_spread=bare["spread"])
            bandwidth = read_bandwidth(args.device)
            if bandwidth:  # the weight-read bound of a step, and the bare step's share of it
                read = bytes_per_step(models[row["contender"], row["params"]], batch, prompt,
                                      new_tokens)
                row.update(read_bytes=read, read_bandwidth=bandwidth,
                           bound_ms=read / bandwidth * 1e3)
            if "device_profile" in bare:
                row["device_profile"] = bare["device_profile"][label]
            if args.profile_host:
                row["host_profile"] = host_profile(decoder, steps[label], args.profile_host,
                                                   timer)
    check_tokens(list(rows.values()))
    return list(rows.values())


def check_tokens(rows: list[dict]) -> None:
    """Every row's tokens against one reference: eager's, else Inductor's, with DTensor
    parameters where they ran (the plan as users apply it), else with local ones."""
    made = {(r["contender"], r["params"]): r for r in rows if "tokens" in r}
    reference = next((key for key in itertools.product(("eager", "inductor"), PARAMS)
                      if key in made), None)
    for key, row in made.items():
        if reference is not None and key != reference:
            row["reference"] = "/".join(reference)
            row["first_difference"] = first_difference(row, made[reference])


# ------------------------------------------------------------------------------------- report


def table(rows: list[dict]) -> str:
    head = ["B", "prompt", "new", "params", "contender", "decode tokens/s", "step ms",
            "step p99 ms", "host ms per step", "bare step ms", "of the read bound",
            "bare step host ms",
            "prefill ms", "vs Inductor", "tokens", "graphs (first call / later)", "ditron ops"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        shape = [str(r["batch"]), str(r["prompt"]), str(r["new_tokens"]), r["params"],
                 r["contender"]]
        if r["failed"]:
            lines.append("| " + " | ".join(shape + [f"failed: {r['failed']}"]
                                           + [""] * (len(head) - 6)) + " |")
            continue
        inductor = next((o for o in rows if o["contender"] == "inductor" and not o["failed"]
                         and all(o[k] == r[k] for k in ("batch", "prompt", "new_tokens",
                                                        "params"))), None)
        ratio = (f"{r['tokens_per_s'] / inductor['tokens_per_s']:.2f}x"
                 if inductor and r["contender"] != "inductor" else "-")
        if "reference" not in r:
            tokens = "reference"
        elif r["first_difference"] is None:
            tokens = f"= {r['reference']}"
        else:
            tokens = f"differ from {r['reference']}: {r['first_difference']}"
        if r["calls_unlike_first"]:
            tokens += f"; {r['calls_unlike_first']} timed call(s) unlike the first"
        bound = (f"{r['bound_ms'] / r['bare_ms']:.0%} ({r['bound_ms']:.3f} ms)"
                 if "bound_ms" in r else "-")
        ops = ", ".join(f"{g['graph'].split()[-1]} {g['ditron_ops']}"
                        for g in r.get("ditron_graphs", [])) or "-"
        cells = shape + [f"{r['tokens_per_s']:.0f}", f"{r['step_ms']:.3f}",
                         f"{r['step_p99_ms']:.3f}", f"{r['step_host_ms']:.3f}",
                         f"{r['bare_ms']:.3f}", bound, f"{r['bare_host_ms']:.3f}",
                         f"{r['prefill_ms']:.1f}", ratio, tokens,
                         f"{r['graphs_first_call']} / {r['graphs_later_calls']}", ops]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def host_table(rows: list[dict], steps: int) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.3f}"
    head = ["B", "prompt", "new", "params", "contender", "bare step host ms",
            "outside AOTAutograd (Module call, Dynamo's guards)", "AOTAutograd wrappers",
            "Inductor's call", "Python calls", "generate() host ms per step",
            "generate()'s loop outside the step"]
    lines = [f"Host time per decode step (cProfile over {steps} bare steps and one generate() "
             "call, its prefill left out; cProfile adds to the Python-heavy parts: compare the "
             "split, not the totals, with the times above)", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if "host_profile" not in r:
            continue
        bare, whole = r["host_profile"]["bare"], r["host_profile"]["generate"]
        cells = [str(r["batch"]), str(r["prompt"]), str(r["new_tokens"]), r["params"],
                 r["contender"], ms(bare["ms"]), ms(bare["dynamo_ms"]), ms(bare["aot_ms"]),
                 ms(bare["graph_ms"]), f"{bare['calls']:.0f}", ms(whole["ms"]),
                 ms(whole["outside_call_ms"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SPLIT_TITLES = {"gemm": "GEMV/GEMM", "attention": "attention", "collectives": "collectives",
                "small": "small ops", "idle": "idle"}  # e2e_llama.STEP_PARTS' columns


def split_table(rows: list[dict], steps: int) -> str:
    """Each profiled row's bare step beside its device time per step in parts (e2e_llama.
    step_split), ms and share of the span."""
    head = ["B", "prompt", "new", "params", "contender", "bare step ms", "span ms",
            *(f"{SPLIT_TITLES[part]} ms (share)" for part in e2e_llama.STEP_PARTS), "overlap ms"]
    lines = [f"Device time per decode step by part (torch profiler over {steps} bare steps, rank "
             "0; share: of the span, the first kernel's start to the last one's end, per step; "
             "idle: no kernel runs; overlap: kernels on different streams at once, which the "
             "parts count twice)", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        split = r.get("device_profile", {}).get("split")
        if split is None:
            continue
        span = split["span"]
        cells = [str(r["batch"]), str(r["prompt"]), str(r["new_tokens"]), r["params"],
                 r["contender"], f"{r['bare_ms']:.3f}", f"{span:.3f}",
                 *(f"{split[part]:.3f} ({split[part] / span:.0%})" if span else
                   f"{split[part]:.3f}" for part in e2e_llama.STEP_PARTS),
                 f"{split['overlap']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(result: dict, argv: list[str]) -> None:
    args = parse_args(argv)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows = result["rows"]
    for r in rows:
        where = (f"B {r['batch']}, prompt {r['prompt']}, new {r['new_tokens']}, "
                 f"{r['contender']}/{r['params']}")
        if r["failed"]:
            print(f"\n{where}: failed: {r['failed']}")
        if r.get("cudagraph_skips") and args.device == "cuda":
            print(f"\n{where}: Inductor skipped CUDA graphs {r['cudagraph_skips']} times "
                  "(TORCH_LOGS=cudagraphs says why)")
        if "host_profile" in r:
            print(f"\n{where}: cProfile of {args.profile_host} bare steps:\n"
                  f"{r['host_profile']['bare_top']}\n{where}: cProfile of one generate() "
                  f"call:\n{r['host_profile']['generate_top']}")
    if args.profile_device:
        device_rows = [{"workload": f"bare step {r['contender']}/{r['params']}",
                        "shape": f"B {r['batch']}, P {r['prompt']}, N {r['new_tokens']}",
                        "mode": MODE, "ms": {r["contender"]: r["bare_ms"]},
                        "device_profile": {r["contender"]: r["device_profile"]}}
                       for r in rows if "device_profile" in r]
        print("\n" + e2e_llama.device_table(device_rows, args.profile_device))
        print("\n" + split_table(rows, args.profile_device))
    print("\nditron, one line per match (rank 0):")
    for line in result["ditron_log"]:
        print("  " + line)
    if args.profile_host:
        print("\n" + host_table(rows, args.profile_host))
    print(f"\n## Llama decode: generate() with a static cache, world {result['world']}, "
          f"{device}, hidden {args.hidden}, intermediate {args.intermediate}, heads "
          f"{args.heads}/{args.kv_heads}, {args.layers} layers, "
          f"{args.dtype}, "
          + (f"options {json.dumps(args.compile_options)}" if args.compile_options
             else f"mode {MODE}")
          + (f" (`{STEP_GRAPH}`: no mode, the step in StepGraph's CUDA graph)"
             if STEP_GRAPH in args.contenders else "") + "\n")
    bandwidth = next((r["read_bandwidth"] for r in rows if "read_bandwidth" in r), None)
    if bandwidth:
        print(f"Of the read bound: the bytes a step reads at the least (the weights but the "
              f"embedding, the KV cache to the decode's mean position) at the measured read "
              f"rate, {bandwidth / 1e12:.2f} TB/s, over the bare step's time.\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.argv[0]] + argv), "device": device,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "torch": torch.__version__, "world": result["world"],
                       "ditron_log": result["ditron_log"],
                       # the tokens are checked above; the file keeps the verdicts
                       "rows": [{k: v for k, v in r.items() if k not in ("tokens", "margins")}
                                for r in rows]},
                      f, indent=1)


# --------------------------------------------------------------------------------------- main


def run(rank: int, world_size: int, argv=None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from ditron_inductor.log_names import LOGGER_NAME

    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    # each contender's model compiles each shape once; they share the model's code objects
    torch._dynamo.config.cache_size_limit = 64
    lines = e2e_llama.Lines()
    ditron_log = logging.getLogger(LOGGER_NAME)
    ditron_log.addHandler(lines)
    ditron_log.setLevel(min(ditron_log.getEffectiveLevel(), logging.INFO))

    mesh = init_device_mesh(args.device, (world_size,))
    config = llama_tp.llama_config(args.hidden, args.intermediate, args.heads, args.kv_heads,
                                   args.layers, args.vocab)
    models = {}
    for params in args.params.split(","):
        for contender in args.contenders.split(","):
            model = llama_tp.build_llama(config, dtype=dtype, device=args.device)
            model.generation_config.eos_token_id = None  # random weights: no end of sequence
            models[contender, params] = llama_tp.parallelize(
                model, llama_tp.TENSOR_PARALLEL, mesh, local_params=params == "local").eval()
    timer = e2e_llama.Timer(args.device)
    shapes = itertools.product(*(map(int, getattr(args, name).split(","))
                                 for name in ("batches", "prompts", "new_tokens")))
    with torch.no_grad():  # inference only (generate() says so itself; the bare steps here)
        rows = [row for shape in shapes
                for row in shape_rows(shape, models, args, config, timer)]
    ditron_log.removeHandler(lines)
    return {"rows": rows, "ditron_log": lines.lines, "world": world_size}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # a run that does not exit: SIGUSR1 to a rank (not to torchrun) prints where its threads wait
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    e2e_llama.launch(run, report, args, argv)


if __name__ == "__main__":
    main()
