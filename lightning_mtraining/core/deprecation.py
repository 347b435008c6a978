"""Names that moved: one warning, attributed to the user's line.

A module keeps a moved name working through a PEP 562 ``__getattr__`` that calls :func:`warn_moved`. The warning is a
``DeprecationWarning`` attributed to the code that used the name, also for ``from package import name``, where
Python's import machinery sits between that code and ``__getattr__`` (so Python's default filter, which shows a
``DeprecationWarning`` raised from ``__main__``, shows it for a script).
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

__all__ = ["warn_moved"]


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller of ``__getattr__`` outside the import machinery."""
    frame: FrameType | None = sys._getframe(3)  # 1: this function, 2: warn_moved, 3: __getattr__'s caller
    level = 3
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame, level = frame.f_back, level + 1
    return level


def warn_moved(old: str, new: str) -> None:
    """Warn that ``old`` (a dotted name) is deprecated in favour of ``new``; call it from the module's
    ``__getattr__``."""
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=_user_stacklevel())
