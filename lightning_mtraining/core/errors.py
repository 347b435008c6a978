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

Note [The first failure speaks last]
------------------------------------
A failure only one rank finds (the user's ``training_step`` raising on rank 1 at step 2) leaves the other ranks
waiting in a collective for that rank; when its process ends, each of them fails in turn ("connection closed by
peer"), with its own traceback through Lightning's loops, so the cause sits mid-log (hundreds of lines) and the
last screen shows a consequence that does not name it. Instead, once the process group exists, every process
watches the job's key-value store (a :class:`FailureWatch`, one per process: a thread that asks the store twice a
second whether a failure is recorded, with its own client connection, so it answers while the main thread is blocked
in a collective):

1. The first rank to fail records itself in the store, atomically (``compare_set`` on an absent key: exactly one
   rank wins): its rank, the step (the strategies record the Trainer's global step, in ``on_exception``) and a
   one-line summary. A failure marked by Note [Failures that speak once] records nothing (it has its own report).
2. Every other rank's watcher sees the record, prints one line naming the rank that failed first, its step and
   summary, silences this process's stdout and stderr (what it prints after is a consequence), and acknowledges.
   A rank that fails on its own after the record exists does the same from its except hook.
3. The first rank's except hook waits until every other rank has acknowledged (at most :data:`ACK_WAIT_S`: a dead
   rank never does), then prints its report: the frames of the user's code (those of Lightning, torch and this
   package left out), the message, and a line with its rank and step. So it is printed once, and last.

The processes still end as before (a peer's closed connection, the launchers of Note [No rank outlives a failure]
in :mod:`lightning_mtraining.strategies.launchers`, torchrun's agent); only what they print changes.
``LIGHTNING_MTRAINING_FULL_TRACEBACK=1`` turns this off as well: every rank prints Python's full traceback.

Note [Who did not arrive]
-------------------------
A collective that times out or fails says only that it waited; an operator of a large job needs to know which ranks
it waited for and where they were. Every rank counts the package's collectives as it enters them
(:func:`entering_collective`, called by :func:`lightning_mtraining.core.collectives.named_failure`: the count, the
operation's name and the step the strategy last noted, :func:`note_step`: attribute writes, no communication), and its
:class:`FailureWatch` thread publishes that place in the job's store with a heartbeat when it changed or every
:data:`HEARTBEAT_S`. When a collective fails, the waiting rank reads every other rank's place
(:func:`who_did_not_arrive`): a rank whose count is lower had not reached this collective (stalled, in its step or in
the data; its process last heard from a moment ago, or silent for a while: ended), one at the same count in another
operation ran different work. The error's message then names them, first, with the operation and step each reached,
the furthest behind first (a rank blocked in a transfer to a stalled peer is behind too, but less far than the peer),
at most :data:`MAX_NAMED` of them; the rest are counted.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist

__all__ = ["ACK_WAIT_S", "FULL_TRACEBACK_ENV", "HEARTBEAT_S", "MAX_NAMED", "FailureWatch", "FirstFailure", "Place",
           "SameOnRanks", "claim_first_failure", "entering_collective", "format_failure", "format_first_failure",
           "group_ranks", "mark_same_on_ranks", "note_step", "same_on_ranks", "same_on_ranks_of",
           "told_the_others_first", "watch_failures", "who_did_not_arrive"]

FULL_TRACEBACK_ENV = "LIGHTNING_MTRAINING_FULL_TRACEBACK"
_MARK = "_mtraining_same_on_ranks"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib",
                                                                          "platlib")})
_ONE_LINE = 120  # characters of the message on a rank that does not report
_SUMMARY = 240  # characters of the first failure's summary (a failed collective names the ranks it waited for)
ACK_WAIT_S = 5.0  # how long the first failing rank waits for the others' one line before its report
_FIRST_KEY = "lightning_mtraining/first_failure"
_TOLD_KEY = "lightning_mtraining/first_failure/told"
_MAX_FRAMES = 8  # frames of the user's code in the first failure's report (the innermost ones)
_MAX_MESSAGE_LINES = 12
_PLACE_KEY = "lightning_mtraining/place/"  # + global rank: where the rank is (Note [Who did not arrive])
HEARTBEAT_S = 2.0  # a rank's place is published at least this often while its watch runs
MAX_NAMED = 8  # ranks named in a failed collective's message (the others counted)


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a rank is (Note [Who did not arrive]): the number of the package's collectives it has entered
    (``count``), the last one's name (``op``), the step noted last (``step``, None before any) and when it was
    published (``time``, the rank's wall clock)."""

    count: int = 0
    op: str = ""
    step: int | None = None
    time: float = 0.0


class _Here:
    """This process's place, updated by the main thread without any communication."""

    count = 0
    op = ""
    step: int | None = None


def entering_collective(what: str) -> int:
    """Count the collective ``what`` this rank enters now; returns its number (Note [Who did not arrive])."""
    _Here.count += 1
    _Here.op = what
    return _Here.count


def note_step(step: int | None) -> None:
    """The training step this rank is in (the strategies call it once a batch)."""
    _Here.step = step


def _place_now() -> Place:
    return Place(_Here.count, _Here.op, _Here.step, time.time())


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


@dataclasses.dataclass(frozen=True)
class FirstFailure:
    """The failure recorded first in the job (Note [The first failure speaks last]): the global ``rank`` it happened
    on, the training ``step`` there (None if unknown), the ``stage`` (``"fit"``, ``"validate"``, ...; None if
    unknown) and a one-line ``summary`` (``"RuntimeError: ..."``)."""

    rank: int
    step: int | None
    stage: str | None
    summary: str

    def where(self) -> str:
        """``"at step 2"``, ``"at step 2 (validate)"`` or ``""``."""
        step = f" at step {self.step}" if self.step is not None else ""
        stage = f" ({self.stage})" if self.stage not in (None, "fit", "train") else ""
        return step + stage


def _summary(exc: BaseException) -> str:
    text = " ".join("".join(traceback.format_exception_only(type(exc), exc)).split())
    return text if len(text) <= _SUMMARY else text[:_SUMMARY - 3] + "..."


class FailureWatch:
    """This process's part of Note [The first failure speaks last]: records a failure first if no other rank has,
    tells (one line) and silences this process when another rank did, and waits for the others before the first
    failure's report.

    Args:
        store: a ``torch.distributed.Store`` client of its own (every rank's reaches the same store).
        rank, world_size: this process's global rank and the world size.
        poll_s: how often the watching thread asks the store.
    """

    def __init__(self, store: Any, rank: int, world_size: int, poll_s: float = 0.5) -> None:
        self.store, self.rank, self.world_size, self.poll_s = store, rank, world_size, poll_s
        self._lock = threading.Lock()  # one store operation at a time (the thread and the main thread)
        self._stop = threading.Event()
        self._told = False
        self._first: FirstFailure | None = None
        self._published: tuple[int, str, int | None, float] | None = None
        self._thread = threading.Thread(target=self._watch, name="mtraining-failure-watch", daemon=True)

    def start(self) -> FailureWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watching thread (at exit) and wait for it, so that it is not left inside a store call."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 6)

    def first(self) -> FirstFailure | None:
        """The recorded first failure, if any."""
        if self._first is None:
            with self._lock:
                if self.store.check([_FIRST_KEY]):
                    self._first = FirstFailure(**json.loads(self.store.get(_FIRST_KEY)))
        return self._first

    def claim(self, exc: BaseException, step: int | None = None, stage: str | None = None) -> FirstFailure:
        """Record ``exc`` as the job's first failure unless another is recorded already; returns the first failure
        (this one, or the one recorded before). Idempotent."""
        if self._first is None:
            mine = FirstFailure(self.rank, step, stage, _summary(exc))
            with self._lock:
                value = self.store.compare_set(_FIRST_KEY, "", json.dumps(dataclasses.asdict(mine)))
            self._first = FirstFailure(**json.loads(value))
        return self._first

    def tell(self, first: FirstFailure) -> None:
        """Print the one line naming the rank that failed first, once; then silence this process (what it prints
        after is a consequence) and acknowledge."""
        if self._told:
            return
        self._told = True
        sys.stdout.flush()
        sys.stderr.write(f"[rank{self.rank}]: ending: rank {first.rank} failed first{first.where()} "
                         f"({first.summary})\n")
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
        with self._lock:
            self.store.add(_TOLD_KEY, 1)

    def wait_for_the_others(self, timeout: float = ACK_WAIT_S) -> bool:
        """The first failing rank: wait until every other rank has said its one line (True), or ``timeout``
        (False)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self.store.add(_TOLD_KEY, 0) >= self.world_size - 1:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def publish(self, force: bool = False) -> None:
        """Put this rank's place in the store when it changed, or its heartbeat is :data:`HEARTBEAT_S` old."""
        place = _place_now()
        last = self._published
        if not force and last is not None and last[:3] == (place.count, place.op, place.step) and \
                place.time - last[3] < HEARTBEAT_S:
            return
        with self._lock:
            self.store.set(_PLACE_KEY + str(self.rank), json.dumps(dataclasses.asdict(place)))
        self._published = (place.count, place.op, place.step, place.time)

    def places(self) -> dict[int, Place | None]:
        """Every other rank's last published place (None: none published)."""
        found: dict[int, Place | None] = {}
        with self._lock:
            for rank in range(self.world_size):
                if rank == self.rank:
                    continue
                key = _PLACE_KEY + str(rank)
                found[rank] = Place(**json.loads(self.store.get(key))) if self.store.check([key]) else None
        return found

    def _watch(self) -> None:
        try:
            self.publish(force=True)
            while not self._stop.wait(self.poll_s):
                self.publish()
                first = self.first()
                if first is not None:
                    if first.rank != self.rank:
                        self.tell(first)
                    return
        except Exception:  # the store is gone (its host ended): nothing to watch any more
            return


_WATCH: FailureWatch | None = None


def watch_failures(rank: int, world_size: int, store: Any = None) -> FailureWatch | None:
    """Start this process's :class:`FailureWatch` (once; Note [The first failure speaks last]) and install the
    except hook. ``store``: a store client of its own; default: a new ``TCPStore`` client of the job's store at
    ``MASTER_ADDR:MASTER_PORT`` (set by every launcher once the process group exists). None when the world is one
    process or no store can be reached (the failures then print as Python prints them)."""
    global _WATCH
    if _WATCH is not None or world_size < 2:
        return _WATCH
    if store is None:
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=5))
        except (KeyError, ValueError, RuntimeError, OSError):
            return None
    _WATCH = FailureWatch(store, rank, world_size).start()
    atexit.register(_WATCH.stop)
    _install_hook()
    return _WATCH


def who_did_not_arrive(count: int, op: str) -> str:
    """The ranks that have not entered this rank's collective number ``count`` (``op``), or entered another one
    there, in words (Note [Who did not arrive]); "" without a watch, a store, or any such rank."""
    if _WATCH is None:
        return ""
    try:
        # every rank publishes its place within a poll of entering a collective: wait one, so that a rank that is
        # merely a poll behind in publishing is not named
        time.sleep(1.2 * _WATCH.poll_s)
        places = _WATCH.places()
    except Exception:  # the store is gone (its host ended)
        return ""
    now = time.time()
    behind: list[tuple[int, int, str]] = []  # (count, rank, words): sorted, the furthest behind first
    other = []
    for rank, place in sorted(places.items()):
        if place is None:
            behind.append((-1, rank, f"rank {rank} (no place published: not started, or ended)"))
            continue
        age = max(0.0, now - place.time)
        alive = f"last heard {age:.0f} s ago" if age < 3 * HEARTBEAT_S + 1 else f"silent for {age:.0f} s: ended?"
        step = f" at step {place.step}" if place.step is not None else ""
        if place.count < count:
            last = f"last in collective {place.count}, {place.op}" if place.count else "in no collective yet"
            behind.append((place.count, rank, f"rank {rank} ({last}{step}; {alive})"))
        elif place.count == count and place.op != op:
            other.append(f"rank {rank} (in {place.op}{step}; {alive})")
    parts = []
    for title, ranks in (("did not arrive", [words for *_, words in sorted(behind)]), ("ran different work", other)):
        if ranks:
            shown = ranks[:MAX_NAMED]
            more = f" and {len(ranks) - len(shown)} more" if len(ranks) > len(shown) else ""
            parts.append(f"{title}: {', '.join(shown)}{more}")
    return "; ".join(parts)


def told_the_others_first() -> bool:
    """Whether this process recorded the job's first failure and every other rank has said its one line (waits up to
    :data:`ACK_WAIT_S` for them; Note [The first failure speaks last]). A launcher then has nothing more to wait for
    from its other ranks before ending them."""
    if _WATCH is None:
        return False
    try:
        first = _WATCH.first()
        return first is not None and first.rank == _WATCH.rank and _WATCH.wait_for_the_others()
    except Exception:  # the store is gone
        return False


def claim_first_failure(exc: BaseException, step: int | None = None, stage: str | None = None) -> None:
    """Record ``exc`` (raised on this rank, nothing caught it inside the loop) as the job's first failure if it is
    (Note [The first failure speaks last]); a marked failure (Note [Failures that speak once]), a ``KeyboardInterrupt``
    or a process without a watch records nothing. Never raises."""
    if _WATCH is None or not isinstance(exc, Exception) or getattr(exc, _MARK, None) is not None:
        return
    try:
        first = _WATCH.claim(exc, step, stage)
        if first.rank != _WATCH.rank:
            _WATCH.tell(first)
    except Exception:  # the store is gone: Python prints this failure as it would
        pass


def _user_frames(frames: traceback.StackSummary) -> list[traceback.FrameSummary]:
    """The frames of the user's code, and the innermost frame (where it was raised) whoever's it is."""
    kept = [f for f in frames if _is_user_frame(f.filename)]
    if frames and (not kept or kept[-1] is not frames[-1]):
        kept.append(frames[-1])
    return kept[-_MAX_FRAMES:]


def format_first_failure(exc: BaseException, first: FirstFailure, world_size: int, told: bool = True) -> str:
    """What the rank that failed first prints (Note [The first failure speaks last]): the user's frames, the
    message, and its rank and step; under 30 lines. ``told``: every other rank said its one line (else some had
    ended before, or do not answer)."""
    prefix = f"[rank{first.rank}]: "
    frames = _user_frames(traceback.extract_tb(exc.__traceback__))
    lines = ["Traceback (the frames of your code and where it was raised; Lightning's and torch's left out):"]
    for frame in frames:
        lines.append(f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}')
        if frame.line:
            lines.append(f"    {frame.line.strip()}")
    message = "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n").split("\n")
    if len(message) > _MAX_MESSAGE_LINES:
        message = message[:_MAX_MESSAGE_LINES] + [f"... ({len(message) - _MAX_MESSAGE_LINES} more lines)"]
    lines += message
    if world_size == 1:
        others = ""
    elif told:
        others = "; the other ranks stopped with one line each"
    else:
        others = "; not every other rank answered (ended already, or stuck)"
    lines.append(f"rank {first.rank} failed first{first.where()}{others}; the full traceback: {FULL_TRACEBACK_ENV}=1")
    return "".join(f"{prefix}{line}\n" for line in lines)


class _ExceptHook:
    """``sys.excepthook``: a marked exception is printed by :func:`format_failure`, any other by ``previous``."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        mark = getattr(exc, _MARK, None)
        if os.environ.get(FULL_TRACEBACK_ENV, "") not in ("", "0"):
            self.previous(exc_type, exc, tb)
        elif mark is not None:
            sys.stderr.write(format_failure(exc, mark))
        elif _WATCH is not None and isinstance(exc, Exception) and self._first_failure(exc):
            pass
        else:
            self.previous(exc_type, exc, tb)
        sys.stderr.flush()

    @staticmethod
    def _first_failure(exc: BaseException) -> bool:
        """Note [The first failure speaks last]: the report if this rank failed first, else the one line; False
        when the store cannot be reached (Python's report then)."""
        assert _WATCH is not None
        try:
            first = _WATCH.claim(exc)
            if first.rank != _WATCH.rank:
                _WATCH.tell(first)
                return True
            told = _WATCH.wait_for_the_others()
        except Exception:
            return False
        sys.stderr.write(format_first_failure(exc, first, _WATCH.world_size, told))
        return True


def _install_hook() -> None:
    if not isinstance(sys.excepthook, _ExceptHook):
        sys.excepthook = _ExceptHook(sys.excepthook)
