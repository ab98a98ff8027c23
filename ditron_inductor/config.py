"""User-facing options of the ditron backend.

Each option has an environment variable that sets its default. Every option that can change
what the pass does enters the pass's cache key (`lowering.graph_pass.DitronPass.uuid`), so
Inductor's FX graph cache never serves a graph compiled under other options. Options must be
the same on every rank: they feed decisions that change the communication protocol.
"""

from __future__ import annotations

import os

import torch


def _env_set(name: str, default: str) -> frozenset[str]:
    return frozenset(p.strip() for p in os.environ.get(name, default).split(",") if p.strip())


# Which patterns the pass may rewrite (DITRON_PATTERNS, comma separated).
patterns: frozenset[str] = _env_set(
    "DITRON_PATTERNS",
    "all_gather_matmul,matmul_reduce_scatter,matmul_all_reduce,matmul_all_reduce_rmsnorm",
)

# Dtypes the ditron ops serve; other dtypes are left to Inductor.
dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})

# Force a device-plan implementation for every fused op: "" (let the scheduler choose),
# "reference" (decomposed collective + matmul) or "fused" (DITRON_PLAN).
force_plan: str = os.environ.get("DITRON_PLAN", "")

# Symmetric-memory backend for the fused kernels: "auto", "nvshmem" or "torch"
# (DITRON_SYMM_MEM_BACKEND). "auto" takes nvshmem4py where it imports, else PyTorch's.
symm_mem_backend: str = os.environ.get("DITRON_SYMM_MEM_BACKEND", "auto")

# Bound on each flag wait in the fused kernels, in seconds (0: unbounded). Used in debug mode so a
# missing signal names its flag instead of hanging (DITRON_WAIT_TIMEOUT_S).
wait_timeout_s: float = float(os.environ.get("DITRON_WAIT_TIMEOUT_S", "0"))


def cache_key() -> str:
    """The options that change compiled graphs, as text for the pass's uuid."""
    return repr(
        (
            sorted(patterns),
            sorted(str(d) for d in dtypes),
            force_plan,
            symm_mem_backend,
            wait_timeout_s,
        )
    )
