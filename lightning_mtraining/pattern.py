"""Vertical-slash sparse attention pattern: the budgets (``SparsityConfig``).

Minimal placeholder written by the integration (issue 3) so the strategies can take a typed ``sparsity``
argument; online pattern estimation lands here with the sparse ring (issue 4).
"""

from __future__ import annotations

import dataclasses

__all__ = ["SparsityConfig"]


@dataclasses.dataclass(frozen=True)
class SparsityConfig:
    """Budgets of the vertical-slash pattern estimated online per layer and head (MTraining, section 3.1).

    Args:
        vertical_topk: key columns kept per head (top-k mode).
        slash_topk: diagonals kept per head (top-k mode).
        top_p: if set, keep the smallest set of verticals/slashes holding this share of the estimated attention
            mass (the reference uses 0.9 or 0.95), capped by ``max_vertical``/``max_slash``; overrides top-k.
        max_vertical: cap on key columns per head in top-p mode.
        max_slash: cap on diagonals per head in top-p mode.
        last_q: number of last queries scored against all keys to estimate the pattern.
        sink_tokens: first key positions always kept (attention sinks).
        local_window: nearest diagonals always kept (local window).
    """

    vertical_topk: int = 1024
    slash_topk: int = 1024
    top_p: float | None = None
    max_vertical: int = 4096
    max_slash: int = 4096
    last_q: int = 64
    sink_tokens: int = 4
    local_window: int = 128

    def __post_init__(self) -> None:
        for name in ("vertical_topk", "slash_topk", "max_vertical", "max_slash", "last_q"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SparsityConfig.{name} must be a positive int, got {value!r}")
        for name in ("sink_tokens", "local_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"SparsityConfig.{name} must be a non-negative int, got {value!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SparsityConfig.top_p must be in (0, 1] or None, got {self.top_p!r}")
