"""The ditron backend's options, each declared once in TABLE.

An option is a key that `torch.compile(m, backend="ditron", options={...})` takes beside
Inductor's own keys, and an environment variable that sets its default. Every value is
validated (`OptionError` names the option, the value and what is allowed). The backend reads
them once per compile (`defaults`, `split_options`) and hands the resulting `Options` to the pass,
which passes them on as arguments. Options must be the same on every rank: they feed decisions
that change the communication protocol. Those that change what the pass does enter its cache
key (`Options.cache_key`), so Inductor's FX graph cache never serves a graph compiled under
other options. Debug options are for benchmarks and bisecting, not for users.

The table (generated from TABLE; the README's option table is too: `python -m
ditron_inductor.config --readme PATH`):
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys
import types
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch._dynamo.exc import ShortenTraceback

from .patterns import PATTERNS

PREFIX = "ditron."
PLANS = ("auto", "reference", "fused")
SYMM_MEM_BACKENDS = ("auto", "nvshmem", "torch")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# Dtypes the ditron ops serve; other dtypes are left to Inductor (the float8 ones: the operands
# of torch._scaled_mm, whose output is one of the others).
dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16,
                                            torch.float8_e4m3fn, torch.float8_e5m2})


class OptionError(ShortenTraceback, ValueError):
    """A ditron option with a value it does not take. Dynamo passes a ShortenTraceback from a
    backend through as it is and cuts its traceback to start at `first_useful_frame` (the
    backend's frame: the user reads the message under their own call)."""

    def __init__(self, message: str, first_useful_frame: types.FrameType | None = None):
        super().__init__(message, first_useful_frame=first_useful_frame)


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


def _choice(allowed: tuple[str, ...], auto_is: Optional[str] = None) -> Callable:
    def parse(name: str, value: Any) -> str:
        text = str(value).strip().lower()
        if text not in allowed:
            raise OptionError(f"{name}={value!r}: allowed values are {', '.join(allowed)}")
        return auto_is if auto_is is not None and text == "auto" else text
    return parse


def _auto_bool(name: str, value: Any) -> Optional[bool]:
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        return _bool(name, value)
    except OptionError:
        raise OptionError(
            f"{name}={value!r}: expected auto or a boolean (1/0, true/false)") from None


def _seconds(name: str, value: Any) -> Optional[float]:
    """Seconds >= 0, or None for auto (the runtime takes the process group's timeout)."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds >= 0 or seconds == float("inf"):
        raise OptionError(f"{name}={value!r}: expected auto or a number of seconds >= 0 "
                          "(0: unbounded)")
    return seconds


@dataclasses.dataclass(frozen=True)
class Option:
    key: str  # after PREFIX
    env: str
    field: str  # the Options field it sets
    parse: Callable[[str, Any], Any]
    default: Any
    values: str  # what a user may write, for the tables
    doc: str
    changes_graphs: bool = True  # enters the pass's cache key
    debug: bool = False  # for benchmarks and bisecting: not in the README's table

    @property
    def name(self) -> str:
        return PREFIX + self.key


TABLE = (
    Option("enabled", "DITRON_ENABLED", "enabled", _bool, True, "1, 0",
           "0: plain Inductor, no ditron pass or rewrite"),
    Option("patterns", "DITRON_PATTERNS", "patterns", _patterns, frozenset(PATTERNS),
           "comma-separated patterns", "the patterns matched (default: all)"),
    Option("plan", "DITRON_PLAN", "force_plan", _choice(PLANS, auto_is=""), "",
           "auto, reference, fused",
           "auto: the scheduler decides; reference: the decomposed collective + matmul op; "
           "fused: the fused kernels wherever the device has them (CUDA)"),
    Option("symm_mem_backend", "DITRON_SYMM_MEM_BACKEND", "symm_mem_backend",
           _choice(SYMM_MEM_BACKENDS), "auto", "auto, nvshmem, torch",
           "symmetric memory: auto takes nvshmem4py where it imports and the group is the "
           "world, else PyTorch's"),
    Option("wait_timeout_s", "DITRON_WAIT_TIMEOUT_S", "wait_timeout_s", _seconds, None,
           "auto, seconds >= 0",
           "bound on each flag wait of the fused kernels, after which every rank raises (auto: "
           "the process group's timeout; 0: unbounded)"),
    Option("log_all_ranks", "DITRON_LOG_ALL_RANKS", "log_all_ranks", _bool, False, "0, 1",
           "INFO lines from every rank, not only rank 0's", changes_graphs=False),
    Option("causal_mask", "DITRON_CAUSAL_MASK", "causal_mask", _bool, True, "1, 0",
           "an SDPA mask that is a constant causal one becomes is_causal=True"),
    Option("decode_gemm", "DITRON_DECODE_GEMM", "decode_gemm", _bool, True, "1, 0",
           "matmuls of at most 16 rows (decode at batch <= 16) take the decode GEMM template"),
    Option("gqa_packing", "DITRON_GQA_PACKING", "gqa_packing", _bool, True, "1, 0",
           "decode attention on repeated keys/values reads them once per key/value head"),
    Option("cuda_graphs", "DITRON_CUDA_GRAPHS", "cuda_graphs", _auto_bool, None,
           "auto, 1, 0",
           "whether the graph is replayed from a CUDA graph, which picks the plans (auto: as "
           "Inductor's triton.cudagraphs says; StepGraph sets 1)"),
    Option("decode_gemm_groups", "DITRON_DECODE_GEMM_GROUPS", "decode_gemm_groups", _bool, True,
           "1, 0", "the decode GEMMs of one input (q/k/v, gate/up) in one launch", debug=True),
)
OPTIONS = {option.key: option for option in TABLE}


def _cache_key(self) -> str:
    """The options that change compiled graphs, as text for the pass's uuid."""
    return repr(tuple((o.key, sorted(v) if isinstance(v := getattr(self, o.field), frozenset)
                       else v) for o in TABLE if o.changes_graphs))


Options = dataclasses.make_dataclass(
    "Options", [(o.field, Any, dataclasses.field(default=o.default)) for o in TABLE],
    frozen=True, namespace={"cache_key": _cache_key, "__module__": __name__,
                            "__doc__": "The value of every option in TABLE, by field."})


def from_env(environ: Mapping[str, str] = os.environ) -> Options:
    """The options the environment variables set (each unset one at its default; an empty one
    is unset too, but for DITRON_PATTERNS, where it means none)."""
    return Options(**{o.field: o.parse(o.env, environ[o.env]) for o in TABLE if
                      environ.get(o.env, "") != "" or (o.key == "patterns" and o.env in environ)})


def split_options(options: Mapping[str, Any] | None,
                  defaults: Options) -> tuple[Options, dict[str, Any]]:
    """torch.compile's `options=` -> (ditron's options over `defaults`, Inductor's options)."""
    ours, inductor = {}, {}
    for key, value in (options or {}).items():
        if not key.startswith(PREFIX):
            inductor[key] = value
            continue
        option = OPTIONS.get(key[len(PREFIX):])
        if option is None:
            raise OptionError(f"unknown option {key!r}; ditron's options are "
                              f"{', '.join(o.name for o in TABLE)}")
        ours[option.field] = option.parse(key, value)
    return dataclasses.replace(defaults, **ours), inductor


_overrides: contextvars.ContextVar[dict] = contextvars.ContextVar("ditron_overrides", default={})


@contextlib.contextmanager
def overriding(**fields: Any) -> Iterator[None]:
    """Compiles started inside take these Options fields over the environment's (StepGraph's
    captures set cuda_graphs so)."""
    token = _overrides.set({**_overrides.get(), **fields})
    try:
        yield
    finally:
        _overrides.reset(token)


def defaults() -> Options:
    """The options a compile starts from: the environment's, under `overriding`'s. A bad
    variable is an error here, at the compile, rather than at import (where torch's backend
    lookup would hide it)."""
    return dataclasses.replace(from_env(), **_overrides.get())


# --------------------------------------------------------------------- the generated tables
def markdown_table() -> str:
    rows = ["| option | variable | values | default | what it does |",
            "| --- | --- | --- | --- | --- |"]
    for o in TABLE:
        if not o.debug:
            default = o.default
            shown = ("all" if isinstance(default, frozenset) else "auto" if default in (None, "")
                     else int(default) if isinstance(default, bool) else default)
            rows.append(f"| `{o.name}` | `{o.env}` | {o.values} | {shown} | {o.doc} |")
    return "\n".join(rows)


def text_table() -> str:
    return "\n".join(f"    {o.name:<26} {o.env:<27} {o.values}{'  (debug)' if o.debug else ''}"
                     f"\n        {o.doc}" for o in TABLE)


README_BEGIN, README_END = "<!-- options:begin -->", "<!-- options:end -->"


def readme_with_table(text: str) -> str:
    """The README text with the option table between its markers made anew."""
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_BEGIN}\n{markdown_table()}\n{README_END}{tail}"


__doc__ += text_table() + "\n"

if __name__ == "__main__":  # python -m ditron_inductor.config [--readme PATH]
    if sys.argv[1:2] == ["--readme"]:
        path = sys.argv[2]
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(readme_with_table(text))
    else:
        print(markdown_table())
