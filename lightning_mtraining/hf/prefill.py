"""Sparse prefill for Hugging Face ``generate``: the training pattern and kernels serve the prompt, dense decoding.

One call registers an attention function with ``transformers``; a model switched to it runs its *prefill* (the forward
over the prompt) with the vertical-slash pattern estimated online from the prompt's own Q and K
(:func:`~lightning_mtraining.sparsity.estimation.estimate_pattern`, one device) and the sparse kernels
(:func:`~lightning_mtraining.sparsity.attention.sparse_attention`: Triton on CUDA, the torch path elsewhere); every
other forward (decode steps, a continued prefill over a cache that already holds tokens) runs exact dense attention
through transformers' own SDPA function against the cache::

    import lightning_mtraining as lmt
    name = lmt.register_sparse_prefill(lmt.SparsityConfig(top_p=0.9, pattern_heads="kv"))
    model.set_attn_implementation(name)          # or from_pretrained(..., attn_implementation=name)
    out = model.generate(input_ids, max_new_tokens=32)

Which forward is a prefill (Note [Prefill or decode]):

    ===================================  ==============================  ==============================
    query length, mask from the model     what it is                      what runs
    ===================================  ==============================  ==============================
    L > 1, no mask                        causal prefill from position 0  sparse (dense if L < last_q)
    L > 1, a mask, keys == L              a padded batch's prefill        ValueError (unsupported)
    L > 1, a mask, keys > L               a continued/chunked prefill     dense SDPA with the mask
    L == 1                                a decode step                   dense SDPA (with the mask)
    ===================================  ==============================  ==============================

The name is registered with transformers' ``AttentionMaskInterface`` as SDPA's mask function, so the model builds
the same masks it builds for ``attn_implementation="sdpa"``: none where SDPA's ``is_causal`` suffices (a prefill
without padding, a decode step without padding), a boolean mask otherwise. Sliding-window layers (their band is
their pattern, as in training) run dense SDPA with the model's window mask.

Unsupported (clear errors): padded batches at prefill (the pattern would be estimated over pad tokens; generate
one prompt per call, or prompts of equal length), attention dropout at prefill, score soft-capping (Gemma 2), learned
attention sinks (gpt-oss).

Note [Prefill or decode]
------------------------
transformers' SDPA mask function returns no mask exactly when SDPA's own ``is_causal`` flag is right: a query of
length 1, or queries and keys of equal length, or a cache with no earlier tokens (``q_offset == 0``) whose padding
is only the static cache's unused tail (``masking_utils._ignore_causal_mask_sdpa``). transformers'
``sdpa_attention_forward`` reads "no mask and L > 1" as a causal prefill from position 0 and keeps the first L keys
(a static cache's first L slots); this module reads it the same way, so the sparse path sees exactly the keys SDPA
would.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_mtraining.sparsity.attention import sparse_attention
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.estimation import estimate_pattern
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern

__all__ = ["DEFAULT_PREFILL_NAME", "register_sparse_prefill", "sparse_prefill_attention"]

DEFAULT_PREFILL_NAME = "mtraining_prefill"
# transformers' own names, and the training hook's (lightning_mtraining.hf.attention.ATTENTION_NAME)
_RESERVED = frozenset({"eager", "sdpa", "flex_attention", "paged_attention", "sdpa_paged", "eager_paged",
                       "mtraining_ring"})

# Called once per sparse prefill and layer: (layer_idx, pattern, prompt length). For statistics (density, recall).
PatternHook = Callable[[int | None, VerticalSlashPattern, int], None]


def _dense(module: nn.Module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """transformers' own SDPA attention: what ``attn_implementation="sdpa"`` runs, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _single_rank_group(group: Any, name: str) -> Any:
    """The estimator's group: one rank. ``estimate_pattern(group=None)`` means the default group once
    torch.distributed is initialised, which would treat every process's prompt as a shard of one sequence."""
    import torch.distributed as dist

    if group is not None:
        if dist.get_world_size(group) != 1:
            raise ValueError(f"{name}: the sparse prefill runs on one device; the group given to "
                             f"register_sparse_prefill has {dist.get_world_size(group)} ranks, it needs 1")
        return group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"{name}: torch.distributed is initialised with {dist.get_world_size()} processes, and the sparse prefill "
            "estimates each prompt on its own device: create one-rank groups on every process "
            "(`group, _ = torch.distributed.new_subgroups(group_size=1)`) and pass "
            "register_sparse_prefill(..., group=group)"
        )
    return None


def sparse_prefill_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    sparsity: SparsityConfig,
    on_pattern: PatternHook | None = None,
    group: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function: query ``[B, H, L, D]``, key/value ``[B, Hkv, K, D]`` (the cache after this
    forward's update) -> ``([B, L, H, D], None)``.

    Sparse for a causal prefill from position 0 (see the module docstring's table), dense SDPA otherwise.
    ``sparsity``, ``on_pattern`` and ``group`` are bound by :func:`register_sparse_prefill`.
    """
    name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    q_len, k_len = query.shape[2], key.shape[2]
    if kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:
        what = "learned attention sinks (s_aux)" if kwargs.get("s_aux") is not None else "score soft-capping"
        raise ValueError(f"{name}: {what} is not supported by the sparse prefill (nor by SDPA); use another "
                         "attention implementation for this model")
    window = kwargs.get("sliding_window")
    if q_len == 1 or window is not None or sparsity.is_dense_layer(getattr(module, "layer_idx", None)):
        return _dense(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if attention_mask is not None:
        if k_len == q_len:
            raise ValueError(
                f"{name}: the sparse prefill got a padding mask (a batch of prompts of different lengths, shape "
                f"{tuple(attention_mask.shape)}); padded batches are not supported, since the pattern would be "
                "estimated over pad tokens. Generate one prompt per call, or prompts of equal length without "
                "padding, or use attn_implementation='sdpa' for padded batches"
            )
        # a continued (chunked) prefill over a cache that already holds tokens: exact dense attention
        return _dense(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if getattr(module, "is_causal", True) is False:
        raise ValueError(f"{name} is not causal; the sparse prefill computes causal attention only")
    if q_len < sparsity.last_q:  # too short to estimate from (the same rule as training): dense, exact
        return _dense(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if dropout:
        raise ValueError(f"{name}: attention dropout ({dropout}) is not supported by the sparse prefill; call "
                         "model.eval() before generating (from_pretrained returns the model in eval mode)")
    # no mask and L > 1: a causal prefill from position 0; a static cache holds the prompt in its first L slots
    key, value = key[:, :, :q_len], value[:, :, :q_len]
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    layer_idx = getattr(module, "layer_idx", None)
    pattern = estimate_pattern(query, key, sparsity, group=_single_rank_group(group, name), layout="contiguous",
                               block_size=sparsity.tile_size, scale=scaling, layer_idx=layer_idx)
    if on_pattern is not None:
        on_pattern(layer_idx, pattern, q_len)
    out = sparse_attention(query, key, value, pattern.vertical_idx, pattern.slash_idx, scale=scaling,
                           block_size=pattern.tile_size)
    return out.transpose(1, 2).contiguous(), None


def register_sparse_prefill(
    config: SparsityConfig,
    name: str = DEFAULT_PREFILL_NAME,
    *,
    on_pattern: PatternHook | None = None,
    group: Any = None,
) -> str:
    """Register the sparse prefill under ``name`` with ``transformers`` and return ``name``.

    Then ``model.set_attn_implementation(name)``, or ``from_pretrained(..., attn_implementation=name)``, and use
    the model as usual (``generate``, a plain forward). Registering a name again replaces its config.

    Args:
        config: the pattern budgets (:class:`~lightning_mtraining.SparsityConfig`); ``dense_layers`` run dense;
            ``dense_warmup_steps`` is a training setting and is ignored here.
        name: the attention implementation's name. Must not contain "flash" (transformers treats such names as
            flash-attention kernels to fetch from the hub) and must not be a built-in name.
        on_pattern: called with ``(layer_idx, pattern, prompt_length)`` after each layer's estimate at prefill
            (statistics: density, recall); ``None`` for none.
        group: only where torch.distributed is initialised with several processes (each serving its own
            prompts): a process group holding just this rank, e.g. ``torch.distributed.new_subgroups(group_size=1)[0]``
            (collective: every process calls it once); otherwise leave it None.

    Returns:
        ``name``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not isinstance(config, SparsityConfig):
        raise TypeError(f"register_sparse_prefill: config must be a SparsityConfig, got {type(config).__name__}")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ValueError(f"register_sparse_prefill: name must be a non-empty identifier-like string, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"register_sparse_prefill: name {name!r} contains 'flash': transformers would treat it as a "
                         "flash-attention kernel to fetch from the hub; choose another name")
    if name in _RESERVED:
        raise ValueError(f"register_sparse_prefill: {name!r} is a built-in or reserved attention implementation "
                         f"({sorted(_RESERVED)}); choose another name")

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return sparse_prefill_attention(module, query, key, value, attention_mask, scaling, dropout,
                                        sparsity=config, on_pattern=on_pattern, group=group, **kwargs)

    attention.__name__ = f"sparse_prefill_attention[{name}]"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
