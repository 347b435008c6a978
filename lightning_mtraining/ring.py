"""Ring attention over a context-parallel (CP) process group: flat and hierarchical, forward and backward.

Shape legend: B batch, H query heads, Hkv key/value heads, S local (per-rank) sequence length, D head dim,
W = cp_size. ``kv`` is K and V packed as one tensor ``[2, B, Hkv, S, D]`` so each ring step sends one message;
K/V keep their Hkv heads on the wire and in memory (never repeated to H).

Note [Ring schedule]
--------------------
CP ranks are numbered ``cp_rank = outer_rank * inner_size + inner_rank`` (outer = node, inner = GPU in node).
A flat ring is the case ``outer_size == 1``. Every rank starts with its own K/V chunk. At outer step ``so`` a
rank holds the chunk of node ``outer_rank - so``; it first *posts* the transfer of that chunk to the next node
(slow link), then runs a whole inner ring over it (fast link), and only then waits for the outer transfer::

      outer step 0                 outer step 1              ...
    +--------------------------+ +--------------------------+
    | post outer send/recv  ---+-+--> wait                   |
    | inner step 0: compute    | | inner step 0: compute    |
    |   (inner send/recv posted| |   ...                    |
    |    before compute)       | |                          |
    | inner step 1: compute    | |                          |
    +--------------------------+ +--------------------------+

    rank (o, i) at (so, si) computes against the chunk of rank ((o - so) mod Wo, (i - si) mod Wi)

Step (0, 0) is always the rank's own chunk (the causal diagonal), so every query row has a finite log-sum-exp
after the first step. Every other step's transfer is posted before the step's compute and waited after it.

Backward re-walks the same schedule with K/V; the dK/dV accumulated for a chunk travel with it around the
inner ring (float32), return to the rank that started the inner ring with it, and then travel with the outer
transfer (posted after the inner ring, waited at the end of the next outer step: hidden behind its compute).
After the last step each rank receives the complete dK/dV of its own chunk.

Causality comes from global token positions (:func:`~lightning_mtraining.layouts.global_positions`): the block
op never computes a tile that is entirely masked and masks tokens only in partially visible tiles (the
diagonal blocks of the layout).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator

import torch
import torch.distributed as dist

from lightning_mtraining.attention_ops import (
    BlockAttentionOp,
    acc_dtype,
    default_block_op,
    default_scale,
    merge_attention,
)
from lightning_mtraining.layouts import LAYOUTS, global_positions, layout_unit

__all__ = ["RingTopology", "backward_step", "forward_step", "resolve_topology", "ring_attention"]


@dataclasses.dataclass(frozen=True)
class RingTopology:
    """Where this rank sits in the (outer x inner) ring, and the process groups of each ring."""

    inner_rank: int
    inner_size: int
    outer_rank: int
    outer_size: int
    inner_group: dist.ProcessGroup | None = None
    outer_group: dist.ProcessGroup | None = None

    @property
    def cp_rank(self) -> int:
        return self.outer_rank * self.inner_size + self.inner_rank

    @property
    def cp_size(self) -> int:
        return self.outer_size * self.inner_size

    def source(self, outer_step: int, inner_step: int) -> int:
        """CP rank whose K/V chunk this rank holds at (outer_step, inner_step)."""
        o = (self.outer_rank - outer_step) % self.outer_size
        i = (self.inner_rank - inner_step) % self.inner_size
        return o * self.inner_size + i

    def sources(self) -> list[int]:
        """CP ranks whose chunk is computed at each step, in schedule order (the first is always cp_rank)."""
        return [self.source(so, si) for so in range(self.outer_size) for si in range(self.inner_size)]


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def resolve_topology(
    group: dist.ProcessGroup | None = None,
    inner_group: dist.ProcessGroup | None = None,
    outer_group: dist.ProcessGroup | None = None,
) -> RingTopology:
    """The ring topology from a flat CP group, or from an inner (intra-node) and outer (inter-node) group."""
    if (inner_group is None) != (outer_group is None):
        raise ValueError(
            "hierarchical ring attention needs both inner_group (ranks of one node) and outer_group (same "
            f"local rank across nodes); got inner_group={inner_group!r}, outer_group={outer_group!r}"
        )
    if inner_group is not None:
        inner_rank, inner_size = _group_rank_size(inner_group)
        outer_rank, outer_size = _group_rank_size(outer_group)
        topo = RingTopology(inner_rank, inner_size, outer_rank, outer_size, inner_group, outer_group)
        if group is not None:
            rank, size = _group_rank_size(group)
            if (rank, size) != (topo.cp_rank, topo.cp_size):
                raise ValueError(
                    f"group rank/size ({rank}/{size}) disagree with the hierarchical rings: outer rank "
                    f"{outer_rank}/{outer_size} x inner rank {inner_rank}/{inner_size} gives CP rank "
                    f"{topo.cp_rank}/{topo.cp_size}; CP ranks must be numbered outer_rank * inner_size + inner_rank"
                )
        return topo
    if group is None and not dist.is_initialized():
        return RingTopology(0, 1, 0, 1)
    rank, size = _group_rank_size(group)
    return RingTopology(rank, size, 0, 1, inner_group=group if group is not None else dist.group.WORLD)


class _Exchange:
    """One posted ring transfer: ``send`` goes to the next rank, the returned buffer comes from the previous."""

    def __init__(self, send: torch.Tensor, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.recv = torch.empty_like(send)
        nxt = dist.get_global_rank(group, (rank + 1) % size)
        prv = dist.get_global_rank(group, (rank - 1) % size)
        ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, self.recv, prv, group)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.recv


def _inner(topo: RingTopology, send: torch.Tensor) -> _Exchange:
    return _Exchange(send, topo.inner_group, topo.inner_rank, topo.inner_size)


def _outer(topo: RingTopology, send: torch.Tensor) -> _Exchange:
    return _Exchange(send, topo.outer_group, topo.outer_rank, topo.outer_size)


def _walk(kv: torch.Tensor, topo: RingTopology) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(source cp rank, kv chunk)`` per step; the next step's transfers are posted before each yield."""
    outer_kv = kv
    for so in range(topo.outer_size):
        outer_pending = _outer(topo, outer_kv) if so < topo.outer_size - 1 else None
        cur = outer_kv
        for si in range(topo.inner_size):
            inner_pending = _inner(topo, cur) if si < topo.inner_size - 1 else None
            yield topo.source(so, si), cur
            if inner_pending is not None:
                cur = inner_pending.wait()
        if outer_pending is not None:
            outer_kv = outer_pending.wait()


def forward_step(state, op: BlockAttentionOp, q, kv_chunk, q_pos, k_pos, scale: float):
    """One ring step of the forward: attend to ``kv_chunk`` and merge into ``state = (out, lse)`` (or start it).

    Shared by the real ring and :mod:`lightning_mtraining.simulated`, so both have the same numerics.
    """
    blk_out, blk_lse = op.forward(q, kv_chunk[0], kv_chunk[1], q_pos, k_pos, scale)
    if state is None:  # step (0, 0): this rank's own chunk
        adt = acc_dtype(q.dtype)
        return blk_out.to(adt), blk_lse.to(adt)
    return merge_attention(state[0], state[1], blk_out, blk_lse)


def backward_step(dq, op: BlockAttentionOp, q, kv_chunk, out, lse, dout, q_pos, k_pos, scale: float) -> torch.Tensor:
    """One ring step of the backward: adds this block's dq into ``dq``, returns its packed ``[2, ...]`` dK/dV."""
    adt = acc_dtype(q.dtype)
    dq_b, dk_b, dv_b = op.backward(q, kv_chunk[0], kv_chunk[1], out, lse, dout, q_pos, k_pos, scale)
    dq += dq_b
    return torch.stack([dk_b.to(adt), dv_b.to(adt)])


def _ring_forward(q, kv, topo: RingTopology, positions, op: BlockAttentionOp, scale: float):
    state = None
    for src, cur in _walk(kv, topo):
        state = forward_step(state, op, q, cur, positions[topo.cp_rank], positions[src], scale)
    return state


def _ring_backward(dout, q, kv, out, lse, topo: RingTopology, positions, op: BlockAttentionOp, scale: float):
    adt = acc_dtype(q.dtype)
    q_pos = positions[topo.cp_rank]
    dq = torch.zeros(q.shape, dtype=adt, device=q.device)
    Wi, Wo = topo.inner_size, topo.outer_size
    outer_kv = kv
    outer_dkv: _Exchange | None = None
    total: torch.Tensor | None = None
    for so in range(Wo):
        outer_kv_pending = _outer(topo, outer_kv) if so < Wo - 1 else None
        cur = outer_kv
        inner_dkv: _Exchange | None = None
        dkv = None
        for si in range(Wi):
            kv_pending = _inner(topo, cur) if si < Wi - 1 else None
            dkv = backward_step(dq, op, q, cur, out, lse, dout, q_pos, positions[topo.source(so, si)], scale)
            if inner_dkv is not None:  # what the previous ranks of the inner ring accumulated for this chunk
                dkv += inner_dkv.wait()
            if Wi > 1:  # on to the next rank; after the last step this returns the chunk to its starter
                inner_dkv = _inner(topo, dkv)
            if kv_pending is not None:
                cur = kv_pending.wait()
        node_dkv = inner_dkv.wait() if Wi > 1 else dkv  # this node's sum for the outer chunk held at step so
        if outer_dkv is not None:  # what earlier nodes accumulated for the same chunk
            node_dkv = node_dkv + outer_dkv.wait()
        if Wo > 1:
            outer_dkv = _outer(topo, node_dkv)
        else:
            total = node_dkv
        if outer_kv_pending is not None:
            outer_kv = outer_kv_pending.wait()
    if Wo > 1:
        total = outer_dkv.wait()
    return dq, total[0], total[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, topo, positions, op, scale):
        kv = torch.stack([k, v])
        out_acc, lse = _ring_forward(q, kv, topo, positions, op, scale)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.topo, ctx.positions, ctx.op, ctx.scale = topo, positions, op, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, kv, out, lse, ctx.topo, ctx.positions, ctx.op, ctx.scale)
        return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype), None, None, None, None


@functools.lru_cache(maxsize=64)
def _positions(n: int, cp_size: int, layout: str, block_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every CP rank's global positions; cached so that every layer and step sees the same tensors (which lets
    block ops cache what they derive from them, such as FlexAttention BlockMasks)."""
    return tuple(global_positions(n, r, cp_size, layout, block_size, device=device) for r in range(cp_size))


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, block_size: int, cp_size: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    B, H, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on batch, local sequence length and head dim"
        )
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    unit = layout_unit(layout, cp_size, block_size)
    if S == 0 or (S * cp_size) % unit:
        raise ValueError(
            f"local sequence length {S} on {cp_size} ranks gives {S * cp_size} tokens, not a positive multiple of "
            f"the {layout} layout's unit {unit}; pad the full sequence to a multiple of {unit} before sharding "
            f"(the strategy does this for you)"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "striped",
    block_size: int = 128,
    sparsity=None,
    inner_group: dist.ProcessGroup | None = None,
    outer_group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    op: BlockAttentionOp | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's query shard against the whole (sharded) sequence.

    Args:
        q: ``[B, H, S, D]`` this rank's queries, in ``layout``.
        k, v: ``[B, Hkv, S, D]`` this rank's keys/values (H divisible by Hkv; never repeated).
        group: the CP process group (default: the default group; none initialised means world size 1).
        layout, block_size: how the sequence was sharded (:mod:`lightning_mtraining.layouts`).
        sparsity: a ``SparsityConfig`` for sparse ring attention, or None for dense (exact) attention.
        inner_group, outer_group: intra-node and inter-node rings for hierarchical ring attention; CP ranks
            must be numbered ``outer_rank * inner_size + inner_rank``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        op: the per-block attention op (default: FlexAttention on CUDA, chunked torch elsewhere).

    Returns:
        ``[B, H, S, D]`` in q's dtype; differentiable in q, k and v.
    """
    if sparsity is not None:
        raise NotImplementedError(
            "sparse ring attention (sparsity=SparsityConfig(...)) is not implemented yet: it needs the online "
            "vertical-slash pattern estimator and the sparse ring on top of the Triton kernels; pass sparsity=None "
            "for exact dense ring attention"
        )
    topo = resolve_topology(group, inner_group, outer_group)
    _validate(q, k, v, layout, block_size, topo.cp_size)
    scale = default_scale(q.shape[-1], scale)
    op = default_block_op(q.device) if op is None else op
    positions = _positions(q.shape[2] * topo.cp_size, topo.cp_size, layout, block_size, q.device)
    if topo.cp_size == 1 and hasattr(op, "differentiable"):
        return op.differentiable(q, k, v, positions[0], positions[0], scale)
    return _RingAttention.apply(q, k, v, topo, positions, op, scale)
