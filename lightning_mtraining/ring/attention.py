"""Ring attention, the public function: causal attention of this rank's query shard against the whole sequence,
dense or sparse, flat or hierarchical (Note [Ring schedule] in :mod:`.walk`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mtraining.core.layouts import check_doc_start
from lightning_mtraining.core.numerics import default_scale
from lightning_mtraining.core.topology import resolve_topology
from lightning_mtraining.ring.block_ops import BlockAttentionOp
from lightning_mtraining.ring.setup import (
    check_sparse_layout,
    dense_setup,
    documents_op,
    rank_positions,
    resolve_pattern,
    sparse_block_op,
    validate_ring_inputs,
    variant_op,
    window_for_length,
)
from lightning_mtraining.ring.steps import attention_variant, build_step_lists, document_skips
from lightning_mtraining.ring.walk import RingAttentionFunction
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.pattern import LayerPattern, VerticalSlashPattern, real_lengths

__all__ = ["ring_attention"]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "striped",
    block_size: int = 128,
    sparsity: SparsityConfig | VerticalSlashPattern | LayerPattern | None = None,
    inner_group: dist.ProcessGroup | None = None,
    outer_group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    op: BlockAttentionOp | None = None,
    seq_len=None,
    layer_idx: int | None = None,
    verticals: str = "gathered",
    window: int | None = None,
    softcap: float | None = None,
    doc_start: torch.Tensor | None = None,
    dense_above: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's query shard against the whole (sharded) sequence.

    Args:
        q: ``[B, H, S, D]`` this rank's queries, in ``layout``.
        k, v: ``[B, Hkv, S, D]`` this rank's keys/values (H divisible by Hkv; never repeated).
        group: the CP process group (default: the default group; none initialised means world size 1). Sparse
            attention with a hierarchical ring needs it (the pattern is estimated over the whole CP group).
        layout, block_size: how the sequence was sharded (:mod:`lightning_mtraining.core.layouts`).
        sparsity: ``None`` for dense (exact) ring attention; a :class:`SparsityConfig` to estimate the pattern online
            (:func:`~lightning_mtraining.sparsity.estimation.estimate_pattern`); a :class:`VerticalSlashPattern` to use
            as given; a :class:`~lightning_mtraining.sparsity.pattern.LayerPattern` (a pattern whose dense heads were
            already decided) runs as decided, with no second check or decision.
            Sparse: the result equals ``sparse_attention(q, k, v, p.vertical_idx, p.slash_idx, block_size=p.tile_size)``
            on the unsharded tensors; every shard must hold whole T x T tiles (striped: ``block_size`` a multiple of T).
        inner_group, outer_group: intra-node and inter-node rings for hierarchical ring attention; CP ranks
            must be numbered ``outer_rank * inner_size + inner_rank``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        op: the per-block attention op (default: FlexAttention on CUDA and chunked torch elsewhere for dense; the
            Triton vertical-slash kernels on CUDA for sparse).
        seq_len: the real length before padding (int or one per batch row), for the estimator's probes.
        layer_idx: the layer, for per-layer budgets of a ``SparsityConfig``.
        verticals: where a sparse ring computes the vertical columns: ``"gathered"`` (default) in one extra step
            against their K/V gathered from every rank, which keeps the ring's steps balanced (Note [Gathered
            verticals]); ``"arrival"`` at the step their key's chunk arrives. The same result either way.
        window: a sliding-window layer (Hugging Face's ``sliding_window``): query q sees key k iff
            ``q - window < k <= q``, token-exact. Ring steps whose chunk holds no key inside this rank's windows
            compute nothing (the chunk still passes through, for the ranks after this one). A window layer
            ignores ``sparsity``: its band is already its sparse pattern, computed exactly.
        softcap: scores become ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2's
            ``attn_logit_softcapping``). Sparse: the pattern is estimated from uncapped scores (the cap is
            monotonic, so each row's ranking of keys is the same), the attention over it is capped (the Triton
            kernels apply the cap on CUDA; their Gluon variants do not, so a capped layer runs the Triton ones).
        doc_start: packed documents: ``[B or 1, S]`` integers, for each of this rank's tokens the global position of its
            document's first token (:attr:`~lightning_mtraining.distributed.sharding.ShardedBatch.doc_start`); a token
            sees only keys of its own document (``doc_start <= k <= q``), in the dense and the sparse ring. Ring steps
            with no key in any of this rank's documents compute nothing, and within a step the torch op computes no key
            below its query chunk's earliest document. A sparse pattern is estimated with the same mask and forces every
            document's first ``sink_tokens`` keys (:func:`~lightning_mtraining.sparsity.estimation.estimate_pattern`).
            Ops: the dense ring's FlexAttention on CUDA and the torch op mask documents; the sparse Triton kernels have
            no per-document bound yet, so a sparse ring over packed documents runs the chunked torch op
            (:class:`TorchBlockOp`) on CUDA: exact but slower (warned once).

        dense_above: compute densely each pattern head whose pattern allows more than this share of the causal pairs
            of its real sequence (``seq_len``; :func:`~lightning_mtraining.sparsity.pattern.sparse_part`: decided per
            head, the same on every rank, at every world size and under tensor parallelism), where the sparse
            kernels cost more than the dense one. When every head does, the ring runs its dense op. Default: the
            ``SparsityConfig``'s ``dense_above`` when ``sparsity`` is a config; a given ``VerticalSlashPattern`` runs
            as given unless this is set.

    Returns:
        ``[B, H, S, D]`` in q's dtype; differentiable in q, k and v.
    """
    topo = resolve_topology(group, inner_group, outer_group)
    validate_ring_inputs(q, k, v, layout, block_size, topo.cp_size)
    window = window_for_length(window, q.shape[2] * topo.cp_size)  # None when longer than the sequence
    if sparsity is None or window is not None:
        d = dense_setup(q, k, v, topo, layout, block_size, scale, window, softcap, doc_start, op)
        if topo.cp_size == 1 and hasattr(d.op, "differentiable"):  # one step: the op's own autograd, if it has one
            out = d.op.differentiable(q, k, v, d.positions[0], d.positions[0], d.scale, **d.variant)
            if out is not None:
                return out
        return RingAttentionFunction.apply(q, k, v, topo, d.positions, d.op, d.scale, None, None, d.variant, d.skips)
    scale = default_scale(q.shape[-1], scale)
    n = q.shape[2] * topo.cp_size
    positions = rank_positions(n, topo.cp_size, layout, block_size, q.device)
    given_docs = doc_start  # the estimator validates it itself, on every rank (its collectives need all of them)
    doc_start = check_doc_start(doc_start, q, positions[topo.cp_rank])  # None here: nothing to mask on this rank
    variant = attention_variant(None, softcap, doc_start)
    user_op = op is not None
    doc_skips = document_skips(positions, topo.cp_rank, doc_start) if doc_start is not None else None
    if topo.cp_size > 1 and group is None and topo.outer_size > 1:
        raise ValueError(
            "sparse hierarchical ring attention needs group= (the whole CP group, for the pattern estimator) "
            "besides inner_group and outer_group"
        )
    est_group = group if group is not None else (topo.inner_group if topo.cp_size > 1 else None)
    if isinstance(sparsity, LayerPattern):  # decided once by the caller, for this forward
        est = sparsity.estimated
        if sparsity.seq_len != n or est.batch_size != q.shape[0] or est.num_heads not in (q.shape[1], k.shape[1]):
            raise ValueError(
                f"the LayerPattern was decided for {sparsity.seq_len} tokens, batch {est.batch_size} and "
                f"{est.num_heads} pattern heads; the inputs hold {n} tokens, batch {q.shape[0]}, H={q.shape[1]}, "
                f"H_kv={k.shape[1]}: decide it for these inputs (LayerPattern.decide)"
            )
        check_sparse_layout(n, topo.cp_size, layout, block_size, sparsity.tile_size)
        layer = sparsity
    else:
        found = resolve_pattern(q, k, sparsity, group=est_group, cp_size=topo.cp_size, layout=layout,
                                block_size=block_size, seq_len=seq_len, scale=scale, layer_idx=layer_idx,
                                doc_start=given_docs)
        if dense_above is None and isinstance(sparsity, SparsityConfig):
            dense_above = sparsity.dense_above
        layer = LayerPattern.decide(found, real_lengths(seq_len, q.shape[0], n), dense_above, n)

    pattern = layer.computed
    if pattern is None:  # every head's pattern covers so much that dense attention is cheaper
        return ring_attention(q, k, v, group=group, layout=layout, block_size=block_size,
                              inner_group=inner_group, outer_group=outer_group, scale=scale, softcap=softcap,
                              doc_start=given_docs)
    op_ = variant_op(sparse_block_op(op, q.device, pattern.tile_size), None, softcap)
    if doc_start is not None:
        op_ = documents_op(op_, user_op)
    gather = verticals if topo.cp_size > 1 else "arrival"  # one rank holds every vertical already
    plan = build_step_lists(pattern, positions, topo.cp_rank, topo.sources(), q.shape[1], k.shape[1], n, gather)
    if topo.cp_size == 1 and hasattr(op_, "differentiable") and not plan.skip[0]:
        return op_.differentiable(q, k, v, positions[0], positions[0], scale, tiles=plan.lists[0], **variant)
    return RingAttentionFunction.apply(q, k, v, topo, positions, op_, scale, plan, est_group, variant, doc_skips)
