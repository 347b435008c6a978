"""Ring instrumentation: per ring step, the compute time, the time spent waiting on transfers and the bytes sent,
separately for the inner ring (intra-node) and the outer ring (inter-node), forward and backward, dense and sparse.

Off by default. :mod:`lightning_mtraining.ring` calls the hooks below at the points where a step starts, where its
block op runs, where a transfer is posted and where it is waited; with no trace active every hook is one read of a
module variable and returns (no timer, no CUDA event, no synchronisation, no tensor op). Enable it around the code
to measure::

    trace = RingTrace()
    with trace:
        loss = model(**batch).loss
        loss.backward()
    trace.summary()  # {"fwd/sparse/compute_ms": ..., "bwd/dense/wait_outer_ms": ..., ...}: means per ring step
    trace.steps()    # one RingStep per ring step, in the order they ran

What is measured (per step of one ring call, :class:`RingStep`):

- ``compute_ms``: the step's block op (``ring.forward_step`` / ``ring.backward_step``: kernel, merge, dq add).
- ``wait_ms[level]``: time the step spent in ``wait()`` of a posted transfer of that level. On CPU (gloo) the wait
  blocks the host: wall-clock time by :func:`time.perf_counter`. On CUDA (NCCL) ``wait()`` makes the compute stream
  wait for the transfer: two CUDA events around it measure how long the *stream* stalled, i.e. the communication
  that compute did not hide. CUDA events are resolved (one ``torch.cuda.synchronize``) only when
  :meth:`RingTrace.steps` or :meth:`RingTrace.summary` is read.
- ``bytes_sent[level]``: bytes this rank posted to send in that step.

Levels: ``"inner"`` is the inner ring (a hierarchical ring's intra-node ring; a flat ring is all inner, whatever links
its hops cross), ``"outer"`` the outer ring (inter-node), ``"collective"`` the all-reduces of the gathered vertical
columns' K/V and dK/dV (Note [Gathered verticals] in :mod:`lightning_mtraining.ring.walk`), recorded in the sparse
ring's extra ``"vertical"`` step.

Note [A process-wide switch]
----------------------------
The active trace is one module variable, set by ``with trace:`` and restored on exit, like ``torch.profiler``'s
state: the backward of CUDA tensors runs in autograd's device threads, which see neither the caller's
``contextvars`` nor its thread-locals, so a context-local switch would miss every CUDA backward step. What each
thread is doing (phase, current step) is thread-local, so the autograd thread and the main thread never mix
their records. Nested traces are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["LEVELS", "RingStep", "RingTrace", "active"]

LEVELS = ("inner", "outer", "collective")

_ACTIVE: RingTrace | None = None
_NULL = contextlib.nullcontext()


def _host_clock() -> float:
    """Seconds, for host-side (CPU) timing."""
    return time.perf_counter()


def _cuda_event() -> Any:
    """A timing CUDA event, for device-side timing."""
    return torch.cuda.Event(enable_timing=True)


def active() -> RingTrace | None:
    """The trace being recorded, or None (the default: instrumentation off)."""
    return _ACTIVE


@dataclasses.dataclass
class RingStep:
    """One ring step of one ring call, times resolved (milliseconds).

    ``phase``: ``"fwd"`` or ``"bwd"``; ``ring``: ``"dense"`` or ``"sparse"``; ``index``: the step's place in its
    call (0 = this rank's own chunk); ``kind``: ``"ring"`` or ``"vertical"`` (the gathered vertical step).
    """

    phase: str
    ring: str
    index: int
    kind: str
    compute_ms: float
    wait_ms: dict[str, float]
    bytes_sent: dict[str, int]


class _Pending:
    """A step being recorded: timer marks (floats on CPU, CUDA events on CUDA), resolved later."""

    __slots__ = ("phase", "ring", "index", "kind", "device", "compute", "waits", "bytes_sent")

    def __init__(self, phase: str, ring: str, index: int, kind: str, device: torch.device) -> None:
        self.phase, self.ring, self.index, self.kind, self.device = phase, ring, index, kind, device
        self.compute: list[tuple[Any, Any]] = []
        self.waits: dict[str, list[tuple[Any, Any]]] = {lvl: [] for lvl in LEVELS}
        self.bytes_sent = dict.fromkeys(LEVELS, 0)


def _elapsed_ms(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return (end - start) * 1e3
    return float(start.elapsed_time(end))


class RingTrace:
    """Records what every ring step of :func:`~lightning_mtraining.ring.attention.ring_attention` does while it is
    active (``with trace: ...``); see the module docstring for what is measured and how.

    A trace keeps every step until :meth:`reset` (on CUDA, two events per timed span): enable it for the steps to
    measure, not for a whole run (:class:`~lightning_mtraining.callbacks.ring_trace.RingTraceCallback` resets it each
    logged step).
    """

    def __init__(self) -> None:
        self._steps: list[_Pending] = []
        self._local = threading.local()
        self._lock = threading.Lock()

    # --- enabling --------------------------------------------------------------------------------------------
    def __enter__(self) -> RingTrace:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError(
                "a RingTrace is already active; ring traces do not nest (exit the other one first, or read both "
                "phases from one trace)"
            )
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None

    def reset(self) -> None:
        """Forget every recorded step."""
        with self._lock:
            self._steps = []

    # --- reading ---------------------------------------------------------------------------------------------
    def steps(self) -> list[RingStep]:
        """Every recorded step in the order the steps started, times in milliseconds (synchronises CUDA once if
        any step ran there)."""
        with self._lock:
            pending = list(self._steps)
        if any(p.device.type == "cuda" for p in pending):
            torch.cuda.synchronize()
        out = []
        for p in pending:
            waits = {lvl: sum(_elapsed_ms(a, b) for a, b in spans) for lvl, spans in p.waits.items()}
            out.append(RingStep(p.phase, p.ring, p.index, p.kind, sum(_elapsed_ms(a, b) for a, b in p.compute),
                                waits, dict(p.bytes_sent)))
        return out

    def summary(self) -> dict[str, float]:
        """Means per ring step, keyed ``"{phase}/{ring}/{what}"``: ``steps`` (how many), ``compute_ms``,
        ``wait_inner_ms``, ``wait_outer_ms``, ``bytes_inner``, ``bytes_outer``, and where the sparse ring gathered
        verticals ``wait_collective_ms`` / ``bytes_collective`` (means over the ring's steps, the vertical step
        included). Only the (phase, ring) pairs that ran appear."""
        groups: dict[tuple[str, str], list[RingStep]] = {}
        for s in self.steps():
            groups.setdefault((s.phase, s.ring), []).append(s)
        out: dict[str, float] = {}
        for (phase, ring), steps in sorted(groups.items()):
            n = len(steps)
            pre = f"{phase}/{ring}"
            out[f"{pre}/steps"] = float(n)
            out[f"{pre}/compute_ms"] = sum(s.compute_ms for s in steps) / n
            for lvl in LEVELS:
                waited = sum(s.wait_ms[lvl] for s in steps) / n
                sent = sum(s.bytes_sent[lvl] for s in steps) / n
                if lvl != "collective" or waited or sent:
                    out[f"{pre}/wait_{lvl}_ms"] = waited
                    out[f"{pre}/bytes_{lvl}"] = sent
        return out

    # --- hooks (ring.py calls these through the module functions below) --------------------------------------
    def _mark(self) -> Any:
        if self._local.device.type == "cuda":
            ev = _cuda_event()
            ev.record()
            return ev
        return _host_clock()

    @contextlib.contextmanager
    def _call(self, phase: str, sparse: bool, device: torch.device, first_index: int) -> Iterator[None]:
        loc = self._local
        saved = getattr(loc, "state", None)
        loc.state = (phase, "sparse" if sparse else "dense", device)
        loc.device, loc.next_index, loc.current = device, first_index, None
        try:
            yield
        finally:
            loc.current = None
            loc.state = saved

    def _step(self, kind: str) -> None:
        loc = self._local
        if getattr(loc, "state", None) is None:
            return
        phase, ring, device = loc.state
        rec = _Pending(phase, ring, loc.next_index, kind, device)
        loc.next_index += 1
        loc.current = rec
        with self._lock:
            self._steps.append(rec)

    @contextlib.contextmanager
    def _span(self, level: str | None) -> Iterator[None]:
        rec = getattr(self._local, "current", None)
        if rec is None:
            yield
            return
        start = self._mark()
        try:
            yield
        finally:
            end = self._mark()
            (rec.compute if level is None else rec.waits[level]).append((start, end))

    def _sent(self, level: str, nbytes: int) -> None:
        rec = getattr(self._local, "current", None)
        if rec is not None:
            rec.bytes_sent[level] += nbytes


# --- the hooks ring.py calls: one read of _ACTIVE each when no trace is active -------------------------------------


def call(phase: str, sparse: bool, device: torch.device, first_index: int = 0) -> contextlib.AbstractContextManager:
    """Around one ring call's forward (``phase="fwd"``) or backward (``"bwd"``); its steps are numbered from
    ``first_index``."""
    rec = _ACTIVE
    return _NULL if rec is None else rec._call(phase, sparse, device, first_index)


def step(kind: str = "ring") -> None:
    """A new ring step starts (before its transfers are posted)."""
    rec = _ACTIVE
    if rec is not None:
        rec._step(kind)


def compute() -> contextlib.AbstractContextManager:
    """Around the step's block op."""
    rec = _ACTIVE
    return _NULL if rec is None else rec._span(None)


def waiting(level: str) -> contextlib.AbstractContextManager:
    """Around the wait for a transfer (or a blocking collective) of ``level``."""
    rec = _ACTIVE
    return _NULL if rec is None else rec._span(level)


def sent(level: str, tensor: torch.Tensor) -> None:
    """``tensor`` was posted to send (its bytes count for the current step)."""
    rec = _ACTIVE
    if rec is not None:
        rec._sent(level, tensor.numel() * tensor.element_size())

