"""``SparseAttentionCallback``: per-layer attention options for MTraining.

The strategy's ``sparsity`` applies to every layer; this callback overrides it per layer (which layers stay
dense, budgets per layer). It only holds options: :class:`~lightning_mtraining.strategy.MTrainingStrategy`
reads it in ``setup``, after ``configure_model``, so models built there are covered. With Fabric, pass it to
``MTrainingFabricStrategy(attention=...)``.

Not usable yet: sparse ring attention is being built, and until it lands a callback that asks for sparsity on
any layer is refused before the run starts (NotImplementedError from the strategy).

Example::

    trainer = Trainer(
        strategy=MTrainingStrategy(sparsity=SparsityConfig(vertical_topk=1024, slash_topk=1024)),
        callbacks=[SparseAttentionCallback(dense_layers=[0, 1], layer_sparsity={5: SparsityConfig(top_p=0.95)})],
    )
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_mtraining.hf import find_hf_models
from lightning_mtraining.pattern import SparsityConfig

__all__ = ["SparseAttentionCallback"]


class SparseAttentionCallback(Callback):
    """Per-layer sparse attention options.

    Args:
        sparsity: budgets for layers not listed below; ``None`` keeps the strategy's ``sparsity``.
        dense_layers: layer indices that always use dense (exact) ring attention (the reference keeps the first
            layers dense).
        layer_sparsity: budgets for specific layers, overriding ``sparsity``.
    """

    def __init__(
        self,
        sparsity: SparsityConfig | None = None,
        dense_layers: list[int] | None = None,
        layer_sparsity: dict[int, SparsityConfig] | None = None,
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

    def layer_sparsity_fn(self, default: SparsityConfig | None) -> Callable[[int], SparsityConfig | None]:
        """``layer_idx -> SparsityConfig | None`` given the strategy's default ``sparsity``."""
        base = self.sparsity if self.sparsity is not None else default

        def for_layer(layer_idx: int) -> SparsityConfig | None:
            if layer_idx in self.dense_layers:
                return None
            return self.layer_sparsity.get(layer_idx, base)

        return for_layer

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
