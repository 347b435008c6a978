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

Both helpers find the shard's record through the tensors themselves
(:func:`~lightning_mtraining.distributed.sharding.shard_of`): the batch tensors and the logits the model returns carry
it, so no strategy needs to be passed. A tensor that carries none (one device, plain DDP, or
``context_parallel_size=1``) is treated as a whole sequence: the ordinary local shift and mean, exactly what Hugging
Face computes.

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
import functools
import importlib.util
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_mtraining.core.errors import group_ranks, mark_same_on_ranks
from lightning_mtraining.core.layouts import document_starts
from lightning_mtraining.distributed.sharding import (
    IGNORE_INDEX,
    ShardedBatch,
    padded_labels_error,
    shard_of,
    shift_labels,
    shift_labels_sharded,
)

__all__ = [
    "FUSED_LOSS_BACKENDS",
    "LOSS_MARK",
    "MAX_SEARCH_NODES",
    "causal_lm_loss",
    "causal_lm_targets",
    "exact_group_loss",
    "fused_linear_cross_entropy",
    "is_marked_loss",
    "mark_loss",
    "unmarked_loss_message",
]

LOSS_MARK = "mtraining_exact_loss"
MAX_SEARCH_NODES = 1000


def mark_loss(loss: torch.Tensor) -> torch.Tensor:
    """Mark ``loss`` as made by a sharding-aware path (see Note [Checking the loss]); returns it."""
    if loss.grad_fn is not None:
        loss.grad_fn.metadata[LOSS_MARK] = True  # type: ignore[index]  # a dict property; torch's stub says method
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
        "loss_check='warn' or 'off' to the strategy (docs/strategies-and-sparsity.md, 'What a step may do under "
        "context parallelism')."
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


def _within_documents(targets: torch.Tensor, position_ids: Any, ignore_index: int) -> torch.Tensor:
    """Whole-sequence next-token ``targets`` with -100 where the next token starts a packed document (read from the
    batch's ``position_ids``, :func:`~lightning_mtraining.core.layouts.document_starts`); unchanged otherwise."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point() \
            or position_ids.shape[-1] != targets.shape[-1]:
        return targets
    doc = document_starts(position_ids)
    if doc is None:
        return targets
    first = (doc == torch.arange(doc.shape[-1], device=doc.device)).to(targets.device)
    crosses = torch.cat([first[:, 1:], torch.zeros_like(first[:, :1])], dim=1).expand_as(targets)
    return targets.masked_fill(crosses, ignore_index)


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
        if isinstance(labels, Mapping) and not isinstance(labels.get("labels"), torch.Tensor):
            mask = labels.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.shape == tensor.shape:
                # the batch's input_ids as targets: padding has none, as under context parallelism (the sharded
                # batch's input_ids targets); the batch's own labels are the user's statement and stay as they are
                tensor = tensor.masked_fill(mask == 0, ignore_index)
        targets = tensor if shifted else shift_labels(tensor, None, ignore_index)
        if not shifted and isinstance(labels, Mapping):  # packed documents: no target crosses a boundary
            targets = _within_documents(targets, labels.get("position_ids"), ignore_index)
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
            tensor, sharded.target_valid, group=sharded.group, cp_rank=sharded.cp_rank, cp_size=sharded.cp_size,
            layout=sharded.layout, block_size=sharded.block_size, ignore_index=ignore_index,
            lengths=sharded.lengths, seq_len=sharded.seq_len,
        )
        return targets, count, sharded
    targets = tensor.masked_fill(~sharded.valid, ignore_index)  # padding has no target
    # targets at the user's padded positions: refused on every rank alike (Note [Labels at padding])
    user_padding = ~sharded.valid & (sharded.position_ids < sharded.seq_len)
    counts = torch.stack([(targets != ignore_index).sum(), ((tensor != ignore_index) & user_padding).sum()])
    if sharded.cp_size > 1:
        dist.all_reduce(counts, group=sharded.group)
    if int(counts[1]):  # the group's sum: every rank raises alike
        raise mark_same_on_ranks(padded_labels_error([], int(counts[1]), "the shifted labels"),
                                 *group_ranks(sharded.group), "every rank of the context-parallel group")
    return targets, counts[0], sharded


def causal_lm_targets(
    labels: Any, *, logits: torch.Tensor | None = None, shifted: bool = False, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Next-token targets lined up with the logits: ``targets[:, t]`` is the token after position ``t``.

    Args:
        labels: the batch the step received (its ``labels``, else its ``input_ids``, whose padded positions,
            ``attention_mask`` 0, then have no target), or a ``[B, L]`` tensor of it or built from it, aligned with
            ``input_ids`` as Hugging Face expects. Under context parallelism, labels other than -100 at padded
            positions are an error (Note [Labels at padding] in :mod:`lightning_mtraining.distributed.sharding`).
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
    full-sequence gradient (Note [Exact losses and gradients] in :mod:`lightning_mtraining.hf.model`); the result is
    marked for the strategy's loss check. On a whole sequence it is Hugging Face's causal-LM loss. Computed in
    float32 whatever the logits' dtype. Packed documents (``position_ids`` that restart): no target crosses a
    boundary, read from the shard's record under context parallelism, and on a whole sequence from the batch, so
    pass the batch there (a bare labels tensor carries no boundaries).
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


# --------------------------------------------------------------------------------------------------------------
# fused linear + cross-entropy
# --------------------------------------------------------------------------------------------------------------

_CHUNK_BYTES = 512 * 2**20  # float32 logits of one chunk of rows (a chunk's peak: about 3 such buffers)


def _chunk_rows(rows: int, vocab: int, chunk_size: int | None) -> int:
    if chunk_size is None:
        chunk_size = max(128, _CHUNK_BYTES // (4 * max(vocab, 1)))
    return max(1, min(chunk_size, max(rows, 1)))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, logit_scale, softcap, chunk, ignore_index, need_grad):
        rows, V = hidden.shape[0], weight.shape[0]
        total = torch.zeros((), dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32,
                            device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_grad[0] else None
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grad[1] else None
        grad_b = torch.zeros(V, dtype=acc, device=weight.device) if need_grad[2] else None
        any_grad = any(need_grad)
        for start in range(0, rows, chunk):
            h = hidden[start:start + chunk]
            t = targets[start:start + chunk]
            valid = t != ignore_index
            safe = torch.where(valid, t, 0)
            z = F.linear(h, weight, bias)  # the matmul in the inputs' dtype, the loss in float32 (float64 kept)
            z = z if z.dtype == torch.float64 else z.float()
            # in place where possible: at most two [chunk, V] float32 buffers (z, and tanh for a soft-cap) besides
            # logsumexp's own temporaries
            if logit_scale != 1.0:
                z.mul_(logit_scale)
            tanh = None
            if softcap is not None:
                tanh = z.div_(softcap).tanh_()
                z = tanh * softcap
            lse = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, safe[:, None]).squeeze(1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            if not any_grad:
                continue
            # d(sum of losses) / dz = softmax(z) - onehot(target) on valid rows, 0 on ignored ones
            g = z.sub_(lse[:, None]).exp_()
            g.scatter_add_(1, safe[:, None], torch.full_like(picked, -1.0)[:, None])
            g.mul_(valid[:, None])
            if tanh is not None:  # d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2
                g.mul_(tanh.square_().neg_().add_(1.0))
                del tanh
            if logit_scale != 1.0:
                g.mul_(logit_scale)
            if grad_b is not None:
                grad_b += g.sum(0)
            g = g.to(hidden.dtype)
            if grad_h is not None:
                grad_h[start:start + chunk] = g @ weight
            if grad_w is not None:
                grad_w += g.t() @ h  # the chunk's product in the inputs' dtype, summed in float32
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        dh_t, dw_t, db_t = ctx.dtypes
        dh = (grad_h * grad_out.to(grad_h.dtype)) if grad_h is not None else None
        dw = (grad_w * grad_out).to(dw_t) if grad_w is not None else None
        db = (grad_b * grad_out).to(db_t) if grad_b is not None else None
        return dh, dw, db, None, None, None, None, None, None


FUSED_LOSS_BACKENDS = ("auto", "torch", "liger")


def _liger_obstacle(h: torch.Tensor, weight: torch.Tensor, logit_scale: float, need: tuple[bool, ...]) -> str | None:
    """Why Liger-Kernel's fused loss cannot compute this call (None: it can)."""
    if not h.is_cuda:
        return f"the inputs are on {h.device.type}, Liger-Kernel's kernels need CUDA"
    if logit_scale != 1.0:
        return f"logit_scale={logit_scale} (Liger-Kernel applies no constant logit scale)"
    if h.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != h.dtype:
        return f"dtypes {h.dtype} / {weight.dtype} (Liger-Kernel needs one of bf16, fp16, fp32 for both)"
    if not need[0]:
        return "no gradient is needed (Liger-Kernel computes gradients in the forward; the loss alone is cheaper here)"
    if isinstance(_liger_function(), str):
        return _liger_function()
    return None


@functools.cache
def _liger_function() -> Any:
    """Liger-Kernel's fused-loss autograd Function, or why it cannot be imported (a string)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed (pip install liger-kernel)"
    try:
        from liger_kernel.ops import LigerFusedLinearCrossEntropyFunction
    except Exception as e:  # noqa: BLE001 - an install that cannot import is reported, the torch path used
        return f"liger_kernel does not import ({type(e).__name__}: {e})"
    return LigerFusedLinearCrossEntropyFunction


# Liger-Kernel's chunking: rows per chunk ~ rows * chunk_mem_const * hidden / vocab (a power of two), so its default
# (1) runs ~vocab / hidden chunks at every length (74 for Qwen2.5-3B) and adds the float32 [vocab, hidden] weight
# gradient once per chunk; a larger constant runs fewer, larger chunks (transient bf16 logits of
# rows * chunk_mem_const * hidden / vocab rows). 4 is the knee for a Qwen2.5-3B head on Hopper: 1 is several times
# slower at 8K rows, 8 and 16 gain little more for more memory (``benchmarks/fused_loss.py``).
LIGER_CHUNK_MEM = 4


def _liger_loss(h, weight, bias, t, softcap, ignore_index, chunk_mem_const: int = LIGER_CHUNK_MEM) -> torch.Tensor:
    LigerFusedLinearCrossEntropyFunction = _liger_function()
    h, t = h.contiguous(), t.contiguous()
    if "chunk_mem_const" in inspect.signature(LigerFusedLinearCrossEntropyFunction.forward).parameters:
        # positional, as autograd.Function.apply takes them: (input, weight, target, bias, ce_weight, ignore_index,
        # lse_square_scale, label_smoothing, reduction, softcap, return_z_loss, accum_dtype, use_token_scaling,
        # return_token_accuracy, return_predicted_tokens, ce_impl, ce_mode, chunk_mem_const); float32
        # accumulation of d weight over the chunks, as the torch path does (Liger's default sums in bf16)
        out = LigerFusedLinearCrossEntropyFunction.apply(h, weight, t, bias, None, ignore_index, 0.0, 0.0, "sum",
                                                         softcap, False, torch.float32, False, False, False, None,
                                                         None, chunk_mem_const)
        return out[0] if isinstance(out, tuple) else out
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # releases without the constant

    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum", ignore_index=ignore_index, softcap=softcap,
                                            accum_dtype=torch.float32)
    return loss(weight, h, t, bias)  # Liger takes the weight first


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               bias: torch.Tensor | None = None, *, logit_scale: float = 1.0,
                               softcap: float | None = None, chunk_size: int | None = None,
                               ignore_index: int = IGNORE_INDEX, backend: str = "auto") -> torch.Tensor:
    """Sum of the next-token cross-entropies of ``logits = softcap(logit_scale * (hidden @ weight.T + bias))``
    over the positions whose target is not ``ignore_index``, float32 (float64 for float64 inputs), without
    materialising the logits.

    ``hidden [..., D]`` (the inputs of the output embedding), ``targets [...]`` (already shifted: the target of
    each position), ``weight [V, D]`` (the output embedding, tied or not), ``bias [V]`` or None; ``softcap(x) =
    c * tanh(x / c)`` (Gemma 2's final soft-cap; identity when None). Rows are processed ``chunk_size`` at a time
    (default: about 512 MiB of float32 logits per chunk), so the memory beyond the inputs is one chunk's logits
    and softmax plus the gradients. Each chunk's matmul runs in the inputs' dtype and its logits are upcast to
    float32, as Hugging Face's causal-LM loss does.

    Gradients are computed chunk by chunk in the forward when any input requires grad (three matmuls per chunk:
    logits, ``d hidden``, ``d weight``; a backward that recomputed the logits would need four) and scaled by the
    incoming gradient in backward; under ``torch.no_grad`` only the loss is computed. ``d weight`` and ``d bias``
    accumulate in float32. Ignored rows contribute 0 to the loss and to every gradient; no host sync.

    ``backend``: ``"torch"`` computes it as above (any device); ``"liger"`` calls Liger-Kernel's
    ``LigerFusedLinearCrossEntropyLoss`` (CUDA, ``logit_scale`` 1, gradients needed; float32 accumulation of
    ``d weight``; a ValueError says which condition fails); ``"auto"`` (default) takes Liger-Kernel where it can
    compute the call and it is installed, else the torch path. Why: on a GPU with a large vocabulary Liger-Kernel
    (float32 accumulation, chunk constant :data:`LIGER_CHUNK_MEM`) computes the loss and gradients about twice as fast
    as this path (whose float32 elementwise passes over each chunk's logits cost more than its matmuls), with the same
    error against a float32 reference (``benchmarks/fused_loss.py`` compares them, and cut-cross-entropy, whose
    ``d hidden`` error is several times larger). Liger-Kernel is maintained
    by LinkedIn, used by Hugging Face's Trainer and TRL, and applies a soft-cap; the torch path stays for CPU, a
    constant logit scale (Granite, Cohere) and installs without it. Both match the plain loss
    (tests/unit/test_fused_loss.py).
    """
    if backend not in FUSED_LOSS_BACKENDS:
        raise ValueError(f"fused_linear_cross_entropy: backend must be one of {FUSED_LOSS_BACKENDS}, got {backend!r}")
    if not torch.is_floating_point(hidden) or not torch.is_floating_point(weight):
        raise ValueError(f"fused_linear_cross_entropy: hidden and weight must be floating point, got {hidden.dtype} "
                         f"and {weight.dtype}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"fused_linear_cross_entropy: targets must be integer token ids, got {targets.dtype}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         "do not match: weight must be [vocab, hidden[-1]]")
    if tuple(hidden.shape[:-1]) != tuple(targets.shape):
        raise ValueError(f"fused_linear_cross_entropy: targets {tuple(targets.shape)} do not line up with hidden "
                         f"{tuple(hidden.shape)}: one target per row of hidden")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fused_linear_cross_entropy: bias {tuple(bias.shape)} must be [{weight.shape[0]}]")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"fused_linear_cross_entropy: softcap must be positive or None, got {softcap}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be at least 1, got {chunk_size}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(h.device)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad)
    if backend != "torch":
        obstacle = _liger_obstacle(h, weight, float(logit_scale), need)
        if obstacle is None:
            return _liger_loss(h, weight, bias, t, softcap, ignore_index)
        if backend == "liger":
            raise ValueError(f"fused_linear_cross_entropy(backend='liger'): {obstacle}; use backend='auto' to fall "
                             "back to the torch path")
    chunk = _chunk_rows(h.shape[0], weight.shape[0], chunk_size)
    return _FusedLinearCrossEntropy.apply(h, weight, bias, t, float(logit_scale), softcap, chunk, ignore_index, need)
