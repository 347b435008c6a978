"""Data: the embedded corpus (this machine's Python standard library source as tokens) and its litdata loaders
(:mod:`.corpus`), the corpus in a pretrained model's tokens (:mod:`.model_tokens`), and generated long-context tasks
with their scorer (:mod:`.long_tasks`).

litdata is imported only when a loader is used (``lightning_mtraining.data.token_dataloader`` loads :mod:`.corpus` on
first access), so :mod:`.model_tokens` and :mod:`.long_tasks` work where litdata is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("corpus", "long_tasks", "model_tokens"):
        return importlib.import_module(f"{__name__}.{name}")
    model_tokens = importlib.import_module("lightning_mtraining.data.model_tokens")
    if name in model_tokens.__all__:
        return getattr(model_tokens, name)
    corpus = importlib.import_module("lightning_mtraining.data.corpus")
    if name in corpus.__all__:
        return getattr(corpus, name)
    raise AttributeError(f"module 'lightning_mtraining.data' has no attribute {name!r}")
