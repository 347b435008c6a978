"""Failures that every rank finds the same way, reported once.

Note [Failures that speak once]
-------------------------------
A check that fails on what every rank holds alike (the model's config, the strategy's options, a batch that the
ranks of one context-parallel group share, the loss their step returns) raises on every one of those ranks at the
same point. Left to Python, each rank then prints the whole traceback through Lightning's loops (50 to 170 lines
per rank), the message at the end of each. Instead, the code that runs such a check marks what it raises
(:func:`same_on_ranks`, :func:`mark_same_on_ranks`) with this rank and the rank that reports it: global rank 0 for
what the whole world shares, the group's first rank for what a group shares. The first marked failure installs an
except hook for exceptions that nothing catches:

- the reporting rank prints the message first, then one line with the check that raised it and the innermost
  frame of the user's code, and how to see the full traceback (``LIGHTNING_MTRAINING_FULL_TRACEBACK=1``);
- every other rank prints one line: the error's type, the rank that reports it, and the start of the message (so
  that it still says what happened if the reporting rank was ended first).

The exception itself is unchanged (type, message, traceback): code that catches it sees nothing different; only what
Python prints at exit changes. The hook wraps the one before it (torch.distributed's, which prefixes
``[rankN]:``) and hands every unmarked exception to it. Only checks whose outcome is the same on every rank of the
named set are marked: before any collective, or on values every rank received from the same collective. A
collective's own failure (a timeout, a dead peer) is never marked: the ranks see it differently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch.distributed as dist

__all__ = ["FULL_TRACEBACK_ENV", "SameOnRanks", "format_failure", "group_ranks", "mark_same_on_ranks",
           "same_on_ranks", "same_on_ranks_of"]

FULL_TRACEBACK_ENV = "LIGHTNING_MTRAINING_FULL_TRACEBACK"
_MARK = "_mtraining_same_on_ranks"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib",
                                                                          "platlib")})
_ONE_LINE = 120  # characters of the message on a rank that does not report


@dataclasses.dataclass(frozen=True)
class SameOnRanks:
    """Where a marked failure was found: this ``rank`` (global), the ``reporter`` (global rank that reports it),
    ``world_size`` (for the ``[rankN]:`` prefix) and ``ranks`` (which ranks found the same, in words)."""

    rank: int
    reporter: int
    world_size: int
    ranks: str


def group_ranks(group: Any = None) -> tuple[int, int, int]:
    """``(this rank, the group's first global rank, the world size)``; ``group=None``: the default group.
    ``(0, 0, 1)`` without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 0, 1
    first = dist.get_global_rank(group, 0) if group is not None else 0
    return dist.get_rank(), first, dist.get_world_size()


def mark_same_on_ranks(exc: BaseException, rank: int, reporter: int, world_size: int, ranks: str) -> BaseException:
    """Mark ``exc`` as found alike by ``ranks`` (Note [Failures that speak once]) unless it is marked already, and
    install the except hook; returns ``exc``."""
    if getattr(exc, _MARK, None) is None:
        setattr(exc, _MARK, SameOnRanks(rank, reporter, world_size, ranks))
        _install_hook()
    return exc


@contextlib.contextmanager
def same_on_ranks(rank: int, reporter: int, world_size: int, ranks: str) -> Iterator[None]:
    """Mark every ``Exception`` raised inside (see :func:`mark_same_on_ranks`). For checks only: code that runs a
    collective inside may fail differently on different ranks."""
    try:
        yield
    except Exception as exc:
        mark_same_on_ranks(exc, rank, reporter, world_size, ranks)
        raise


def same_on_ranks_of(group: Any, ranks: str = "every rank of the context-parallel group") -> Any:
    """:func:`same_on_ranks` for the ranks of ``group`` (``None``: the default group), reported by its first."""
    rank, first, world = group_ranks(group)
    return same_on_ranks(rank, first, world, ranks)


def _is_user_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not (filename.startswith("<") or path.startswith(_PACKAGE_DIR + os.sep)
                or any(path.startswith(d + os.sep) for d in _LIBRARY_DIRS))


def _where(frame: traceback.FrameSummary) -> str:
    path = os.path.abspath(frame.filename)
    if path.startswith(_PACKAGE_DIR + os.sep):
        path = os.path.relpath(path, os.path.dirname(_PACKAGE_DIR))
    return f"{path}:{frame.lineno} ({frame.name})"


def format_failure(exc: BaseException, mark: SameOnRanks) -> str:
    """What this rank prints for a marked ``exc`` that nothing caught (Note [Failures that speak once])."""
    prefix = f"[rank{mark.rank}]: " if mark.world_size > 1 else ""
    message = "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")
    if mark.rank != mark.reporter:
        text = " ".join(message.split(": ", 1)[-1].split())
        if len(text) > _ONE_LINE:
            text = text[:_ONE_LINE - 3] + "..."
        return f"{prefix}{type(exc).__name__}, reported by rank {mark.reporter} (found the same here): {text}\n"
    frames = traceback.extract_tb(exc.__traceback__)
    lines = message.split("\n")
    if frames:
        user = [f for f in frames if _is_user_frame(f.filename)]
        place = f"  raised in {_where(frames[-1])}"
        if user and user[-1] is not frames[-1]:
            place += f", called from {_where(user[-1])}"
        lines.append(place)
    others = f"{mark.ranks} found the same (the others stop with one line); " if mark.world_size > 1 else ""
    lines.append(f"  {others}the full traceback: {FULL_TRACEBACK_ENV}=1")
    return "".join(f"{prefix}{line}\n" for line in lines)


class _ExceptHook:
    """``sys.excepthook``: a marked exception is printed by :func:`format_failure`, any other by ``previous``."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        mark = getattr(exc, _MARK, None)
        if mark is None or os.environ.get(FULL_TRACEBACK_ENV, "") not in ("", "0"):
            self.previous(exc_type, exc, tb)
            return
        sys.stderr.write(format_failure(exc, mark))
        sys.stderr.flush()


def _install_hook() -> None:
    if not isinstance(sys.excepthook, _ExceptHook):
        sys.excepthook = _ExceptHook(sys.excepthook)
