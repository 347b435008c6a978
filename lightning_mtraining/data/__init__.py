"""Data: the embedded corpus (this machine's Python standard library source as tokens) and its litdata loaders
(:mod:`.corpus`), and generated long-context tasks with their scorer (:mod:`.long_tasks`).

litdata is imported only when a loader is used (``lightning_mtraining.data.token_dataloader`` loads :mod:`.corpus` on
first access), so :mod:`.long_tasks` works where litdata is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("corpus", "long_tasks"):
        return importlib.import_module(f"{__name__}.{name}")
    corpus = importlib.import_module("lightning_mtraining.data.corpus")
    if name in corpus.__all__:
        return getattr(corpus, name)
    raise AttributeError(f"module 'lightning_mtraining.data' has no attribute {name!r}")
