"""Dense float64 references shared by the ring tests."""

from __future__ import annotations

import math

import torch


def dense_reference(q, k, v, scale=None):
    """Causal attention in float64 with K/V heads repeated (the reference may repeat; the ring may not)."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v
