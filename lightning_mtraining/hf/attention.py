"""Ring attention as a Hugging Face ``AttentionInterface`` function (registered as ``"mtraining_ring"``).

Every attention module of a prepared model (:mod:`.model`) carries a :class:`RingAttentionConfig`; the function reads
it, decides with the attention schedule (:mod:`lightning_mtraining.sparsity.schedule`) whether the layer runs sparse
now, estimates the layer's pattern once per forward and calls the ring: eagerly
:func:`~lightning_mtraining.ring.attention.ring_attention`, while compiling the custom ops
(:mod:`lightning_mtraining.ring.dense_op`, :mod:`lightning_mtraining.ring.sparse_op`). The name has no "flash" in it:
transformers would try to fetch such a name as a hub kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mtraining.distributed.plan import ContextParallelPlan
from lightning_mtraining.ring.attention import ring_attention
from lightning_mtraining.ring.dense_op import dense_ring_attention
from lightning_mtraining.ring.setup import resolve_pattern
from lightning_mtraining.ring.sparse_op import estimate_pattern_op, sparse_ring_attention
from lightning_mtraining.ring.straight import Kernels, LayerRun, StraightPlan
from lightning_mtraining.sparsity.estimation import attention_recall
from lightning_mtraining.sparsity.pattern import LayerPattern

__all__ = ["ATTENTION_NAME", "CONFIG_ATTR", "RingAttentionConfig", "attention_dropout_fields", "register_attention",
           "ring_attention_forward", "track_straight_module"]

ATTENTION_NAME = "mtraining_ring"
CONFIG_ATTR = "_mtraining_ring"


@dataclasses.dataclass(frozen=True)
class RingAttentionConfig:
    """What one attention module passes to :func:`~lightning_mtraining.ring.attention.ring_attention`."""

    group: dist.ProcessGroup | None
    cp_size: int
    layout: str
    block_size: int
    sparsity: Any = None
    inner_group: dist.ProcessGroup | None = None
    outer_group: dist.ProcessGroup | None = None
    plan: ContextParallelPlan | None = None  # the shared plan: the current batch and the attention schedule
    # ``[plan.uid, layer_idx]`` on the CPU: the layer's key for the estimate op's pattern reuse (ring.sparse_op); a
    # tensor, so the compiled layers' graphs do not differ by a constant and compile once
    layer_key: torch.Tensor | None = dataclasses.field(default=None, compare=False)


def _layer_pattern(module: nn.Module, cfg: RingAttentionConfig, query, key, scaling,
                   as_op: bool = False) -> tuple[Any, float | None]:
    """What this layer's ring attention runs now on the general path (packed documents, soft-capped layers):
    ``(None, None)`` (dense) or the forward's :class:`~lightning_mtraining.sparsity.pattern.LayerPattern` (the
    pattern with its dense heads decided once, in this forward, under the config's ``dense_above``: one host read)
    and that ``dense_above``; with ``as_op`` (while compiling) the estimate op's
    ``(vertical_idx, slash_idx, tile_size)`` instead (the sparse ring op decides the dense heads itself, exactly, so
    its forward and backward agree).

    Sparse per the schedule (:mod:`lightning_mtraining.sparsity.schedule`): the layer's config, dense layers, the dense
    warm-up; a batch whose shortest real sequence is shorter than ``last_q`` probes runs dense (there is nothing
    to estimate from). One estimate per layer and forward (Note [One pattern per forward]), compiled or not: eager,
    the schedule keeps the pattern for a checkpointed layer's recompute; compiled, the estimate op returns it again
    (:mod:`lightning_mtraining.ring.sparse_op`).
    """
    plan = cfg.plan
    schedule = plan.schedule if plan is not None else None
    layer_idx = getattr(module, "layer_idx", None)
    if schedule is None:
        sparsity = cfg.sparsity
    elif as_op and layer_idx is not None and layer_idx in plan.layer_configs:
        sparsity = plan.layer_configs[layer_idx]  # decided when the forward began (no step count in the graph)
    else:
        sparsity = schedule.config_for(layer_idx)
    if sparsity is None:
        return None, None
    n_total = query.shape[2] * cfg.cp_size
    current = plan.current if plan is not None else None
    lengths = list(current.lengths) if current is not None and current.lengths else [n_total] * query.shape[0]
    if min(lengths) < sparsity.last_q:
        return None, None

    doc_start = current.doc_start if current is not None else None

    def estimate():
        if as_op:
            reuse = None if plan is None or cfg.layer_key is None else (plan.forward_id, cfg.layer_key)
            return (*estimate_pattern_op(query, key, sparsity, group=cfg.group, layout=cfg.layout,
                                         block_size=cfg.block_size, seq_len=lengths, scale=scaling,
                                         layer_idx=layer_idx, doc_start=doc_start, reuse=reuse), sparsity.tile_size)
        found = resolve_pattern(query, key, sparsity, group=cfg.group, cp_size=cfg.cp_size, layout=cfg.layout,
                                block_size=cfg.block_size, seq_len=lengths, scale=scaling, layer_idx=layer_idx,
                                doc_start=doc_start)
        return LayerPattern.decide(found, lengths, sparsity.dense_above, n_total)

    if schedule is None or as_op:
        # compiled: the estimate op itself returns the forward's pattern again (by plan.forward_id) when a
        # checkpointed layer recomputes, so the forward and its recompute run one graph that saves the same tensors
        # (non-reentrant checkpointing checks that); the schedule's cache would make the recompute another graph
        return estimate(), sparsity.dense_above
    layer, new = schedule.pattern_for(layer_idx, estimate)
    if new and schedule.measuring:
        recall = None
        if schedule.measuring_recall:
            recall = attention_recall(query, key, layer.estimated, rows=schedule.recall_rows, group=cfg.group,
                                      layout=cfg.layout, block_size=cfg.block_size, seq_len=lengths, scale=scaling,
                                      doc_start=doc_start)
        schedule.record(layer_idx, layer, lengths, n_total, cfg.cp_size, cfg.layout, cfg.block_size,
                        plan.inner_size, recall, sparsity.dense_above)
    return layer, sparsity.dense_above


def ring_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function: query ``[B, H, L, D]``, key/value ``[B, Hkv, L, D]`` -> ``[B, L, H, D]``."""
    cfg: RingAttentionConfig | None = getattr(module, CONFIG_ATTR, None)
    name = type(module).__name__
    if cfg is None:
        raise RuntimeError(
            f"{name} uses attn_implementation={ATTENTION_NAME!r} but was not prepared for it; train with "
            "MTrainingStrategy / MTrainingFabricStrategy, or call "
            "lightning_mtraining.hf.model.prepare_model(model, plan)"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{name} received an attention mask of shape {tuple(attention_mask.shape)}: custom attention masks are "
            "not supported by ring attention (only causal attention with right padding, handled by the strategy)"
        )
    if dropout:
        fields = attention_dropout_fields(getattr(module, "config", None))
        where = ", ".join(f"config.{k}={v}" for k, v in fields.items()) or f"dropout={dropout}"
        raise ValueError(f"{name}: attention dropout ({where}) is not supported by ring attention; set it to 0.0")
    # Sliding-window layers (Gemma 2/3, Mistral, Qwen2 with use_sliding_window) pass their window, Gemma 2 its
    # score soft-cap; both are computed exactly by the ring (a window layer runs its band densely).
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{name}: learned attention sinks (s_aux, gpt-oss's `sinks`) are not supported by ring "
                         "attention")
    if getattr(module, "is_causal", True) is False:
        raise ValueError(f"{name} is not causal; ring attention only computes causal attention")
    # Under autocast (precision="bf16-mixed") RoPE returns float32 q/k while v is bfloat16: run attention in
    # the autocast dtype, as SDPA would; otherwise in the query's dtype.
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    try:
        out = _ring(module, cfg, query, key, value, scaling, window, softcap)
    except ValueError as err:  # name the layer: the ring's own messages do not know it
        raise ValueError(f"{name} (layer {getattr(module, 'layer_idx', '?')}): {err}") from None
    return out.transpose(1, 2).contiguous(), None


_STRAIGHT_PLANS = 4  # batch shapes whose straight plans a ContextParallelPlan keeps


def _straight_plan(cfg: RingAttentionConfig, query: torch.Tensor, key: torch.Tensor,
                   lengths: tuple[int, ...]) -> StraightPlan:
    """The batch's :class:`~lightning_mtraining.ring.straight.StraightPlan`, made by the first layer that needs it and
    kept for later layers and batches of the same shapes and lengths (a few, most recent last)."""
    plan = cfg.plan
    assert plan is not None
    kernels: Kernels = "triton" if plan.kernels == "triton" or (plan.kernels == "auto" and query.is_cuda) else "torch"
    key_ = (tuple(query.shape), tuple(key.shape), query.dtype, query.device, lengths, kernels)
    found = plan.straight.pop(key_, None)
    if found is None:
        found = StraightPlan(query, key, lengths=lengths, group=cfg.group, inner_group=cfg.inner_group,
                             outer_group=cfg.outer_group, layout=cfg.layout, block_size=cfg.block_size,
                             kernels=kernels)
        while len(plan.straight) >= _STRAIGHT_PLANS:
            plan.straight.pop(next(iter(plan.straight)))
    plan.straight[key_] = found
    return found


def _straight_lengths(module, cfg: RingAttentionConfig, query) -> tuple[int, ...] | None:
    """The batch's real lengths where the layer's sparse attention takes the straight path (Note [The straight path]
    in :mod:`lightning_mtraining.ring.straight`), else None: the general path runs it (packed documents, sequences
    shorter than the probes, no schedule: a bare prepared model) or the layer runs dense now. Host values only: a
    compiled layer decides it while tracing."""
    plan = cfg.plan
    schedule = plan.schedule if plan is not None else None
    if schedule is None or not plan.straight_path or plan.current is None or plan.current.doc_start is not None:
        return None
    layer_idx = getattr(module, "layer_idx", None)
    if torch.compiler.is_compiling():  # decided when the forward began (no step count in the graph)
        config = plan.layer_configs.get(layer_idx) if layer_idx is not None else None
    else:
        config = schedule.config_for(layer_idx)
    if config is None:
        return None
    n_total = query.shape[2] * cfg.cp_size
    lengths = tuple(plan.current.lengths) if plan.current.lengths else (n_total,) * query.shape[0]
    return lengths if min(lengths) >= config.last_q else None


def _straight_run(module, cfg: RingAttentionConfig, query, key, scaling,
                  lengths: tuple[int, ...]) -> tuple[StraightPlan, LayerRun]:
    """The batch's plan and the layer's :class:`~lightning_mtraining.ring.straight.LayerRun` for this forward: made by
    the forward (the estimate with the dense heads the layer's last forward decided, the lists; this forward's
    decision noted for the next), found again by a checkpointed recompute. A measured step also records the
    statistics (host reads)."""
    plan = cfg.plan
    assert plan is not None and plan.schedule is not None
    schedule = plan.schedule
    layer_idx = getattr(module, "layer_idx", None)
    config = schedule.config_for(layer_idx)
    B, n_total = query.shape[0], query.shape[2] * cfg.cp_size
    straight = _straight_plan(cfg, query, key, lengths)

    def make() -> LayerRun:
        made = straight.layer(query, key, config, layer_idx, scaling, schedule.dense_heads(layer_idx, B))
        if made.estimate.decided is not None and layer_idx is not None:
            schedule.note_decision(layer_idx, made.estimate.decided)
        return made

    run, new = schedule.pattern_for(layer_idx, make)
    if new and schedule.measuring and layer_idx is not None:
        est = run.estimate
        ran = None if est.dense is None else torch.tensor(est.dense, dtype=torch.bool)
        layer = LayerPattern.ran(est.pattern, ran, est.allowed.cpu(), list(lengths), config.dense_above, n_total)
        recall = None
        if schedule.measuring_recall:
            recall = attention_recall(query, key, est.pattern, rows=schedule.recall_rows, group=cfg.group,
                                      layout=cfg.layout, block_size=cfg.block_size, seq_len=list(lengths),
                                      scale=scaling)
        schedule.record(layer_idx, layer, list(lengths), n_total, cfg.cp_size, cfg.layout, cfg.block_size,
                        plan.inner_size, recall, config.dense_above)
    return straight, run


def _straight(module, cfg: RingAttentionConfig, query, key, value, scaling,
              lengths: tuple[int, ...]) -> torch.Tensor:
    """The layer's sparse attention on the straight path, eagerly."""
    straight, run = _straight_run(module, cfg, query, key, scaling, lengths)
    if run.all_dense:  # every head decided dense in the last forward: the dense ring (SDPA at one rank)
        return ring_attention(query, key, value, group=cfg.group, layout=cfg.layout, block_size=cfg.block_size,
                              inner_group=cfg.inner_group, outer_group=cfg.outer_group, scale=scaling)
    return straight.attend(query, key, value, run, scaling)


# The straight path as custom ops, for compiled layers (torch.compile keeps them whole in its graph; they run the
# eager code inside). A layer is named by its RingAttentionConfig.layer_key ([plan uid, layer]); the forward op keeps
# the batch's plan and the layer's run for the backward op, by that key (the latest forward's: a backward follows its
# forward, and a checkpointed recompute finds the same run).
_STRAIGHT_MODULES: dict[tuple[int, ...], Any] = {}  # layer key -> weak reference to the attention module
_STRAIGHT_RUNS: dict[tuple[int, ...], tuple[StraightPlan, LayerRun]] = {}


def track_straight_module(module: nn.Module, cfg: RingAttentionConfig) -> None:
    """Let the compiled straight op find ``module`` (and its config) by its layer key."""
    import weakref

    if cfg.layer_key is not None:
        _STRAIGHT_MODULES[tuple(int(x) for x in cfg.layer_key.tolist())] = weakref.ref(module)


@torch.library.custom_op("mtraining::straight_forward", mutates_args=())
def _straight_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_key: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from lightning_mtraining.ring.dense_op import outside_dispatch_mode

    key = tuple(int(x) for x in layer_key.tolist())  # a CPU tensor: no device sync
    module = _STRAIGHT_MODULES[key]()
    cfg = getattr(module, CONFIG_ATTR)
    with outside_dispatch_mode():
        lengths = _straight_lengths(module, cfg, q)
        assert lengths is not None  # decided while tracing; the batch's shape and lengths are guarded
        straight, run = _straight_run(module, cfg, q, k, scale, lengths)
        _STRAIGHT_RUNS[key] = (straight, run)
        return straight.forward(q, k, v, run, scale)


@_straight_forward_op.register_fake
def _(q, k, v, layer_key, scale):
    from lightning_mtraining.core.numerics import acc_dtype

    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("mtraining::straight_backward", mutates_args=())
def _straight_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, layer_key: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from lightning_mtraining.ring.dense_op import outside_dispatch_mode

    straight, run = _STRAIGHT_RUNS[tuple(int(x) for x in layer_key.tolist())]
    with outside_dispatch_mode():
        dq, dk, dv = straight.backward(dout, q, k, v, out, lse, run, scale)
    # dk and dv may be views of one buffer: an op's outputs may not alias each other
    return dq.contiguous(), dk.clone() if dk._base is not None else dk, dv.clone() if dv._base is not None else dv


@_straight_backward_op.register_fake
def _(dout, q, k, v, out, lse, layer_key, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _straight_setup_context(ctx, inputs, output) -> None:
    q, k, v, layer_key, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.layer_key, ctx.scale = layer_key, scale


def _straight_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors  # (dlse unused: the op's callers take out only)
    dq, dk, dv = _straight_backward_op(dout, q, k, v, out, lse, ctx.layer_key, ctx.scale)
    return dq, dk, dv, None, None


torch.library.register_autograd(_straight_forward_op, _straight_backward, setup_context=_straight_setup_context)


def _ring(module, cfg: RingAttentionConfig, query, key, value, scaling, window, softcap) -> torch.Tensor:
    straight = _straight_lengths(module, cfg, query) if window is None and softcap is None else None
    if straight is not None:
        if torch.compiler.is_compiling():
            from lightning_mtraining.core.numerics import default_scale

            out, _ = _straight_forward_op(query, key, value, cfg.layer_key, default_scale(query.shape[-1], scaling))
            return out
        return _straight(module, cfg, query, key, value, scaling, straight)
    # While torch.compile traces, every layer is custom ops (ring.dense_op, ring.sparse_op), which it keeps in its
    # graph. Eager: dense layers use the dense op from 2 ranks; one rank keeps ring_attention, whose single step runs
    # FlexAttention's own autograd on CUDA (no recomputed forward); sparse layers keep ring_attention, whose backward
    # reuses the forward's per-step lists (the sparse op's backward rebuilds them, see ring.sparse_op)
    compiling = torch.compiler.is_compiling()
    pattern: Any = None  # dense; else a LayerPattern, or (while compiling) the estimate op's tensors and tile size
    dense_above: float | None = None
    if window is None:
        pattern, dense_above = _layer_pattern(module, cfg, query, key, scaling, as_op=compiling)
    doc_start = cfg.plan.current.doc_start if cfg.plan is not None and cfg.plan.current is not None else None
    args = dict(group=cfg.group, layout=cfg.layout, block_size=cfg.block_size, inner_group=cfg.inner_group,
                outer_group=cfg.outer_group, scale=scaling, softcap=softcap, doc_start=doc_start)
    if pattern is None and (cfg.cp_size > 1 or compiling):
        return dense_ring_attention(query, key, value, window=window, **args)
    # the real lengths: dense_above compares the pattern's pairs with the causal pairs of the unpadded sequences
    current = cfg.plan.current if cfg.plan is not None else None
    lengths = list(current.lengths) if current is not None and current.lengths else None
    if compiling:
        vertical_idx, slash_idx, tile_size = pattern
        return sparse_ring_attention(query, key, value, vertical_idx, slash_idx, tile_size=tile_size,
                                     dense_above=dense_above, seq_len=lengths, **args)
    return ring_attention(query, key, value, sparsity=pattern, window=window, dense_above=dense_above,
                          seq_len=lengths, **args)


def register_attention() -> None:
    """Register :func:`ring_attention_forward` as ``"mtraining_ring"`` with ``transformers`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ring_attention_forward)


def attention_dropout_fields(config: Any) -> dict[str, float]:
    """Non-zero attention-dropout fields of a config, by name: ``attention_dropout`` (Llama, Qwen2, ...),
    ``attn_pdrop`` (GPT-2), ``attention_probs_dropout_prob`` (BERT-style), ... Residual and embedding dropout
    act on single tokens and are fine under context parallelism."""
    if config is None or not hasattr(config, "to_dict"):
        return {}
    return {
        key: value
        for key, value in config.to_dict().items()
        if "drop" in key and ("attn" in key or "attention" in key)
        and isinstance(value, (int, float)) and not isinstance(value, bool) and value
    }
