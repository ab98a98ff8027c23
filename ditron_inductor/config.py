"""User-facing options of the ditron backend.

Each option has a key that `torch.compile(m, backend="ditron", options={...})` takes beside
Inductor's own keys, and an environment variable that sets its default:

    ditron.enabled           DITRON_ENABLED            1 | 0 (0: plain Inductor, no ditron pass)
    ditron.patterns          DITRON_PATTERNS           comma-separated subset of PATTERNS
    ditron.plan              DITRON_PLAN               auto | reference | fused
    ditron.symm_mem_backend  DITRON_SYMM_MEM_BACKEND   auto | nvshmem | torch
    ditron.wait_timeout_s    DITRON_WAIT_TIMEOUT_S     seconds >= 0 (0: unbounded)
    ditron.log_all_ranks     DITRON_LOG_ALL_RANKS      0 | 1 (INFO lines of every rank, not 0's)
    ditron.causal_mask       DITRON_CAUSAL_MASK        1 | 0 (1: an attention mask that is a
                                                       constant causal one becomes is_causal=True)
    ditron.measured_plans    DITRON_MEASURED_PLANS     1 | 0 (0: the AG/RS plans from the link
                                                       model alone, never from the plans measured
                                                       at a near shape, scheduler/measured_plans.py)
    ditron.skip_plans        DITRON_SKIP_PLANS         comma-separated AG/RS candidate labels
                                                       (cost_model.AG_CANDIDATES, RS_CANDIDATES)
                                                       the scheduler never takes, measured or
                                                       predicted (default: none)
    ditron.decode_gemm       DITRON_DECODE_GEMM        1 | 0 (1: one-row matmuls, a decode step's
                                                       at batch 1, take the decode GEMM template,
                                                       lowering/decode_gemm.py)
    ditron.decode_gemm_groups DITRON_DECODE_GEMM_GROUPS 1 | 0 (1: the decode GEMMs of one input,
                                                       q/k/v and gate/up, in one launch)
    ditron.gqa_packing       DITRON_GQA_PACKING        1 | 0 (1: a decode step's grouped-query
                                                       attention reads keys and values once per
                                                       key/value head, lowering/gqa_packing.py)
    ditron.sequence_shard    DITRON_SEQUENCE_SHARD     0 | 1 (1: plain TP's all-reduces become
                                                       a reduce-scatter and an all-gather, the
                                                       residual stream sharded on rows between
                                                       them, lowering/sequence_shard.py)
    ditron.cuda_graphs       DITRON_CUDA_GRAPHS        auto | 1 | 0 (whether the compiled graph
                                                       will be replayed from a CUDA graph, which
                                                       picks the plans: auto, as Inductor's
                                                       triton.cudagraphs says; StepGraph sets 1)

Every value is validated (`OptionError` names the option, the value and what is allowed). The
module attributes below hold the options of the compile in progress (`using`), the environment's
otherwise; the pass reads them at compile time. Every option that can change what the pass does
enters the pass's cache key (`Options.cache_key`), so Inductor's FX graph cache never serves a
graph compiled under other options. Options must be the same on every rank: they feed decisions
that change the communication protocol.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
from typing import Any, Iterator, Mapping, Optional

import torch
from torch._dynamo.exc import ShortenTraceback

from .patterns import PATTERNS

PREFIX = "ditron."
PLANS = ("auto", "reference", "fused")
SYMM_MEM_BACKENDS = ("auto", "nvshmem", "torch")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# Dtypes the ditron ops serve; other dtypes are left to Inductor.
# (the float8 ones: the operands of torch._scaled_mm, whose output is one of the others)
dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16,
                                            torch.float8_e4m3fn, torch.float8_e5m2})


class OptionError(ShortenTraceback, ValueError):
    """A ditron option with a value it does not take. Dynamo passes a ShortenTraceback from a
    backend through as it is, instead of wrapping it in BackendCompilerFailed, and cuts its
    traceback to start at `first_useful_frame` (the backend's frame: the user reads the message
    under their own call, not under Dynamo's internals)."""

    def __init__(self, message: str, first_useful_frame: types.FrameType | None = None):
        super().__init__(message, first_useful_frame=first_useful_frame)


@dataclasses.dataclass(frozen=True)
class Options:
    enabled: bool = True
    patterns: frozenset[str] = frozenset(PATTERNS)
    # "" lets the scheduler choose; "reference" forces the decomposed collective + matmul,
    # "fused" the fused kernels wherever the device has them (CUDA).
    force_plan: str = ""
    # "auto" takes nvshmem4py where it imports and the group is the world, else PyTorch's.
    symm_mem_backend: str = "auto"
    # Bound on each flag wait in the fused kernels (debug: a missing signal names its flag).
    wait_timeout_s: float = 0.0
    log_all_ranks: bool = False
    # Rewrite SDPA calls whose mask is a constant causal (or empty) one (lowering/causal_mask.py).
    causal_mask: bool = True
    # Take the fastest measured AG/RS plan at a measured shape near the task's (on the task's
    # world size) over the link model's prediction (scheduler/measured_plans.py).
    measured_plans: bool = True
    # AG/RS candidates never taken (a plan's effect on a whole step, timed in one process
    # against the same step without it: benchmarks/e2e_llama.py --b-options).
    skip_plans: frozenset[str] = frozenset()
    # One-row matmuls (a decode step at batch 1), plain and inside the fused all-reduces, in the
    # decode GEMM template instead of cuBLAS (lowering/decode_gemm.py).
    decode_gemm: bool = True
    # The decode GEMMs of the same input (a step's q/k/v, gate/up) in one launch of the template
    # (lowering/decode_gemm.py; timed: benchmarks/results/e2e_decode_h100x4_gemm_groups.md).
    decode_gemm_groups: bool = True
    # SDPA calls on repeated keys/values (GQA, decode) take the query heads of each key/value
    # head as rows instead (lowering/gqa_packing.py).
    gqa_packing: bool = True
    # Plain tensor parallelism's all-reduces as reduce-scatter + all-gather, the residual adds
    # and norms between them on this rank's rows (lowering/sequence_shard.py). Off: on 2 H100s
    # its prefill was 0.98-1.03x of fusions only (README, "Sequence sharding of plain TP").
    sequence_shard: bool = False
    # Whether the graph will be replayed from a CUDA graph (the plans measured that way are
    # chosen): None follows Inductor's triton.cudagraphs ("reduce-overhead"); step_graph.py's
    # StepGraph, which captures a whole compiled call itself, sets True.
    cuda_graphs: Optional[bool] = None

    def cache_key(self) -> str:
        """The options that change compiled graphs, as text for the pass's uuid."""
        return repr((sorted(self.patterns), sorted(str(d) for d in dtypes), self.force_plan,
                     self.symm_mem_backend, self.wait_timeout_s, self.causal_mask,
                     self.measured_plans, self.decode_gemm, self.gqa_packing,
                     self.decode_gemm_groups, self.cuda_graphs, self.sequence_shard,
                     sorted(self.skip_plans)))


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise OptionError(f"{name}={value!r}: expected a boolean (1/0, true/false)")


def _patterns(name: str, value: Any) -> frozenset[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    chosen = frozenset(str(p).strip() for p in items if str(p).strip())
    unknown = sorted(chosen - set(PATTERNS))
    if unknown:
        raise OptionError(f"{name}={value!r}: unknown pattern(s) {', '.join(unknown)}; allowed: "
                          f"a comma-separated subset of {', '.join(PATTERNS)}")
    return chosen


def _skip_plans(name: str, value: Any) -> frozenset[str]:
    """The labels as a set; whether each names a candidate is checked where the candidates are
    known, at the compile (backend.check_plan_labels): this module imports no layer above it."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return frozenset(str(p).strip() for p in items if str(p).strip())


def _plan(name: str, value: Any) -> str:
    text = str(value).strip().lower()
    if text not in PLANS + ("",):
        raise OptionError(f"{name}={value!r}: allowed values are {', '.join(PLANS)}")
    return "" if text == "auto" else text


def _symm_mem_backend(name: str, value: Any) -> str:
    text = str(value).strip().lower()
    if text not in SYMM_MEM_BACKENDS:
        raise OptionError(f"{name}={value!r}: allowed values are {', '.join(SYMM_MEM_BACKENDS)}")
    return text


def _auto_bool(name: str, value: Any) -> Optional[bool]:
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        return _bool(name, value)
    except OptionError:
        raise OptionError(
            f"{name}={value!r}: expected auto or a boolean (1/0, true/false)") from None


def _seconds(name: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds >= 0 or seconds == float("inf"):
        raise OptionError(f"{name}={value!r}: expected a number of seconds >= 0 (0: unbounded)")
    return seconds


# Option key (after the prefix) -> (environment variable, Options field, parser).
OPTIONS = {
    "enabled": ("DITRON_ENABLED", "enabled", _bool),
    "patterns": ("DITRON_PATTERNS", "patterns", _patterns),
    "plan": ("DITRON_PLAN", "force_plan", _plan),
    "symm_mem_backend": ("DITRON_SYMM_MEM_BACKEND", "symm_mem_backend", _symm_mem_backend),
    "wait_timeout_s": ("DITRON_WAIT_TIMEOUT_S", "wait_timeout_s", _seconds),
    "log_all_ranks": ("DITRON_LOG_ALL_RANKS", "log_all_ranks", _bool),
    "causal_mask": ("DITRON_CAUSAL_MASK", "causal_mask", _bool),
    "measured_plans": ("DITRON_MEASURED_PLANS", "measured_plans", _bool),
    "skip_plans": ("DITRON_SKIP_PLANS", "skip_plans", _skip_plans),
    "decode_gemm": ("DITRON_DECODE_GEMM", "decode_gemm", _bool),
    "decode_gemm_groups": ("DITRON_DECODE_GEMM_GROUPS", "decode_gemm_groups", _bool),
    "gqa_packing": ("DITRON_GQA_PACKING", "gqa_packing", _bool),
    "sequence_shard": ("DITRON_SEQUENCE_SHARD", "sequence_shard", _bool),
    "cuda_graphs": ("DITRON_CUDA_GRAPHS", "cuda_graphs", _auto_bool),
}


def from_env(environ: Mapping[str, str] = os.environ) -> Options:
    """The options the environment variables set (each unset one at its default; an empty one
    is unset too, but for DITRON_PATTERNS, where it means none)."""
    fields = {field: parse(var, environ[var]) for var, field, parse in OPTIONS.values()
              if environ.get(var, "") != "" or (field == "patterns" and var in environ)}
    return Options(**fields)


def split_options(options: Mapping[str, Any] | None,
                  defaults: Options) -> tuple[Options, dict[str, Any]]:
    """torch.compile's `options=` -> (ditron's options over `defaults`, Inductor's options)."""
    ours, inductor = {}, {}
    for key, value in (options or {}).items():
        if not key.startswith(PREFIX):
            inductor[key] = value
            continue
        name = key[len(PREFIX):]
        if name not in OPTIONS:
            raise OptionError(f"unknown option {key!r}; ditron's options are "
                              f"{', '.join(PREFIX + k for k in OPTIONS)}")
        _, field, parse = OPTIONS[name]
        ours[field] = parse(key, value)
    return dataclasses.replace(defaults, **ours), inductor


# The module attributes at the end mirror the fields of Options one for one (code and tests read
# and set `config.force_plan`, ...): current() and _apply() go through the fields, so an option
# added to Options needs no edit here.
_FIELDS = tuple(f.name for f in dataclasses.fields(Options))


def current() -> Options:
    return Options(**{name: globals()[name] for name in _FIELDS})


def _apply(options: Options) -> None:
    globals().update({name: getattr(options, name) for name in _FIELDS})


@contextlib.contextmanager
def using(options: Options) -> Iterator[None]:
    """The module attributes hold `options` for the duration (a compile)."""
    saved = current()
    _apply(options)
    try:
        yield
    finally:
        _apply(saved)


def cache_key() -> str:
    return current().cache_key()


def defaults() -> Options:
    """The options a compile starts from; a bad environment variable is an error here, at the
    first compile, rather than at import (where torch's backend lookup would hide it)."""
    if _env_error is not None:
        raise OptionError(str(_env_error))
    return current()


try:
    _defaults, _env_error = from_env(), None
except OptionError as error:
    _defaults, _env_error = Options(), error
enabled: bool = _defaults.enabled
patterns: frozenset[str] = _defaults.patterns
force_plan: str = _defaults.force_plan
symm_mem_backend: str = _defaults.symm_mem_backend
wait_timeout_s: float = _defaults.wait_timeout_s
log_all_ranks: bool = _defaults.log_all_ranks
causal_mask: bool = _defaults.causal_mask
measured_plans: bool = _defaults.measured_plans
skip_plans: frozenset[str] = _defaults.skip_plans
decode_gemm: bool = _defaults.decode_gemm
decode_gemm_groups: bool = _defaults.decode_gemm_groups
gqa_packing: bool = _defaults.gqa_packing
sequence_shard: bool = _defaults.sequence_shard
cuda_graphs: Optional[bool] = _defaults.cuda_graphs
