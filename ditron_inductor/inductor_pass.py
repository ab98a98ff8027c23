"""ditron as Inductor passes, for frameworks that compile with `backend="inductor"` and take graph
passes through Inductor's config rather than a backend name (the project's framework notes: each
entry point, what it does not do, the vLLM and torchtitan recipes).

`post_grad_pass()` is the backend's `DitronPass`; `pre_grad_pass()` its rewrites of Dynamo's graph
(the causal mask, grouped-query packing), which need that graph. Options are the backend's
(`ditron.*` keys over the `DITRON_*` variables, read when the pass is made); with
`ditron.enabled=0` the passes do nothing. Each call also installs `clean_exit`'s handler.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import clean_exit, config
from . import ops  # noqa: F401 - registers torch.ops.ditron.*
from .log_names import LOGGER_NAME
from .lowering.graph_pass import DitronPass, _source_files

log = logging.getLogger(LOGGER_NAME)


def _options(options: Optional[Mapping[str, Any]]) -> config.Options:
    """`ditron.*` keys over the environment's defaults; any other key is an OptionError (an
    Inductor option belongs in Inductor's config, beside the pass)."""
    ours, others = config.split_options(options, config.defaults())
    if others:
        raise config.OptionError(
            f"not a ditron option: {', '.join(map(repr, others))}; the passes take only "
            f"ditron.* keys (set Inductor's options in Inductor's config)")
    return ours


class _Off(CustomGraphPass):
    """The pass under `ditron.enabled=0`: Inductor compiles the graph as it is."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> Any:
        return "ditron off"


class DitronPreGradPass(CustomGraphPass):
    """Inductor's `pre_grad_custom_pass`: the backend's rewrites of Dynamo's graph (the causal
    mask, grouped-query packing), each as its option says, with the backend's log lines; runs a
    pass that was configured there first."""

    def __init__(self, options: config.Options,
                 user_pass: Optional[Callable[[torch.fx.Graph], Any]] = None):
        self.options = options
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        from .backend import pre_grad_rewrites

        if self.user_pass is not None:
            self.user_pass(graph)
        pre_grad_rewrites(graph.owning_module, self.options)

    def uuid(self) -> Any:
        user = getattr(self.user_pass, "uuid", lambda: None)() if self.user_pass else None
        return (get_hash_for_files(_source_files()).hex(), self.options.cache_key(), user)


def _without_ditron(user_pass):
    """The pass a config held before ditron's was set there: installing twice runs ditron once."""
    while isinstance(user_pass, (DitronPass, DitronPreGradPass)):
        user_pass = user_pass.user_pass
    return None if isinstance(user_pass, _Off) else user_pass


def _make(cls, options, user_pass) -> CustomGraphPass:
    """`cls` with the options, after `user_pass`; under ditron.enabled=0 `user_pass` alone."""
    opts = _options(options)
    clean_exit.install()
    user_pass = _without_ditron(user_pass)
    if not opts.enabled:
        if cls is DitronPass:  # one line for both passes
            log.info("ditron is off (ditron.enabled / DITRON_ENABLED): Inductor compiles the "
                     "graph as it is")
        return user_pass if user_pass is not None else _Off()
    return cls(opts, user_pass)


def post_grad_pass(options: Optional[Mapping[str, Any]] = None,
                   user_pass: Optional[Callable[[torch.fx.Graph], Any]] = None) -> CustomGraphPass:
    """For Inductor's `post_grad_custom_post_pass`: the collective + matmul fusions and the decode
    GEMM template; `user_pass`, a pass that was already there, runs first."""
    return _make(DitronPass, options, user_pass)


def pre_grad_pass(options: Optional[Mapping[str, Any]] = None,
                  user_pass: Optional[Callable[[torch.fx.Graph], Any]] = None) -> CustomGraphPass:
    """For Inductor's `pre_grad_custom_pass`: the causal-mask and grouped-query rewrites;
    `user_pass` runs first."""
    return _make(DitronPreGradPass, options, user_pass)


def inductor_config(options: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Inductor config entries that make Inductor compile as `backend="ditron"` does: both
    passes (each after the pass the global config holds there, if any), and the FX graph cache
    off while the ditron log is at INFO. For `torch.compile(options=...)` or
    `torch._inductor.config.patch`."""
    from torch._inductor import config as inductor_config_module

    patches: dict[str, Any] = {
        "pre_grad_custom_pass": pre_grad_pass(
            options, inductor_config_module.pre_grad_custom_pass),
        "post_grad_custom_post_pass": post_grad_pass(
            options, inductor_config_module.post_grad_custom_post_pass),
    }
    if log.isEnabledFor(logging.INFO):
        patches["fx_graph_cache"] = False  # a cached graph skips the pass and so its log
    return patches


@contextlib.contextmanager
def installed(options: Optional[Mapping[str, Any]] = None) -> Iterator[dict[str, Any]]:
    """Compiles started inside compile as with `backend="ditron"` (`inductor_config`)."""
    from torch._inductor import config as inductor_config_module

    from .backend import without_autograd_cache

    patches = inductor_config(options)
    with inductor_config_module.patch(patches), without_autograd_cache(patches):
        yield patches


def install(options: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Every later compile of the process with `backend="inductor"` compiles as with
    `backend="ditron"` (`inductor_config`, set in torch._inductor.config); returns the entries
    it set. For a framework whose compile call cannot be given a backend or options (torchtitan
    accepts only "inductor" and "aot_eager" on FlexAttention models)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config_module

    patches = inductor_config(options)
    for key, value in patches.items():
        setattr(inductor_config_module, key, value)
    if patches.get("fx_graph_cache") is False:
        functorch_config.enable_autograd_cache = False
    log.info("ditron's passes are installed in Inductor's config: every compile with "
             "backend='inductor' runs them")
    return patches
