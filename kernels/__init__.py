"""Triton kernels for vertical-slash sparse attention (installed as ``mtraining_kernels``).

- :mod:`mtraining_kernels.indexing`: pattern / positions -> per-query-tile lists of key tiles and key columns
  (:class:`TileLists`), on the device with torch ops.
- :mod:`mtraining_kernels.vertical_slash`: Triton forward/backward, block ops for the ring
  (``block_forward`` / ``block_backward`` / ``TritonBlockOp``), autograd ``vertical_slash_attention``.
- :mod:`mtraining_kernels.gluon_hopper`: warp-specialised Gluon forward, dq and dk/dv for sm_90, the same pairs;
  ``block_forward`` / ``block_backward`` use them where they can run (``KernelConfig(forward=, dq=, dkdv=)``).
- :mod:`mtraining_kernels.reference`: dense-masked torch references computing exactly the same pairs.

Importing this package does not import triton; :mod:`.vertical_slash` does.
"""

from mtraining_kernels.indexing import COL_CHUNK, TileLists, dense_tile_lists, expand_pattern, pattern_tile_lists

__all__ = ["COL_CHUNK", "TileLists", "dense_tile_lists", "expand_pattern", "pattern_tile_lists"]
