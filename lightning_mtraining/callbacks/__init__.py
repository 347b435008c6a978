"""Lightning callbacks: per-layer sparsity and its logged statistics (:class:`SparseAttentionCallback`), and the
ring's per-step instrumentation (:class:`RingTraceCallback`)."""

from lightning_mtraining.callbacks.ring_trace import RingTraceCallback
from lightning_mtraining.callbacks.sparse_attention import SparseAttentionCallback

__all__ = ["RingTraceCallback", "SparseAttentionCallback"]
