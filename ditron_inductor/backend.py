"""The `ditron` torch.compile backend: Inductor with the ditron post-grad pass, registered
through the `torch_dynamo_backends` entry point (pyproject.toml) and nowhere else."""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
from typing import Any, Optional

import torch

from . import clean_exit, config
from . import ops  # noqa: F401 - registers torch.ops.ditron.*
from .log_names import LOGGER_NAME
from .lowering import graph_pass
from .lowering import causal_mask, gqa_packing
from .lowering.graph_pass import DitronPass, GraphReport

log = logging.getLogger(LOGGER_NAME)


def inductor_patches(mode: Optional[str], options: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The Inductor config for this compile: the user's mode and Inductor options, plus our pass
    carrying ditron's options (the `ditron.*` keys over the environment's defaults)."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    ditron_options, inductor_options = config.split_options(options, config.defaults())
    patches: dict[str, Any] = dict(list_mode_options(mode)) if mode else {}
    patches.update(inductor_options)
    if not ditron_options.enabled:
        log.info("ditron is off (ditron.enabled / DITRON_ENABLED): Inductor compiles the graph "
                 "as it is")
        return patches
    user_pass = patches.get("post_grad_custom_post_pass",
                            inductor_config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = DitronPass(ditron_options, user_pass)
    if log.isEnabledFor(logging.INFO):
        # a cached graph skips the pass and so its report: while INFO is on, compile every graph
        patches.setdefault("fx_graph_cache", False)
    return patches


def ditron_backend(gm: torch.fx.GraphModule, example_inputs, mode: Optional[str] = None,
                   options: Optional[dict[str, Any]] = None):
    """`torch.compile(model, backend="ditron", mode=..., options={...})`: mode and Inductor's
    options mean what they mean for Inductor; keys `ditron.*` are ditron's (`config`)."""
    from torch._inductor.compile_fx import compile_fx

    try:
        patches = inductor_patches(mode, options)
    except config.OptionError as error:
        raise config.OptionError(str(error), first_useful_frame=inspect.currentframe()) from None
    ditron_pass = patches.get("post_grad_custom_post_pass")
    if isinstance(ditron_pass, DitronPass):
        pre_grad_rewrites(gm, ditron_pass.options)
    clean_exit.install()
    hits, known = _cache_hits(), len(graph_pass.reports)
    with without_autograd_cache(patches):
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    if _cache_hits() > hits and len(graph_pass.reports) == known:
        report = GraphReport(str(torch._guards.CompileContext.current_compile_id() or "?"), (),
                             from_cache=True)
        graph_pass.reports.append(report)
        log.info("graph %s: %s", report.graph, report.summary())
    return compiled


def without_autograd_cache(patches: dict[str, Any]):
    """AOTAutograd's cache off where the patches turn the FX graph cache off (each serves a
    graph without running the pass)."""
    from torch._functorch import config as functorch_config

    if patches.get("fx_graph_cache") is False:
        return functorch_config.patch(enable_autograd_cache=False)
    return contextlib.nullcontext()


def pre_grad_rewrites(gm: torch.fx.GraphModule, options: config.Options) -> None:
    """The rewrites of Dynamo's graph that the options turn on."""
    if options.causal_mask:
        _rewrite_causal_masks(gm)
    if options.gqa_packing:
        _pack_grouped_queries(gm)


def _optional_rewrite(rewrite, gm: torch.fx.GraphModule, name: str, left: str) -> list:
    """rewrite(gm)'s sites, or none after a warning: each of its steps leaves a valid graph."""
    try:
        return rewrite(gm)
    except Exception as e:  # noqa: BLE001 - the graph stays valid; the user's model still runs
        log.warning("%s failed (%s: %s); %s", name, type(e).__name__, e, left)
        return []


def _rewrite_causal_masks(gm: torch.fx.GraphModule) -> None:
    """lowering/causal_mask.py's rewrite: one INFO line per graph and per mask kept."""
    sites = _optional_rewrite(causal_mask.rewrite_causal_masks, gm, "the attention-mask rewrite",
                              "the masks it had not reached stay as they are")
    if not sites:
        return
    graph = str(torch._guards.CompileContext.current_compile_id() or "?")
    kinds = collections.Counter(site.became for site in sites)
    log.info("graph %s: %d attention call(s) with a mask: %d causal -> is_causal=True, %d masking "
             "nothing -> no mask, %d kept", graph, len(sites), kinds[causal_mask.CAUSAL],
             kinds[causal_mask.NO_MASK], kinds[None])
    for site in sites:
        log.log(logging.DEBUG if site.became else logging.INFO, "  %s", site.describe())


def _pack_grouped_queries(gm: torch.fx.GraphModule) -> None:
    """lowering/gqa_packing.py's rewrite: one INFO line per graph, with why the first call kept
    was kept (prefill and training keep every call)."""
    sites = _optional_rewrite(gqa_packing.pack_grouped_queries, gm, "the grouped-query packing",
                              "the calls it had not reached keep their repeated keys and values")
    if not sites:
        return
    graph = str(torch._guards.CompileContext.current_compile_id() or "?")
    packed = sum(site.packed for site in sites)
    kept = next((site.reason for site in sites if not site.packed), "")
    log.info("graph %s: %d attention call(s) on repeated keys/values: %d packed (query heads as "
             "rows), %d kept%s", graph, len(sites), packed, len(sites) - packed,
             f" (the first: {kept})" if kept else "")
    for site in sites:
        log.debug("  %s", site.describe())


def _cache_hits() -> int:
    """Graphs Inductor's FX graph cache and AOTAutograd's cache served so far in this process."""
    from torch._dynamo.utils import counters

    return (counters["inductor"]["fxgraph_cache_hit"]
            + counters["aot_autograd"]["autograd_cache_hit"])
