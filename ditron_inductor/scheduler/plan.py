"""Device level: how one GPU runs a Task.

A `DevicePlan` is chosen at compile time by the scheduler, identically on every rank, and travels
into the graph as a string argument of the ditron op, so the compiled code (and Inductor's cache)
carries the decision and nothing is re-decided per call.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

REFERENCE = "reference"  # decomposed collective + matmul: runs anywhere, the ground truth
FUSED = "fused"  # a fused kernel from templates/, CUDA only


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    impl: str = REFERENCE
    # Kernel parameters of a fused plan (transfer engine, block shapes, ...), by name.
    params: tuple[tuple[str, Any], ...] = ()
    # What the cost model predicted, in ms, by contender; for the logs only.
    predicted_ms: tuple[tuple[str, float], ...] = ()

    def param(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def encode(self) -> str:
        return json.dumps({"impl": self.impl, **dict(self.params)}, sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> "DevicePlan":
        fields = json.loads(text)
        impl = fields.pop("impl")
        return cls(impl=impl, params=tuple(sorted(fields.items())))

    def describe(self) -> str:
        parts = [self.impl] + [f"{k}={v}" for k, v in self.params]
        if self.predicted_ms:
            parts.append(
                "predicted " + ", ".join(f"{k} {v:.3f} ms" for k, v in self.predicted_ms)
            )
        return " ".join(parts)


REFERENCE_PLAN = DevicePlan()
