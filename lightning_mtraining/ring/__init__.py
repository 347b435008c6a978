"""The ring layer: ring attention over a context-parallel group, dense or sparse, flat or hierarchical.

- :mod:`.attention`: :func:`ring_attention`, the public function.
- :mod:`.walk`: the ring's forward and backward walks and their autograd function (Note [Ring schedule], Note
  [Gathered verticals]).
- :mod:`.steps`: what each step computes (per-step tile lists, steps that compute nothing) and one step's forward and
  backward; :mod:`.setup`: what a call runs (positions, the block op of the attention variant, the checked pattern).
- :mod:`.block_ops`: per-block attention ops (torch, FlexAttention) and the log-sum-exp merge.
- :mod:`.dense_op`, :mod:`.sparse_op`: the dense ring, the pattern estimator and the sparse ring as ``torch.library``
  custom ops, so ``torch.compile`` keeps them in its graph.
- :mod:`.simulated`: every rank of a ring in one process (benchmarks, property tests); :mod:`.trace`: optional
  per-step instrumentation (compute, waits, bytes).

Imports torch only (never Lightning or transformers).
"""

from lightning_mtraining.ring.attention import ring_attention
from lightning_mtraining.ring.block_ops import BlockAttentionOp, FlexBlockOp, TorchBlockOp, merge_attention
from lightning_mtraining.ring.simulated import SimulatedRing
from lightning_mtraining.ring.trace import RingTrace

__all__ = ["BlockAttentionOp", "FlexBlockOp", "RingTrace", "SimulatedRing", "TorchBlockOp", "merge_attention",
           "ring_attention"]
