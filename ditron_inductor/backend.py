"""The `ditron` torch.compile backend: Inductor with the ditron post-grad pass.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml) and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch

from . import ops  # noqa: F401 - registers torch.ops.ditron.*
from .log_names import LOGGER_NAME
from .lowering.graph_pass import DitronPass

log = logging.getLogger(LOGGER_NAME)


def inductor_patches(mode: Optional[str], options: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The Inductor config for this compile: the user's mode and options, plus our pass."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    patches: dict[str, Any] = dict(list_mode_options(mode)) if mode else {}
    patches.update(options or {})
    user_pass = patches.get("post_grad_custom_post_pass",
                            inductor_config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = DitronPass(user_pass)
    if log.isEnabledFor(logging.INFO):
        # A cached graph skips the pass and so its report: while the user asks for the report,
        # compile every graph.
        patches.setdefault("fx_graph_cache", False)
    return patches


def ditron_backend(gm: torch.fx.GraphModule, example_inputs, mode: Optional[str] = None,
                   options: Optional[dict[str, Any]] = None):
    """`torch.compile(model, backend="ditron", mode=..., options={...})`: mode and options mean
    what they mean for Inductor."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    patches = inductor_patches(mode, options)
    no_autograd_cache = (
        functorch_config.patch(enable_autograd_cache=False)
        if patches.get("fx_graph_cache") is False
        else contextlib.nullcontext()
    )
    with no_autograd_cache:
        return compile_fx(gm, example_inputs, config_patches=patches)
