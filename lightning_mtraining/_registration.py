"""The strategy names, registered whenever Lightning is imported, before or after this package.

Note [Registering without importing Lightning]
---------------------------------------------
Lightning has no entry point for strategies: ``Trainer(strategy="mtraining")`` and ``Fabric(strategy="mtraining")``
look the name up in registries that our strategy modules fill when they are imported. Importing them imports
Lightning, and ``import lightning_mtraining.ring`` runs ``lightning_mtraining/__init__.py`` first, so an eager import
there would make every torch-only user (and every test worker) pay for Lightning. Instead :func:`install` registers at
once when Lightning is already imported, and otherwise watches the imports of ``lightning.pytorch`` and
``lightning.fabric``: once either has finished importing, the strategy modules that need it are imported, and they
register their names (idempotently) as the last thing they do. While ``lightning.pytorch`` is itself importing (it
imports ``lightning.fabric`` on the way), nothing is imported until it has finished, so our modules never see a
half-imported Lightning. A strategy module the user imports directly registers itself in the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
from typing import Any

__all__ = ["install"]

# which of our modules register the names of each Lightning package's registry
_STRATEGY_MODULES = {
    "lightning.pytorch": ("lightning_mtraining.strategies.trainer", "lightning_mtraining.strategies.fsdp"),
    "lightning.fabric": ("lightning_mtraining.strategies.fabric",),
}
_running: set[str] = set()  # the watched packages being imported right now
_lock = threading.RLock()


def _import_strategies(package: str) -> None:
    if "lightning.pytorch" in _running:  # Lightning is half imported: wait for lightning.pytorch to finish
        return
    names = _STRATEGY_MODULES[package]
    if package == "lightning.pytorch":  # lightning.pytorch imports lightning.fabric: both registries are ready
        names = names + _STRATEGY_MODULES["lightning.fabric"]
    for name in names:
        if name not in sys.modules:  # a module being imported registers itself when it finishes
            importlib.import_module(name)


def _imported(package: str) -> bool:
    module = sys.modules.get(package)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False) and package not in _running


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched package it wraps the found loader's ``exec_module`` so that our strategy
    modules are imported right after the package's own code has run."""

    def __init__(self) -> None:
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _STRATEGY_MODULES or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            with _lock:
                _running.add(fullname)
                try:
                    run(module)
                finally:
                    _running.discard(fullname)
                _import_strategies(fullname)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader, this import
        return spec


def install() -> None:
    """Register the strategy names now for the Lightning packages already imported; watch for the others."""
    with _lock:
        waiting = [p for p in _STRATEGY_MODULES if not _imported(p)]
        if waiting and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
        for package in _STRATEGY_MODULES:
            if _imported(package):
                _import_strategies(package)
