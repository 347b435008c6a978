"""What is derived from a tensor, kept while the tensor lives (:class:`TensorMemo`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["TensorMemo"]


class TensorMemo:
    """Values derived from a tensor, by the tensor's identity and a key, forgotten when the tensor is freed.

    A ``WeakKeyDictionary`` cannot hold tensors (it compares keys with ``==``, elementwise for tensors); this keys on
    ``id`` and drops an entry from a finalizer, checking the weak reference so a reused id never answers for another
    tensor. Its values must not refer to their tensor (that would keep it alive). The tensor's in-place version is
    part of every key: a modified tensor misses."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, dict[Hashable, Any]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def get_or_make(self, tensor: torch.Tensor, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value kept for ``(tensor, key)``, made by ``make()`` the first time."""
        tid = id(tensor)
        entry = self._entries.get(tid)
        if entry is None or entry[0]() is not tensor:
            entry = (weakref.ref(tensor), {})
            self._entries[tid] = entry
            weakref.finalize(tensor, self._forget, tid, entry[0])
        values = entry[1]
        full = (tensor._version, key)
        if full not in values:
            values[full] = make()
        return values[full]

    def _forget(self, tid: int, ref: weakref.ref) -> None:
        entry = self._entries.get(tid)
        if entry is not None and entry[0] is ref:
            del self._entries[tid]
