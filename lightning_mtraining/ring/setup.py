"""What a ring call runs, worked out once per layer and call: every rank's global positions, the checked inputs, the
block op for the attention variant (sliding window, soft-cap, packed documents, sparse tiles), the layer's validated
pattern, and the ring steps that compute nothing. The public :func:`~lightning_mtraining.ring.attention.ring_attention`
and the custom ops (:mod:`.dense_op`, :mod:`.sparse_op`) call the same functions.

Causality comes from global token positions (:func:`~lightning_mtraining.core.layouts.global_positions`): the block
op never computes a tile that is entirely masked and masks tokens only in partially visible tiles (the diagonal blocks
of the layout).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import torch.distributed as dist

from lightning_mtraining.core.checks import check_softcap, check_window
from lightning_mtraining.core.layouts import (
    check_attention_inputs,
    check_doc_start,
    check_local_length,
    global_positions,
)
from lightning_mtraining.core.numerics import default_scale
from lightning_mtraining.core.topology import RingTopology
from lightning_mtraining.ring.block_ops import BlockAttentionOp, TorchBlockOp, default_block_op
from lightning_mtraining.ring.steps import attention_variant, document_skips, merge_skips, window_skips
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.estimation import estimate_pattern
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern
from mtraining_kernels.indexing import check_tile_aligned

__all__ = ["DenseSetup", "check_sparse_layout", "dense_setup", "documents_op", "rank_positions", "resolve_pattern",
           "shared_block_op", "sparse_block_op", "validate_ring_inputs", "variant_op", "window_for_length"]


@functools.lru_cache(maxsize=16)
def shared_block_op(device: torch.device) -> BlockAttentionOp:
    """The dense ring's default block op, one per device: FlexAttention's BlockMasks (cached by the op, keyed by
    the :func:`rank_positions` tensors) are then built once per layout and shape, not again in every layer's call."""
    return default_block_op(device)


@functools.lru_cache(maxsize=64)
def rank_positions(n: int, cp_size: int, layout: str, block_size: int,
                   device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every CP rank's global positions; cached so that every layer and step sees the same tensors (which lets
    block ops cache what they derive from them, such as FlexAttention BlockMasks)."""
    return tuple(global_positions(n, r, cp_size, layout, block_size, device=device) for r in range(cp_size))


def validate_ring_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, block_size: int,
                         cp_size: int) -> None:
    check_attention_inputs(q, k, v)
    check_local_length(q.shape[2], cp_size, layout, block_size)


@functools.lru_cache(maxsize=64)
def check_sparse_layout(n: int, cp_size: int, layout: str, block_size: int, tile: int) -> None:
    """Sparse rings run T x T tiles: every rank's shard must hold whole, aligned global tiles (checked on the host,
    once per layout)."""
    for r in range(cp_size):
        pos = global_positions(n, r, cp_size, layout, block_size)
        if not check_tile_aligned(pos, tile):
            hint = {
                "striped": f"use block_size a multiple of the tile ({tile})",
                "contiguous": f"pad the sequence to a multiple of {cp_size * tile} (cp_size x tile)",
                "zigzag": f"pad the sequence to a multiple of {2 * cp_size * tile} (2 x cp_size x tile)",
            }[layout]
            raise ValueError(
                f"sparse ring attention runs {tile} x {tile} tiles, but the {layout} layout (block_size={block_size}) "
                f"of {n} tokens on {cp_size} ranks does not give rank {r} whole tiles: {hint}, or change "
                "SparsityConfig.tile_size / the pattern's tile_size"
            )


def resolve_pattern(
    q: torch.Tensor,
    k: torch.Tensor,
    sparsity: SparsityConfig | VerticalSlashPattern,
    *,
    group: dist.ProcessGroup | None,
    cp_size: int,
    layout: str,
    block_size: int,
    seq_len=None,
    scale: float | None = None,
    layer_idx: int | None = None,
    doc_start: torch.Tensor | None = None,
) -> VerticalSlashPattern:
    """The layer's global pattern: estimated online from a ``SparsityConfig``, or a given pattern, validated."""
    n = q.shape[2] * cp_size
    if isinstance(sparsity, SparsityConfig):
        pattern = estimate_pattern(q, k, sparsity, group=group, layout=layout, block_size=block_size,
                                   seq_len=seq_len, scale=scale, layer_idx=layer_idx, doc_start=doc_start)
    elif isinstance(sparsity, VerticalSlashPattern):
        pattern = sparsity.to(q.device) if sparsity.device != q.device else sparsity
        pattern.validate(n, q.shape[1], k.shape[1], batch_size=q.shape[0])
    else:
        raise TypeError(
            f"sparsity must be None (dense ring attention), a SparsityConfig (estimated online) or a "
            f"VerticalSlashPattern (used as given); got {type(sparsity).__name__}"
        )
    check_sparse_layout(n, cp_size, layout, block_size, pattern.tile_size)  # one rank too: whole tiles
    return pattern


def window_for_length(window: int | None, n: int) -> int | None:
    """A valid window, or None when it spans the whole (padded) sequence and so masks nothing."""
    window = check_window(window)
    if window is None:
        return None
    return None if window >= n else window


_warned_documents: set[str] = set()


def documents_op(op: BlockAttentionOp, given: bool) -> BlockAttentionOp:
    """An op that computes packed documents: ``op`` if it does; the chunked torch op in place of a default op that
    does not (the sparse Triton kernels have no per-row document bound yet; warned once per op type, since it is
    exact but slower on CUDA); a clear error for a user's op that does not."""
    if getattr(op, "supports_documents", False):
        return op
    if given:
        raise ValueError(
            f"doc_start (packed documents): the block op {op!r} does not compute it (supports_documents is not set); "
            "pass op=None for the default"
        )
    name = type(op).__name__
    if name not in _warned_documents:
        _warned_documents.add(name)
        warnings.warn(
            f"packed documents: {name} has no per-document mask, so attention over packed documents runs the chunked "
            "torch op (TorchBlockOp) instead: exact, but slower than the CUDA kernels on long sequences",
            stacklevel=3,
        )
    return TorchBlockOp()


def variant_op(op: BlockAttentionOp, window: int | None, softcap: float | None) -> BlockAttentionOp:
    """``op``, after checking that it computes the variant (a clear error naming the op and the option if not)."""
    check_softcap(softcap)
    for name, value, attr in (("window", window, "supports_window"), ("softcap", softcap, "supports_softcap")):
        if value is not None and not getattr(op, attr, False):
            raise ValueError(
                f"{name}={value}: the block op {op!r} does not compute it ({attr} is not set). Dense ring attention "
                "computes it with the default ops (FlexAttention on CUDA, torch elsewhere); keep such a sparse layer "
                "dense (SparsityConfig(dense_layers=...))"
            )
    return op


def sparse_block_op(op: BlockAttentionOp | None, device: torch.device, tile: int) -> BlockAttentionOp:
    if op is None:
        if device.type == "cuda":
            from mtraining_kernels.vertical_slash import TritonBlockOp

            return TritonBlockOp(tile, tile)
        return TorchBlockOp()
    if not getattr(op, "supports_tiles", False):
        raise ValueError(
            f"sparse ring attention needs a block op that takes tile lists (supports_tiles = True); {op!r} computes "
            "dense blocks only. Pass op=None for the default (the Triton kernels on CUDA, torch elsewhere)"
        )
    return op


@functools.lru_cache(maxsize=256)
def _window_skips_cached(n: int, cp_size: int, layout: str, block_size: int, cp_rank: int,
                         window: int | None) -> dict[int, bool] | None:
    """:func:`window_skips` from host positions, once per shape (no device sync in each layer's forward)."""
    return window_skips(rank_positions(n, cp_size, layout, block_size, torch.device("cpu")), cp_rank, window)


@dataclasses.dataclass
class DenseSetup:
    """What a dense ring call (or a window layer's band) runs: every rank's positions, the block op, the scale, the
    op's variant keywords and the ring steps that compute nothing."""

    positions: tuple[torch.Tensor, ...]
    op: BlockAttentionOp
    scale: float
    variant: dict
    skips: dict[int, bool] | None


def dense_setup(q, k, v, topo: RingTopology, layout: str, block_size: int, scale: float | None,
                window: int | None, softcap: float | None, doc_start: torch.Tensor | None,
                op: BlockAttentionOp | None = None) -> DenseSetup:
    """Validate a dense ring call's inputs and work out what it runs (:class:`DenseSetup`); shared by
    :func:`ring_attention` and its custom op (:mod:`lightning_mtraining.ring.dense_op`)."""
    validate_ring_inputs(q, k, v, layout, block_size, topo.cp_size)
    n = q.shape[2] * topo.cp_size
    positions = rank_positions(n, topo.cp_size, layout, block_size, q.device)
    window = window_for_length(window, n)
    doc_start = check_doc_start(doc_start, q, positions[topo.cp_rank])  # None here: nothing to mask on this rank
    variant = attention_variant(window, softcap, doc_start)
    chosen = variant_op(shared_block_op(q.device) if op is None else op, window, softcap)
    if doc_start is not None:
        chosen = documents_op(chosen, op is not None)
    skips = _window_skips_cached(n, topo.cp_size, layout, block_size, topo.cp_rank, window)
    if doc_start is not None:
        skips = merge_skips(skips, document_skips(positions, topo.cp_rank, doc_start))
    return DenseSetup(positions, chosen, default_scale(q.shape[-1], scale), variant, skips)
