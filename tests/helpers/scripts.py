"""The repository's scripts (benchmarks, examples) loaded as modules, for tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative_path: str, name: str) -> ModuleType:
    """The script at ``ROOT / relative_path`` (e.g. ``"benchmarks/accuracy.py"``) imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses defined in the script look their module up)
    spec.loader.exec_module(module)
    return module
