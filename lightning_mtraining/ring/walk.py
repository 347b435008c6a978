"""The ring walks: flat and hierarchical ring attention's forward and backward over a context-parallel (CP) process
group, and their autograd function.

Shape legend: B batch, H query heads, Hkv key/value heads, S local (per-rank) sequence length, D head dim,
W = cp_size. ``kv`` is K and V packed as one tensor ``[2, B, Hkv, S, D]`` so each ring step sends one message;
K/V keep their Hkv heads on the wire and in memory (never repeated to H).

The custom ops (:mod:`.dense_op`, :mod:`.sparse_op`) call the same walks.

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

Note [Gathered verticals]
-------------------------
In a sparse ring a vertical column (a key every later query attends to) would be computed at the step its key's
chunk arrives. The attention sinks all live in the first tile, on one rank, so with verticals at arrival the
step that brings that chunk is heavier for whichever rank holds it then, and every step waits for its slowest rank
(``benchmarks/imbalance.py`` counts it: the striped critical path is several percent longer with verticals at
arrival than gathered). Instead,
each layer gathers the K/V rows of the pattern's verticals from their owners (one all-reduce of
``[2, B, Hkv, NV, D]``, NV = the union of the verticals over batch rows and heads: a few MB against the ring's
chunks) and every rank computes its own queries' vertical pairs in one extra step, so vertical work follows the
query count, which the striped layout balances. Backward sums the columns' dK/dV over the ranks (one more
all-reduce) and each owner adds its rows. The per-step lists then hold tiles only; the pairs are the same.

Causality comes from global token positions (:func:`~lightning_mtraining.core.layouts.global_positions`): the block
op never computes a tile that is entirely masked and masks tokens only in partially visible tiles (the
diagonal blocks of the layout).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from lightning_mtraining.core.collectives import named_failure
from lightning_mtraining.core.numerics import acc_dtype
from lightning_mtraining.core.topology import RingTopology
from lightning_mtraining.ring import trace as ring_trace
from lightning_mtraining.ring.block_ops import BlockAttentionOp
from lightning_mtraining.ring.steps import StepLists, backward_step, forward_step, lists_for_step

__all__ = ["RingAttentionFunction", "gather_vertical_kv", "gathered_backward", "ring_backward", "ring_forward"]


class _Exchange:
    """One posted ring transfer: ``send`` goes to the next rank, the returned buffer comes from the previous."""

    def __init__(self, send: torch.Tensor, group: dist.ProcessGroup | None, rank: int, size: int, level: str) -> None:
        self.recv, self.level = torch.empty_like(send), level
        assert group is not None  # a ring of one rank posts no transfer; a longer one has its group
        nxt = dist.get_global_rank(group, (rank + 1) % size)
        prv = dist.get_global_rank(group, (rank - 1) % size)
        ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, self.recv, prv, group)]
        self.peers = (f"send of {tuple(send.shape)} to rank {nxt}", f"receive of {tuple(send.shape)} from rank {prv}")
        with named_failure(f"ring attention's transfers to rank {nxt} and from rank {prv}"):
            self.works = dist.batch_isend_irecv(ops)
        ring_trace.sent(level, send)  # instrumentation (ring_trace.py): a no-op unless a RingTrace is active

    def wait(self) -> torch.Tensor:
        with ring_trace.waiting(self.level):
            for w, what in zip(self.works, self.peers):
                with named_failure(f"ring attention's {what}"):
                    w.wait()
        return self.recv


def _inner(topo: RingTopology, send: torch.Tensor) -> _Exchange:
    return _Exchange(send, topo.inner_group, topo.inner_rank, topo.inner_size, "inner")


def _outer(topo: RingTopology, send: torch.Tensor) -> _Exchange:
    return _Exchange(send, topo.outer_group, topo.outer_rank, topo.outer_size, "outer")


def _walk(kv: torch.Tensor, topo: RingTopology) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(source cp rank, kv chunk)`` per step; the next step's transfers are posted before each yield."""
    outer_kv = kv
    for so in range(topo.outer_size):
        ring_trace.step()  # a step starts before its transfers are posted
        outer_pending = _outer(topo, outer_kv) if so < topo.outer_size - 1 else None
        cur = outer_kv
        for si in range(topo.inner_size):
            if si:
                ring_trace.step()
            inner_pending = _inner(topo, cur) if si < topo.inner_size - 1 else None
            yield topo.source(so, si), cur
            if inner_pending is not None:
                cur = inner_pending.wait()
        if outer_pending is not None:
            outer_kv = outer_pending.wait()


def gather_vertical_kv(kv: torch.Tensor, plan: StepLists, group, cp_size: int) -> torch.Tensor:
    """``[2, B, Hkv, NV, D]``: the K/V rows of the pattern's vertical keys, from the ranks that own them (exact:
    each row is summed from one owner and zeros)."""
    assert plan.owned is not None  # set together with vert_pos (Note [Gathered verticals])
    local, mine = plan.owned
    rows = kv.index_select(3, local) * mine.view(1, 1, 1, -1, 1).to(kv.dtype)
    if cp_size > 1:
        rows = rows.contiguous()
        ring_trace.sent("collective", rows)
        with named_failure(f"ring attention's all-reduce of the vertical keys' K/V {tuple(rows.shape)}"), \
                ring_trace.waiting("collective"):
            dist.all_reduce(rows, group=group)
    return rows


def ring_forward(q, kv, topo: RingTopology, positions, op: BlockAttentionOp, scale: float, plan=None,
                  group=None, variant: dict | None = None, skip_dense: dict[int, bool] | None = None):
    with ring_trace.call("fwd", plan is not None, q.device):
        state = None
        for src, cur in _walk(kv, topo):
            tiles, skip = lists_for_step(plan, src, skip_dense)
            with ring_trace.compute():
                state = forward_step(state, op, q, cur, positions[topo.cp_rank], positions[src], scale, tiles, skip,
                                     variant)
        if plan is not None and plan.vert_pos is not None:  # Note [Gathered verticals]
            ring_trace.step("vertical")
            kv_v = gather_vertical_kv(kv, plan, group, topo.cp_size)
            with ring_trace.compute():
                state = forward_step(state, op, q, kv_v, positions[topo.cp_rank], plan.vert_pos, scale, plan.gathered,
                                     plan.gathered_skip, variant)
            return state, kv_v
    return state, None


def ring_backward(dout, q, kv, out, lse, topo: RingTopology, positions, op: BlockAttentionOp, scale: float,
                   plan=None, variant: dict | None = None, skip_dense: dict[int, bool] | None = None):
    with ring_trace.call("bwd", plan is not None, q.device):
        adt = acc_dtype(q.dtype)
        q_pos = positions[topo.cp_rank]
        dq = torch.zeros(q.shape, dtype=adt, device=q.device)
        Wi, Wo = topo.inner_size, topo.outer_size
        outer_kv = kv
        outer_dkv: _Exchange | None = None
        total: torch.Tensor | None = None
        for so in range(Wo):
            ring_trace.step()  # a step starts before its transfers are posted
            outer_kv_pending = _outer(topo, outer_kv) if so < Wo - 1 else None
            cur = outer_kv
            inner_dkv: _Exchange | None = None
            for si in range(Wi):  # at least one step: dkv is set below
                if si:
                    ring_trace.step()
                kv_pending = _inner(topo, cur) if si < Wi - 1 else None
                src = topo.source(so, si)
                tiles, skip = lists_for_step(plan, src, skip_dense)
                with ring_trace.compute():
                    dkv = backward_step(dq, op, q, cur, out, lse, dout, q_pos, positions[src], scale, tiles, skip,
                                        variant)
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
    assert total is not None  # the one node's sum, or the sum the outer ring returned
    return dq, total[0], total[1]


def gathered_backward(dq, q, kv_v, out, lse, dout, q_pos, plan: StepLists, op, scale, group, cp_size: int, dk, dv,
                       variant: dict | None = None):
    """The gathered vertical step's backward: dq here, the columns' dK/dV summed over the ranks and added by their
    owners (Note [Gathered verticals])."""
    with ring_trace.call("bwd", True, q.device, first_index=cp_size):
        ring_trace.step("vertical")
        with ring_trace.compute():
            dkv_v = backward_step(dq, op, q, kv_v, out, lse, dout, q_pos, plan.vert_pos, scale, plan.gathered,
                                  plan.gathered_skip, variant)
        if cp_size > 1:
            ring_trace.sent("collective", dkv_v)
            with named_failure(f"ring attention's all-reduce of the vertical keys' dK/dV {tuple(dkv_v.shape)}"), \
                    ring_trace.waiting("collective"):
                dist.all_reduce(dkv_v, group=group)
    assert plan.owned is not None  # set together with vert_pos (Note [Gathered verticals])
    local, mine = plan.owned
    keep = mine.view(1, 1, 1, -1, 1).to(dkv_v.dtype)
    dk.index_add_(2, local, (dkv_v[0] * keep[0]).to(dk.dtype))
    dv.index_add_(2, local, (dkv_v[1] * keep[0]).to(dv.dtype))


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, topo, positions, op, scale, plan, group, variant=None, skip_dense=None):
        kv = torch.stack([k, v])
        (out_acc, lse), kv_v = ring_forward(q, kv, topo, positions, op, scale, plan, group, variant, skip_dense)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse, kv_v)
        ctx.topo, ctx.positions, ctx.op, ctx.scale, ctx.plan, ctx.group = topo, positions, op, scale, plan, group
        ctx.variant, ctx.skip_dense = variant, skip_dense
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, kv_v = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ring_backward(dout, q, kv, out, lse, ctx.topo, ctx.positions, ctx.op, ctx.scale, ctx.plan,
                                    ctx.variant, ctx.skip_dense)
        if kv_v is not None:
            gathered_backward(dq, q, kv_v, out, lse, dout, ctx.positions[ctx.topo.cp_rank], ctx.plan, ctx.op,
                               ctx.scale, ctx.group, ctx.topo.cp_size, dk, dv, ctx.variant)
        return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype), None, None, None, None, None, None, None, None
