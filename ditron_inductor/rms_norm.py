"""RMSNorm as the models compute it, for the ops' reference and the runtime alike (the runtime
imports no `ops`): the reciprocal RMS in float32, and the rounding of the normalised rows."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def reciprocal_rms(h: Tensor, eps: float) -> Tensor:
    """rsqrt(mean(h^2) + eps) over the last dim in float32, [..., 1]: what the norm multiplies
    by, and what its backward saves."""
    return torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_reference(h: Tensor, weight: Tensor, eps: float, weight_in_fp32: bool,
                       rstd: Optional[Tensor] = None) -> Tensor:
    """RMSNorm over the last dim in float32, rounded to h's dtype before the weight (Hugging
    Face) or, weight_in_fp32, after it (F.rms_norm); `rstd`: h's reciprocal_rms, if known."""
    normed = h.float() * (reciprocal_rms(h, eps) if rstd is None else rstd)
    if weight_in_fp32:
        return (normed * weight).to(h.dtype)
    return normed.to(h.dtype) * weight
