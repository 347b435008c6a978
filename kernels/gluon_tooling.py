"""Deprecated: the Gluon kernels' tooling is :mod:`mtraining_kernels.testing.gluon`; this name re-exports it with a
``DeprecationWarning``."""

import warnings

from .testing.gluon import compile_report, install_offline_sm90_target, wgmma_serialization_note

__all__ = ["compile_report", "install_offline_sm90_target", "wgmma_serialization_note"]

warnings.warn("mtraining_kernels.gluon_tooling is deprecated: use mtraining_kernels.testing.gluon",
              DeprecationWarning, stacklevel=2)
