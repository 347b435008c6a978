"""Tensor parallelism for Hugging Face decoder layers, composed with context parallelism (Note [The mesh axes]
in :mod:`lightning_mtraining.distributed.mesh`).

Note [Tensor parallel attention]
--------------------------------
Each decoder layer is split with torch's ``parallelize_module`` over the ``"tp"`` axis (the Megatron-LM split):
``q_proj``, ``k_proj``, ``v_proj`` and the MLP's ``gate_proj``/``up_proj`` column-wise (``ColwiseParallel``: each
rank computes a contiguous block of output features), ``o_proj`` and ``down_proj`` row-wise (``RowwiseParallel``:
each rank multiplies its block of input features and the partial outputs are all-reduced). The column blocks are
whole heads, so on tp rank t the attention module sees the query heads ``[t H/T, (t+1) H/T)`` and the KV heads
``[t Hkv/T, (t+1) Hkv/T)``: query head h uses KV head ``h // (H/Hkv)`` in both numberings, so grouped-query
attention stays local (hence Hkv divisible by T, :func:`~lightning_mtraining.distributed.mesh.check_mesh_fits_model`).
Hugging Face attention reshapes with ``view(..., -1, head_dim)``, so no head count in the model changes.

The ring (``cp`` axis) then runs on these local heads as on any others; the vertical-slash estimator estimates
one pattern per local head (``pattern_heads="query"``) or per local KV group (``"kv"``), which are exactly the
patterns one device would estimate for those heads: the scores of a head depend on that head only. Per-head
budgets are sliced to the local heads (:func:`local_sparsity`). Attention statistics are then those of the local
heads.

Outside the decoder layers' projections nothing is split: embeddings, norms and the output layer stay
replicated over ``tp`` (and sharded by FSDP2 over dp x cp like every parameter). Every tp rank computes the
same hidden states, logits and loss, and the same gradient for the replicated parameters: the column-wise
layers' input gradient is all-reduced over ``tp`` by ``ColwiseParallel``'s input redistribution. The exact-loss
scaling (Note [Exact losses and gradients] in :mod:`lightning_mtraining.hf.model`) is over the cp group only and is
unchanged.

The plan comes from the model's config (``base_model_tp_plan``, transformers' own, whose ``"colwise"`` and
``"rowwise"`` entries are these torch styles); a model whose plan holds any other style for a decoder layer (for
example Qwen3's per-head ``q_norm``, ``"replicated_with_grad_allreduce"``, whose gradient would need a sum over
``tp`` before FSDP's reduction) is refused with the style named.

After FSDP2 the split parameters are DTensors on the ``(dp_shard_cp, tp)`` mesh and the replicated ones on
``dp_shard_cp`` alone; ``torch.nn.utils.clip_grad_norm_`` stacks their norms and DTensor refuses operands on
different meshes ("All operands in aten.stack.default must have the same mesh", torch 2.13). torchtitan avoids it by
making every parameter a DTensor on the tp mesh (norms ``SequenceParallel``); here :func:`clip_grad_norm_` takes the
norm per mesh and combines the totals.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mtraining.distributed.mesh import check_mesh_fits_model
from lightning_mtraining.hf.model import find_hf_models

__all__ = ["TP_STYLES", "apply_tensor_parallel", "clip_grad_norm_", "layer_tp_plan", "local_sparsity"]

# transformers' plan style names that are exactly torch's default ColwiseParallel / RowwiseParallel (replicated
# input, Shard(-1) local output; Shard(-1) input, replicated output)
TP_STYLES = ("colwise", "rowwise")

_LAYERS = "layers.*."


def layer_tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor parallel plan of one decoder layer of ``model``, ``{path in the layer: "colwise" | "rowwise"}``,
    from ``config.base_model_tp_plan``. Raises ValueError for a model without a plan or with other styles."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()
    plan = getattr(text_config, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"{name} has no tensor parallel plan (config.base_model_tp_plan is empty): tensor parallelism supports "
            "Hugging Face models that declare one (Llama, Qwen2, Mistral, Gemma 2, ...); use tp=1 for this model"
        )
    layer_plan: dict[str, str] = {}
    for key, style in plan.items():
        if not key.startswith(_LAYERS):  # embeddings, norm, lm_head: kept replicated over tp
            continue
        if style not in TP_STYLES:
            raise ValueError(
                f"{name}: its tensor parallel plan gives {key!r} the style {style!r}; only {TP_STYLES} (torch's "
                "ColwiseParallel / RowwiseParallel) compose with ring attention and FSDP2 here. Use tp=1 for this "
                "model"
            )
        layer_plan[key[len(_LAYERS):]] = style
    if not any(s == "colwise" for s in layer_plan.values()) or not any(s == "rowwise" for s in layer_plan.values()):
        raise ValueError(f"{name}: its tensor parallel plan {plan} splits no decoder-layer projection pair")
    return layer_plan


def _decoder_layers(model: nn.Module) -> Any:
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: found no decoder layers at base_model.layers to split over tp")
    return layers


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh) -> list[nn.Module]:
    """Split the decoder layers of every Hugging Face model inside ``module`` over the 1D ``tp_mesh``
    (Note [Tensor parallel attention]); returns the models split. Call before FSDP2's ``fully_shard``.

    Raises ValueError when a model's heads or MLP cannot be split ``tp_mesh.size()`` ways or it has no usable plan.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel: tp_mesh must be 1D, got dimensions {tp_mesh.mesh_dim_names}")
    tp = tp_mesh.size()
    models = find_hf_models(module)
    if tp == 1:
        return models
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for model in models:
        check_mesh_fits_model(getattr(model, "config", None), tp, owner=type(model).__name__)
        layer_plan = layer_tp_plan(model)
        for layer in _decoder_layers(model):
            names = [n for n, _ in layer.named_modules() if n]
            plan = {}
            for pattern, style in layer_plan.items():
                matched = fnmatch.filter(names, pattern)
                if not matched:
                    raise ValueError(f"{type(model).__name__}: its tensor parallel plan names {pattern!r}, which "
                                     f"{type(layer).__name__} does not have")
                plan.update({n: styles[style]() for n in matched})
            parallelize_module(layer, tp_mesh, plan)
    return models


def local_sparsity(config: Any, tp_rank: int, tp_size: int) -> Any:
    """``config`` (a :class:`~lightning_mtraining.sparsity.config.SparsityConfig` or None) for the local heads of tp
    rank
    ``tp_rank``: per-head budget lists are cut to the rank's contiguous block of pattern heads; the rest is kept."""
    if config is None or tp_size == 1:
        return config

    def cut(values: Any, what: str) -> Any:
        if not isinstance(values, (tuple, list)) or len(values) == 1:
            return values
        if len(values) % tp_size:
            raise ValueError(f"SparsityConfig.{what} has {len(values)} per-head budgets, not divisible by the "
                             f"tensor parallel size {tp_size}")
        n = len(values) // tp_size
        return tuple(values[tp_rank * n:(tp_rank + 1) * n])

    changes = {f: cut(getattr(config, f), f) for f in ("vertical_topk", "slash_topk", "max_vertical", "max_slash")}
    if config.budgets is not None:
        changes["budgets"] = {layer: cut(pairs, f"budgets[{layer}]") for layer, pairs in config.budgets}
    return dataclasses.replace(config, **changes)


@torch.no_grad()
def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters whose gradients are DTensors on different meshes (see the
    module docstring): the total norm of every gradient (each mesh's part reduced over its ranks), and every
    gradient scaled by ``max_norm / (total + 1e-6)`` when that is below 1. Returns the total norm (a plain tensor)."""
    from torch.distributed.tensor import DTensor

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0, dtype=torch.float32)  # not the default dtype (bf16 under bf16-true)
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]  # the shards, scaled in place
    torch._foreach_mul_(local, coef.to(local[0].device))
    return total
