"""Ring attention over a context-parallel (CP) process group: flat and hierarchical, forward and backward.

Shape legend: B batch, H query heads, Hkv key/value heads, S local (per-rank) sequence length, D head dim,
W = cp_size. ``kv`` is K and V packed as one tensor ``[2, B, Hkv, S, D]`` so each ring step sends one message;
K/V keep their Hkv heads on the wire and in memory (never repeated to H).

Why one file of ~740 lines: the forward and backward walks, the step functions the simulated ring shares, and the
setup that decides what each step runs (pattern -> per-step lists, the steps windows and documents skip, the variant
op) all follow Note [Ring schedule]; the custom ops (``ring_op``, ``sparse_ring_op``) call the same setup and walks.

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
(``benchmarks/RESULTS.md``, Balance: striped critical path 1.059 at W=32, 512K, against 1.005 gathered). Instead,
each layer gathers the K/V rows of the pattern's verticals from their owners (one all-reduce of
``[2, B, Hkv, NV, D]``, NV = the union of the verticals over batch rows and heads: a few MB against the ring's
chunks) and every rank computes its own queries' vertical pairs in one extra step, so vertical work follows the
query count, which the striped layout balances. Backward sums the columns' dK/dV over the ranks (one more
all-reduce) and each owner adds its rows. The per-step lists then hold tiles only; the pairs are the same.

Causality comes from global token positions (:func:`~lightning_mtraining.layouts.global_positions`): the block
op never computes a tile that is entirely masked and masks tokens only in partially visible tiles (the
diagonal blocks of the layout).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Iterator

import torch
import torch.distributed as dist

from lightning_mtraining import ring_trace
from lightning_mtraining._profiling import ATTENTION, LISTS, profiled
from lightning_mtraining.attention_ops import (
    BlockAttentionOp,
    TorchBlockOp,
    acc_dtype,
    default_block_op,
    default_scale,
    merge_attention,
)
from lightning_mtraining.collectives import named_failure
from lightning_mtraining.estimation import estimate_pattern
from lightning_mtraining.layouts import (
    check_attention_inputs,
    check_doc_start,
    check_local_length,
    global_positions,
)
from lightning_mtraining.pattern import SparsityConfig, VerticalSlashPattern
from mtraining_kernels.indexing import (
    TileLists,
    check_tile_aligned,
    lists_have_work,
    prepare_pattern_tiles,
    step_tile_lists,
    step_tile_lists_batched,
)

__all__ = [
    "RingTopology",
    "StepLists",
    "attention_variant",
    "backward_step",
    "build_step_lists",
    "forward_step",
    "resolve_pattern",
    "resolve_topology",
    "ring_attention",
    "window_skips",
]


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

    def __init__(self, send: torch.Tensor, group: dist.ProcessGroup | None, rank: int, size: int, level: str) -> None:
        self.recv, self.level = torch.empty_like(send), level
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


class StepLists:
    """What each ring step computes under a sparse pattern: the tile lists per source CP rank (None: dense ring).

    ``lists[src]`` are this rank's queries against rank ``src``'s key chunk (:func:`step_tile_lists`), built once per
    layer in the forward and reused by the backward; ``skip[src]`` is True when they hold no pair at all, and the
    step then computes nothing (its K/V still travel on, for the ranks after it).

    Gathered verticals (Note [Gathered verticals]): ``vert_pos`` are the pattern's vertical key positions (the union
    over batch rows and heads), ``gathered`` the column-only lists of this rank's queries against them, and
    ``owned`` (this rank's local indices of them, which of them it owns); the per-step lists then hold tiles only.
    """

    def __init__(self, lists: dict[int, TileLists], skip: dict[int, bool], vert_pos: torch.Tensor | None = None,
                 gathered: TileLists | None = None, gathered_skip: bool = True,
                 owned: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.lists, self.skip = lists, skip
        self.vert_pos, self.gathered, self.gathered_skip, self.owned = vert_pos, gathered, gathered_skip, owned

    def for_source(self, src: int) -> tuple[TileLists | None, bool]:
        return self.lists.get(src), self.skip.get(src, False)


@profiled(ATTENTION)
def forward_step(state, op: BlockAttentionOp, q, kv_chunk, q_pos, k_pos, scale: float, tiles=None, skip=False,
                 variant: dict | None = None):
    """One ring step of the forward: attend to ``kv_chunk`` and merge into ``state = (out, lse)`` (or start it).

    ``tiles``: the step's sparse lists (None: dense causal); ``skip``: the step has no allowed pair, nothing runs;
    ``variant``: the op's ``window=`` / ``softcap=`` keywords (:func:`attention_variant`).
    Shared by the real ring and :mod:`lightning_mtraining.simulated`, so both have the same numerics.
    """
    adt = acc_dtype(q.dtype)
    if skip:
        if state is None:
            return (torch.zeros(q.shape, dtype=adt, device=q.device),
                    torch.full(q.shape[:3], float("-inf"), dtype=adt, device=q.device))
        return state
    kw = dict(variant or {})
    if tiles is not None:
        kw["tiles"] = tiles
    blk_out, blk_lse = op.forward(q, kv_chunk[0], kv_chunk[1], q_pos, k_pos, scale, **kw)
    if state is None:  # step (0, 0): this rank's own chunk
        return blk_out.to(adt), blk_lse.to(adt)
    return merge_attention(state[0], state[1], blk_out, blk_lse)


@profiled(ATTENTION)
def backward_step(dq, op: BlockAttentionOp, q, kv_chunk, out, lse, dout, q_pos, k_pos, scale: float, tiles=None,
                  skip=False, variant: dict | None = None) -> torch.Tensor:
    """One ring step of the backward: adds this block's dq into ``dq``, returns its packed ``[2, ...]`` dK/dV."""
    adt = acc_dtype(q.dtype)
    if skip:
        return torch.zeros((2, *kv_chunk.shape[1:]), dtype=adt, device=q.device)
    kw = dict(variant or {})
    if tiles is not None:
        kw["tiles"] = tiles
    dq_b, dk_b, dv_b = op.backward(q, kv_chunk[0], kv_chunk[1], out, lse, dout, q_pos, k_pos, scale, **kw)
    dq += dq_b
    return torch.stack([dk_b.to(adt), dv_b.to(adt)])


def _step(plan: StepLists | None, src: int, skip_dense: dict[int, bool] | None = None) -> tuple[TileLists | None, bool]:
    """The step's lists and whether it computes nothing: ``skip_dense`` (window or document skips) holds for the
    dense and the sparse ring alike."""
    extra = bool(skip_dense and skip_dense.get(src, False))
    if plan is None:
        return None, extra
    tiles, skip = plan.for_source(src)
    return tiles, skip or extra


def document_skips(positions: tuple[torch.Tensor, ...], cp_rank: int, doc_start: torch.Tensor) -> dict[int, bool]:
    """For packed documents: which source ranks' chunks hold no key of any of this rank's queries' documents
    (``doc_start[b, q] <= k <= q`` for no row), so their ring steps compute nothing. One host sync."""
    q_pos = positions[cp_rank]
    lo = doc_start.reshape(-1, q_pos.shape[0])
    hits = []
    for k_pos in positions:
        hi = torch.searchsorted(k_pos, q_pos, right=True)  # keys <= q
        first = torch.searchsorted(k_pos, lo.contiguous())  # first key >= the document's start
        hits.append((hi[None, :] > first).any())
    work = torch.stack(hits).tolist()
    return {src: not w for src, w in enumerate(work)}


def _merge_skips(a: dict[int, bool] | None, b: dict[int, bool] | None) -> dict[int, bool] | None:
    if a is None or b is None:
        return a if b is None else b
    return {src: a.get(src, False) or b.get(src, False) for src in set(a) | set(b)}


def window_skips(positions: tuple[torch.Tensor, ...], cp_rank: int, window: int | None) -> dict[int, bool] | None:
    """For a sliding-window layer: which source ranks' chunks hold no key inside this rank's queries' windows
    (their ring steps compute nothing). None without a window."""
    if window is None:
        return None
    q_pos = positions[cp_rank]
    out = {}
    for src, k_pos in enumerate(positions):
        # a query q sees a key iff q - window < k <= q: count the chunk's keys in (q - window, q] for every q
        hi = torch.searchsorted(k_pos, q_pos, right=True)
        lo = torch.searchsorted(k_pos, q_pos - window, right=True)
        out[src] = not bool((hi > lo).any())
    return out


@functools.lru_cache(maxsize=256)
def _window_skips_cached(n: int, cp_size: int, layout: str, block_size: int, cp_rank: int,
                         window: int | None) -> dict[int, bool] | None:
    """:func:`window_skips` from host positions, once per shape (no device sync in each layer's forward)."""
    return window_skips(_positions(n, cp_size, layout, block_size, torch.device("cpu")), cp_rank, window)


def _gather_vertical_kv(kv: torch.Tensor, plan: StepLists, group, cp_size: int) -> torch.Tensor:
    """``[2, B, Hkv, NV, D]``: the K/V rows of the pattern's vertical keys, from the ranks that own them (exact:
    each row is summed from one owner and zeros)."""
    local, mine = plan.owned
    rows = kv.index_select(3, local) * mine.view(1, 1, 1, -1, 1).to(kv.dtype)
    if cp_size > 1:
        rows = rows.contiguous()
        ring_trace.sent("collective", rows)
        with named_failure(f"ring attention's all-reduce of the vertical keys' K/V {tuple(rows.shape)}"), \
                ring_trace.waiting("collective"):
            dist.all_reduce(rows, group=group)
    return rows


def _ring_forward(q, kv, topo: RingTopology, positions, op: BlockAttentionOp, scale: float, plan=None,
                  group=None, variant: dict | None = None, skip_dense: dict[int, bool] | None = None):
    with ring_trace.call("fwd", plan is not None, q.device):
        state = None
        for src, cur in _walk(kv, topo):
            tiles, skip = _step(plan, src, skip_dense)
            with ring_trace.compute():
                state = forward_step(state, op, q, cur, positions[topo.cp_rank], positions[src], scale, tiles, skip,
                                     variant)
        if plan is not None and plan.vert_pos is not None:  # Note [Gathered verticals]
            ring_trace.step("vertical")
            kv_v = _gather_vertical_kv(kv, plan, group, topo.cp_size)
            with ring_trace.compute():
                state = forward_step(state, op, q, kv_v, positions[topo.cp_rank], plan.vert_pos, scale, plan.gathered,
                                     plan.gathered_skip, variant)
            return state, kv_v
    return state, None


def _ring_backward(dout, q, kv, out, lse, topo: RingTopology, positions, op: BlockAttentionOp, scale: float,
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
            dkv = None
            for si in range(Wi):
                if si:
                    ring_trace.step()
                kv_pending = _inner(topo, cur) if si < Wi - 1 else None
                src = topo.source(so, si)
                tiles, skip = _step(plan, src, skip_dense)
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
    return dq, total[0], total[1]


def _gathered_backward(dq, q, kv_v, out, lse, dout, q_pos, plan: StepLists, op, scale, group, cp_size: int, dk, dv,
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
    local, mine = plan.owned
    keep = mine.view(1, 1, 1, -1, 1).to(dkv_v.dtype)
    dk.index_add_(2, local, (dkv_v[0] * keep[0]).to(dk.dtype))
    dv.index_add_(2, local, (dkv_v[1] * keep[0]).to(dv.dtype))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, topo, positions, op, scale, plan, group, variant=None, skip_dense=None):
        kv = torch.stack([k, v])
        (out_acc, lse), kv_v = _ring_forward(q, kv, topo, positions, op, scale, plan, group, variant, skip_dense)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse, kv_v)
        ctx.topo, ctx.positions, ctx.op, ctx.scale, ctx.plan, ctx.group = topo, positions, op, scale, plan, group
        ctx.variant, ctx.skip_dense = variant, skip_dense
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, kv_v = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _ring_backward(dout, q, kv, out, lse, ctx.topo, ctx.positions, ctx.op, ctx.scale, ctx.plan,
                                    ctx.variant, ctx.skip_dense)
        if kv_v is not None:
            _gathered_backward(dq, q, kv_v, out, lse, dout, ctx.positions[ctx.topo.cp_rank], ctx.plan, ctx.op,
                               ctx.scale, ctx.group, ctx.topo.cp_size, dk, dv, ctx.variant)
        return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype), None, None, None, None, None, None, None, None


@functools.lru_cache(maxsize=16)
def _default_block_op(device: torch.device) -> BlockAttentionOp:
    """The dense ring's default block op, one per device: FlexAttention's BlockMasks (cached by the op, keyed by
    the :func:`_positions` tensors) are then built once per layout and shape, not again in every layer's call."""
    return default_block_op(device)


@functools.lru_cache(maxsize=64)
def _positions(n: int, cp_size: int, layout: str, block_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every CP rank's global positions; cached so that every layer and step sees the same tensors (which lets
    block ops cache what they derive from them, such as FlexAttention BlockMasks)."""
    return tuple(global_positions(n, r, cp_size, layout, block_size, device=device) for r in range(cp_size))


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, block_size: int, cp_size: int) -> None:
    check_attention_inputs(q, k, v)
    check_local_length(q.shape[2], cp_size, layout, block_size)


@functools.lru_cache(maxsize=64)
def _check_sparse_layout(n: int, cp_size: int, layout: str, block_size: int, tile: int) -> None:
    """Sparse rings run T x T tiles: every rank's shard must hold whole, aligned global tiles (checked on the host,
    once per layout)."""
    for r in range(cp_size):
        pos = global_positions(n, r, cp_size, layout, block_size)
        if not check_tile_aligned(pos, tile):
            hint = {
                "striped": f"use block_size a multiple of the tile ({tile})",
                "contiguous": f"pad the sequence to a multiple of {cp_size * tile} (cp_size x tile)",
                "zigzag": f"pad the sequence to a multiple of {2 * cp_size * tile} (2 x cp_size x tile)",
            }[layout]
            raise ValueError(
                f"sparse ring attention runs {tile} x {tile} tiles, but the {layout} layout (block_size={block_size}) "
                f"of {n} tokens on {cp_size} ranks does not give rank {r} whole tiles: {hint}, or change "
                "SparsityConfig.tile_size / the pattern's tile_size"
            )


def resolve_pattern(
    q: torch.Tensor,
    k: torch.Tensor,
    sparsity: SparsityConfig | VerticalSlashPattern,
    *,
    group: dist.ProcessGroup | None,
    cp_size: int,
    layout: str,
    block_size: int,
    seq_len=None,
    scale: float | None = None,
    layer_idx: int | None = None,
    doc_start: torch.Tensor | None = None,
) -> VerticalSlashPattern:
    """The layer's global pattern: estimated online from a ``SparsityConfig``, or a given pattern, validated."""
    n = q.shape[2] * cp_size
    if isinstance(sparsity, SparsityConfig):
        pattern = estimate_pattern(q, k, sparsity, group=group, layout=layout, block_size=block_size,
                                   seq_len=seq_len, scale=scale, layer_idx=layer_idx, doc_start=doc_start)
    elif isinstance(sparsity, VerticalSlashPattern):
        pattern = sparsity.to(q.device) if sparsity.device != q.device else sparsity
        pattern.validate(n, q.shape[1], k.shape[1], batch_size=q.shape[0])
    else:
        raise TypeError(
            f"sparsity must be None (dense ring attention), a SparsityConfig (estimated online) or a "
            f"VerticalSlashPattern (used as given); got {type(sparsity).__name__}"
        )
    _check_sparse_layout(n, cp_size, layout, block_size, pattern.tile_size)  # one rank too: whole tiles
    return pattern


@profiled(LISTS)
def build_step_lists(pattern: VerticalSlashPattern, positions, cp_rank: int, sources, num_heads: int,
                     num_kv_heads: int, n: int, verticals: str = "arrival") -> StepLists:
    """This rank's lists for every ring step (queries at ``positions[cp_rank]`` against each source's keys).

    ``verticals="gathered"``: the per-step lists hold tiles only, and the vertical columns are computed in one extra
    step against their gathered K/V (Note [Gathered verticals]); ``"arrival"``: each vertical at the step its key's
    chunk arrives. One host sync for the pattern's list widths and one for which steps have any work."""
    if verticals not in ("arrival", "gathered"):
        raise ValueError(f"verticals must be 'gathered' or 'arrival', got {verticals!r}")
    full = pattern.expand(num_heads, num_kv_heads)
    pt = prepare_pattern_tiles(full.vertical_idx, full.slash_idx, n, pattern.tile_size)
    q_pos = positions[cp_rank]
    gather = verticals == "gathered" and pt.verticals.numel() > 0
    # every step's lists in one builder call (one Triton launch on CUDA)
    built = step_tile_lists_batched(pt, q_pos, torch.stack([positions[src] for src in sources]), columns=not gather)
    lists = dict(zip(sources, built))
    flags = [lists_have_work(lists[src]) for src in sources]
    vert_pos = gathered = owned = None
    if gather:
        v = pt.verticals.to(q_pos.device)
        vert_pos = torch.unique(v[v < pt.big])  # sorted union over batch rows and heads
        gathered = step_tile_lists(pt, q_pos, vert_pos, tiles=False)
        flags.append(lists_have_work(gathered))
        local = torch.searchsorted(q_pos, vert_pos).clamp(max=q_pos.numel() - 1)
        owned = (local, q_pos[local] == vert_pos)
    work = torch.stack(flags).tolist()
    return StepLists(lists, {src: not w for src, w in zip(sources, work)}, vert_pos, gathered,
                     not work[-1] if gather else True, owned)


def attention_variant(window: int | None = None, softcap: float | None = None,
                      doc_start: torch.Tensor | None = None) -> dict:
    """The block op keywords of an attention variant (only those set: plain causal attention passes none)."""
    return {k: v for k, v in (("window", window), ("softcap", softcap), ("doc_start", doc_start)) if v is not None}


def _check_window(window: int | None, n: int) -> int | None:
    """A valid window, or None when it spans the whole (padded) sequence and so masks nothing."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (query q sees key k iff q - window < k <= q), got {window!r}")
    return None if window >= n else window


_warned_documents: set[str] = set()


def _documents_op(op: BlockAttentionOp, given: bool) -> BlockAttentionOp:
    """An op that computes packed documents: ``op`` if it does; the chunked torch op in place of a default op that
    does not (the sparse Triton kernels have no per-row document bound yet; warned once per op type, since it is
    exact but slower on CUDA); a clear error for a user's op that does not."""
    if getattr(op, "supports_documents", False):
        return op
    if given:
        raise ValueError(
            f"doc_start (packed documents): the block op {op!r} does not compute it (supports_documents is not set); "
            "pass op=None for the default"
        )
    name = type(op).__name__
    if name not in _warned_documents:
        _warned_documents.add(name)
        warnings.warn(
            f"packed documents: {name} has no per-document mask, so attention over packed documents runs the chunked "
            "torch op (TorchBlockOp) instead: exact, but slower than the CUDA kernels on long sequences",
            stacklevel=3,
        )
    return TorchBlockOp()


def _variant_op(op: BlockAttentionOp, window: int | None, softcap: float | None) -> BlockAttentionOp:
    """``op``, after checking that it computes the variant (a clear error naming the op and the option if not)."""
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap > 0):
        raise ValueError(f"softcap must be a positive float (scores become softcap * tanh(s / softcap)), got {softcap!r}")
    for name, value, attr in (("window", window, "supports_window"), ("softcap", softcap, "supports_softcap")):
        if value is not None and not getattr(op, attr, False):
            raise ValueError(
                f"{name}={value}: the block op {op!r} does not compute it ({attr} is not set). Dense ring attention "
                "computes it with the default ops (FlexAttention on CUDA, torch elsewhere); keep such a sparse layer "
                "dense (SparsityConfig(dense_layers=...))"
            )
    return op


def _sparse_op(op: BlockAttentionOp | None, device: torch.device, tile: int) -> BlockAttentionOp:
    if op is None:
        if device.type == "cuda":
            from mtraining_kernels.vertical_slash import TritonBlockOp

            return TritonBlockOp(tile, tile)
        return TorchBlockOp()
    if not getattr(op, "supports_tiles", False):
        raise ValueError(
            f"sparse ring attention needs a block op that takes tile lists (supports_tiles = True); {op!r} computes "
            "dense blocks only. Pass op=None for the default (the Triton kernels on CUDA, torch elsewhere)"
        )
    return op


@dataclasses.dataclass
class DenseSetup:
    """What a dense ring call (or a window layer's band) runs: every rank's positions, the block op, the scale, the
    op's variant keywords and the ring steps that compute nothing."""

    positions: tuple[torch.Tensor, ...]
    op: BlockAttentionOp
    scale: float
    variant: dict
    skips: dict[int, bool] | None


def dense_setup(q, k, v, topo: RingTopology, layout: str, block_size: int, scale: float | None,
                window: int | None, softcap: float | None, doc_start: torch.Tensor | None,
                op: BlockAttentionOp | None = None) -> DenseSetup:
    """Validate a dense ring call's inputs and work out what it runs (:class:`DenseSetup`); shared by
    :func:`ring_attention` and its custom op (:mod:`lightning_mtraining.ring_op`)."""
    _validate(q, k, v, layout, block_size, topo.cp_size)
    n = q.shape[2] * topo.cp_size
    positions = _positions(n, topo.cp_size, layout, block_size, q.device)
    window = _check_window(window, n)
    doc_start = check_doc_start(doc_start, q, positions[topo.cp_rank])  # None here: nothing to mask on this rank
    variant = attention_variant(window, softcap, doc_start)
    chosen = _variant_op(_default_block_op(q.device) if op is None else op, window, softcap)
    if doc_start is not None:
        chosen = _documents_op(chosen, op is not None)
    skips = _window_skips_cached(n, topo.cp_size, layout, block_size, topo.cp_rank, window)
    if doc_start is not None:
        skips = _merge_skips(skips, document_skips(positions, topo.cp_rank, doc_start))
    return DenseSetup(positions, chosen, default_scale(q.shape[-1], scale), variant, skips)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "striped",
    block_size: int = 128,
    sparsity: SparsityConfig | VerticalSlashPattern | None = None,
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
) -> torch.Tensor:
    """Causal attention of this rank's query shard against the whole (sharded) sequence.

    Args:
        q: ``[B, H, S, D]`` this rank's queries, in ``layout``.
        k, v: ``[B, Hkv, S, D]`` this rank's keys/values (H divisible by Hkv; never repeated).
        group: the CP process group (default: the default group; none initialised means world size 1). Sparse
            attention with a hierarchical ring needs it (the pattern is estimated over the whole CP group).
        layout, block_size: how the sequence was sharded (:mod:`lightning_mtraining.layouts`).
        sparsity: ``None`` for dense (exact) ring attention; a :class:`SparsityConfig` to estimate the pattern
            online (:func:`~lightning_mtraining.estimation.estimate_pattern`); a :class:`VerticalSlashPattern` to use
            as given. Sparse: the result equals ``sparse_attention(q, k, v, p.vertical_idx, p.slash_idx,
            block_size=p.tile_size)`` on the unsharded tensors; every shard must hold whole T x T tiles (striped:
            ``block_size`` a multiple of T).
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
        doc_start: packed documents: ``[B or 1, S]`` integers, for each of this rank's tokens the global position of
            its document's first token (:attr:`~lightning_mtraining.sharding.ShardedBatch.doc_start`); a token sees
            only keys of its own document (``doc_start <= k <= q``), in the dense and the sparse ring. Ring steps
            with no key in any of this rank's documents compute nothing, and within a step the torch op computes no
            key below its query chunk's earliest document. A sparse pattern is estimated with the same mask and
            forces every document's first ``sink_tokens`` keys (:func:`~lightning_mtraining.estimation.
            estimate_pattern`). Ops: the dense ring's FlexAttention on CUDA and the torch op mask documents; the
            sparse Triton kernels have no per-document bound yet, so a sparse ring over packed documents runs the
            chunked torch op (:class:`TorchBlockOp`) on CUDA: exact but slower (warned once).

    Returns:
        ``[B, H, S, D]`` in q's dtype; differentiable in q, k and v.
    """
    topo = resolve_topology(group, inner_group, outer_group)
    _validate(q, k, v, layout, block_size, topo.cp_size)
    window = _check_window(window, q.shape[2] * topo.cp_size)  # None when longer than the sequence
    if sparsity is None or window is not None:
        d = dense_setup(q, k, v, topo, layout, block_size, scale, window, softcap, doc_start, op)
        if topo.cp_size == 1 and hasattr(d.op, "differentiable"):
            return d.op.differentiable(q, k, v, d.positions[0], d.positions[0], d.scale, **d.variant)
        return _RingAttention.apply(q, k, v, topo, d.positions, d.op, d.scale, None, None, d.variant, d.skips)
    scale = default_scale(q.shape[-1], scale)
    n = q.shape[2] * topo.cp_size
    positions = _positions(n, topo.cp_size, layout, block_size, q.device)
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
    pattern = resolve_pattern(q, k, sparsity, group=est_group, cp_size=topo.cp_size, layout=layout,
                              block_size=block_size, seq_len=seq_len, scale=scale, layer_idx=layer_idx,
                              doc_start=given_docs)
    op = _variant_op(_sparse_op(op, q.device, pattern.tile_size), None, softcap)
    if doc_start is not None:
        op = _documents_op(op, user_op)
    gather = verticals if topo.cp_size > 1 else "arrival"  # one rank holds every vertical already
    plan = build_step_lists(pattern, positions, topo.cp_rank, topo.sources(), q.shape[1], k.shape[1], n, gather)
    if topo.cp_size == 1 and hasattr(op, "differentiable") and not plan.skip[0]:
        return op.differentiable(q, k, v, positions[0], positions[0], scale, tiles=plan.lists[0], **variant)
    return _RingAttention.apply(q, k, v, topo, positions, op, scale, plan, est_group, variant, doc_skips)
