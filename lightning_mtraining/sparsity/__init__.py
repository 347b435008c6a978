"""The sparsity layer: the vertical-slash pattern, how it is chosen, and what it costs.

- :mod:`.config`: :class:`SparsityConfig` (top-k or top-p budgets with caps, probes, sinks, window, dense layers,
  warm-up, per-layer / per-head budgets) and the paper's setting :data:`PAPER_SPARSITY`.
- :mod:`.pattern`: :class:`VerticalSlashPattern`, a global pattern (key columns and diagonals of the whole sequence),
  and :class:`LayerPattern`, what a layer ran in one forward: its pattern with the heads that ran dense.
- :mod:`.estimation`: online estimation over a context-parallel group (:func:`estimate_pattern`, the same pattern on
  every rank) and the share of attention mass a pattern keeps (:func:`attention_recall`).
- :mod:`.balance`: exact work counts per rank and ring step (``ring_work``, ``ring_step_work``, ``imbalance``).
- :mod:`.schedule`: which layers run sparse at each step, one pattern per layer and forward, the logged statistics.
- :mod:`.attention`: single-device :func:`sparse_attention` with a given pattern (Triton on CUDA, torch elsewhere).
"""

from lightning_mtraining.sparsity import balance
from lightning_mtraining.sparsity.attention import sparse_attention
from lightning_mtraining.sparsity.config import PAPER_SPARSITY, SparsityConfig, parse_sparsity
from lightning_mtraining.sparsity.estimation import attention_recall, estimate_pattern
from lightning_mtraining.sparsity.pattern import LayerPattern, VerticalSlashPattern

__all__ = ["PAPER_SPARSITY", "LayerPattern", "SparsityConfig", "VerticalSlashPattern",
           "attention_recall", "balance", "estimate_pattern", "parse_sparsity", "sparse_attention"]
