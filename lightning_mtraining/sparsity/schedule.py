"""The sparse attention schedule of a training run, shared by every attention layer of the prepared models.

One :class:`AttentionSchedule` per strategy (or :func:`~lightning_mtraining.hf.parallel.apply_context_parallel`)
decides, for each layer and forward, whether attention runs sparse (the layer's ``SparsityConfig``, its
``dense_layers``, the dense warm-up of ``dense_warmup_steps`` optimizer steps, sequences too short for the probes, a
pattern that allows more than ``dense_above`` of the causal pairs), keeps the layer's pattern for the rest of the
forward and backward (Note [One pattern per forward]), and measures what users watch: the pattern's exact density,
the ring's work imbalance, how many layers fell back to dense and, when asked, the attention recall.

Note [One pattern per forward]
------------------------------
A pattern is estimated once per layer per model forward: the model's forward pre-hook starts a new forward
(:meth:`AttentionSchedule.begin_forward`), and a layer that runs again before the next one (activation
checkpointing recomputes decoder layers during backward: HF ``gradient_checkpointing_enable`` or
``torch.utils.checkpoint``) gets the pattern it had, not a second estimate. Backward itself never estimates: the
ring saves its per-step lists for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from lightning_mtraining.sparsity.balance import ring_step_work
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.pattern import (
    LayerPattern,
    VerticalSlashPattern,
    dense_heads,
    head_pairs,
    with_dense_heads,
)

__all__ = ["AttentionSchedule", "DENSE_LIKE_DENSITY", "LayerStats"]

# A sparse forward whose patterns keep at least this share of the causal pairs computes about what a dense one does,
# plus the pattern estimation: the run is told once (AttentionSchedule.dense_cost_note).
DENSE_LIKE_DENSITY = 0.9


@dataclasses.dataclass
class LayerStats:
    """What one layer's pattern looked like in the last measured forward."""

    allowed: int  # allowed (query, key) pairs over the real sequences, summed over batch rows and pattern heads
    causal: int  # causal pairs of the same sequences and heads
    step_max: float  # sum over ring steps of the busiest rank's work (exact pair counts)
    step_mean: float  # sum over ring steps of the mean rank's work
    recall: float | None = None  # mean share of the attention mass kept (attention_recall), if measured
    computed: int = 0  # pairs computed: the pattern's, with every causal pair for the heads that ran dense
    dense_heads: int = 0  # pattern heads (over batch rows) whose pattern allowed more than ``dense_above``: ran dense
    heads: int = 1  # pattern heads over batch rows


def dense_head_share(stats: dict[int, LayerStats]) -> float:
    """The share of pattern heads (over layers and batch rows) that ran dense under ``dense_above``."""
    return sum(s.dense_heads for s in stats.values()) / max(1, sum(s.heads for s in stats.values()))


def _imbalance(stats: dict[int, LayerStats]) -> float:
    """The ring's critical path over its mean (1.0 when no layer ran a sparse ring)."""
    mean = sum(s.step_mean for s in stats.values())
    return sum(s.step_max for s in stats.values()) / mean if mean > 0 else 1.0


class AttentionSchedule:
    """Per-layer sparsity over time, the per-forward pattern cache, and the measured statistics.

    Args:
        layer_sparsity: ``layer_idx -> SparsityConfig | None`` (the strategy's sparsity and callback overrides).
        log_every_n_steps: measure density and imbalance on the training forwards of every n-th optimizer step
            (0: never); measuring costs an exact per-tile count of each layer's pattern on the host.
        recall_every_n_steps: also measure ``attention_recall`` (``recall_rows`` sampled query rows per layer)
            every n-th step; 0 (default) disables it. Cost: like one estimation with ``recall_rows`` probes.
        recall_rows: query rows sampled per layer for the recall.
    """

    def __init__(
        self,
        layer_sparsity: Callable[[int], SparsityConfig | None],
        log_every_n_steps: int = 50,
        recall_every_n_steps: int = 0,
        recall_rows: int = 64,
    ) -> None:
        self.layer_sparsity = layer_sparsity
        self.log_every_n_steps = log_every_n_steps
        self.recall_every_n_steps = recall_every_n_steps
        self.recall_rows = recall_rows
        self.step = 0
        self.estimations = 0  # patterns estimated so far (a test hook for Note [One pattern per forward])
        self._patterns: dict[int, Any] = {}  # this forward's pattern (or LayerPattern record) per layer
        # the straight path (Note [The straight path] in lightning_mtraining.ring.straight): this forward's decisions
        # on the device, their copy to the host, and each layer's pattern heads that run dense in the next forward
        self._decisions: dict[int, torch.Tensor] = {}
        self._decisions_host: tuple[list[int], list[tuple[int, ...]], torch.Tensor, Any] | None = None
        self._dense_heads: dict[int, tuple[tuple[bool, ...], ...]] = {}  # per layer: [batch row][pattern head]
        self._measuring = False
        self._recall = False
        self._stats: dict[int, LayerStats] = {}
        self._last: dict[str, float] = {}
        self.measured_at: int | None = None  # the step of the last measured forward
        self._measured_len = 0  # the longest real sequence of the last measured forward
        self._noted = False

    # --- the schedule ------------------------------------------------------------------------------------------

    def config_for(self, layer_idx: int | None) -> SparsityConfig | None:
        """The layer's budgets now, or None when it runs dense (dense layer, or still in the dense warm-up)."""
        cfg = self.layer_sparsity(layer_idx) if layer_idx is not None else None
        if cfg is None or cfg.is_dense_layer(layer_idx) or self.step < cfg.dense_warmup_steps:
            return None
        return cfg

    def sparse_configs(self, layers: list[int]) -> list[SparsityConfig]:
        """The distinct configs any of ``layers`` may ever run sparse with (warm-up aside)."""
        found = []
        for layer in layers:
            cfg = self.layer_sparsity(layer)
            if cfg is not None and not cfg.is_dense_layer(layer) and cfg not in found:
                found.append(cfg)
        return found

    def set_step(self, step: int) -> None:
        """The number of optimizer steps done (the Trainer's ``global_step``; Fabric counts its own)."""
        self.step = int(step)

    def begin_forward(self, training: bool) -> None:
        """A new model forward: forget the last forward's patterns (after reading its dense decisions); measure on
        the logging steps' training passes."""
        self._read_decisions()
        self._patterns.clear()
        every, recall_every = self.log_every_n_steps, self.recall_every_n_steps
        self._measuring = training and every > 0 and self.step % every == 0
        self._recall = training and recall_every > 0 and self.step % recall_every == 0
        if self._measuring or self._recall:
            self._stats = {}
            self.measured_at = self.step

    def pattern_for(self, layer_idx: int, estimate: Callable[[], Any]) -> tuple[Any, bool]:
        """``(pattern, new)``: this forward's pattern of the layer, estimated on first use (see the Note). What
        ``estimate`` returns is kept as is: the Hugging Face hook keeps a
        :class:`~lightning_mtraining.sparsity.pattern.LayerPattern`, so a recompute also reuses the forward's decision
        of which heads run dense."""
        found = self._patterns.get(layer_idx)
        if found is not None:
            return found, False
        pattern = estimate()
        self.estimations += 1
        self._patterns[layer_idx] = pattern
        return pattern, True

    def note_decision(self, layer_idx: int, decided: torch.Tensor) -> None:
        """This forward's decision of a layer (``[B, G]`` bool on the device: the pattern heads that allowed more than
        ``dense_above`` of their causal pairs), for the layer's next forward (:meth:`dense_heads`)."""
        self._decisions[layer_idx] = decided

    def end_forward(self) -> None:
        """The model's forward ended: start copying its decisions to the host (without waiting, on a GPU)."""
        if not self._decisions or self._decisions_host is not None:
            return
        layers = list(self._decisions)
        flags = [self._decisions[i] for i in layers]
        flat = torch.cat([f.reshape(-1) for f in flags]).to(torch.int8)
        self._decisions.clear()
        event = None
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = flat
        self._decisions_host = (layers, [tuple(f.shape) for f in flags], host, event)

    def _read_decisions(self) -> None:
        """The last forward's decisions, on the host: each layer's pattern heads that run dense from now on (a head
        decided dense, per batch row)."""
        self.end_forward()  # a forward the model hook did not see end
        if self._decisions_host is None:
            return
        layers, shapes, host, event = self._decisions_host
        self._decisions_host = None
        if event is not None:
            event.synchronize()
        flat, start = host.tolist(), 0
        for layer, (rows, heads) in zip(layers, shapes):
            self._dense_heads[layer] = tuple(tuple(bool(flat[start + b * heads + g]) for g in range(heads))
                                             for b in range(rows))
            start += rows * heads

    def dense_heads(self, layer_idx: int | None, batch: int) -> tuple[tuple[bool, ...], ...] | None:
        """Per batch row, the pattern heads of the layer that run dense in this forward: those the layer's last
        forward decided dense in that row (Note [The straight path] in :mod:`lightning_mtraining.ring.straight`;
        per row, so a batch split over data-parallel ranks decides as it would whole); None when none does, or the
        last forward had another number of rows."""
        found = self._dense_heads.get(layer_idx) if layer_idx is not None else None
        if found is None or len(found) != batch or not any(any(row) for row in found):
            return None
        return found

    # --- measurements -----------------------------------------------------------------------------------------

    @property
    def measuring(self) -> bool:
        return self._measuring or self._recall

    @property
    def measuring_recall(self) -> bool:
        return self._recall

    def record(self, layer_idx: int, pattern: VerticalSlashPattern | LayerPattern, lengths: list[int], n_total: int,
               cp_size: int, layout: str, block_size: int, inner_size: int | None,
               recall: torch.Tensor | None = None, dense_above: float | None = None) -> None:
        """Exact density and ring-step imbalance of ``pattern`` (one host sync), and the recall if measured; the heads
        the ring ran dense (:func:`~lightning_mtraining.sparsity.pattern.dense_heads` with ``dense_above``) count as
        every causal pair of their sequence. A :class:`~lightning_mtraining.sparsity.pattern.LayerPattern` brings its
        decision and pair counts with it (``dense_above`` is then its own): they are not computed again."""
        self._measured_len = max(self._measured_len if self._stats else 0, *lengths, 0)
        # decide() sets allowed, causal and dense together
        if isinstance(pattern, LayerPattern) and pattern.allowed is not None and pattern.causal is not None:
            p = pattern.estimated.to("cpu")
            per_head, causal_rows, mask = pattern.allowed, pattern.causal, pattern.dense
        else:
            if isinstance(pattern, LayerPattern):
                pattern, dense_above = pattern.estimated, None
            p = pattern.to("cpu")
            per_head, causal_rows = head_pairs(p, lengths)
            mask = dense_heads(p, lengths, dense_above)
        causal_heads = causal_rows[:, None].expand_as(per_head)
        allowed, causal = int(per_head.sum()), int(causal_heads.sum())
        n_dense = 0 if mask is None else int(mask.sum())
        computed = allowed if mask is None else int(torch.where(mask, causal_heads, per_head).sum())
        base = dict(computed=computed, dense_heads=n_dense, heads=per_head.numel())
        ran_dense_op = pattern.all_dense if isinstance(pattern, LayerPattern) else n_dense == per_head.numel() > 0
        if ran_dense_op:
            self._stats[layer_idx] = LayerStats(allowed, causal, 0.0, 0.0, None, **base)
            return
        if mask is not None and n_dense:
            p = with_dense_heads(p, mask, n_total)
        if cp_size > 1:
            work = ring_step_work(p, n_total, cp_size, layout, block_size, inner_size=inner_size).double()
            step_max, step_mean = float(work.max(0).values.sum()), float(work.mean(0).sum())
        else:
            step_max = step_mean = float(computed)
        # a float32 sum of probabilities can exceed 1 by rounding (1 + 1e-8 seen): clamp for the [0, 1] metrics
        value = None if recall is None else min(1.0, max(0.0, float(recall.double().mean())))
        self._stats[layer_idx] = LayerStats(allowed, causal, step_max, step_mean, value, **base)

    def metrics(self) -> dict[str, float]:
        """The last measured forward's numbers: ``attention/density`` (computed over causal pairs of the sparse
        layers), ``attention/imbalance`` (ring critical path: sum over layers and steps of the busiest rank's work
        over the mean rank's, 1.0 = balanced), ``attention/dense_heads`` (the share of pattern heads, over the sparse
        layers and batch rows, whose pattern allowed more than ``dense_above`` of the pairs and ran dense: they count
        as every causal pair in the density; a layer whose every head did ran the dense ring and has no imbalance),
        ``attention/recall`` when measured, and the same per layer (``attention/density/layer_3``, ...). Empty before
        the first measurement or when no layer ran sparse."""
        stats = self._stats
        if not stats:
            return self._last
        out: dict[str, float] = {
            "attention/density": (sum(s.computed for s in stats.values())
                                  / max(1, sum(s.causal for s in stats.values()))),
            "attention/imbalance": _imbalance(stats),
            "attention/dense_heads": dense_head_share(stats),
        }
        recalls = [s.recall for s in stats.values() if s.recall is not None]
        if recalls:
            out["attention/recall"] = sum(recalls) / len(recalls)
        for layer, s in sorted(stats.items()):
            out[f"attention/density/layer_{layer}"] = s.computed / max(1, s.causal)
            if s.recall is not None:
                out[f"attention/recall/layer_{layer}"] = s.recall
        self._last = out
        return out

    def dense_cost_note(self, density: float | None = None) -> str | None:
        """A message, at most once per schedule, when the last measured forward's sparse layers kept at least
        :data:`DENSE_LIKE_DENSITY` of the causal pairs (``density``: the world's share if known, else this rank's):
        such a step costs what a dense one costs plus the estimation (layers whose pattern keeps more than
        ``dense_above`` run dense: they count as computing every pair). It says what was kept at which length, why,
        and what to do instead. None otherwise, and once said."""
        stats = self._stats
        if self._noted or not stats:
            return None
        if density is None:
            density = sum(s.computed for s in stats.values()) / max(1, sum(s.causal for s in stats.values()))
        if density < DENSE_LIKE_DENSITY:
            return None
        kept = sum(s.allowed for s in stats.values()) / max(1, sum(s.causal for s in stats.values()))
        fell_back = dense_head_share(stats)
        self._noted = True
        config = next((c for c in map(self.layer_sparsity, sorted(stats)) if c is not None), None)
        if config is None:
            return None
        if config.top_p is not None:
            budget = (f"top_p={config.top_p}, at most {config.max_vertical} verticals and {config.max_slash} slashes "
                      f"per head, {config.tile_size}-token tiles")
            why = (f"keeping {config.top_p:.0%} of this model's attention mass takes nearly every tile at this length "
                   "(attention spread out, as at random initialisation or on short sequences)")
        else:
            budget = (f"{config.vertical_topk} verticals and {config.slash_topk} slashes per head, "
                      f"{config.tile_size}-token tiles")
            why = "at this length these budgets reach nearly every tile (slashes run whole tiles)"
        fallback = (f" ({fell_back:.0%} of the heads kept more than SparsityConfig.dense_above and ran dense "
                    "attention instead: attention/dense_heads)") if fell_back else ""
        return (
            f"MTraining sparse attention kept {kept:.0%} of the causal pairs at {self._measured_len:,} tokens "
            f"({budget}){fallback}: {why}, so each step costs what dense attention costs plus the pattern's "
            "estimation. Sparse "
            "attention pays when the patterns keep a small share of the pairs (attention/density): on long sequences "
            "(the paper trains at 32K-512K tokens) of a model whose attention is concentrated. At this length: "
            "strategy='mtraining_dense' (sparsity=None) is exact and skips the estimation; or a fixed budget "
            "SparsityConfig(vertical_topk=V, slash_topk=S, tile_size=T) computes at most V + 2*S*T keys per query "
            "besides the sinks and the local window, whatever the attention (examples/train.py: V=64, S=16, T=32 "
            "train 8K tokens at about 9% density)."
        )

    def layer_stats(self) -> dict[int, LayerStats]:
        """The last measured forward's statistics per layer (empty before the first measurement)."""
        return dict(self._stats)

    def state_dict(self) -> dict[str, Any]:
        """The step and each layer's dense heads per batch row (the last forward's decisions, which the next forward
        runs: a run resumed with them runs what the uninterrupted one would)."""
        self._read_decisions()
        return {"step": self.step,
                "dense_heads": {layer: [list(row) for row in rows] for layer, rows in self._dense_heads.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        self._decisions.clear()
        self._decisions_host = None
        self._dense_heads = {int(layer): tuple(tuple(bool(x) for x in row) for row in rows)
                             for layer, rows in state.get("dense_heads", {}).items()}
