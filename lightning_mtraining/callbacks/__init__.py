"""Lightning callbacks: per-layer sparsity and its logged statistics (:class:`SparseAttentionCallback`), the
ring's per-step instrumentation (:class:`RingTraceCallback`), and Lightning's progress bar labelled right for runs
bounded by steps (:func:`~lightning_mtraining.callbacks.progress.progress_bar`)."""

from lightning_mtraining.callbacks.progress import progress_bar
from lightning_mtraining.callbacks.ring_trace import RingTraceCallback
from lightning_mtraining.callbacks.sparse_attention import SparseAttentionCallback

__all__ = ["RingTraceCallback", "SparseAttentionCallback", "progress_bar"]
