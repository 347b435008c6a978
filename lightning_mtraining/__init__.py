"""lightning-mtraining: MTraining (distributed dynamic sparse attention) for PyTorch Lightning.

The package is split by layer; imports only point down (``tests/unit/test_layers.py`` enforces it)::

    mtraining_kernels   Triton / Gluon vertical-slash kernels, pattern -> tile lists      torch, triton
    core                layouts, ring topology, collectives, shared checks                torch.distributed
    sparsity            SparsityConfig, VerticalSlashPattern, online estimation, work counts, schedule,
                        single-device sparse_attention
    ring                block ops, per-step lists, the ring's forward/backward (flat, hierarchical), custom ops
                        for torch.compile, the simulated ring, tracing
    distributed         the named device mesh, the context-parallel plan, batch sharding
    hf                  Hugging Face models: attention hook and model preparation, losses and the fused loss,
                        tensor parallel, sparse prefill, compile, apply_context_parallel        transformers
    metrics, data       torchmetrics metrics; litdata loaders, the embedded corpus, long-context tasks
    callbacks           SparseAttentionCallback, RingTraceCallback                           Lightning
    strategies          the shared options and mixin, the Trainer (DDP, FSDP2) and Fabric strategies

Everything up to ``hf`` imports without Lightning: ``import lightning_mtraining.ring`` serves torch-only users. The
names below load on first use. Importing this package registers the strategy names ``"mtraining"`` (sparse, the
paper's training setting), ``"mtraining_dense"`` (exact dense ring attention), ``"mtraining_fsdp"`` and
``"mtraining_fsdp_dense"`` with the Trainer and Fabric registries, as soon as Lightning is imported (Note
[Registering without importing Lightning] in :mod:`lightning_mtraining._registration`).
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_mtraining import _registration

# The public API: name -> the module that defines it.
_API = {
    "MTrainingStrategy": "lightning_mtraining.strategies.trainer",
    "MTrainingFSDPStrategy": "lightning_mtraining.strategies.fsdp",
    "MTrainingFabricStrategy": "lightning_mtraining.strategies.fabric",
    "SparsityConfig": "lightning_mtraining.sparsity.config",
    "VerticalSlashPattern": "lightning_mtraining.sparsity.pattern",
    "estimate_pattern": "lightning_mtraining.sparsity.estimation",
    "sparse_attention": "lightning_mtraining.sparsity.attention",
    "ring_attention": "lightning_mtraining.ring.attention",
    "shard_sequence": "lightning_mtraining.core.layouts",
    "unshard_sequence": "lightning_mtraining.core.layouts",
    "global_positions": "lightning_mtraining.core.layouts",
    "apply_context_parallel": "lightning_mtraining.hf.parallel",
    "causal_lm_loss": "lightning_mtraining.hf.losses",
    "causal_lm_targets": "lightning_mtraining.hf.losses",
    "SparseAttentionCallback": "lightning_mtraining.callbacks.sparse_attention",
    "RingTraceCallback": "lightning_mtraining.callbacks.ring_trace",
}
# Modules reachable as attributes: ``lightning_mtraining.balance.ring_work(...)``.
_MODULES = {
    "balance": "lightning_mtraining.sparsity.balance",
    "ring_trace": "lightning_mtraining.ring.trace",
}
# Names this package exported before its split into layers: they still resolve here, with a DeprecationWarning that
# names their layer's namespace (``lightning_mtraining.hf.register_sparse_prefill``), where they live on.
_DEPRECATED = {
    "attention_recall": "lightning_mtraining.sparsity.estimation",
    "RingTrace": "lightning_mtraining.ring.trace",
    "fused_linear_cross_entropy": "lightning_mtraining.hf.losses",
    "ContextParallel": "lightning_mtraining.hf.parallel",
    "apply_fsdp": "lightning_mtraining.hf.parallel",
    "compile_decoder_layers": "lightning_mtraining.hf.compile",
    "apply_tensor_parallel": "lightning_mtraining.hf.tensor_parallel",
    "register_sparse_prefill": "lightning_mtraining.hf.prefill",
    "MeshAxes": "lightning_mtraining.distributed.mesh",
    "build_mesh": "lightning_mtraining.distributed.mesh",
    "ContextParallelOptions": "lightning_mtraining.strategies.options",
    "AttentionDensity": "lightning_mtraining.metrics",
    "AttentionRecall": "lightning_mtraining.metrics",
    "TokenPerplexity": "lightning_mtraining.metrics",
    "TokensPerSecond": "lightning_mtraining.metrics",
    "TokenWeightedLoss": "lightning_mtraining.metrics",
}

__all__ = sorted([*_API, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        from lightning_mtraining.core.deprecation import warn_moved

        warn_moved(f"lightning_mtraining.{name}", ".".join(_DEPRECATED[name].split(".")[:2]) + f".{name}")
        return getattr(importlib.import_module(_DEPRECATED[name]), name)  # not cached: every use warns
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
    else:
        raise AttributeError(f"module 'lightning_mtraining' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API, *_MODULES})


_registration.install()
