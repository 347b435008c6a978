"""Tooling for testing and measuring the kernels, apart from what runs in training (nothing in
:mod:`lightning_mtraining` or the runtime kernels imports it).

- :mod:`mtraining_kernels.testing.references`: torch references for tests: the pairs a kernel computes from its lists
  (``tile_lists_mask``), a whole-sequence reference for a pattern, the chunked forward and backward at a chosen
  precision (``attention_chunked_ref``).
- :mod:`mtraining_kernels.testing.precision`: the half-precision rule (``check_half_precision``), its cases and the
  fixed test pattern (``random_pattern``), ``KernelConfig`` from a string (``kernel_config``).
- :mod:`mtraining_kernels.testing.gluon`: compile the Gluon kernels for sm_90 without a GPU and report their
  resources (imports triton; not re-exported here).

The dense-masked references the package itself uses (``attention_ref``, ``vertical_slash_mask``,
``tile_rows_mask``) are in :mod:`mtraining_kernels.reference`.
"""

from .precision import (
    HALF_PRECISION_CASES,
    check_half_precision,
    half_precision_case,
    half_precision_floor,
    kernel_config,
    max_abs_errors,
    random_pattern,
)
from .references import attention_chunked_ref, tile_lists_mask, vertical_slash_attention_ref

__all__ = [
    "HALF_PRECISION_CASES", "attention_chunked_ref", "check_half_precision", "half_precision_case",
    "half_precision_floor", "kernel_config", "max_abs_errors", "random_pattern", "tile_lists_mask",
    "vertical_slash_attention_ref",
]
