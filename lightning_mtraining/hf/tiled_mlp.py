"""Sequence-tiled MLPs: each decoder layer's MLP computed a chunk of tokens at a time (the strategies' ``tiled_mlp``).

Note [Tiled MLP]
~~~~~~~~~~~~~~~~
At long context the MLP, not attention, holds most of a layer's activations: a SwiGLU MLP saves its input and four
``[B, S, intermediate]`` tensors for backward (the gate and up projections, the activation, their product; about 21x
the hidden states for the Qwen2.5-3B shape, intermediate 11008 over hidden 2048), and under activation checkpointing
the recomputed layer still materialises them for the whole sequence at once. An MLP acts on each token alone, so it
can run along the sequence in chunks: here each chunk runs under ``torch.utils.checkpoint`` (non-reentrant), which
keeps only the chunk's input and recomputes its intermediates in backward, one chunk at a time. The layer then holds
the MLP's input and output for the whole sequence, and the intermediates of one chunk. Results equal the untiled MLP
up to the rounding of the smaller matrix products (the same per-token arithmetic; the weight gradients are sums over
chunks instead of one product).

The patch sets the MLP module's ``forward`` on the instance (the state dict and the parameters are untouched, so
checkpoints see the same module; tiling together with FSDP2 or tensor parallelism is not tested yet);
:meth:`TiledMLPs.restore` removes it. Only MLPs that act on each token independently may be tiled: dense MLPs and
per-token mixture-of-experts routing without a capacity limit; the decoder layer's ``mlp`` attribute is the module
patched.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mtraining.core.checks import is_int
from lightning_mtraining.hf.model import decoder_layers

__all__ = ["TiledMLPs", "tile_mlps", "tiled_forward"]


def tiled_forward(forward: Any, hidden_states: torch.Tensor, chunk_tokens: int, *args: Any, **kwargs: Any
                  ) -> torch.Tensor:
    """``forward(hidden_states)`` computed ``chunk_tokens`` tokens at a time along dim 1 (Note [Tiled MLP]); each
    chunk under a non-reentrant checkpoint when autograd records, so only its input is kept for backward."""
    if hidden_states.dim() < 2 or hidden_states.shape[1] <= chunk_tokens:
        return forward(hidden_states, *args, **kwargs)
    record = torch.is_grad_enabled()
    outputs = []
    for chunk in hidden_states.split(chunk_tokens, dim=1):
        if record:
            outputs.append(checkpoint(forward, chunk, *args, use_reentrant=False, **kwargs))
        else:
            outputs.append(forward(chunk, *args, **kwargs))
    return torch.cat(outputs, dim=1)


class TiledMLPs:
    """The MLPs :func:`tile_mlps` patched; :meth:`restore` gives them their own ``forward`` back."""

    def __init__(self, mlps: list[nn.Module], chunk_tokens: int) -> None:
        self.mlps = mlps
        self.chunk_tokens = chunk_tokens

    def restore(self) -> None:
        for mlp in self.mlps:
            mlp.__dict__.pop("forward", None)
        self.mlps = []


def tile_mlps(module: nn.Module, chunk_tokens: int, owner: str = "tile_mlps") -> TiledMLPs:
    """Compute the MLP of every decoder layer of the Hugging Face models inside ``module`` ``chunk_tokens`` tokens
    (of this rank's shard) at a time (Note [Tiled MLP]). Idempotent per MLP; raises when no decoder layer has an
    ``mlp`` module, naming what was found."""
    if not is_int(chunk_tokens):
        raise ValueError(f"{owner}: tiled_mlp must be None or a positive int (tokens per chunk), got {chunk_tokens!r}")
    mlps = []
    for layer in decoder_layers(module):
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, nn.Module) and "forward" not in mlp.__dict__:
            mlps.append(mlp)
    if not mlps:
        raise ValueError(
            f"{owner}: tiled_mlp={chunk_tokens} but no decoder layer of {type(module).__name__} has an `mlp` module "
            "(or every one is tiled already); tiled_mlp applies to Hugging Face decoder layers with `layer.mlp`, "
            "set it to None for this model"
        )
    for mlp in mlps:
        original = type(mlp).forward.__get__(mlp)

        def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, _original: Any = original,
                    **kwargs: Any) -> torch.Tensor:
            return tiled_forward(_original, hidden_states, chunk_tokens, *args, **kwargs)

        mlp.forward = types.MethodType(forward, mlp)
    return TiledMLPs(mlps, chunk_tokens)
