"""The Gluon (warp-specialised Hopper, sm_90) kernels of vertical-slash attention under the module path they first
had; the code is in:

- :mod:`mtraining_kernels.gluon_forward`: the FA3-style forward (:func:`gluon_block_forward`; its docstring says why
  and how it is scheduled);
- :mod:`mtraining_kernels.gluon_backward`: the dq and dk/dv kernels built the same way (:func:`gluon_block_dq`,
  :func:`gluon_block_dkdv`, and the gathered columns' dk/dv by the same dk/dv kernel: :func:`gluon_block_dkdv_cols`);
- :mod:`mtraining_kernels.gluon_common`: what they share (:func:`gluon_supported`, :func:`gather_columns`, the
  persistent kernels' order of work items, the producer partition, TMA descriptors);
- :mod:`mtraining_kernels.gluon_tooling`: :func:`install_offline_sm90_target`, :func:`compile_report`,
  :func:`wgmma_serialization_note`.

Chosen by ``KernelConfig(forward= / dq= / dkdv= / dkdv_cols="auto" | "gluon")`` in
:mod:`mtraining_kernels.vertical_slash`; resources: :func:`compile_report` (works offline, after
:func:`install_offline_sm90_target`).
"""

from __future__ import annotations

from mtraining_kernels.gluon_backward import column_query_lists, gluon_block_dkdv, gluon_block_dkdv_cols, gluon_block_dq
from mtraining_kernels.gluon_common import HAS_GLUON, POS_MAX_INT, gather_columns, gluon_supported
from mtraining_kernels.gluon_forward import gluon_block_forward
from mtraining_kernels.gluon_tooling import compile_report, install_offline_sm90_target, wgmma_serialization_note

__all__ = ["HAS_GLUON", "POS_MAX_INT", "column_query_lists", "compile_report", "gather_columns", "gluon_block_dkdv",
           "gluon_block_dkdv_cols", "gluon_block_dq", "gluon_block_forward", "gluon_supported",
           "install_offline_sm90_target", "wgmma_serialization_note"]
