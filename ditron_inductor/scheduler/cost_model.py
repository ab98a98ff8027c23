"""Device plans for fused ops on CUDA, chosen from the Task alone (shape, dtype, world size).

First version: no fused kernels are registered yet, so every CUDA task gets the reference plan
(decomposed collective + matmul inside one ditron op). The fused kernels' issue replaces this with
a cost model calibrated on the GPU machine.
"""

from __future__ import annotations

from typing import Optional

from .plan import REFERENCE_PLAN, DevicePlan
from .task import Task


def choose_device_plan(task: Task) -> tuple[Optional[DevicePlan], str]:
    """(plan, why). A None plan means: leave the graph as it was (no predicted gain)."""
    return REFERENCE_PLAN, "no fused kernel for this task yet"
