"""``torch.compile`` of the decoder layers of Hugging Face models, in place (what the strategies' ``compile=`` option
does)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from lightning_mtraining.hf.model import decoder_layers

__all__ = ["compile_decoder_layers"]

_log = logging.getLogger(__name__)


def compile_decoder_layers(model: nn.Module, **compile_kwargs: Any) -> list[nn.Module]:
    """Compile every decoder layer of the Hugging Face models inside ``model``, in place, with
    ``layer.compile(**compile_kwargs)`` (``torch.compile`` options: ``fullgraph=True``, ``mode=...``, ``backend=...``),
    as torchtitan compiles each transformer block: the layers compile once each and the rest of the model (embeddings,
    the loss, the hooks) stays eager. Returns the compiled layers.

    Under context parallelism the attention of a layer is custom ops while it compiles (the dense ring, the pattern
    estimator and the sparse ring: :mod:`lightning_mtraining.ring.dense_op`, :mod:`lightning_mtraining.ring.sparse_op`),
    so a layer compiles with ``fullgraph=True``. Call it after :func:`prepare_model` (or
    :func:`~lightning_mtraining.hf.parallel.apply_context_parallel`) and after enabling activation checkpointing; the
    module names and the ``state_dict`` keys do not change (``nn.Module.compile``, no ``_orig_mod`` wrapper).

    Each layer's graph holds its layer index as a constant (dense layers, per-layer budgets, its pattern's key), so
    every layer compiles its own graph, and again where a constant it read changes (a new sequence length, the end of
    a dense warm-up, the non-finite watch's first forward); torch stops recompiling one function after
    ``torch._dynamo.config.recompile_limit`` graphs (8 by default), an error with ``fullgraph=True``, so this raises
    that limit to four graphs per layer plus 8 when it is lower (logged).
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"compile_decoder_layers: {type(model).__name__} holds no Hugging Face decoder layer (no "
                         "module whose child is an attention module with layer_idx and is_causal)")
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    needed = 4 * len(layers) + 8
    if getattr(dynamo_config, name) < needed:
        _log.info("compile_decoder_layers: torch._dynamo.config.%s raised from %d to %d (graphs per layer)", name,
                  getattr(dynamo_config, name), needed)
        setattr(dynamo_config, name, needed)
    for layer in layers:
        layer.compile(**compile_kwargs)
    return layers
