"""The two numerical conventions every attention path shares: the softmax scale and the accumulation dtype."""

from __future__ import annotations

import math

import torch

__all__ = ["acc_dtype", "default_scale"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (for references), everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_dim: int, scale: float | None) -> float:
    """The attention scale everywhere in the package: ``scale``, or ``1 / sqrt(head_dim)`` when None. (The kernels
    package, which the package builds on and so cannot import, applies the same rule in
    ``mtraining_kernels.vertical_slash.vertical_slash_attention``.)"""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
