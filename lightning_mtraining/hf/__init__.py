"""The Hugging Face layer: ``transformers`` causal LMs under context parallelism, without Lightning.

- :mod:`.parallel`: :func:`apply_context_parallel` (models + a device mesh -> ring attention, the fused loss,
  activation checkpointing, tensor parallel) and :func:`apply_fsdp`: what the strategies do, for plain loops.
- :mod:`.model`: model validation and preparation (the hooks that give each shard its global positions, shifted labels
  and exact loss), the non-finite watch; :mod:`.attention`: ring attention as an ``AttentionInterface`` function.
- :mod:`.losses`: Hugging Face's causal-LM loss, exact on a shard, and the fused linear + cross-entropy loss;
  :mod:`.fused_loss`: the hook that computes a model's loss without its full logits.
- :mod:`.tensor_parallel`: decoder layers split over a tensor-parallel mesh axis.
- :mod:`.prefill`: sparse prefill for ``generate``; :mod:`.compile`: ``torch.compile`` of the decoder layers.
- :mod:`.tiled_mlp`: the MLPs computed a chunk of tokens at a time; :mod:`.offload`: saved activations of all or
  the first N decoder layers in host memory.
- :mod:`.pretrained`: real models with no download at run time (a checkpoint folder, a hub id, a ``.gguf`` file, the
  packaged SmolLM2-135M), their tokenizers, and the RoPE change of context extension.
"""

from lightning_mtraining.hf.compile import compile_decoder_layers
from lightning_mtraining.hf.fused_loss import FUSED_LOSS_MODEL_TYPES
from lightning_mtraining.hf.losses import causal_lm_loss, causal_lm_targets, fused_linear_cross_entropy
from lightning_mtraining.hf.model import find_hf_models, prepare_model, validate_model
from lightning_mtraining.hf.parallel import ContextParallel, apply_context_parallel, apply_fsdp
from lightning_mtraining.hf.prefill import register_sparse_prefill
from lightning_mtraining.hf.tensor_parallel import apply_tensor_parallel, clip_grad_norm_

__all__ = ["FUSED_LOSS_MODEL_TYPES", "ContextParallel", "apply_context_parallel", "apply_fsdp", "apply_tensor_parallel",
           "causal_lm_loss", "causal_lm_targets", "clip_grad_norm_", "compile_decoder_layers", "find_hf_models",
           "fused_linear_cross_entropy", "prepare_model", "register_sparse_prefill", "validate_model"]
