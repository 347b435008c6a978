"""lightning-mtraining: MTraining (distributed dynamic sparse attention) for PyTorch Lightning.

Layers, lowest first (imports only point down):

- ``mtraining_kernels`` (folder ``kernels/``): Triton vertical-slash sparse attention kernels.
- core: :mod:`.layouts` (token layouts), :mod:`.pattern` (the pattern and its budgets), :mod:`.estimation`
  (online pattern estimation, recall), :mod:`.balance` (exact work per rank and step), :mod:`.attention_ops`
  (per-block attention ops), :mod:`.ring` (flat and hierarchical ring attention, dense and sparse), :mod:`.ring_trace`
  (its optional per-step instrumentation), :mod:`.mesh` (the named dp x cp x tp device mesh),
  :mod:`.simulated` (single-process ring), :mod:`.sparse` (single-device sparse attention), :mod:`.collectives`.
- integration: :mod:`.sharding`, :mod:`.hf`, :mod:`.prefill` (sparse prefill for ``generate``), :mod:`.schedule`,
  :mod:`.strategy`, :mod:`.fabric`, :mod:`.callback`, :mod:`.trace_callback`,
  :mod:`.data`, :mod:`.metrics`, :mod:`.losses`, :mod:`.parallel`, :mod:`.tensor_parallel`.

Importing this package registers the strategy names ``"mtraining"`` (sparse, the paper's training setting) and
``"mtraining_dense"`` (exact dense ring attention) with the Trainer and Fabric strategy registries (Lightning has
no entry point for strategies).
"""

# --- core -------------------------------------------------------------------------------
from lightning_mtraining import balance, ring_trace
from lightning_mtraining.estimation import attention_recall, estimate_pattern
from lightning_mtraining.layouts import global_positions, shard_sequence, unshard_sequence
from lightning_mtraining.pattern import SparsityConfig, VerticalSlashPattern
from lightning_mtraining.ring import ring_attention
from lightning_mtraining.ring_trace import RingTrace

__all__ = [
    "SparsityConfig",
    "VerticalSlashPattern",
    "attention_recall",
    "balance",
    "ring_trace",
    "estimate_pattern",
    "global_positions",
    "RingTrace",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
]

# --- single-device sparse attention ---------------------------------------------------------
from lightning_mtraining.sparse import sparse_attention

__all__ += ["sparse_attention"]

# --- integration --------------------------------------------------------------------------
# Importing strategy/fabric registers "mtraining" with the Trainer and Fabric strategy registries.
from lightning_mtraining.callback import SparseAttentionCallback
from lightning_mtraining.fabric import MTrainingFabricStrategy
from lightning_mtraining.hf import compile_decoder_layers
from lightning_mtraining.losses import causal_lm_loss, causal_lm_targets, fused_linear_cross_entropy
from lightning_mtraining.mesh import MeshAxes, build_mesh
from lightning_mtraining.parallel import ContextParallel, apply_context_parallel, apply_fsdp
from lightning_mtraining.strategy import MTrainingStrategy
from lightning_mtraining.options import ContextParallelOptions
from lightning_mtraining.strategy_fsdp import MTrainingFSDPStrategy
from lightning_mtraining.trace_callback import RingTraceCallback

__all__ += ["ContextParallelOptions", "MTrainingFSDPStrategy", "MTrainingFabricStrategy", "MTrainingStrategy", "SparseAttentionCallback"]
__all__ += ["RingTraceCallback"]
# Losses and targets for training steps that compute their own loss (right on a context-parallel shard).
__all__ += ["causal_lm_loss", "causal_lm_targets", "fused_linear_cross_entropy"]
__all__ += ["ContextParallel", "apply_context_parallel", "apply_fsdp"]
# torch.compile of each decoder layer (what the strategies' compile= option does), for plain loops and configure_model
__all__ += ["compile_decoder_layers"]
# The N-dimensional mesh (dp_replicate x dp_shard x cp x tp) and tensor parallelism of HF decoder layers.
from lightning_mtraining.tensor_parallel import apply_tensor_parallel

__all__ += ["MeshAxes", "apply_tensor_parallel", "build_mesh"]
# Serving: the sparse prefill for Hugging Face generate (one device).
from lightning_mtraining.prefill import register_sparse_prefill

__all__ += ["register_sparse_prefill"]

# Metrics (torchmetrics). The litdata loaders stay in `lightning_mtraining.data`, NOT imported here:
# litdata is absent from the GPU image, and `import lightning_mtraining` must work there.
from lightning_mtraining.metrics import (
    AttentionDensity,
    AttentionRecall,
    TokenPerplexity,
    TokensPerSecond,
    TokenWeightedLoss,
)

__all__ += ["AttentionDensity", "AttentionRecall", "TokenPerplexity", "TokensPerSecond", "TokenWeightedLoss"]
