"""Counting what the host issues: the ATen ops a region dispatches, those of them that launch a kernel, the host
reads of device values, and the package's own (Triton / Gluon) kernel launches (:func:`count_ops`).

A sparse layer whose host issues hundreds of small ops is bound by the host however few FLOPs its kernels do; the
number is a property of the Python structure, not of the sequence length, so a CPU run of the code path a GPU takes
counts it exactly (the kernels in the Triton interpreter). The tests hold the sparse layer to a budget with it, and
``benchmarks/hot_path_ops.py`` / the GPU gate report it per phase (forward, checkpointed recompute, backward).

What counts as a launch: every dispatched ATen op except views (``OpOverload.is_view``), allocations without a fill
(``empty*``, ``new_empty*``), aliases and detaches, and the scalar reads (``_local_scalar_dense``, counted as host
reads instead: on a GPU each one waits for the device). A composite op that dispatches several ATen ops counts as
each of them, since that is what runs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtraining_kernels.launch import count_launches, interpreting

__all__ = ["OpCounts", "count_ops"]

_aten = torch.ops.aten
# ops that allocate, alias or describe without running a kernel
_NO_KERNEL = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.detach.default, _aten.alias.default, _aten.lift_fresh.default,
    _aten.set_.source_Storage_storage_offset, _aten.resize_.default,
}
_HOST_READS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}


@dataclasses.dataclass
class OpCounts:
    """The counts of one region, per phase (the label current when an op ran, :meth:`phase`).

    ``ops[phase]``: ATen ops dispatched; ``launches[phase]``: those that launch a kernel plus the package's kernel
    launches; ``host_reads[phase]``: scalar reads of tensor values; ``by_op[phase]``: a Counter per op name (the
    package's kernels as ``triton:<name>``)."""

    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    launches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    host_reads: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_op: dict[str, collections.Counter] = dataclasses.field(default_factory=dict)
    current: str = "all"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs inside the block under ``name``."""
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def add(self, name: str, launches: bool, host_read: bool = False, op: bool = True) -> None:
        p = self.current
        self.ops[p] += int(op)
        self.launches[p] += int(launches)
        self.host_reads[p] += int(host_read)
        self.by_op.setdefault(p, collections.Counter())[name] += 1

    def total(self, what: str = "ops", phases: tuple[str, ...] | None = None) -> int:
        counter: collections.Counter = getattr(self, what)
        return sum(v for k, v in counter.items() if phases is None or k in phases)

    def as_dict(self) -> dict:
        return {"ops": dict(self.ops), "launches": dict(self.launches), "host_reads": dict(self.host_reads),
                "by_op": {p: dict(c.most_common()) for p, c in self.by_op.items()}}


class _Count(TorchDispatchMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if interpreting():  # the Triton interpreter's own emulation of a kernel (counted once, as its launch)
            return func(*args, **(kwargs or {}))
        read = func in _HOST_READS
        launches = not (read or func in _NO_KERNEL or getattr(func, "is_view", False))
        self.counts.add(str(func.overloadpacket.__name__), launches, read)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_ops() -> Iterator[OpCounts]:
    """Count the ATen ops, kernel launches and host reads of the block (:class:`OpCounts`; label parts of it with
    ``counts.phase(name)``). The package's kernel launches are counted through
    :func:`mtraining_kernels.launch.count_launches` (every one goes through its ``Launcher``)."""
    counts = OpCounts()
    with count_launches(lambda name: counts.add(f"triton:{name}", True, op=False)), _Count(counts):
        yield counts
