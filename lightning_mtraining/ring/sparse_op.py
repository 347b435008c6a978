"""The pattern estimator and the sparse ring as ``torch.library`` custom ops, so ``torch.compile`` sees opaque ops.

:func:`~lightning_mtraining.sparsity.estimation.estimate_pattern` and the sparse
:func:`~lightning_mtraining.ring.attention.ring_attention` are Python around collectives, host syncs (list widths,
skipped steps) and an ``autograd.Function``: the compiler breaks the graph there. This module computes the same through
three custom ops, each with a fake implementation (shapes only); process groups travel by name, as in
:mod:`lightning_mtraining.ring.dense_op`:

- ``mtraining::estimate_pattern(q, k, ...) -> (vertical_idx, slash_idx)``: the layer's global pattern as two int64
  tensors of *static* width, so the compiled graph knows their shapes: ``sink_tokens + max vertical budget`` and
  ``local_window + max slash budget`` columns (the budgets are the top-k sizes, or in top-p mode the caps), -1 padding
  on the right (a :class:`~lightning_mtraining.sparsity.pattern.VerticalSlashPattern` ignores negative entries; the
  estimator's own output is never wider). Packed documents force the first ``sink_tokens`` keys of every document, a
  number only the data knows: there the vertical width is a data-dependent size in the graph.
- ``mtraining::sparse_ring_forward(q, k, v, vertical_idx, slash_idx, ...) -> (out, lse)`` and
  ``mtraining::sparse_ring_backward(dout, q, k, v, out, lse, vertical_idx, slash_idx, ...) -> (dq, dk, dv)``, the
  backward registered as the forward's autograd formula.

Why the backward rebuilds the per-step lists (and re-gathers the vertical columns' K/V) instead of receiving them from
the forward: the lists' sizes depend on the pattern's values (tiles per query tile, columns per step), so as op
outputs they would be a dozen tensors per ring step with data-dependent shapes in the graph, and the forward op would
have to return them all. Rebuilding costs one list-builder call (one Triton launch on CUDA, two host syncs) and one
all-reduce of the gathered columns' K/V (``[2, B, Hkv, NV, D]``, a few MB) per layer: a small share of a training step
next to the attention itself.

One pattern per forward (Note [One pattern per forward] in :mod:`lightning_mtraining.sparsity.schedule`): a compiled
layer recomputed by activation checkpointing must run the same graph as its forward (non-reentrant checkpointing checks
that the recompute saves the same tensors), so the pattern cannot come from the schedule's cache there (a second graph).
Instead the estimate op takes ``reuse=(forward_id, key)``: a CPU int64 tensor naming the model forward (an input of the
graph, bumped by the model hook each forward) and one naming the plan and layer (an input too, so the layers' graphs are
one graph, compiled once); called again with the same pair, it returns the pattern it estimated then, without estimating
or communicating (every rank of the group makes the same decision: they share the forward count). One pattern per (plan,
layer) is kept, until the next forward's replaces it or the plan is freed. The compiled layers do not measure the
density, imbalance or recall (host work); those are measured in eager forwards only.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import cast

import torch
import torch.distributed as dist
from torch.library import custom_op, register_autograd

from lightning_mtraining.core.layouts import check_doc_start
from lightning_mtraining.core.numerics import acc_dtype, default_scale
from lightning_mtraining.ring.dense_op import group_by_name, group_name, outside_dispatch_mode, topology_by_names
from lightning_mtraining.ring.setup import (
    check_sparse_layout,
    dense_setup,
    documents_op,
    rank_positions,
    sparse_block_op,
    validate_ring_inputs,
    variant_op,
)
from lightning_mtraining.ring.steps import attention_variant, build_step_lists, document_skips
from lightning_mtraining.ring.walk import gather_vertical_kv, gathered_backward, ring_backward, ring_forward
from lightning_mtraining.sparsity.config import PatternHeads, Probes, SparsityConfig
from lightning_mtraining.sparsity.estimation import estimate_pattern
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern, real_lengths, sparse_part

__all__ = ["estimate_pattern_op", "forget_plan", "new_plan_uid", "pattern_widths", "sparse_ring_attention",
           "track_plan"]

# (plan number, layer) -> (forward id, vertical_idx, slash_idx): the last pattern each layer estimated through the op
_REUSE: dict[tuple[int, ...], tuple[int, torch.Tensor, torch.Tensor]] = {}
_PLAN_IDS = itertools.count()
estimations = 0  # patterns the op estimated (not reused) so far: a test hook for Note [One pattern per forward]


def new_plan_uid() -> int:
    """A number for a new context-parallel plan, never reused in this process (its patterns' keys in the op)."""
    return next(_PLAN_IDS)


def forget_plan(uid: int) -> None:
    """Drop the patterns kept for plan ``uid`` (called when the plan is freed)."""
    for key in [k for k in _REUSE if k[0] == uid]:
        del _REUSE[key]


def track_plan(plan: object, uid: int) -> None:
    """Forget ``uid``'s patterns when ``plan`` is garbage collected."""
    weakref.finalize(plan, forget_plan, uid)


def pattern_widths(config: SparsityConfig, num_heads: int, num_kv_heads: int,
                   layer_idx: int | None = None) -> tuple[int, int]:
    """The static widths of the estimate op's outputs for ``config`` (``layer_idx`` for per-layer budgets):
    ``(sink_tokens + max vertical budget, local_window + max slash budget)``."""
    G = num_heads if config.pattern_heads == "query" else num_kv_heads
    vert, slash = config.head_budgets(G, layer_idx)
    return config.sink_tokens + max(vert), config.local_window + max(slash)


@functools.lru_cache(maxsize=256)
def _config(last_q: int, probes: str, probe_blocks: int, sink_tokens: int, local_window: int, top_p: float | None,
            pattern_heads: str, vertical: tuple[int, ...], slash: tuple[int, ...], tile_size: int) -> SparsityConfig:
    # the per-head budgets as both the top-k sizes and the caps: the mode (top_p) decides which are read
    # pattern_heads and probes travel through the op as strs; SparsityConfig checks their values
    return SparsityConfig(vertical_topk=vertical, slash_topk=slash, top_p=top_p, max_vertical=vertical,
                          max_slash=slash, last_q=last_q, probes=cast(Probes, probes), probe_blocks=probe_blocks,
                          sink_tokens=sink_tokens, local_window=local_window,
                          pattern_heads=cast(PatternHeads, pattern_heads), tile_size=tile_size)


def _pad(idx: torch.Tensor, width: int) -> torch.Tensor:
    """``idx [B, G, n]`` with -1 columns appended up to ``width`` (n <= width: the estimator keeps at most the
    budget), as a fresh tensor (an op's output may not alias anything)."""
    if idx.shape[-1] > width:
        raise RuntimeError(f"estimate_pattern returned {idx.shape[-1]} entries per head, more than the budget {width}")
    out = torch.full((*idx.shape[:2], width), -1, dtype=torch.int64, device=idx.device)
    out[..., :idx.shape[-1]] = idx
    return out


@custom_op("mtraining::estimate_pattern", mutates_args=())
def _estimate_op(q: torch.Tensor, k: torch.Tensor, doc_start: torch.Tensor | None, forward_id: torch.Tensor | None,
                 reuse_key: torch.Tensor | None, group: str, layout: str, block_size: int, seq_len: list[int],
                 scale: float, last_q: int, probes: str, probe_blocks: int, sink_tokens: int, local_window: int,
                 top_p: float | None, pattern_heads: str, vertical_budgets: list[int], slash_budgets: list[int],
                 tile_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    global estimations
    fid = int(forward_id) if forward_id is not None else None  # CPU tensors: no device sync
    key = tuple(reuse_key.tolist()) if reuse_key is not None else ()
    if fid is not None:
        hit = _REUSE.get(key)
        if hit is not None and hit[0] == fid:  # a recompute of this forward: its pattern (fresh outputs)
            return hit[1].clone(), hit[2].clone()
    with outside_dispatch_mode():
        config = _config(last_q, probes, probe_blocks, sink_tokens, local_window, top_p, pattern_heads,
                         tuple(vertical_budgets), tuple(slash_budgets), tile_size)
        p = estimate_pattern(q, k, config, group=group_by_name(group), layout=layout, block_size=block_size,
                             seq_len=seq_len or None, scale=scale, doc_start=doc_start)
        slash = _pad(p.slash_idx, local_window + max(slash_budgets))
        if doc_start is not None:  # data-dependent width (every document's sinks): unpadded, a fresh copy
            vertical = p.vertical_idx.clone()
        else:
            vertical = _pad(p.vertical_idx, sink_tokens + max(vertical_budgets))
    estimations += 1
    if fid is not None:
        _REUSE[key] = (fid, vertical, slash)
        return vertical.clone(), slash.clone()
    return vertical, slash


@_estimate_op.register_fake
def _(q, k, doc_start, forward_id, reuse_key, group, layout, block_size, seq_len, scale, last_q, probes, probe_blocks,
      sink_tokens, local_window, top_p, pattern_heads, vertical_budgets, slash_budgets, tile_size):
    B, G = q.shape[0], q.shape[1] if pattern_heads == "query" else k.shape[1]
    if doc_start is not None:
        n_vert = torch.library.get_ctx().new_dynamic_size()
    else:
        n_vert = sink_tokens + max(vertical_budgets)
    return (q.new_empty((B, G, n_vert), dtype=torch.int64),
            q.new_empty((B, G, local_window + max(slash_budgets)), dtype=torch.int64))


def estimate_pattern_op(q: torch.Tensor, k: torch.Tensor, config: SparsityConfig, *,
                        group: dist.ProcessGroup | None = None, layout: str = "striped", block_size: int = 128,
                        seq_len: list[int] | int | None = None, scale: float | None = None,
                        layer_idx: int | None = None, doc_start: torch.Tensor | None = None,
                        reuse: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~lightning_mtraining.sparsity.estimation.estimate_pattern` (arguments as there) as one custom op that
    ``torch.compile`` does not break: ``(vertical_idx, slash_idx)``, padded with -1 to :func:`pattern_widths`
    (packed documents: the vertical width is the data's). Not differentiable (the estimate never is).

    ``reuse=(forward_id, key)``: CPU int64 tensors, a scalar and ``[plan number, layer]``; a second call with the same
    key while ``forward_id`` holds the same value returns the first call's pattern without estimating (see the module
    docstring). Every rank of ``group`` must pass the same values. Tensors, not ints or strings: compiled graphs take
    them as inputs, so every layer's graph is the same graph (compiled once, then found in inductor's cache)."""
    G = q.shape[1] if config.pattern_heads == "query" else k.shape[1]
    vert, slash = config.head_budgets(G, layer_idx)
    lens = [] if seq_len is None else [seq_len] * q.shape[0] if isinstance(seq_len, int) else [int(x) for x in seq_len]
    forward_id, key = reuse if reuse is not None else (None, None)
    return _estimate_op(q.detach(), k.detach(), doc_start, forward_id, key, group_name(group), layout, block_size, lens,
                        default_scale(q.shape[-1], scale), config.last_q, config.probes, config.probe_blocks,
                        config.sink_tokens, config.local_window,
                        config.top_p, config.pattern_heads, list(vert), list(slash), config.tile_size)


def _sparse_setup(q, k, v, vertical_idx, slash_idx, doc_start, group: str, inner_group: str, outer_group: str,
                  layout: str, block_size: int, tile_size: int, scale: float, softcap: float | None,
                  verticals: str, dense_above: float, seq_lens: list[int], validate: bool = False):
    """What :func:`~lightning_mtraining.ring.attention.ring_attention` decides before a sparse ring, from the op's
    arguments: the topology, positions, block op, per-step lists (None: every head's pattern allows more than
    ``dense_above`` of its pairs and the ring runs dense, as ring_attention does; heads that do run the full pattern),
    estimator group and variant keywords, and the steps that compute nothing (``validate``: check the pattern against
    the sequence and heads, one host sync; the forward does, the backward gets the same pattern)."""
    topo = topology_by_names(group, inner_group, outer_group)
    validate_ring_inputs(q, k, v, layout, block_size, topo.cp_size)
    n = q.shape[2] * topo.cp_size
    positions = rank_positions(n, topo.cp_size, layout, block_size, q.device)
    doc_start = check_doc_start(doc_start, q, positions[topo.cp_rank])
    variant = attention_variant(None, softcap, doc_start)
    doc_skips = document_skips(positions, topo.cp_rank, doc_start) if doc_start is not None else None
    given = VerticalSlashPattern(vertical_idx, slash_idx, tile_size)
    if validate:
        given.validate(n, q.shape[1], k.shape[1], batch_size=q.shape[0])
    check_sparse_layout(n, topo.cp_size, layout, block_size, tile_size)
    pattern = sparse_part(given, real_lengths(seq_lens or None, q.shape[0], n),
                          dense_above if dense_above >= 0 else None, n)
    if pattern is None:
        d = dense_setup(q, k, v, topo, layout, block_size, scale, None, softcap, doc_start)
        return topo, d.positions, d.op, None, None, d.variant, d.skips
    op = variant_op(sparse_block_op(None, q.device, tile_size), None, softcap)
    if doc_start is not None:
        op = documents_op(op, False)
    gather = verticals if topo.cp_size > 1 else "arrival"  # one rank holds every vertical already
    plan = build_step_lists(pattern, positions, topo.cp_rank, topo.sources(), q.shape[1], k.shape[1], n, gather)
    g = group_by_name(group)
    est_group = g if g is not None else (topo.inner_group if topo.cp_size > 1 else None)
    return topo, positions, op, plan, est_group, variant, doc_skips


@custom_op("mtraining::sparse_ring_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vertical_idx: torch.Tensor,
                slash_idx: torch.Tensor, doc_start: torch.Tensor | None, group: str, inner_group: str,
                outer_group: str, layout: str, block_size: int, tile_size: int, scale: float, softcap: float | None,
                verticals: str, dense_above: float, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    with outside_dispatch_mode():
        topo, positions, op, plan, est_group, variant, doc_skips = _sparse_setup(
            q, k, v, vertical_idx, slash_idx, doc_start, group, inner_group, outer_group, layout, block_size,
            tile_size, scale, softcap, verticals, dense_above, seq_lens, validate=True)
        (out, lse), _ = ring_forward(q, torch.stack([k, v]), topo, positions, op, scale, plan, est_group, variant,
                                      doc_skips)
    return out.to(q.dtype).contiguous(), lse.to(acc_dtype(q.dtype)).contiguous()


@_forward_op.register_fake
def _(q, k, v, vertical_idx, slash_idx, doc_start, group, inner_group, outer_group, layout, block_size, tile_size,
      scale, softcap, verticals, dense_above, seq_lens):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


@custom_op("mtraining::sparse_ring_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, vertical_idx: torch.Tensor, slash_idx: torch.Tensor, doc_start: torch.Tensor | None,
                 group: str, inner_group: str, outer_group: str, layout: str, block_size: int, tile_size: int,
                 scale: float, softcap: float | None, verticals: str, dense_above: float,
                 seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with outside_dispatch_mode():
        topo, positions, op, plan, est_group, variant, doc_skips = _sparse_setup(
            q, k, v, vertical_idx, slash_idx, doc_start, group, inner_group, outer_group, layout, block_size,
            tile_size, scale, softcap, verticals, dense_above, seq_lens)
        dout = dout.contiguous()
        kv = torch.stack([k, v])
        dq, dk, dv = ring_backward(dout, q, kv, out, lse, topo, positions, op, scale, plan, variant, doc_skips)
        # Note [Gathered verticals] in ring/walk.py: the columns' K/V again, then their step
        if plan is not None and plan.vert_pos is not None:
            kv_v = gather_vertical_kv(kv, plan, est_group, topo.cp_size)
            gathered_backward(dq, q, kv_v, out, lse, dout, positions[topo.cp_rank], plan, op, scale, est_group,
                               topo.cp_size, dk, dv, variant)
    # dk and dv are views of one buffer: an op's outputs may not alias each other (a copy where the dtype is kept)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype, copy=True).contiguous(), dv.to(v.dtype, copy=True).contiguous()


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, vertical_idx, slash_idx, doc_start, group, inner_group, outer_group, layout,
      block_size, tile_size, scale, softcap, verticals, dense_above, seq_lens):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, vertical_idx, slash_idx, doc_start, *config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, vertical_idx, slash_idx)
    ctx.doc_start, ctx.config = doc_start, config


def _backward(ctx, dout, dlse):
    # dlse is not used: callers take ``out`` only (the lse output is for the backward)
    q, k, v, out, lse, vertical_idx, slash_idx = ctx.saved_tensors
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, vertical_idx, slash_idx, ctx.doc_start, *ctx.config)
    return (dq, dk, dv) + (None,) * 14


register_autograd(_forward_op, _backward, setup_context=_setup_context)


def sparse_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    vertical_idx: torch.Tensor,
    slash_idx: torch.Tensor,
    *,
    tile_size: int = 128,
    group: dist.ProcessGroup | None = None,
    layout: str = "striped",
    block_size: int = 128,
    inner_group: dist.ProcessGroup | None = None,
    outer_group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    doc_start: torch.Tensor | None = None,
    verticals: str = "gathered",
    dense_above: float | None = None,
    seq_len: list[int] | int | None = None,
) -> torch.Tensor:
    """:func:`~lightning_mtraining.ring.attention.ring_attention` with
    ``sparsity=VerticalSlashPattern(vertical_idx, slash_idx, tile_size)`` and the default block op, as one custom op
    that ``torch.compile`` does not break (arguments as there; the pattern as its two tensors, e.g. from
    :func:`estimate_pattern_op`; ``dense_above`` as there: a pattern that allows more than that share of the pairs of
    the real sequences, ``seq_len``, runs dense, decided inside the op). Differentiable in q, k and v."""
    if verticals not in ("arrival", "gathered"):
        raise ValueError(f"verticals must be 'gathered' or 'arrival', got {verticals!r}")
    if inner_group is not None and group is None:
        raise ValueError(
            "sparse hierarchical ring attention needs group= (the whole CP group) besides inner_group and outer_group"
        )
    out, _ = _forward_op(q, k, v, vertical_idx, slash_idx, doc_start, group_name(group), group_name(inner_group),
                         group_name(outer_group), layout, block_size, tile_size, default_scale(q.shape[-1], scale),
                         softcap, verticals, -1.0 if dense_above is None else float(dense_above),
                         [] if seq_len is None else real_lengths(seq_len, q.shape[0], 0))
    return out
