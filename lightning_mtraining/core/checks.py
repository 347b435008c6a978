"""Argument checks shared across the package: one predicate for "an int of at least N", one message each for an
attention window and a score soft-cap.

Call sites keep their own messages where the argument has a site-specific meaning (a config field, a strategy
option); what is checked is the same everywhere.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_softcap", "check_window", "is_int"]


def is_int(value: Any, low: int = 1) -> bool:
    """``value`` is an int (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_window(window: Any, what: str = "window") -> int | None:
    """A sliding window in tokens (query q sees key k iff ``q - window < k <= q``), or None; raises otherwise."""
    if window is not None and not is_int(window):
        raise ValueError(f"{what} must be a positive int (query q sees key k iff q - window < k <= q), got {window!r}")
    return window


def check_softcap(softcap: Any, what: str = "softcap") -> float | None:
    """A score soft-cap (scores become ``softcap * tanh(s / softcap)``), or None; raises otherwise."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"{what} must be a positive float (scores become softcap * tanh(s / softcap)), got "
                         f"{softcap!r}")
    return softcap
