"""Exact work counts of a vertical-slash pattern: per pattern row, per (query rank, key rank), per ring step.

Shape legend: B batch, G pattern heads, R = B * G pattern rows, n / n' (padded) verticals / slashes per row,
N sequence length, T tile (the pattern's ``tile_size``), NT = ceil(N / T) tiles, W = cp_size,
c = block_size / T tiles per striped block, P = c * W the striped period in tiles, J = NT / P periods.

The counted pairs are exactly those of :func:`mtraining_kernels.reference.vertical_slash_mask` (the rule is in
:mod:`mtraining_kernels.indexing`): query i sees key j iff ``j <= i`` and (the tile offset ``u = i//T - j//T`` is
*computed*, i.e. some valid slash s has ``|s - u*T| < T``, or j is a vertical). Work is the number of such
(query, key) pairs: what a kernel that skips non-computed tiles and gathers vertical columns does, up to the
cost of the gathered columns themselves.

Note [Counting per tile, never per pair]
----------------------------------------
A computed offset u adds a whole band of tile pairs (query tile m, key tile m - u), T*T pairs each (T*(T+1)/2 on
the diagonal u = 0). Summed over the rows first, the tile work is one weight per offset, ``w[u]`` = (rows that
compute u) x (pairs per tile pair), and the question per rank pair (r, s) is only *how many* of band u's tile
pairs have the query tile on rank r and the key tile on rank s::

                      key tile ->  0  1  2  3  4  5       striped, W = 2, c = 1: owner(m) = m mod 2
    query tile 0 (rank 0)          D                      band u = 1 (X): (1,0) (2,1) (3,2) (4,3) (5,4)
    query tile 1 (rank 1)          X  D                   go to ranks (1,0) (0,1) (1,0) (0,1) (1,0):
    query tile 2 (rank 0)          .  X  D                always r - s = u mod W, shared evenly by the
    query tile 3 (rank 1)          .  .  X  D             W rank pairs up to one tile pair; that is why
    query tile 4 (rank 0)          .  .  .  X  D          striping balances slash work
    query tile 5 (rank 1)          .  .  .  .  X  D

Layouts place tiles in *blocks* of lam consecutive tiles on one rank: a striped block (lam = c), a zigzag chunk
(NT / 2W) or a contiguous shard (NT / W).

- striped: owner(m) = (m // c) mod W has period P = c*W, and NT = J*P. For u = q*P + d, the key tiles
  ``k = i*P + a`` of band u with ``k + u < NT`` number ``(J - q - 1) + [a + d < P]``, and their pair of owners is
  (owner((a + d) mod P), owner(a)). Summing w[u] by d first makes the tile work O(NT + P^2).
- contiguous / zigzag (nb = NT / lam = W or 2W blocks): band u holds ``|[a0, a1) & [b0 - u, b1 - u)|`` tile pairs
  of key block [a0, a1) and query block [b0, b1), the sum ``R(b1-u-a0) - R(b0-u-a0) - R(b1-u-a1) + R(b0-u-a1)``
  of ramps R(x) = max(x, 0). With ``F(x) = sum_u w[u] R(x - u)`` (two prefix sums) a block pair costs four
  look-ups, which depend only on the blocks' distance: O(NT + nb^2).

A vertical v (key tile t, deduplicated per row) adds T pairs for each later query tile m > t whose offset
m - t is not computed in its row, plus ``(t + 1)*T - v`` pairs in its own tile when offset 0 is not computed
(the pairs under a computed tile are already in the tile work). "All later query tiles of rank r" is a suffix
count over tiles, summed over rows first. The part to take back, ``#{u >= 1 computed in the row: owner(t + u) =
r}``, pairs each row's verticals with its computed offsets; it is read from prefix counts of the offsets and
contracted with the verticals' histogram over key tiles by integer matrix products: per residue (striped,
``[P, R*J] @ [R*J, P]``) or per block (contiguous / zigzag, ``R`` products ``[nb, lam] @ [lam, nb]``), O(R * NT * P)
or O(R * NT * nb) multiply-adds, whatever the number of verticals and slashes.

Ring steps (:func:`ring_step_work`): at step k rank r computes its queries against the K/V chunk of rank
``RingTopology.sources()[k]`` (the real flat or hierarchical schedule of :mod:`lightning_mtraining.ring`), so a
step's work is one entry of :func:`ring_work`'s matrix, verticals counted when their key's chunk arrives; or,
with the selected vertical columns all-gathered once per layer, the vertical pairs of all chunks form one extra
step and the ring steps carry tile work only.

Cost: tensor ops over tiles, never over pairs, so a whole model's pattern at a million tokens and 64 ranks counts in
well under a second on a CPU (``benchmarks/imbalance.py``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_mtraining.core.checks import is_int
from lightning_mtraining.core.layouts import global_positions, layout_unit
from mtraining_kernels.indexing import computed_tile_offsets

__all__ = ["allowed_pairs", "imbalance", "ring_step_work", "ring_work"]

VerticalMode = Literal["arrival", "gathered"]

_CHUNK = 1 << 22  # elements of one batched-product output (bounds memory to ~32 MB of int64 per chunk of rows)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pattern_rows(pattern: Any, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(vertical_idx [R, n] int64, slash_idx [R, n'] int64, T) of a duck-typed vertical-slash pattern."""
    missing = [a for a in ("vertical_idx", "slash_idx", "tile_size") if not hasattr(pattern, a)]
    if missing:
        raise TypeError(
            f"expected a vertical-slash pattern (vertical_idx, slash_idx, tile_size), e.g. a "
            f"lightning_mtraining.VerticalSlashPattern; {type(pattern).__name__} has no {missing}"
        )
    if not is_int(seq_len):
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    v, s, T = pattern.vertical_idx, pattern.slash_idx, pattern.tile_size
    if v.dim() != 3 or s.dim() != 3 or v.shape[:2] != s.shape[:2]:
        raise ValueError(
            f"pattern indices must be [batch, heads, n] with the same [batch, heads]; got vertical_idx "
            f"{tuple(v.shape)} and slash_idx {tuple(s.shape)}"
        )
    if not is_int(T):
        raise ValueError(f"pattern.tile_size must be a positive int, got {T!r}")
    rows = v.shape[0] * v.shape[1]
    return v.reshape(rows, v.shape[-1]).long(), s.reshape(rows, s.shape[-1]).to(v.device).long(), T


def _computed(slash: torch.Tensor, seq_len: int, T: int) -> torch.Tensor:
    """Bool [R, NT]: entry u says whether tile offset u is computed in that row (square T x T tiles)."""
    return computed_tile_offsets(slash[None], seq_len, T, T)[0]


def _unique_verticals(vertical: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [K], position [K]) of every valid vertical, duplicates within a row dropped (K = kept verticals)."""
    vs = vertical.sort(-1).values
    keep = (vs >= 0) & (vs < seq_len)
    keep[:, 1:] &= vs[:, 1:] != vs[:, :-1]
    rows = torch.arange(vs.shape[0], device=vs.device)[:, None].expand_as(vs)
    return rows[keep], vs[keep]


def _later_offsets(comp: torch.Tensor) -> torch.Tensor:
    """The computed offsets ``comp [R, NT]`` without offset 0: those that cover a vertical's later query tiles."""
    later = comp.clone()
    later[:, 0] = False
    return later


def _offset_prefix(comp: torch.Tensor) -> torch.Tensor:
    """Int64 [R, NT + 1]: entry x + 1 counts the computed offsets u with 1 <= u <= x (x = -1 .. NT-1)."""
    out = torch.zeros(comp.shape[0], comp.shape[1] + 1, dtype=torch.int64, device=comp.device)
    out[:, 1:] = _later_offsets(comp).cumsum(1)
    return out


def allowed_pairs(pattern: Any, seq_len: int) -> torch.Tensor:
    """Exact number of allowed (query, key) pairs of each pattern row on ``seq_len`` tokens, int64 ``[B, G]``.

    ``pattern`` is a :class:`~lightning_mtraining.VerticalSlashPattern` (or anything with its ``vertical_idx``,
    ``slash_idx`` and ``tile_size``). Equals ``vertical_slash_mask(...).sum((-1, -2))`` but counts per tile:
    O(R * (NT + n + n')) work. ``seq_len`` need not be a multiple of the tile (the last tile is ragged: only its
    real queries and keys count); entries ``>= seq_len`` are ignored, like padding.
    """
    vertical, slash, T = _pattern_rows(pattern, seq_len)
    B, G = pattern.vertical_idx.shape[:2]
    N, NT = seq_len, _cdiv(seq_len, T)
    last = N - (NT - 1) * T  # real tokens in the last tile
    comp = _computed(slash, N, T)  # [R, NT]
    u = torch.arange(NT, device=comp.device)
    # A band u > 0 holds NT-1-u full tile pairs and one whose query tile is the last; the diagonal band is
    # NT-1 full triangles and the last tile's triangle.
    band = torch.where(u == 0, (NT - 1) * (T * (T + 1) // 2) + last * (last + 1) // 2, (NT - 1 - u) * T * T + last * T)
    tiles = (comp * band).sum(-1)
    # every vertical slot of every row at once, the padding and repeats weighted 0: no data-dependent shape, so no
    # host sync on a GPU
    vs = vertical.sort(-1).values  # [R, n]
    keep = (vs >= 0) & (vs < N)
    keep[:, 1:] &= vs[:, 1:] != vs[:, :-1]
    pos = vs.clamp(0, N - 1)
    t = pos // T
    later = (N - (t + 1) * T).clamp(min=0)  # queries in the tiles after the vertical's own
    x = NT - 1 - t  # the largest offset with a query tile
    covered = _offset_prefix(comp).gather(1, x + 1) * T - (comp.gather(1, x) & (x >= 1)) * (T - last)
    own_tile = (~comp[:, :1]) * (torch.clamp((t + 1) * T, max=N) - pos)
    verts = ((later - covered + own_tile) * keep).sum(-1)
    return (tiles + verts).reshape(B, G)


def _check_alignment(seq_len: int, cp_size: int, layout: str, block_size: int, T: int) -> None:
    """Raise unless ``seq_len`` suits ``layout`` and the layout keeps whole, aligned tiles of T on one rank."""
    unit = layout_unit(layout, cp_size, block_size)  # validates layout, cp_size, block_size
    if seq_len % unit:
        # global_positions explains the unit and the padding; call it for its message.
        global_positions(seq_len, 0, cp_size, layout, block_size)
    if layout == "striped" and block_size % T:
        raise ValueError(
            f"striped layout: block_size={block_size} is not a multiple of the pattern's tile_size={T}, so tiles "
            f"straddle ranks; use a block_size that is a multiple of {T} (128 matches the kernels) or a smaller tile"
        )
    if layout == "contiguous" and (seq_len // cp_size) % T:
        raise ValueError(
            f"contiguous layout: each rank's {seq_len // cp_size} tokens (seq_len={seq_len} / cp_size={cp_size}) "
            f"are not a multiple of tile_size={T}; pad seq_len to a multiple of cp_size * {T} = {cp_size * T}"
        )
    if layout == "zigzag" and (seq_len // (2 * cp_size)) % T:
        raise ValueError(
            f"zigzag layout: each chunk's {seq_len // (2 * cp_size)} tokens (seq_len={seq_len} / 2*cp_size="
            f"{2 * cp_size}) are not a multiple of tile_size={T}; pad seq_len to a multiple of 2 * cp_size * {T} = "
            f"{2 * cp_size * T}"
        )


def _tile_owners(
    seq_len: int, cp_size: int, layout: str, block_size: int, T: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """(owner [NT]: the CP rank holding each tile, lam: tiles per layout block), after checking alignment.

    A layout block is the run of lam consecutive tiles the layout places as one piece: a striped block (lam = c),
    a zigzag chunk (NT / 2W) or a contiguous shard (NT / W).
    """
    _check_alignment(seq_len, cp_size, layout, block_size, T)
    owner = torch.empty(seq_len, dtype=torch.int64, device=device)
    for rank in range(cp_size):
        owner[global_positions(seq_len, rank, cp_size, layout, block_size, device=device)] = rank
    NT = seq_len // T
    lam = {"striped": block_size // T, "contiguous": NT // cp_size, "zigzag": NT // (2 * cp_size)}[layout]
    return owner[::T].contiguous(), lam


def _fold(z: torch.Tensor, query_rank: torch.Tensor, key_rank: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[W, W] sums of the entries of ``z`` by (query_rank, key_rank), tensors of z's shape."""
    out = torch.zeros(cp_size * cp_size, dtype=torch.int64, device=z.device)
    index = (query_rank * cp_size + key_rank).reshape(-1)
    return out.index_add_(0, index, z.reshape(-1)).view(cp_size, cp_size)


def _residue_ranks(owner: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Striped: (query rank, key rank) [P, P] of key tiles of residue a and offsets of residue d, at [a, d]."""
    a = torch.arange(P, device=owner.device)
    return owner[(a[:, None] + a[None, :]) % P], owner[a][:, None].expand(P, P)


def _block_ranks(owner: torch.Tensor, lam: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks: (query rank, key rank) [nb, nb] of query block k and key block A, at [A, k]."""
    block_owner = owner[::lam]
    nb = block_owner.numel()
    return block_owner[None, :].expand(nb, nb), block_owner[:, None].expand(nb, nb)


def _tile_work(w: torch.Tensor, owner: torch.Tensor, lam: int, cp_size: int, striped: bool) -> torch.Tensor:
    """[W, W] tile work from the per-offset weights ``w [NT]`` (see Note [Counting per tile, never per pair])."""
    NT, dev = w.numel(), w.device
    u = torch.arange(NT, device=dev)
    if striped:
        P = lam * cp_size
        J = NT // P
        q, d = u // P, u % P
        per_d = torch.zeros(P, dtype=torch.int64, device=dev).index_add_(0, d, w * (J - q - 1))
        extra = torch.zeros(P, dtype=torch.int64, device=dev).index_add_(0, d, w)
        a = torch.arange(P, device=dev)
        z = per_d[None, :] + (a[:, None] + a[None, :] < P) * extra[None, :]
        return _fold(z, *_residue_ranks(owner, P), cp_size)
    # F[x] = sum_u w[u] * max(x - u, 0) for x = 0 .. NT. Key block A, query block k = A + delta hold
    # F((delta+1) lam) - 2 F(delta lam) + F((delta-1) lam) tile pairs (the four ramps of the Note).
    F = torch.zeros(NT + 1, dtype=torch.int64, device=dev)
    F[1:] = (u + 1) * w.cumsum(0) - (u * w).cumsum(0)
    nb = NT // lam
    delta = torch.arange(nb, device=dev)
    at = lambda k: F[(k * lam).clamp(min=0)]  # noqa: E731
    band = at(delta + 1) - 2 * at(delta) + at(delta - 1)  # [nb] by delta = k - A >= 0
    A = torch.arange(nb, device=dev)
    z = torch.where(A[None, :] >= A[:, None], band[(A[None, :] - A[:, None]).clamp(min=0)], 0)  # [A, k]
    return _fold(z, *_block_ranks(owner, lam), cp_size)


def _covered_by_tiles(
    comp: torch.Tensor, hist: torch.Tensor, owner: torch.Tensor, lam: int, cp_size: int, striped: bool
) -> torch.Tensor:
    """[W, W]: over all verticals (``hist [R, NT]`` per row and key tile t), the later query tiles t + u whose
    offset u >= 1 is computed in the vertical's row, by (query rank, key rank). Integer matmuls over tiles."""
    R, NT = comp.shape
    if striped:
        # Key tile t = i*P + a: offsets u = j*P + d <= NT-1-t number, per residue d, the computed ones with
        # j <= J-1-i when a + d < P, and j <= J-2-i otherwise (prefix counts over j, read back to front).
        P = lam * cp_size
        J = NT // P
        # [R, i, d]: computed u of residue d, j <= J-1-i
        by_j = _later_offsets(comp).view(R, J, P).long().cumsum(1).flip(1)
        next_j = torch.zeros_like(by_j)
        next_j[:, :-1] = by_j[:, 1:]  # j <= J-2-i
        h = hist.view(R * J, P).T  # [a, (row, i)]
        d = torch.arange(P, device=comp.device)
        z = torch.where(d[:, None] + d[None, :] < P, h @ by_j.view(R * J, P), h @ next_j.view(R * J, P))
        return _fold(z, *_residue_ranks(owner, P), cp_size)
    # Blocks of lam tiles: vertical at t = A*lam + tau, query block k = A + kappa - 1 ends at boundary
    # (A + kappa)*lam, and the computed u <= (A + kappa)*lam - 1 - t number prefix[(kappa-1)*lam + lam-1-tau].
    nb = NT // lam
    prefix = _offset_prefix(comp)[:, 1:].reshape(R, nb, lam).flip(-1)  # [R, kappa - 1, tau]
    h = hist.view(R, nb, lam)  # [R, A, tau]
    upto = torch.zeros(nb, nb + 1, dtype=torch.int64, device=comp.device)  # [A, kappa]; kappa = 0: nothing
    step = max(1, _CHUNK // (nb * nb))
    for i in range(0, R, step):
        upto[:, 1:] += torch.bmm(h[i:i + step], prefix[i:i + step].transpose(1, 2)).sum(0)
    A = torch.arange(nb, device=comp.device)
    kappa = A[None, :] - A[:, None] + 1  # [A, k]: the boundary after query block k
    z = upto.gather(1, kappa.clamp(min=0)) - upto.gather(1, (kappa - 1).clamp(min=0))
    return _fold(z, *_block_ranks(owner, lam), cp_size)


def _ring_work_parts(
    pattern: Any, seq_len: int, cp_size: int, layout: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile work, vertical work), each int64 [W, W] (query rank, key rank), summed over the pattern's rows."""
    vertical, slash, T = _pattern_rows(pattern, seq_len)
    owner, lam = _tile_owners(seq_len, cp_size, layout, block_size, T, vertical.device)
    N, NT, dev = seq_len, seq_len // T, vertical.device  # aligned layouts: N is a multiple of T
    striped = layout == "striped"
    comp = _computed(slash, N, T)
    per_tile_pair = torch.full((NT,), T * T, dtype=torch.int64, device=dev)
    per_tile_pair[0] = T * (T + 1) // 2
    tiles = _tile_work(comp.sum(0) * per_tile_pair, owner, lam, cp_size, striped)

    rows, pos = _unique_verticals(vertical, N)
    t = pos // T
    hist = torch.zeros(comp.shape[0] * NT, dtype=torch.int64, device=dev)
    hist = hist.index_add_(0, rows * NT + t, torch.ones_like(t)).view(-1, NT)  # verticals per (row, key tile)
    # All queries in later tiles, by query rank: later[r, t] = #{m > t : owner(m) = r} tiles.
    on_rank = owner[None, :] == torch.arange(cp_size, device=dev)[:, None]  # [W, NT]
    later = on_rank.flip(1).cumsum(1).flip(1) - on_rank.long()
    verts = torch.zeros(cp_size, cp_size, dtype=torch.int64, device=dev).index_add_(1, owner, later * hist.sum(0) * T)
    verts -= T * _covered_by_tiles(comp, hist, owner, lam, cp_size, striped)
    own_tile = (~comp[rows, 0]) * ((t + 1) * T - pos)  # queries in the vertical's own tile, offset 0 not computed
    verts.diagonal().add_(torch.zeros(cp_size, dtype=torch.int64, device=dev).index_add_(0, owner[t], own_tile))
    return tiles, verts


def ring_work(
    pattern: Any, seq_len: int, cp_size: int, layout: str = "striped", block_size: int = 128
) -> torch.Tensor:
    """Exact allowed (query, key) pairs per (query rank, key rank), int64 ``[cp_size, cp_size]``.

    Entry ``[r, s]`` counts the pairs of the pattern (summed over its batch and head rows) whose query lives on
    CP rank r and whose key lives on rank s under ``layout`` (token ownership by
    :func:`~lightning_mtraining.core.layouts.global_positions`): the work rank r does with rank s's K/V chunk in a
    ring. ``ring_work(...).sum()`` equals ``allowed_pairs(pattern, seq_len).sum()``.

    The layout must keep whole tiles of ``pattern.tile_size`` T on one rank: striped needs ``block_size % T == 0``,
    contiguous ``(seq_len / cp_size) % T == 0``, zigzag ``(seq_len / (2 cp_size)) % T == 0``; and ``seq_len`` must
    be a multiple of the layout's unit (:func:`~lightning_mtraining.core.layouts.layout_unit`). Counted per tile (see
    the module's Note), on the pattern's device.
    """
    tiles, verts = _ring_work_parts(pattern, seq_len, cp_size, layout, block_size)
    return tiles + verts


def _ring_sources(cp_size: int, inner_size: int | None, device: torch.device) -> torch.Tensor:
    """Int64 [W, W]: entry [r, k] is the CP rank whose K/V chunk rank r computes at ring step k."""
    # Imported here: ring.py pulls in torch.distributed and the attention ops, which counting does not need.
    from lightning_mtraining.core.topology import RingTopology

    inner = cp_size if inner_size is None else inner_size
    if not is_int(inner) or cp_size % inner:
        raise ValueError(
            f"inner_size={inner_size!r} must be a positive int dividing cp_size={cp_size} (ranks per node of the "
            "hierarchical ring), or None for a flat ring"
        )
    outer = cp_size // inner
    sources = [RingTopology(r % inner, inner, r // inner, outer).sources() for r in range(cp_size)]
    return torch.tensor(sources, dtype=torch.int64, device=device)


def ring_step_work(
    pattern: Any,
    seq_len: int,
    cp_size: int,
    layout: str = "striped",
    block_size: int = 128,
    *,
    inner_size: int | None = None,
    verticals: VerticalMode = "arrival",
) -> torch.Tensor:
    """Exact allowed pairs per CP rank and ring step, int64 ``[cp_size, n_steps]``, in the ring's real schedule.

    Steps follow ``RingTopology(inner_rank, inner_size, outer_rank, outer_size).sources()`` of each rank
    (rank r = outer_rank * inner_size + inner_rank; ``inner_size=None`` is a flat ring), as
    :func:`~lightning_mtraining.ring.attention.ring_attention` runs them.

    ``verticals``:
      - ``"arrival"``: a vertical's pairs are counted at the step its key's chunk arrives (what
        :func:`ring_work` counts); ``n_steps = cp_size`` and row r sums to ``ring_work(...)[r].sum()``.
      - ``"gathered"``: the selected vertical columns are all-gathered once per layer, so every rank computes its
        queries' vertical pairs not under a computed tile in one extra step, column 0; columns 1..cp_size are the
        tile work per ring step; ``n_steps = cp_size + 1``. The total is the same.
    """
    if verticals not in ("arrival", "gathered"):
        raise ValueError(f"verticals must be 'arrival' or 'gathered', got {verticals!r}")
    tiles, verts = _ring_work_parts(pattern, seq_len, cp_size, layout, block_size)
    sources = _ring_sources(cp_size, inner_size, tiles.device)
    if verticals == "arrival":
        return (tiles + verts).gather(1, sources)
    return torch.cat([verts.sum(1, keepdim=True), tiles.gather(1, sources)], dim=1)


def imbalance(step_work: torch.Tensor) -> dict[str, float]:
    """Load imbalance of per-rank, per-step work ``[ranks, steps]`` (e.g. from :func:`ring_step_work`).

    - ``total``: the busiest rank's whole work over the mean rank's (max over mean of the row sums);
    - ``critical_path``: every step waits for its slowest rank, so the time is the sum over steps of the max over
      ranks; reported against the perfectly balanced time, the sum over steps of the mean over ranks.
      Always ``>= total``.

    Work that is all zero is balanced: both are 1.0.
    """
    if step_work.dim() != 2 or step_work.shape[0] < 1 or step_work.shape[1] < 1:
        raise ValueError(f"step_work must be [ranks, steps] with at least one of each, got {tuple(step_work.shape)}")
    work = step_work.double()
    mean_total = float(work.sum(1).mean())
    if mean_total == 0.0:
        return {"total": 1.0, "critical_path": 1.0}
    return {
        "total": float(work.sum(1).max()) / mean_total,
        "critical_path": float(work.max(0).values.sum()) / float(work.mean(0).sum()),
    }
