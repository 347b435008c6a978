"""Causal-LM losses and targets that are right on a context-parallel shard, and the check that a loss is.

Under context parallelism a rank's batch, hidden states and logits cover only its *shard* of each sequence:
padded to the layout's unit and, in the striped layout, blocks spread over the whole sequence (with 2 ranks and
blocks of 128, rank 0 holds positions 0-127, 256-383, ...). Next-token code written for one device pairs
positions with the wrong targets there, and nothing fails::

    logits = self.model(input_ids=ids).logits          # [B, L, V]: this rank's positions only
    loss = cross_entropy(logits[:, :-1], ids[:, 1:])   # pairs position 127 with token 257 (should be 128),
                                                       # and counts padding; DDP then averages partial means

What is right, on a shard and on one device alike:

* ``self.model(**batch).loss`` (labels in the batch or passed as ``labels=``): the model hook gives Hugging Face
  globally shifted labels and the global target count (:mod:`lightning_mtraining.hf`).
* :func:`causal_lm_loss` ``(logits, batch)``: the same loss from logits the step holds, for code that computes its
  own loss (``+ aux`` terms, a z-loss, chunked heads).
* :func:`causal_lm_targets` ``(batch)``: targets lined up position by position with the shard's logits
  (``targets[:, t]`` is the token after position ``t``, -100 where there is none), for per-token metrics:
  ``metrics.token_loss_sum(logits, targets)``, ``(logits.argmax(-1) == targets)``, ...

Both helpers find the shard's record through the tensors themselves (:func:`~lightning_mtraining.sharding.shard_of`):
the batch tensors and the logits the model returns carry it, so no strategy needs to be passed. A tensor that
carries none (one device, plain DDP, or ``context_parallel_size=1``) is treated as a whole sequence: the
ordinary local shift and mean, exactly what Hugging Face computes.

Note [Checking the loss]
------------------------
Every loss made by a sharding-aware path (the model hook, :func:`causal_lm_loss`) is *marked*: its autograd node
gets ``metadata["mtraining_exact_loss"] = True``. Before backward the strategies search the loss's autograd
graph breadth-first for a marked node, visiting at most ``MAX_SEARCH_NODES``: a loss built on a marked one
(``0.5 * out.loss + aux``, Lightning's division for gradient accumulation, a grad scaler's multiplication) finds
it within a few nodes; a loss with none ends the search at the bound (about a millisecond). No mark means the
loss was computed some other way, which under context parallelism is almost always the silent error above, so
the strategies raise (``loss_check="raise"``, the default), warn once (``"warn"``) or skip the check (``"off"``)
for losses that are right on shards by construction. Only backward is checked: validation and test losses have
no autograd graph, so there the rule is documented, not enforced.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_mtraining.sharding import IGNORE_INDEX, ShardedBatch, shard_of, shift_labels, shift_labels_sharded

__all__ = [
    "LOSS_MARK",
    "MAX_SEARCH_NODES",
    "causal_lm_loss",
    "causal_lm_targets",
    "exact_group_loss",
    "is_marked_loss",
    "mark_loss",
    "unmarked_loss_message",
]

LOSS_MARK = "mtraining_exact_loss"
MAX_SEARCH_NODES = 1000


def mark_loss(loss: torch.Tensor) -> torch.Tensor:
    """Mark ``loss`` as made by a sharding-aware path (see Note [Checking the loss]); returns it."""
    if loss.grad_fn is not None:
        loss.grad_fn.metadata[LOSS_MARK] = True
    return loss


def is_marked_loss(loss: torch.Tensor, max_nodes: int = MAX_SEARCH_NODES) -> bool:
    """Whether ``loss``'s autograd graph holds a marked node within ``max_nodes`` nodes, breadth first."""
    root = getattr(loss, "grad_fn", None)
    if root is None:
        return False
    seen = {root}
    queue = collections.deque([root])
    visited = 0
    while queue and visited < max_nodes:
        node = queue.popleft()
        visited += 1
        if node.metadata.get(LOSS_MARK):
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return False


def unmarked_loss_message(owner: str, cp_size: int, layout: str) -> str:
    """The error for a loss that did not come through a sharding-aware path (names the cause and the fix)."""
    return (
        f"{owner}: the loss passed to backward was not computed by a sharding-aware path. Under context "
        f"parallelism (cp_size={cp_size}) the batch and the logits in your step are this rank's padded, {layout} "
        "shard of each sequence, so a loss computed from them by hand (e.g. cross_entropy(logits[:, :-1], "
        "input_ids[:, 1:])) pairs positions with the wrong tokens and is silently wrong. Fix: return "
        "`self.model(**batch).loss` (or pass labels=), or compute it with "
        "`lightning_mtraining.causal_lm_loss(logits, batch)`; per-token metrics: "
        "`lightning_mtraining.causal_lm_targets(batch)`. If your loss is right on shards by construction, pass "
        "loss_check='warn' or 'off' to the strategy (README, 'What a step may do under context parallelism')."
    )


def exact_group_loss(rank_loss: torch.Tensor, group: dist.ProcessGroup | None, cp_size: int) -> torch.Tensor:
    """``rank_loss`` whose value is the CP group's mean and whose gradient is ``rank_loss``'s; marked.

    ``rank_loss`` is ``cp_size / N * (this rank's token-loss sum)``; see Note [Exact losses and gradients] in
    :mod:`lightning_mtraining.hf`. One scalar all-reduce over the CP group when ``cp_size > 1``.
    """
    if cp_size > 1:
        total = rank_loss.detach().clone()
        dist.all_reduce(total, group=group)
        rank_loss = rank_loss + (total / cp_size - rank_loss.detach())
    return mark_loss(rank_loss)


def _labels_tensor(labels: Any) -> torch.Tensor:
    if isinstance(labels, Mapping):
        for key in ("labels", "input_ids"):
            if isinstance(labels.get(key), torch.Tensor):
                return labels[key]
        raise KeyError(f"the batch has neither 'labels' nor 'input_ids' tensors (keys: {sorted(labels)})")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a tensor or a batch mapping, got {type(labels).__name__}")
    return labels


def _aligned_targets(
    labels: Any, logits: torch.Tensor | None, shifted: bool, ignore_index: int
) -> tuple[torch.Tensor, int | torch.Tensor, ShardedBatch | None]:
    """``(targets aligned with the logits, global target count, the shard's record or None)``."""
    tensor = _labels_tensor(labels)
    found = shard_of(tensor)
    via_labels = found is not None
    if found is None and logits is not None:
        found = shard_of(logits)
    if found is None:  # a whole sequence: one device, plain DDP or context_parallel_size=1
        targets = tensor if shifted else shift_labels(tensor, None, ignore_index)
        return targets, (targets != ignore_index).sum(), None
    sharded, key = found
    if via_labels and not shifted and key in sharded.targets:
        return sharded.targets[key], sharded.num_targets[key], sharded
    if tuple(tensor.shape[:2]) != tuple(sharded.valid.shape):
        raise ValueError(
            f"labels of shape {tuple(tensor.shape)} do not match this rank's shard {tuple(sharded.valid.shape)} of "
            f"the batch ({sharded.seq_len} tokens split over {sharded.cp_size} ranks): pass the batch the strategy "
            "gave your step, or labels built from its tensors"
        )
    if not shifted:  # labels built in the step: shift them over the CP group
        targets, count = shift_labels_sharded(
            tensor, sharded.valid, group=sharded.group, cp_rank=sharded.cp_rank, cp_size=sharded.cp_size,
            layout=sharded.layout, block_size=sharded.block_size, ignore_index=ignore_index,
        )
        return targets, count, sharded
    targets = tensor.masked_fill(~sharded.valid, ignore_index)  # padding has no target
    count = (targets != ignore_index).sum()
    if sharded.cp_size > 1:
        dist.all_reduce(count, group=sharded.group)
    return targets, count, sharded


def causal_lm_targets(
    labels: Any, *, logits: torch.Tensor | None = None, shifted: bool = False, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Next-token targets lined up with the logits: ``targets[:, t]`` is the token after position ``t``.

    Args:
        labels: the batch the step received (its ``labels``, else its ``input_ids``), or a ``[B, L]`` tensor of
            it or built from it, aligned with ``input_ids`` as Hugging Face expects.
        logits: the model's logits, needed only when ``labels`` is a tensor built in the step under context
            parallelism (the logits carry the shard's record then).
        shifted: ``labels`` are already next-token targets (``labels[:, t]`` = token ``t + 1``); only the
            padding is masked.
        ignore_index: the value of positions without a target.

    Returns:
        ``[B, L]``: on a shard, this rank's part of the globally shifted targets (-100 at padding and at the
        last position); on a whole sequence, ``labels[:, 1:]`` followed by -100.
    """
    return _aligned_targets(labels, logits, shifted, ignore_index)[0]


def causal_lm_loss(
    logits: torch.Tensor, labels: Any, *, shifted: bool = False, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean next-token cross-entropy of a causal LM, exact on a context-parallel shard and on one device.

    Give it the logits of every position the step holds (``[B, L, V]``, not shifted) and the batch (or its
    labels, as for :func:`causal_lm_targets`). On a shard the value is the loss of the whole sequence, the same
    on every rank of the CP group, and the gradient is this rank's share, so that DDP's average is the
    full-sequence gradient (Note [Exact losses and gradients] in :mod:`lightning_mtraining.hf`); the result is
    marked for the strategy's loss check. On a whole sequence it is Hugging Face's causal-LM loss. Computed in
    float32 whatever the logits' dtype.
    """
    targets, count, sharded = _aligned_targets(labels, logits, shifted, ignore_index)
    if tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not line up with the targets {tuple(targets.shape)}: pass the logits "
            "of every position of the step's sequence, unshifted (the targets are shifted for you)"
        )
    token_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
        reduction="sum",
    )
    cp_size = sharded.cp_size if sharded is not None else 1
    count = max(count, 1) if isinstance(count, int) else count.clamp_min(1)
    return exact_group_loss(token_sum * cp_size / count, sharded.group if sharded is not None else None, cp_size)
