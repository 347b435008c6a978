"""What each ring step computes: the per-step tile lists under a sparse pattern, the steps that compute nothing
(outside every sliding window, or holding no key of any packed document), and the forward and backward of one step,
which the real ring (:mod:`.walk`) and the simulated ring (:mod:`.simulated`) share, so both have the same numerics.

Shape legend: B batch, H query heads, Hkv key/value heads, S local (per-rank) sequence length, D head dim.
``kv_chunk`` is K and V packed as one tensor ``[2, B, Hkv, S, D]``.
"""

from __future__ import annotations

import weakref

import torch

from lightning_mtraining.core.memo import TensorMemo
from lightning_mtraining.core.numerics import acc_dtype
from lightning_mtraining.core.profiling import ATTENTION, LISTS, profiled
from lightning_mtraining.ring.block_ops import BlockAttentionOp, merge_attention
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern
from mtraining_kernels.indexing import (
    TileLists,
    lists_have_work,
    prepare_pattern_tiles,
    sorted_union,
    step_tile_lists,
    step_tile_lists_batched,
)

__all__ = ["StepLists", "attention_variant", "backward_step", "build_step_lists", "document_skips", "forward_step",
           "lists_for_step", "merge_skips", "window_skips"]


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
    Shared by the real ring and :mod:`lightning_mtraining.ring.simulated`, so both have the same numerics.
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
    if state is not None and getattr(op, "supports_running", False):  # merged inside the op's kernel, in place
        kw.update(out=state[0], lse=state[1])
        return op.forward(q, kv_chunk[0], kv_chunk[1], q_pos, k_pos, scale, **kw)
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


def lists_for_step(plan: StepLists | None, src: int,
                   skip_dense: dict[int, bool] | None = None) -> tuple[TileLists | None, bool]:
    """The step's lists and whether it computes nothing: ``skip_dense`` (window or document skips) holds for the
    dense and the sparse ring alike."""
    extra = bool(skip_dense and skip_dense.get(src, False))
    if plan is None:
        return None, extra
    tiles, skip = plan.for_source(src)
    return tiles, skip or extra


# document_skips' answers per doc_start tensor (kept while it lives) and positions: every layer of a forward asks the
# same question, and its host sync is paid once a batch.
_DOC_SKIPS = TensorMemo()


def document_skips(positions: tuple[torch.Tensor, ...], cp_rank: int, doc_start: torch.Tensor) -> dict[int, bool]:
    """For packed documents: which source ranks' chunks hold no key of any of this rank's queries' documents
    (``doc_start[b, q] <= k <= q`` for no row), so their ring steps compute nothing. One host sync the first time a
    batch's ``doc_start`` meets these (cached) positions."""
    q_pos = positions[cp_rank]
    seen = _DOC_SKIPS.get_or_make(doc_start, (cp_rank, len(positions), q_pos._version), list)
    for pos_ref, skips in seen:
        if pos_ref() is q_pos:
            return dict(skips)
    lo = doc_start.reshape(-1, q_pos.shape[0])
    hits = []
    for k_pos in positions:
        hi = torch.searchsorted(k_pos, q_pos, right=True)  # keys <= q
        first = torch.searchsorted(k_pos, lo.contiguous())  # first key >= the document's start
        hits.append((hi[None, :] > first).any())
    work = torch.stack(hits).tolist()
    skips = {src: not w for src, w in enumerate(work)}
    seen.append((weakref.ref(q_pos), skips))
    return dict(skips)


def merge_skips(a: dict[int, bool] | None, b: dict[int, bool] | None) -> dict[int, bool] | None:
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


@profiled(LISTS)
def build_step_lists(pattern: VerticalSlashPattern, positions, cp_rank: int, sources, num_heads: int,
                     num_kv_heads: int, n: int, verticals: str = "arrival") -> StepLists:
    """This rank's lists for every ring step (queries at ``positions[cp_rank]`` against each source's keys).

    ``verticals="gathered"``: the per-step lists hold tiles only, and the vertical columns are computed in one extra
    step against their gathered K/V (Note [Gathered verticals]); ``"arrival"``: each vertical at the step its key's
    chunk arrives.

    Host syncs: on CUDA the lists' widths come from the pattern's shapes (``widths="bounded"``: a few size classes,
    no sync; elsewhere the exact widths, one sync); a ring of one rank reads nothing more; on more than one rank one
    sync reads which steps have any work together with the number of distinct vertical keys."""
    if verticals not in ("arrival", "gathered"):
        raise ValueError(f"verticals must be 'gathered' or 'arrival', got {verticals!r}")
    q_pos = positions[cp_rank]
    full = pattern.expand(num_heads, num_kv_heads)
    pt = prepare_pattern_tiles(full.vertical_idx, full.slash_idx, n, pattern.tile_size,
                               widths="bounded" if q_pos.is_cuda else "exact")
    gather = verticals == "gathered" and pt.verticals.numel() > 0
    # every step's lists in one builder call (one Triton launch on CUDA)
    built = step_tile_lists_batched(pt, q_pos, torch.stack([positions[src] for src in sources]), columns=not gather)
    lists = dict(zip(sources, built))
    if len(sources) == 1 and not gather:  # one step: nothing to skip, and an empty list computes nothing anyway
        return StepLists(lists, {sources[0]: False})
    flags = [lists_have_work(lists[src]).to(torch.int64) for src in sources]
    if gather:
        union, count = sorted_union(pt.verticals.to(q_pos.device), pt.big)  # sorted, ascending, no sync
        flags.append(count.to(torch.int64))
    read = torch.stack(flags).tolist()  # the one host sync
    skip = {src: not w for src, w in zip(sources, read)}
    if not gather:
        return StepLists(lists, skip)
    vert_pos = union[:read[-1]]  # the pattern's vertical keys: the union over batch rows and heads
    gathered = step_tile_lists(pt, q_pos, vert_pos, tiles=False)
    local = torch.searchsorted(q_pos, vert_pos).clamp(max=q_pos.numel() - 1)
    owned = (local, q_pos[local] == vert_pos)
    # a step against no vertical computes nothing; one with verticals may still find them all inside computed tiles
    # (its lists are then empty, and it merges nothing)
    return StepLists(lists, skip, vert_pos, gathered, read[-1] == 0, owned)


def attention_variant(window: int | None = None, softcap: float | None = None,
                      doc_start: torch.Tensor | None = None) -> dict:
    """The block op keywords of an attention variant (only those set: plain causal attention passes none)."""
    return {k: v for k, v in (("window", window), ("softcap", softcap), ("doc_start", doc_start)) if v is not None}
