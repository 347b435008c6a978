"""``SparseAttentionCallback``: the sparse attention schedule's options, and its numbers in Lightning's loggers.

The strategy's ``sparsity`` applies to every layer; this callback overrides it per layer (which layers stay dense,
budgets per layer) and says how often to measure. Each measured training step it logs ``attention/density`` (the
share of causal pairs the patterns allow), ``attention/imbalance`` (the ring's critical-path work over the mean
rank's, 1.0 = balanced), ``attention/dense_heads`` (the share of heads whose pattern kept more than
``SparsityConfig.dense_above`` of their pairs and ran dense) and, when enabled, ``attention/recall`` (the share of
attention mass the patterns keep) to the progress bar and every logger, plus the same per layer
(``attention/density/layer_3``, ...). When the patterns keep nearly every pair (short sequences, spread-out
attention: a sparse step then costs about a dense one's), rank 0 logs that once, with what to do instead
(:meth:`~lightning_mtraining.sparsity.schedule.AttentionSchedule.dense_cost_note`).

:class:`~lightning_mtraining.strategies.trainer.MTrainingStrategy` reads it in ``setup`` (after ``configure_model``, so
models built there are covered), and adds one with the default options when a run is sparse and none was given. The
schedule itself (warm-up, dense layers, the per-forward pattern, the measurements) is Lightning-free
(:mod:`lightning_mtraining.sparsity.schedule`): with Fabric, pass this object as
``MTrainingFabricStrategy(attention=...)`` for its options and read ``fabric.strategy.attention_metrics()``.

Example::

    trainer = Trainer(
        strategy=MTrainingStrategy(sparsity=SparsityConfig(top_p=0.9, dense_warmup_steps=100)),
        callbacks=[SparseAttentionCallback(dense_layers=[0, 1], layer_sparsity={5: SparsityConfig(top_p=0.95)},
                                           recall_every_n_steps=200)],
    )
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_mtraining.core.checks import is_int
from lightning_mtraining.hf.model import find_hf_models
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.schedule import dense_head_share

__all__ = ["SparseAttentionCallback", "say_dense_cost_note"]

_HEADLINE = ("attention/density", "attention/imbalance", "attention/recall")


class SparseAttentionCallback(Callback):
    """Per-layer sparse attention options, and logging of the patterns' density, imbalance and recall.

    Args:
        sparsity: budgets for layers not listed below; ``None`` keeps the strategy's ``sparsity``.
        dense_layers: layer indices that always use dense (exact) ring attention (the reference keeps the first
            layers dense); adds to each config's own ``dense_layers``.
        layer_sparsity: budgets for specific layers, overriding ``sparsity``.
        log_every_n_steps: measure and log every n-th optimizer step (default: the Trainer's
            ``log_every_n_steps``); measuring costs an exact per-tile count of every layer's pattern on the host.
        recall_every_n_steps: measure the attention recall every n-th step (0, the default: never); it costs about
            one extra pattern estimation per layer with ``recall_rows`` probe rows.
        recall_rows: query rows sampled per layer for the recall.
        prog_bar: show the headline numbers in the progress bar.
    """

    def __init__(
        self,
        sparsity: SparsityConfig | None = None,
        dense_layers: list[int] | None = None,
        layer_sparsity: dict[int, SparsityConfig] | None = None,
        log_every_n_steps: int | None = None,
        recall_every_n_steps: int = 0,
        recall_rows: int = 64,
        prog_bar: bool = True,
    ) -> None:
        self.sparsity = sparsity
        self.dense_layers = sorted(set(dense_layers or []))
        self.layer_sparsity = dict(layer_sparsity or {})
        both = set(self.dense_layers) & set(self.layer_sparsity)
        if both:
            raise ValueError(f"layers {sorted(both)} are both in dense_layers and layer_sparsity; choose one")
        bad = [i for i in [*self.dense_layers, *self.layer_sparsity] if not isinstance(i, int) or i < 0]
        if bad:
            raise ValueError(f"layer indices must be non-negative ints, got {bad}")
        for name, value in (("log_every_n_steps", log_every_n_steps), ("recall_every_n_steps", recall_every_n_steps),
                            ("recall_rows", recall_rows)):
            if value is not None and not is_int(value, 0):
                raise ValueError(f"SparseAttentionCallback: {name} must be a non-negative int, got {value!r}")
        self.log_every_n_steps = log_every_n_steps
        self.recall_every_n_steps = recall_every_n_steps
        self.recall_rows = recall_rows
        self.prog_bar = prog_bar
        self._step_at_start: int | None = None
        self._schedule: Any = None  # the strategy's attention schedule, once it exists (its state is checkpointed)
        self._restored: list[Any] | None = None  # the checkpoint's schedule states, until the schedule exists
        self._density: Any = None
        self._recall: Any = None
        self._overall: Any = None

    def layer_sparsity_fn(self, default: SparsityConfig | None) -> Callable[[int], SparsityConfig | None]:
        """``layer_idx -> SparsityConfig | None`` given the strategy's default ``sparsity``."""
        base = self.sparsity if self.sparsity is not None else default

        def for_layer(layer_idx: int) -> SparsityConfig | None:
            if layer_idx in self.dense_layers:
                return None
            return self.layer_sparsity.get(layer_idx, base)

        return for_layer

    def configs(self) -> list[SparsityConfig]:
        """Every config this callback may apply."""
        return [c for c in (self.sparsity, *self.layer_sparsity.values()) if c is not None]

    def schedule_options(self, default_log_every: int = 50) -> dict[str, Any]:
        """Keyword arguments of :class:`~lightning_mtraining.sparsity.schedule.AttentionSchedule`."""
        every = self.log_every_n_steps if self.log_every_n_steps is not None else default_log_every
        return {"log_every_n_steps": every, "recall_every_n_steps": self.recall_every_n_steps,
                "recall_rows": self.recall_rows}

    def check_layers(self, module: Any) -> None:
        """Raise if a listed layer index does not exist in the Hugging Face models inside ``module``."""
        listed = set(self.dense_layers) | set(self.layer_sparsity)
        if not listed:
            return
        for model in find_hf_models(module):
            n = getattr(model.config, "num_hidden_layers", None)
            missing = sorted(i for i in listed if n is not None and i >= n)
            if missing:
                raise ValueError(
                    f"SparseAttentionCallback lists layers {missing}, but {type(model).__name__} has {n} layers"
                )

    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # Runs after configure_model and strategy.setup: the model exists now.
        self.check_layers(pl_module)
        self._schedule = getattr(trainer.strategy, "attention_schedule", None)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Every rank's schedule state (the last forward's dense decisions per layer and batch row, which the next
        forward runs: Note [The straight path] in :mod:`lightning_mtraining.ring.straight`), by global rank, so that
        a resumed run's first forward runs what the uninterrupted one's would. Every rank calls it when a checkpoint
        is saved (an all-gather of the few bytes over the world)."""
        schedule = self._schedule
        mine = schedule.state_dict() if schedule is not None else None
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        return {"schedules": every}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("schedules")

    def _restore(self, trainer: Any) -> None:
        """Give the schedule this rank's saved state (same world size: a resume at another layout starts with no
        decisions, its first forward running every head's pattern)."""
        saved, self._restored = self._restored, None
        schedule = getattr(trainer.strategy, "attention_schedule", None)
        if not saved or schedule is None:
            return
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if len(saved) == world and saved[rank] is not None:
            schedule.load_state_dict(saved[rank])

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._restored is not None:  # a checkpoint's schedule state, now that the schedule exists
            self._restore(trainer)
        schedule = getattr(trainer.strategy, "attention_schedule", None)
        self._schedule = schedule
        self._step_at_start = trainer.global_step
        if schedule is not None:  # the warm-up and the measuring cadence follow the Trainer's optimizer steps
            schedule.set_step(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        schedule = getattr(trainer.strategy, "attention_schedule", None)
        if schedule is None or schedule.measured_at != self._step_at_start:
            return
        stats = schedule.layer_stats()
        if not stats:
            return
        from lightning_mtraining.metrics import AttentionDensity, AttentionRecall

        # Every rank measured this step. Density over the world is exact through the metric (pairs as weights:
        # DP groups may hold sequences of different lengths); recall is a mean; imbalance a mean over DP groups.
        num_layers = max(stats) + 1
        if self._density is None or self._density.num_layers != num_layers:
            self._density = AttentionDensity(num_layers).to(pl_module.device)
            self._recall = AttentionRecall(num_layers).to(pl_module.device)
            self._overall = AttentionDensity(1).to(pl_module.device)
        density = self._density({i: s.computed / max(1, s.causal) for i, s in stats.items()},
                                {i: float(s.causal) for i, s in stats.items()})
        allowed, causal = sum(s.computed for s in stats.values()), sum(s.causal for s in stats.values())
        overall = self._overall([allowed / max(1, causal)], [float(causal)])
        for metric in (self._density, self._overall):
            metric.reset()
        logged = {f"attention/density/layer_{i}": density[i] for i in stats}
        logged["attention/density"] = overall.reshape(-1)[0]
        recalls = {i: s.recall for i, s in stats.items() if s.recall is not None}
        if recalls:
            recall = self._recall(recalls)
            self._recall.reset()
            logged.update({f"attention/recall/layer_{i}": recall[i] for i in recalls})
            logged["attention/recall"] = sum(float(recall[i]) for i in recalls) / len(recalls)
        mean = sum(s.step_mean for s in stats.values())
        imbalance = sum(s.step_max for s in stats.values()) / mean if mean > 0 else 1.0
        pl_module.log("attention/imbalance", imbalance, prog_bar=self.prog_bar, sync_dist=True, on_step=True,
                      on_epoch=False)
        # the share of pattern heads whose pattern allowed more than dense_above of the pairs and ran dense (a rank
        # of a tensor-parallel group holds some of the heads: the mean over ranks)
        pl_module.log("attention/dense_heads", dense_head_share(stats), prog_bar=False, sync_dist=True, on_step=True,
                      on_epoch=False)
        headline = {k: v for k, v in logged.items() if k in _HEADLINE}
        layers = {k: v for k, v in logged.items() if k not in _HEADLINE}
        # already world values (the metrics synced them): no sync_dist
        pl_module.log_dict(headline, prog_bar=self.prog_bar, on_step=True, on_epoch=False)
        pl_module.log_dict(layers, prog_bar=False, on_step=True, on_epoch=False)
        say_dense_cost_note(schedule, float(overall.reshape(-1)[0]))


def say_dense_cost_note(schedule: Any, density: float | None = None) -> None:
    """Rank 0 logs the schedule's note that a sparse run costs what a dense one does, once per run (``density``: the
    world's share of computed pairs if known; see ``AttentionSchedule.dense_cost_note``), wrapped to 116 columns."""
    note = schedule.dense_cost_note(density)
    if note is not None:
        rank_zero_info(textwrap.fill(note, width=116))
