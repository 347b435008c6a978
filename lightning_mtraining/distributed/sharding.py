"""Batch sharding for context parallelism: pad, shift labels globally, split every sequence tensor.

Shape legend: B batch, S the batch's sequence length, P the padded length (a multiple of the layout's unit),
L = P / cp_size the per-rank (local) length.

Why labels are shifted *before* sharding: a causal LM's target for position i is token i + 1. Hugging Face
shifts labels inside the loss, which on a shard would pair each local position with the next *local* token,
wrong at every shard boundary (and for every block edge of the striped layout)::

    global    tokens  a b c d | e f g h        targets  b c d e | f g h -
    shard 1   tokens  a b c d                  local shift: b c d -   (target e lost)
    here      tokens  a b c d                  global shift then shard: b c d e

So the full label row is shifted once, padding and the last position get the ignore index (-100), and each
rank receives its shard of the shifted row (``shift_labels=`` in Hugging Face). The loss is normalised by the
number of target tokens of the *whole* sequence (``num_items_in_batch``), never by a rank's local count.

Padding: the sequence is padded on the right to a multiple of ``layout_unit(layout, cp_size, block_size)``.
Right padding is exact under causal attention (a real token never attends to a later one) so padded tokens
never change a real token's output, and their targets are -100 so they never enter the loss. Left padding or
holes in ``attention_mask`` cannot be expressed without a mask in the ring, and are rejected; so are labels at the
user's padded positions (Note [Labels at padding]).

Note [Labels at padding]
------------------------
With right padding and ``labels = input_ids`` (labels not set to -100 where ``attention_mask`` is 0), Hugging Face
counts every padded position's label in its loss: the last real token predicts a pad token, and each padded
position predicts the next pad token from a hidden state that attends to the real tokens only (Hugging Face masks
padded keys, also for padded queries). Ring attention has no key mask: right padding is harmless to real tokens by
causality alone, so a padded query attends to the padded keys before it, and its output is not Hugging Face's.
Reproducing those targets exactly would take a per-row key bound in every ring step, block op and kernel (dense and
sparse, CPU and CUDA) for positions that carry no information: their targets are pad tokens, which training is not
meant to learn (``DataCollatorForLanguageModeling`` sets them to -100). Dropping them silently made the loss differ
from one device's (5.551573 against 5.551208 on a tiny Llama). So labels other than -100 at a padded position are
refused, every rank of the CP group alike, with the fix; the check is one reduction over the mask and, when it has
zeros, one over the labels. One device with dense attention keeps the model's own attention and computes Hugging
Face's loss as it is.

A shard knows where it came from: every tensor of a sharded batch carries a weak reference to its
:class:`ShardedBatch` (:func:`shard_of`), and so do the logits the model hook returns. That is how
:func:`~lightning_mtraining.hf.losses.causal_lm_loss` finds the globally shifted targets of a shard, and how
outputs are put back in global order (:func:`gather_sequence`) without the caller passing the strategy around.
The reference is weak so that batch tensors and their record do not form a reference cycle (which would keep
every batch alive until the cyclic garbage collector runs).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_mtraining.core.errors import same_on_ranks_of
from lightning_mtraining.core.layouts import (
    document_starts,
    global_positions,
    layout_unit,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "IGNORE_INDEX",
    "ShardedBatch",
    "all_gather_sequence",
    "check_padded_labels",
    "check_right_padding",
    "gather_sequence",
    "pad_sequence_dim",
    "padded_labels_error",
    "shard_batch",
    "shard_of",
    "shift_labels",
    "sparse_padding_multiple",
    "shift_labels_sharded",
    "tag_shard",
]

IGNORE_INDEX = -100

# Keys whose padding value is not 0.
_PAD_VALUES = {"labels": IGNORE_INDEX, "attention_mask": 0}
# Attribute on a shard tensor: (weak reference to its ShardedBatch, its key in the batch or None).
_SHARD_ATTR = "_mtraining_shard"


@dataclasses.dataclass
class ShardedBatch:
    """One rank's view of a batch after :func:`shard_batch`.

    Attributes:
        batch: the input mapping with every ``[B, S, ...]`` tensor replaced by this rank's ``[B, L, ...]`` shard
            (``labels`` stay *unshifted*, aligned with ``input_ids``, as the user expects).
        seq_len: S, the batch's length before padding.
        padded_len: P, the padded global length.
        position_ids: ``[1, L]`` global positions of this rank's tokens (for RoPE).
        valid: ``[B, L]`` bool, True for real (non-padding) tokens of this shard.
        targets: for each integer sequence key usable as labels (``labels``, ``input_ids``), the globally
            shifted targets ``[B, L]`` of this shard (-100 at padding and at the last position).
        num_targets: for each key of ``targets``, the number of targets != -100 in the whole (global) batch.
        cp_rank, cp_size, layout, block_size: how the batch was split.
        group: the context-parallel process group (``None``: the default group, or a single process).
        lengths: the real (unpadded) length of every row of the whole sequence (host ints).
        doc_start: packed documents (the batch's ``position_ids`` restart, see
            :func:`~lightning_mtraining.core.layouts.document_starts`): ``[B, L]`` for each of this shard's tokens the
            global position of its document's first token (what
            :func:`~lightning_mtraining.ring.attention.ring_attention` takes); None when every row is one document.
        doc_position_ids: with packed documents, this shard of the batch's own ``position_ids`` (per document, for
            RoPE), else None.
    """

    batch: dict[str, Any]
    seq_len: int
    padded_len: int
    position_ids: torch.Tensor
    valid: torch.Tensor
    targets: dict[str, torch.Tensor]
    num_targets: dict[str, int]
    cp_rank: int = 0
    cp_size: int = 1
    layout: str = "striped"
    block_size: int = 128
    group: dist.ProcessGroup | None = None
    lengths: list[int] = dataclasses.field(default_factory=list)
    doc_start: torch.Tensor | None = None
    doc_position_ids: torch.Tensor | None = None

    @property
    def local_len(self) -> int:
        return self.position_ids.shape[-1]

    @property
    def target_valid(self) -> torch.Tensor:
        """``[B, L]``: tokens that may be a target: real, and not the first token of a packed document (the last
        token of the document before it predicts nothing across the boundary)."""
        if self.doc_start is None:
            return self.valid
        return self.valid & (self.doc_start != self.position_ids)

    def targets_for(self, labels: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The shifted shard and global count for ``labels`` if it is one of this batch's tensors (by identity)."""
        for key, shifted in self.targets.items():
            if labels is self.batch.get(key):
                return shifted, self.num_targets[key]
        return None


def check_right_padding(attention_mask: torch.Tensor) -> None:
    """Raise unless every row of a ``[B, S]`` mask is ones followed by zeros (right padding, no holes)."""
    mask = attention_mask.bool()
    if mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be [batch, seq] (a padding mask), got shape {tuple(attention_mask.shape)}; "
            "custom (3D/4D) attention masks are not supported by ring attention"
        )
    # A 0 followed later by a 1 is left padding or a hole.
    bad = (mask[:, 1:] & ~mask[:, :-1]).any(dim=1)
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask rows {rows[:8]} have padding before real tokens (left padding or holes); "
            "context-parallel training supports right padding only (tokenizer.padding_side = 'right'), "
            "because causal attention then never lets a real token see padding"
        )


def padded_labels_error(rows: list[int], count: int, what: str = "labels") -> ValueError:
    """The error for ``count`` labels other than -100 at padded positions (of ``rows`` if known) (Note [Labels at
    padding])."""
    where = f" in rows {rows[:8]}" if rows else ""
    return ValueError(
        f"{what} has {count} targets at padded positions (attention_mask 0){where}: Hugging Face counts "
        "them in its loss, and ring attention cannot reproduce a padded position's output (it has no padding mask), "
        "so they would be dropped and the loss would differ from one device's. Set the labels to -100 where "
        "attention_mask is 0, e.g. labels = input_ids.masked_fill(attention_mask == 0, -100) "
        "(DataCollatorForLanguageModeling does this); padding then has no target anywhere"
    )


def check_padded_labels(labels: torch.Tensor, padding: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                        what: str = "labels") -> None:
    """Raise :func:`padded_labels_error` if ``labels`` (``[B or 1, S]``) is not ``ignore_index`` wherever
    ``padding`` (``[B, S]`` bool, the user's padded positions) is True. See Note [Labels at padding]."""
    bad = (labels != ignore_index) & padding
    count = int(bad.sum())
    if count:
        raise padded_labels_error(bad.any(dim=1).nonzero().flatten().tolist(), count, what)


def pad_sequence_dim(x: torch.Tensor, padded_len: int, value: float | int = 0, dim: int = 1) -> torch.Tensor:
    """``x`` padded on the right along ``dim`` to ``padded_len`` with ``value``."""
    extra = padded_len - x.shape[dim]
    if extra == 0:
        return x
    if extra < 0:
        raise ValueError(f"cannot pad length {x.shape[dim]} down to {padded_len}")
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def shift_labels(
    labels: torch.Tensor, valid: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Next-token targets of a full ``[B, S]`` label row: ``out[:, i] = labels[:, i + 1]``.

    The last position and every position whose next token is not ``valid`` (padding) get ``ignore_index``.
    """
    if valid is not None:
        labels = labels.masked_fill(~valid.bool(), ignore_index)
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)


def _is_sequence_tensor(value: Any, batch_size: int, seq_len: int) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and value.shape[1] == seq_len
        and value.shape[0] in (batch_size, 1)
    )


def shard_batch(
    batch: Mapping[str, Any],
    *,
    cp_rank: int,
    cp_size: int,
    layout: str = "striped",
    block_size: int = 128,
    ignore_index: int = IGNORE_INDEX,
    group: dist.ProcessGroup | None = None,
    multiple_of: int = 1,
) -> ShardedBatch:
    """Pad, globally shift and shard a Hugging Face style batch for one context-parallel rank.

    The padded length P is the smallest multiple of both the layout's unit and ``multiple_of`` (sparse attention
    asks for whole tiles on every rank, see :func:`sparse_padding_multiple`) that holds the sequence.

    Every tensor whose first two dims are ``[B or 1, S]`` (``input_ids``, ``labels``, ``attention_mask``,
    ``position_ids``, ``token_type_ids``, ...) is padded to P and sharded along dim 1; other values pass through.
    Padding values: ``labels`` -100, ``position_ids`` continue counting, everything else 0.

    Packed documents: ``position_ids`` that restart (:func:`~lightning_mtraining.core.layouts.document_starts`) give
    :attr:`ShardedBatch.doc_start`, and no target crosses a document boundary (the last token of a document gets
    -100, as ``DataCollatorWithFlattening`` does). Each shard is
    tagged with the returned record (:func:`shard_of`), which must stay referenced while the shards are used
    (the strategies keep the current one).

    Raises:
        TypeError: the batch is not a mapping.
        KeyError: the batch has no ``input_ids``.
        ValueError: ``attention_mask`` has left padding or holes, or a sequence tensor's length is unexpected.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"context-parallel training needs each batch to be a mapping with 'input_ids' (like a Hugging Face "
            f"tokenizer's output), got {type(batch).__name__}; return dicts from your DataLoader/collate_fn"
        )
    if "input_ids" not in batch:
        raise KeyError(
            f"the batch has no 'input_ids' (keys: {sorted(batch)}); context-parallel training shards the sequence "
            "along input_ids' dim 1, so every batch must contain 'input_ids' of shape [batch, seq]"
        )
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"batch['input_ids'] must be a [batch, seq] tensor, got {shape}")
    B, S = input_ids.shape
    unit = math.lcm(layout_unit(layout, cp_size, block_size), max(1, multiple_of))
    P = max(unit, -(-S // unit) * unit)
    device = input_ids.device

    valid = torch.ones(B, P, dtype=torch.bool, device=device)
    valid[:, S:] = False
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.shape != (B, S):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"attention_mask must be a [batch, seq] padding mask matching input_ids {(B, S)}, got {shape}; "
                "custom attention masks are not supported by ring attention"
            )
        check_right_padding(mask)
        valid[:, :S] &= mask.bool()
        labels = batch.get("labels")
        if (labels is not None and _is_sequence_tensor(labels, B, S) and not labels.is_floating_point()
                and not bool(valid[:, :S].all())):
            check_padded_labels(labels, ~valid[:, :S], ignore_index, "batch['labels']")

    def shard(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, 1, cp_rank, cp_size, layout, block_size)

    doc_full = None
    target_valid = valid
    pid = batch.get("position_ids")
    if pid is not None and _is_sequence_tensor(pid, B, S) and pid.dim() == 2 and not pid.is_floating_point():
        doc = document_starts(pid)
        if doc is not None:  # packed documents; the padding continues the last one (as its positions do)
            doc = doc.to(device).expand(B, S)
            doc_full = torch.cat([doc, doc[:, -1:].expand(B, P - S)], dim=1)
            target_valid = valid & (doc_full != torch.arange(P, device=device))

    out: dict[str, Any] = {}
    targets: dict[str, torch.Tensor] = {}
    num_targets: dict[str, int] = {}
    sharded_keys = []
    for key, value in batch.items():
        if not _is_sequence_tensor(value, B, S):
            out[key] = value
            continue
        sharded_keys.append(key)
        if key == "position_ids":
            # Continue each row's count into the padding (padded positions never reach a real token).
            step = torch.arange(1, P - S + 1, device=value.device, dtype=value.dtype)
            padded = torch.cat([value, value[:, -1:] + step], dim=1)
        else:
            padded = pad_sequence_dim(value, P, _PAD_VALUES.get(key, 0))
        out[key] = shard(padded)
        if key in ("labels", "input_ids") and not value.is_floating_point():
            full = shift_labels(padded.expand(B, P), target_valid, ignore_index)
            targets[key] = shard(full)
            num_targets[key] = int((full != ignore_index).sum())
    positions = global_positions(P, cp_rank, cp_size, layout, block_size, device=device)
    sharded = ShardedBatch(
        batch=out,
        seq_len=S,
        padded_len=P,
        position_ids=positions[None, :],
        valid=shard(valid),
        targets=targets,
        num_targets=num_targets,
        cp_rank=cp_rank,
        cp_size=cp_size,
        layout=layout,
        block_size=block_size,
        group=group,
        lengths=valid.sum(1).tolist(),
        doc_start=shard(doc_full) if doc_full is not None else None,
        doc_position_ids=out["position_ids"] if doc_full is not None else None,
    )
    for key in sharded_keys:
        tag_shard(out[key], sharded, key)
    return sharded


def sparse_padding_multiple(layout: str, cp_size: int, block_size: int, tile: int) -> int:
    """What the padded length must be a multiple of for every rank to hold whole, aligned ``tile``-token tiles.

    Striped: ``block_size`` must itself be a multiple of the tile (each block holds whole tiles); contiguous: each
    rank's chunk holds whole tiles (``cp_size * tile``); zigzag: each of a rank's two chunks (``2 * cp_size * tile``).
    """
    if layout == "striped":
        if block_size % tile:
            raise ValueError(
                f"sparse attention runs {tile}-token tiles, but the striped layout's block_size={block_size} is not a "
                f"multiple of it: use block_size={tile} (or a multiple), or SparsityConfig(tile_size=...) dividing "
                f"{block_size}"
            )
        return cp_size * block_size
    return (2 if layout == "zigzag" else 1) * cp_size * tile


def tag_shard(x: torch.Tensor, sharded: ShardedBatch, key: str | None = None) -> None:
    """Record on ``x`` (weakly) that it is a shard of ``sharded`` (``key``: its name in the batch, if any)."""
    setattr(x, _SHARD_ATTR, (weakref.ref(sharded), key))


def shard_of(x: Any) -> tuple[ShardedBatch, str | None] | None:
    """The :class:`ShardedBatch` a tensor is a shard of (and its batch key), or None for any other value.

    Raises:
        RuntimeError: ``x`` is a shard of a batch whose record no longer exists (kept from an earlier step).
    """
    tag = getattr(x, _SHARD_ATTR, None) if isinstance(x, torch.Tensor) else None
    if tag is None:
        return None
    ref, key = tag
    sharded = ref()
    if sharded is None:
        raise RuntimeError(
            f"this tensor (shape {tuple(x.shape)}) is a context-parallel shard of an earlier batch whose record is "
            "gone; use the batch of the current step"
        )
    return sharded, key


def shift_labels_sharded(
    labels: torch.Tensor,
    valid: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    cp_rank: int,
    cp_size: int,
    layout: str = "striped",
    block_size: int = 128,
    ignore_index: int = IGNORE_INDEX,
    lengths: list[int] | None = None,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Globally shifted targets of a label *shard* and the global target count (two all-gathers).

    For labels built inside ``training_step`` (not a tensor of the sharded batch): gathers the CP group's
    shards, shifts the full row, and returns this rank's shard of it. Every rank of the group must call it.
    With ``lengths`` (each row's real length) and ``seq_len`` (the batch's unpadded length), labels other than
    ``ignore_index`` at the user's padded positions raise on every rank alike (Note [Labels at padding]).
    """
    full = all_gather_sequence(labels, 1, group=group, cp_size=cp_size, layout=layout, block_size=block_size)
    if lengths is not None and seq_len is not None and min(lengths, default=seq_len) < seq_len:
        positions = torch.arange(full.shape[1], device=full.device)
        row_lengths = torch.tensor(lengths, device=full.device)[:, None]
        with same_on_ranks_of(group):  # every rank checks the same gathered labels
            check_padded_labels(full, (positions >= row_lengths) & (positions < seq_len), ignore_index)
    full_valid = all_gather_sequence(valid, 1, group=group, cp_size=cp_size, layout=layout, block_size=block_size)
    shifted = shift_labels(full, full_valid, ignore_index)
    count = int((shifted != ignore_index).sum())
    return shard_sequence(shifted, 1, cp_rank, cp_size, layout, block_size), count


def all_gather_sequence(
    x: torch.Tensor,
    dim: int,
    *,
    group: dist.ProcessGroup | None,
    cp_size: int,
    layout: str = "striped",
    block_size: int = 128,
) -> torch.Tensor:
    """The whole (padded) sequence from every CP rank's shard ``x``, in global order (one all-gather).

    Not differentiable (the result is detached). Every rank of the group must call it with the same shape.
    """
    if cp_size == 1:
        return x
    # bool travels as uint8: gloo has no bool all-gather.
    wire = x.detach().to(torch.uint8) if x.dtype == torch.bool else x.detach()
    wire = wire.contiguous()
    shards = [torch.empty_like(wire) for _ in range(cp_size)]
    dist.all_gather(shards, wire, group=group)
    full = unshard_sequence(shards, dim, layout, block_size)
    return full.bool() if x.dtype == torch.bool else full


def gather_sequence(x: torch.Tensor, sharded: ShardedBatch, dim: int = 1) -> torch.Tensor:
    """``x``, a tensor whose ``dim`` is this rank's shard of ``sharded``'s sequence, in global order, unpadded.

    ``[B, L, ...] -> [B, S, ...]`` for ``dim=1``: all-gather over the CP group, undo the layout, drop the padding.
    For outputs (predictions, logits for metrics); not differentiable. Every rank of the group must call it.
    """
    if x.shape[dim] != sharded.local_len:
        raise ValueError(
            f"dim {dim} of a tensor of shape {tuple(x.shape)} is not this rank's shard length {sharded.local_len} "
            f"(the batch has {sharded.seq_len} tokens, padded to {sharded.padded_len} = {sharded.cp_size} ranks x "
            f"{sharded.local_len})"
        )
    full = all_gather_sequence(
        x, dim, group=sharded.group, cp_size=sharded.cp_size, layout=sharded.layout, block_size=sharded.block_size
    )
    return full.narrow(dim, 0, sharded.seq_len)
