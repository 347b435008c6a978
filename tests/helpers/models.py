"""The tiny Hugging Face models the CPU tests train: one builder, so every test's model is the same by construction.

``tiny_config(family)`` is 2 layers, hidden 32, MLP 64, 4 query heads on 2 KV heads (head dim 8), vocabulary
``VOCAB``, eager attention, float32 once built. ``initializer_range=0.3`` (the Hugging Face default is 0.02) gives
sharp attention, so a wrong position, target or shard moves the losses far outside the tests' tolerances (see
``test_strategy.py``'s docstring for the sizes measured).
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64


def tiny_config(family: str, **overrides: Any):
    """The tiny config of ``family`` (a Hugging Face ``model_type``: "qwen2", "llama", "mistral", "gemma2", ...);
    ``overrides`` replace or add config fields (``max_position_embeddings=256``, ``sliding_window=...``)."""
    from transformers import AutoConfig

    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, attn_implementation="eager",
        initializer_range=0.3,  # sharper attention than the default 0.02: wrong positions or targets show up
    )
    kwargs.update(overrides)
    return AutoConfig.for_model(family, **kwargs)


def make_model(family: str, seed: int = 0, **overrides: Any):
    """A float32 causal LM of :func:`tiny_config` (``family``, ``overrides``), initialised after
    ``torch.manual_seed(seed)``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).float()
