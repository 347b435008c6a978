"""Training metrics that stay exact when the sequence is split over context-parallel ranks.

Under context parallelism (CP) each rank holds a shard of every sequence, so a rank's mean loss is
the mean of a *part* of the tokens. Averaging those means over ranks is wrong as soon as the shards
hold different numbers of target tokens (padding, ignored labels, the last position that has no
target). The metrics here keep SUMS and COUNTS instead, reduced with a sum over the whole world
(DP x CP): every target token is counted on exactly one rank (the strategy's sharding guarantees it),
so ``sum(token losses) / count(tokens)`` over the world is exactly the single-device token mean::

    token-weighted loss  =  sum_ranks sum_tokens loss_t  /  sum_ranks n_tokens
    perplexity           =  exp(token-weighted loss)
    tokens / second      =  sum_ranks n_tokens  /  max_ranks seconds
    density (layer l)    =  sum_ranks computed_pairs_l  /  sum_ranks causal_pairs_l

All metrics default to ``dist_sync_on_step=True``: the value that ``self.log(name, metric)`` shows
for a step (in the progress bar and every logger) is then the exact world value for that step, not
rank 0's partial. The cost is one tiny all-reduce per metric per step. Epoch values
(``on_epoch=True``) are always synced by torchmetrics at ``compute``.

States are float64 sums (int64 would also do for counts; float64 keeps one dtype and is exact for
counts below 2**53), so accumulated sums over long runs do not lose the small terms.

Usage in a LightningModule::

    self.train_loss = TokenWeightedLoss()
    self.train_ppl = TokenPerplexity()
    ...
    targets = lightning_mtraining.causal_lm_targets(batch)   # lined up with this rank's logits (its shard)
    loss_sum, n_tokens = token_loss_sum(logits, targets)
    self.train_loss(loss_sum, n_tokens); self.train_ppl(loss_sum, n_tokens)
    self.log("train/loss", self.train_loss, prog_bar=True)

Without logits (large vocabularies): under ``MTrainingStrategy`` the model's loss already has the exact
value of its CP group's sequences, so each rank may add ``(loss * n, n)`` with ``n`` the target tokens it
holds (``(causal_lm_targets(batch) != -100).sum()``): the world sums are then exact too, and the same code
is right under any strategy (``examples/train.py`` does this).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = [
    "AttentionDensity",
    "AttentionRecall",
    "TokenPerplexity",
    "TokenWeightedLoss",
    "TokensPerSecond",
    "token_loss_sum",
]


def token_loss_sum(logits: Tensor, target: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """``(sum of token cross-entropies, number of target tokens)`` for ALREADY-ALIGNED targets.

    ``logits`` ``[..., V]`` and ``target`` ``[...]`` must be aligned position by position: under CP
    pass this rank's shard of the globally shifted labels (``target[t]`` is the token after
    position ``t``; :func:`~lightning_mtraining.hf.losses.causal_lm_targets` gives them), never a
    locally shifted one. Tokens equal to ``ignore_index`` (padding, the
    last position) do not count. Computed in float32 whatever the logits' dtype. Detached: this is
    for metrics, the differentiable loss is the model's.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} must match on all but the last dim"
        )
    with torch.no_grad():
        flat_target = target.reshape(-1)
        loss_sum = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), flat_target, ignore_index=ignore_index, reduction="sum"
        )
        return loss_sum, (flat_target != ignore_index).sum()


class TokenWeightedLoss(Metric):
    """Mean loss per target token over the whole world: ``sum(loss sums) / sum(token counts)``.

    ``update(loss_sum, num_tokens)``: the SUM of this rank's token losses and how many target
    tokens it covers (see :func:`token_loss_sum`); a rank with no target tokens passes 0, 0. A
    batch with no target token anywhere yields NaN for that step.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    loss_sum: Tensor
    num_tokens: Tensor

    def __init__(self, dist_sync_on_step: bool = True, **kwargs: Any) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step, **kwargs)
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_tokens", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss_sum: Tensor | float, num_tokens: Tensor | int) -> None:
        loss_sum = torch.as_tensor(loss_sum, dtype=torch.float64, device=self.loss_sum.device).detach()
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.float64, device=self.num_tokens.device).detach()
        if loss_sum.numel() != 1 or num_tokens.numel() != 1:
            raise ValueError(
                f"pass scalar sums: loss_sum has shape {tuple(loss_sum.shape)}, num_tokens {tuple(num_tokens.shape)}"
            )
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0; got {num_tokens.item()}")
        self.loss_sum += loss_sum.reshape(())
        self.num_tokens += num_tokens.reshape(())

    def compute(self) -> Tensor:
        return self.loss_sum / self.num_tokens


class TokenPerplexity(TokenWeightedLoss):
    """``exp`` of :class:`TokenWeightedLoss` (same update): the exact world perplexity.

    Same numbers as ``torchmetrics.text.Perplexity`` on the full sequences, but fed with sums, so
    it needs no logits (a 150K-vocabulary model at long context should not keep them for a metric).
    """

    def compute(self) -> Tensor:
        return torch.exp(self.loss_sum / self.num_tokens)


class TokensPerSecond(Metric):
    """Training throughput over the world: ``sum(tokens) / max(seconds)``.

    ``update(num_tokens, seconds)``: tokens this rank processed (count each token on one rank only:
    under CP, its local shard length) and the wall-clock seconds it took. The time is reduced with
    ``max`` (the slowest rank sets the pace of a synchronous step); accumulated over steps, the
    epoch value is total tokens over the slowest rank's total time.
    """

    is_differentiable = False
    higher_is_better = True
    # True: torchmetrics' fast forward path merges a step into the running state with the state's
    # reduction, which for "max" would keep the longest STEP instead of the total time. The full
    # path updates the running state with `update` (a local sum) and keeps "max" for ranks only.
    full_state_update = True

    num_tokens: Tensor
    seconds: Tensor

    def __init__(self, dist_sync_on_step: bool = True, **kwargs: Any) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step, **kwargs)
        self.add_state("num_tokens", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("seconds", torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")

    def update(self, num_tokens: Tensor | int, seconds: Tensor | float) -> None:
        seconds = torch.as_tensor(seconds, dtype=torch.float64, device=self.seconds.device).reshape(())
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0; got {seconds.item()}")
        self.num_tokens += torch.as_tensor(num_tokens, dtype=torch.float64, device=self.num_tokens.device).reshape(())
        self.seconds += seconds

    def compute(self) -> Tensor:
        return self.num_tokens / self.seconds


class AttentionDensity(Metric):
    """Per-layer attention density: the share of causal (query, key) pairs actually computed.

    ``update(densities, weights=None)``:
      - ``densities``: one value per layer, as a sequence of floats, a tensor ``[num_layers]``, or a
        mapping ``{layer_index: density}`` (layers left out are not updated: dense layers, say);
      - ``weights``: how many causal pairs each density refers to on this rank (same shape), so
        the world value is exact (``sum(density * pairs) / sum(pairs)``); default 1 per layer
        (a plain mean over ranks and steps).
    ``compute()`` returns ``[num_layers]`` (NaN for a layer never updated). Lightning logs scalars
    only: log ``AttentionDensity.log_dict(values)`` (per layer and mean) with ``self.log_dict``;
    the forward value is already world-synced, so no ``sync_dist`` is needed.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    computed: Tensor
    total: Tensor

    def __init__(self, num_layers: int, dist_sync_on_step: bool = True, **kwargs: Any) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step, **kwargs)
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive; got {num_layers}")
        self.num_layers = num_layers
        self.add_state("computed", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")

    def _as_layer_vector(self, values: Any, name: str, fill: float) -> Tensor:
        device = self.computed.device
        if isinstance(values, Mapping):
            out = torch.full((self.num_layers,), fill, dtype=torch.float64, device=device)
            for layer, value in values.items():
                if not 0 <= int(layer) < self.num_layers:
                    raise ValueError(f"{name}: layer {layer} out of range for num_layers={self.num_layers}")
                out[int(layer)] = float(value)
            return out
        if isinstance(values, Tensor):
            out = values.detach().to(device=device, dtype=torch.float64).reshape(-1)
        else:
            out = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        if out.numel() != self.num_layers:
            raise ValueError(f"{name}: expected {self.num_layers} per-layer values, got {out.numel()}")
        return out

    def update(self, densities: Sequence[float] | Tensor | Mapping[int, float], weights: Any = None) -> None:
        density = self._as_layer_vector(densities, "densities", fill=0.0)
        if weights is None:
            weight = torch.ones_like(density)
            if isinstance(densities, Mapping):  # layers left out get no weight
                weight = self._as_layer_vector({k: 1.0 for k in densities}, "weights", fill=0.0)
        else:
            weight = self._as_layer_vector(weights, "weights", fill=0.0)
        if ((density < 0) | (density > 1)).any():
            raise ValueError(f"densities must lie in [0, 1]; got {density.tolist()}")
        self.computed += density * weight
        self.total += weight

    def compute(self) -> Tensor:
        return self.computed / self.total

    @staticmethod
    def log_dict(values: Tensor, prefix: str = "density") -> dict[str, Tensor]:
        """``{prefix/layer_00: d0, ..., prefix/mean: mean over updated layers}`` for ``self.log_dict``."""
        out = {f"{prefix}/layer_{i:02d}": v for i, v in enumerate(values) if not torch.isnan(v)}
        finite = values[~torch.isnan(values)]
        if finite.numel():
            out[f"{prefix}/mean"] = finite.mean()
        return out


class AttentionRecall(AttentionDensity):
    """Per-layer attention recall: the share of the true attention mass the sparse pattern keeps (1.0 = nothing
    lost), as measured by :func:`~lightning_mtraining.sparsity.estimation.attention_recall` on sampled query rows.

    Same interface as :class:`AttentionDensity` (``update(recalls, weights=None)``, ``compute()`` ``[num_layers]``,
    ``log_dict(values, prefix="recall")``); weights default to 1 per layer (a plain mean over ranks and steps).
    """

    higher_is_better = True

    @staticmethod
    def log_dict(values: Tensor, prefix: str = "recall") -> dict[str, Tensor]:
        return AttentionDensity.log_dict(values, prefix)
