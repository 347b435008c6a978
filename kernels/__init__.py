"""Triton and Gluon kernels for vertical-slash sparse attention (the import package `mtraining_kernels`).

- :mod:`mtraining_kernels.indexing`: pattern / positions -> per-query-tile lists of key tiles and key columns
  (:class:`TileLists`), on the device with torch ops.
- :mod:`mtraining_kernels.vertical_slash`: the attention's public API and dispatch: block ops for the ring
  (``block_forward`` / ``block_backward`` / ``TritonBlockOp``), autograd ``vertical_slash_attention``, and which
  kernel runs each part of a call (``KernelConfig``, defined in :mod:`mtraining_kernels.config`).
- :mod:`mtraining_kernels.triton_forward`, :mod:`mtraining_kernels.triton_backward`: the Triton kernels and their
  launchers (their shared jit helpers: :mod:`mtraining_kernels.triton_common`).
- :mod:`mtraining_kernels.gluon_forward`, :mod:`mtraining_kernels.gluon_backward`: warp-specialised Gluon forward,
  dq and dk/dv for sm_90, the same pairs (shared pieces: :mod:`mtraining_kernels.gluon_common`);
  ``block_forward`` / ``block_backward`` use them where they can run (``KernelConfig(forward=, dq=, dkdv=)``).
- :mod:`mtraining_kernels.host`: the launchers' host-side helpers, shared by both families.
- :mod:`mtraining_kernels.reference`: dense-masked torch references computing exactly the same pairs (the package's
  CPU path uses them).
- :mod:`mtraining_kernels.testing`: tooling for tests and benchmarks, not used at run time: the half-precision rule,
  list-level references, offline sm_90 compile reports of the Gluon kernels (:mod:`mtraining_kernels.testing.gluon`).
- :mod:`mtraining_kernels.launch`: every kernel launch goes through a :class:`~mtraining_kernels.launch.Launcher`
  (repeat launches skip the JIT's argument binding; ``record_launch_keys`` collects the launch keys). Arguments
  that come from a pattern are never specialised, so the number of compiled kernels does not grow with the data.

Importing this package does not import triton; :mod:`.vertical_slash` does. The folder is ``kernels/`` and the import
name ``mtraining_kernels`` (``package-dir`` in ``pyproject.toml``); the modules import each other relatively, so that
the type checker, which reads the folder by its path, follows them.
"""

from .indexing import COL_CHUNK, TileLists, dense_tile_lists, expand_pattern, pattern_tile_lists

__all__ = ["COL_CHUNK", "TileLists", "dense_tile_lists", "expand_pattern", "pattern_tile_lists"]
