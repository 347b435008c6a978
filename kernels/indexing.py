"""Tile and column lists for the vertical-slash kernels, built on the device with torch ops (no Python loops).

Shape legend: B batch, H query heads, Hkv key/value heads, S sequence length, Mq query tiles, Nk key tiles,
L list length (padded), NC gathered-column slots (a multiple of ``COL_CHUNK``), J = NC // COL_CHUNK.

The kernel interface (:class:`TileLists`) is generic and layout-agnostic: it speaks of *local* indices of
query tiles, key tiles and key columns of one (q, k) pair of tensors, and the kernel decides causality from the
global positions ``q_pos`` / ``k_pos``. Two builders fill it:

- :func:`dense_tile_lists` (any positions, increasing): every tile pair that holds at least one allowed pair.
  This is the dense ring's block op.
- :func:`pattern_tile_lists` (single device, positions ``0..S-1``): the vertical-slash pattern, see below. On
  CUDA it runs the Triton builder of :mod:`mtraining_kernels.list_builder` (5 kernels, one host sync); the torch
  code below is the CPU path and the reference it is tested against (same valid entries, counts and bits).
- :func:`step_tile_lists` (one ring step: a query shard against another rank's key chunk, from the pattern prepared
  once per layer by :func:`prepare_pattern_tiles`) and :func:`step_tile_lists_batched` (every step of a layer).
  On CUDA the Triton builder (one kernel launch, no host sync); the torch code here is the CPU path and reference.

List widths: ``widths="exact"`` (the default of :func:`pattern_tile_lists` and :func:`prepare_pattern_tiles`) reads
the widest list and the most columns of any head back to the host (one sync) and makes the lists that wide;
``widths="bounded"`` takes the widths from the pattern's shapes alone (:func:`list_width_bounds`: an upper bound,
rounded to a few size classes, :func:`size_class`), with no host sync: the same valid entries, more padding.
:func:`sorted_union` is the sync-free union of the verticals over batch rows and heads (a fixed size, padded).

Lists ``fwd_*`` are query-tile-major (forward and the dq kernel): for query tile ``m`` the key tiles
``fwd_idx[b, h, m, :fwd_cnt]``; the first ``fwd_nmask`` of them need the token-level mask (``k_pos <= q_pos``,
and key index < Sk), the rest are computed without any mask. Lists ``bwd_*`` are the same set of tile pairs,
key-tile-major (the dk/dv kernel): for key tile ``t`` the query tiles ``bwd_idx[b, h, t, :bwd_cnt]``, masked
ones first. Gathered columns: ``col_idx[b, h, :]`` is one sorted list of key indices per head (chunks of
``COL_CHUNK`` = 64) and ``col_bits[b, h, m, j]`` is an int64 bitmask: bit ``i`` set iff key
``col_idx[b, h, j*64 + i]`` is gathered for query tile ``m``. This is "a list of key columns per query tile"
stored as one shared list plus per-tile bits: O(Mq * NC / 64) memory instead of O(Mq * NC), and the same
arrays serve the query-major forward and the column-major dk/dv kernel. The kernel always applies the token
mask ``k_pos <= q_pos`` to gathered columns. Leading dims of every list may be 1 (broadcast over batch/heads).

Computed pairs of a vertical-slash pattern (single device, positions 0..S-1, tiles BM x BN with BM = r * BN;
the default is square, r = 1), per batch b and query head h, with V = the valid vertical indices and O = the
valid slash offsets of that head. Tile (query tile m, key tile t) has offset u = m*r - t (in key tiles):

    offset u is *computed* iff some s in O has  u*BN - BN < s < u*BN + BM,
    i.e. the diagonal q - k = s crosses the tile when tiles are taken as full BM x BN rectangles (a ragged last
    tile is treated as if it were full, so its crossing test is the same as everyone's); for square tiles
    (T = BM = BN, u = m - t is the tile diagonal d) this reads |s - d*T| < T;
    query i sees key j iff  j <= i  and  ( offset (i//BM)*r - j//BN is computed  or  j in V ).

Cost (single device): O(B*H*(Mq*L + Nk*L + NC*L + Mq*J)) elementwise work and small sorts, L = number of
computed tile offsets; for realistic patterns (local window + a few bands) L << Mq. The [B, H, tiles, L] lists
are int32; one host sync reads the list width L and the gathered-column count (none with bounded widths). On CUDA
the Triton builder (:mod:`mtraining_kernels.list_builder`) makes the same lists in five launches; the torch
builder's ~190 small ops are launch-bound there (``benchmarks/list_builder_bench.py`` compares them).
"""

from __future__ import annotations

import dataclasses

import torch

from .lists import COL_CHUNK, PatternTiles, TileLists, list_width_bounds, size_class

__all__ = [
    "COL_CHUNK", "PatternTiles", "TileLists", "check_tile_aligned", "computed_tile_offsets", "dense_tile_lists",
    "expand_pattern", "list_width_bounds", "lists_have_work", "pattern_tile_lists", "prepare_pattern_tiles",
    "size_class", "sorted_union", "step_tile_lists", "step_tile_lists_batched",
]

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_widths(widths: str) -> bool:
    """Whether a builder's ``widths`` argument asks for the bounded (sync-free) list widths."""
    if widths not in ("exact", "bounded"):
        raise ValueError(f"widths={widths!r}; expected 'exact' (one host sync reads the widths) or 'bounded' "
                         "(widths from the pattern's shapes, no host sync)")
    return widths == "bounded"


def _tile_bounds(pos: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(min position, max position, is ragged) of each tile of ``block`` consecutive entries of ``pos``."""
    n = pos.shape[0]
    nt = _cdiv(n, block)
    start = torch.arange(nt, device=pos.device) * block
    end = torch.clamp(start + block, max=n) - 1
    return pos[start], pos[end], (start + block) > n


def _pack_rows(keep: torch.Tensor, masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of a [..., R, C] boolean grid to padded column lists, masked entries first, then the rest."""
    C = keep.shape[-1]
    col = torch.arange(C, device=keep.device)
    # Sort key: masked kept entries first (by column), then unmasked kept ones, then the dropped ones.
    key = torch.where(keep, torch.where(masked, col, col + C), col + 2 * C)
    order = torch.sort(key, dim=-1).values
    cnt = keep.sum(-1, dtype=torch.int32)
    nmask = (keep & masked).sum(-1, dtype=torch.int32)
    L = max(int(cnt.max()) if cnt.numel() else 0, 1)
    idx = (order[..., :L] % C).to(torch.int32)
    return idx.contiguous(), cnt, nmask


def dense_tile_lists(q_pos: torch.Tensor, k_pos: torch.Tensor, block_m: int = 64, block_n: int = 64) -> TileLists:
    """All tile pairs holding at least one allowed pair (``k_pos <= q_pos``), for any increasing positions.

    A tile pair is flagged for the token-level mask only where some of its pairs are masked (partially causal) or
    its key tile is ragged (keys past the end must be masked); a ragged query tile needs no mask (its extra rows
    are never stored, and contribute nothing to dk/dv). Lists broadcast over batch and heads ([1, 1, ...]).
    """
    qmin, qmax, _ = _tile_bounds(q_pos, block_m)
    kmin, kmax, kragged = _tile_bounds(k_pos, block_n)
    keep = kmin[None, :] <= qmax[:, None]  # [Mq, Nk]
    full = (kmax[None, :] <= qmin[:, None]) & ~kragged[None, :]
    masked = keep & ~full
    f_idx, f_cnt, f_nm = _pack_rows(keep, masked)
    b_idx, b_cnt, b_nm = _pack_rows(keep.T, masked.T)
    return TileLists(
        block_m, block_n, f_idx[None, None], f_cnt[None, None], f_nm[None, None],
        b_idx[None, None], b_cnt[None, None], b_nm[None, None],
    )


def expand_pattern(idx: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """A pattern ``[B, G, n]`` with G = H (per query head) or G = Hkv (per KV group) as ``[B, H, n]``."""
    G = idx.shape[1]
    if G == num_heads:
        return idx
    if G == num_kv_heads:
        return idx.repeat_interleave(num_heads // num_kv_heads, dim=1)
    raise ValueError(f"pattern has {G} heads; expected H={num_heads} or H_kv={num_kv_heads}")


def _sorted_unique(x: torch.Tensor, valid: torch.Tensor, big: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row, invalid and duplicate entries replaced by ``big`` at the end; returns (values, counts)."""
    xs = torch.where(valid, x, torch.full_like(x, big)).sort(-1).values
    if xs.shape[-1] > 1:
        dup = torch.zeros_like(xs, dtype=torch.bool)
        dup[..., 1:] = xs[..., 1:] == xs[..., :-1]
        xs = torch.where(dup, torch.full_like(xs, big), xs).sort(-1).values
    return xs, (xs < big).sum(-1)


def _use_triton(backend: str, x: torch.Tensor) -> bool:
    """Whether a list builder's ``backend`` argument selects the Triton builder for tensors like ``x``."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend={backend!r}; expected 'auto', 'torch' or 'triton'")
    return backend == "triton" or (backend == "auto" and x.is_cuda)


def computed_tile_offsets(slash_idx: torch.Tensor, seq_len: int, block_m: int, block_n: int) -> torch.Tensor:
    """Bool [B, H, Nk + r - 1]: entry u + r - 1 says whether tile offset u = m*r - t is computed (r = BM / BN).

    Tile (m, t) is crossed by slash s iff  u*BN - BN < s < u*BN + BM  (full virtual tiles), u >= -(r - 1).
    """
    BM, BN, S = block_m, block_n, seq_len
    r = BM // BN
    Nk = _cdiv(S, BN)
    UN = Nk + r - 1
    s = slash_idx.to(torch.int64)
    s_ok = (s >= 0) & (s < S)
    lo = torch.clamp(-torch.div(BM - 1 - s, BN, rounding_mode="floor"), min=-(r - 1))  # ceil((s - BM + 1) / BN)
    hi = torch.div(s + BN - 1, BN, rounding_mode="floor")
    comp = torch.zeros(*s.shape[:2], UN + 1, dtype=torch.bool, device=s.device)
    ones = torch.ones_like(s, dtype=torch.bool)
    for j in range(r + 2):  # at most r + 1 offsets per slash
        u = lo + j
        ok = s_ok & (u <= hi) & (u <= Nk - 1)
        comp.scatter_(2, torch.where(ok, u + r - 1, UN), ones)
    return comp[..., :UN]


def pattern_tile_lists(
    vertical_idx: torch.Tensor,
    slash_idx: torch.Tensor,
    seq_len: int,
    block_m: int = 64,
    block_n: int | None = None,
    backend: str = "auto",
    widths: str = "exact",
) -> TileLists:
    """Lists for a vertical-slash pattern on one device (positions 0..S-1); patterns ``[B, H, n]`` per head.

    ``vertical_idx``: key positions; ``slash_idx``: offsets q - k (0 = main diagonal); negative entries are
    padding. Tiles are ``block_m`` x ``block_n`` (block_n defaults to block_m; block_m must be a multiple of it).
    See the module docstring for the computed pairs. Use :func:`expand_pattern` for per-group patterns.

    ``backend``: ``"triton"`` (:mod:`mtraining_kernels.list_builder`: five kernel launches), ``"torch"`` (this
    module's ~190 torch ops; the reference the Triton builder is tested against), or ``"auto"``: Triton on CUDA
    tensors, torch elsewhere. Both give the same valid list entries, counts and column bits.

    ``widths``: ``"exact"`` (one host sync reads the widest list and the most columns of any head, and the lists
    are that wide) or ``"bounded"`` (no host sync: widths from the pattern's shapes, :func:`list_width_bounds`, wider
    than needed and from a few size classes; the same valid entries, counts and bits, the extra slots padding).
    """
    use_triton = _use_triton(backend, vertical_idx)
    bounded = _check_widths(widths)
    BM = block_m
    BN = block_m if block_n is None else block_n
    if BM % BN:
        raise ValueError(f"block_m={BM} must be a multiple of block_n={BN}")
    if vertical_idx.shape[:2] != slash_idx.shape[:2]:
        raise ValueError(
            f"vertical_idx {tuple(vertical_idx.shape)} and slash_idx {tuple(slash_idx.shape)} must share [B, H]"
        )
    if vertical_idx.device != slash_idx.device:
        raise ValueError(f"vertical_idx is on {vertical_idx.device} but slash_idx is on {slash_idx.device}")
    if use_triton:
        from .list_builder import pattern_tile_lists_triton

        return pattern_tile_lists_triton(vertical_idx, slash_idx, seq_len, BM, BN, bounded)
    r, S = BM // BN, seq_len
    dev = vertical_idx.device
    B, H = vertical_idx.shape[:2]
    Mq, Nk = _cdiv(S, BM), _cdiv(S, BN)
    i32 = torch.int32  # the [B, H, tiles, L] lists are the big tensors
    # --- computed tile offsets u = m*r - t, ascending (u <= 0: the tile overlaps the query rows -> masked) --------
    comp = computed_tile_offsets(slash_idx, S, BM, BN)
    big = Nk + r  # larger than any offset
    u_all = torch.arange(-(r - 1), Nk, device=dev, dtype=i32)
    v = vertical_idx.to(torch.int64)
    vs, nv = _sorted_unique(v, (v >= 0) & (v < S), S)
    if bounded:  # no sync: widths that hold any pattern of these shapes
        n_off, n_col = list_width_bounds(slash_idx.shape[-1], vertical_idx.shape[-1], S, BM, BN)
    elif comp.numel() and nv.numel():  # the one host sync: list width (computed offsets) and column count together
        n_off, n_col = torch.stack([comp.sum(-1).max(), nv.max()]).tolist()
    else:
        n_off = int(comp.sum(-1).max()) if comp.numel() else 0
        n_col = int(nv.max()) if nv.numel() else 0
    L = max(n_off, 1)
    u_asc = torch.where(comp, u_all, big).sort(-1).values[..., :L].contiguous()  # [B, H, L] (L <= UN)
    # query-major: key tile t = m*r - u for u in [m*r - Nk + 1, m*r] (all u but for the last query tile)
    mr = torch.arange(Mq, device=dev, dtype=i32) * r
    first = torch.searchsorted(u_asc, (mr - Nk + 1).expand(B, H, Mq).contiguous())
    end = torch.searchsorted(u_asc, mr.expand(B, H, Mq).contiguous(), right=True)
    n_le0 = torch.searchsorted(u_asc, torch.zeros(B, H, 1, device=dev, dtype=i32), right=True)
    f_cnt = (end - first).to(i32)
    f_nm = torch.minimum((n_le0 - first).clamp(min=0), end - first).to(i32)
    slot = torch.arange(L, device=dev, dtype=i32)
    f_idx = mr[:, None] - u_asc[:, :, None, :]  # [B, H, Mq, L]; row m's entries start at first[m]
    # first[m] = 0 for every m < Mq - 1 (m*r - Nk + 1 <= -(r - 1) there); only the last query tile may skip
    # leading offsets (key tiles past the end), so only its row is shifted
    pos_last = (first[..., -1:] + slot).clamp(max=L - 1).long()  # [B, H, L]
    f_idx[:, :, -1] = mr[-1] - torch.gather(u_asc, 2, pos_last)
    f_idx.clamp_(0, Nk - 1)
    # key-major: query tile m = (t + u) / r where divisible and in range, masked (u <= 0) first
    tt = torch.arange(Nk, device=dev, dtype=i32)
    m_num = tt[:, None] + u_asc[:, :, None, :]  # [B, H, Nk, L]
    ok = (u_asc[:, :, None, :] < big) & (m_num >= 0) & (m_num % r == 0) & (m_num < Mq * r)
    b_cnt = ok.sum(-1, dtype=i32)
    b_nm = (ok & (u_asc[:, :, None, :] <= 0)).sum(-1, dtype=i32)
    Lb = L  # a key tile meets each computed offset at most once: b_cnt <= L (no sync for the exact maximum)
    order = torch.sort(torch.where(ok, slot, slot + L), dim=-1).indices[..., :Lb]
    b_idx = torch.gather(torch.div(m_num, r, rounding_mode="floor"), 3, order).clamp_(0, Mq - 1).to(i32)
    # --- gathered columns: sorted unique verticals, minus those inside a computed tile ---------------------------
    NC = _cdiv(n_col, COL_CHUNK) * COL_CHUNK
    col_idx = col_bits = None
    if NC > 0:
        if vs.shape[-1] < NC:
            vs = torch.cat([vs, vs.new_full((B, H, NC - vs.shape[-1]), S)], -1)
        vs = vs[..., :NC].contiguous()
        J = NC // COL_CHUNK
        # causal prefix: columns <= the last query of tile m (token mask in the kernel does the rest)
        qmax = torch.clamp(torch.arange(Mq, device=dev) * BM + BM - 1, max=S - 1)
        n_le = torch.searchsorted(vs, qmax.expand(B, H, Mq).contiguous(), right=True)  # [B, H, Mq]
        cnt = (n_le[..., None] - torch.arange(J, device=dev) * COL_CHUNK).clamp(0, COL_CHUNK)  # [B, H, Mq, J]
        one = torch.ones((), dtype=torch.int64, device=dev)
        bits = torch.where(cnt >= COL_CHUNK, -one, (one << cnt.clamp(max=COL_CHUNK - 1)) - 1)
        # exclusion: column c (key tile c // BN) is covered for query tile m = (c // BN + u) / r for every computed
        # u (distinct bits, so an integer sum is an OR and its order does not matter: deterministic)
        m_num = (vs // BN)[..., None] + u_asc[:, :, None, :]  # [B, H, NC, L]
        ok = (vs[..., None] < S) & (u_asc[:, :, None, :] < big) & (m_num >= 0) & (m_num % r == 0)
        m_ex = torch.div(m_num, r, rounding_mode="floor")
        ok &= m_ex < Mq
        cslot = torch.arange(NC, device=dev)
        bh = torch.arange(B * H, device=dev).view(B, H, 1, 1)
        flat = (bh * Mq + m_ex.clamp(0, Mq - 1)) * J + (cslot // COL_CHUNK)[:, None]
        val = torch.where(ok, (one << (cslot % COL_CHUNK))[:, None], 0)
        excl = torch.zeros(B * H * Mq * J, dtype=torch.int64, device=dev)
        # integer adds (exact, order-free); entries not ok add 0 (no boolean indexing: no host sync)
        excl.scatter_add_(0, flat.reshape(-1), val.reshape(-1))
        col_bits = (bits & ~excl.view(B, H, Mq, J)).contiguous()
        col_idx = torch.where(vs < S, vs, 0).to(i32)
    return TileLists(BM, BN, f_idx.to(i32).contiguous(), f_cnt, f_nm, b_idx.contiguous(), b_cnt, b_nm, col_idx,
                     col_bits)


# --------------------------------------------------------------------------------------------------------------
# lists for one ring step: my query shard against the key chunk of another rank
# --------------------------------------------------------------------------------------------------------------


def prepare_pattern_tiles(vertical_idx: torch.Tensor, slash_idx: torch.Tensor, seq_len: int, tile: int,
                          widths: str = "exact") -> PatternTiles:
    """Computed tile offsets and unique verticals of a pattern ``[B, H, n]`` on a sequence of ``seq_len`` tokens.

    ``widths``: ``"exact"`` (one host sync reads the most offsets and verticals of any head; the rows are that wide)
    or ``"bounded"`` (no host sync: widths from the pattern's shapes, :func:`list_width_bounds` with square tiles,
    so from a few size classes; the same valid entries, more ``big`` padding). The step lists built from either
    (:func:`step_tile_lists`) hold the same valid entries, counts and column bits, the bounded ones more padding.
    """
    bounded = _check_widths(widths)
    comp = computed_tile_offsets(slash_idx, seq_len, tile, tile)  # [B, H, NT]
    B, H, NT = comp.shape
    big = max(seq_len, NT) + 1
    v = vertical_idx.to(torch.int64)
    vs, nv = _sorted_unique(v, (v >= 0) & (v < seq_len), big)
    if bounded:
        n_off, n_col = list_width_bounds(slash_idx.shape[-1], vertical_idx.shape[-1], seq_len, tile, tile)
    elif comp.numel() and nv.numel():
        n_off, n_col = torch.stack([comp.sum(-1).max(), nv.max()]).tolist()
    else:
        n_off = int(comp.sum(-1).max()) if comp.numel() else 0
        n_col = int(nv.max()) if nv.numel() else 0
    if vs.shape[-1] < n_col:
        vs = torch.cat([vs, vs.new_full((B, H, n_col - vs.shape[-1]), big)], -1)
    u = torch.arange(NT, device=comp.device)
    offsets = torch.where(comp, u, big).sort(-1).values[..., : max(n_off, 1)].contiguous()
    return PatternTiles(tile, offsets, vs[..., :n_col].contiguous(), big)


def sorted_union(values: torch.Tensor, big: int, size: int | None = None, fill: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct entries in ``[0, big)`` of ``values`` (any shape, e.g. the verticals ``[B, H, NV]`` of
    :class:`PatternTiles`, padded with ``big``), ascending, in a tensor of a fixed ``size``, without a host sync:
    ``(union [size] int64, count 0-dim int64)``; ``union[:count]`` are the entries, the rest ``fill`` (default
    ``big``: larger than every entry, so the union stays non-decreasing, and as a key position no query sees it).

    ``size`` must be at least the count; the default, ``size_class(values.numel(), 64, big)``, is an upper bound (at
    most ``values.numel()`` entries, at most ``big`` distinct ones) from a few size classes. The sync-free form of
    ``torch.unique(values[(values >= 0) & (values < big)])``."""
    flat = values.reshape(-1).to(torch.int64)
    n = flat.numel()
    if size is None:
        size = size_class(n, 64, big)
    flat = torch.where((flat >= 0) & (flat < big), flat, big)
    xs, count = _sorted_unique(flat, flat < big, big)
    if n < size:
        xs = torch.cat([xs, xs.new_full((size - n,), big)])
    xs = xs[:size]
    if fill is not None and fill != big:
        xs = torch.where(xs < big, xs, fill)
    return xs.contiguous(), count


def check_tile_aligned(pos: torch.Tensor, tile: int) -> bool:
    """Whether every run of ``tile`` consecutive entries of ``pos`` is one whole global tile (host check)."""
    if pos.numel() % tile:
        return False
    p = pos.view(-1, tile)
    return bool(((p[:, 0] % tile) == 0).all()) and bool((p == p[:, :1] + torch.arange(tile, device=pos.device)).all())


def _compact(idx: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the ``ok`` entries of each row to the front, keeping their order; returns (int32 lists, int32 counts)."""
    L = idx.shape[-1]
    slot = torch.arange(L, device=idx.device)
    order = torch.sort(torch.where(ok, slot, slot + L), dim=-1).indices
    return torch.gather(idx, -1, order).to(torch.int32).contiguous(), ok.sum(-1, dtype=torch.int32)


def step_tile_lists(
    pt: PatternTiles, q_pos: torch.Tensor, k_pos: torch.Tensor, columns: bool = True, tiles: bool = True,
    backend: str = "auto",
) -> TileLists:
    """Lists for queries at global positions ``q_pos`` against keys at ``k_pos`` (one ring step), T x T tiles.

    Every run of T consecutive entries of ``q_pos`` (and of ``k_pos`` when ``tiles``) must be one whole global tile
    (:func:`check_tile_aligned`; the ring checks it once per layout). Local query tile m is global tile gq[m], local
    key tile t is gk[t]: the pair is computed iff gq[m] - gk[t] is a computed offset (>= 0); it needs the token mask
    only on the global diagonal (gq[m] == gk[t]). Gathered columns (``columns=True``): the pattern's verticals that
    lie in this key chunk, for query tile m when key <= its last query and its tile offset is not computed.
    The same pairs as :func:`pattern_tile_lists` on the whole sequence, restricted to this (q, k) block.

    ``tiles=False``: no tile pairs (empty tile lists), columns only; ``k_pos`` may then be any increasing positions,
    e.g. the pattern's vertical keys gathered from every rank.

    ``backend``: ``"triton"`` (:func:`mtraining_kernels.list_builder.step_tile_lists_triton`: one kernel launch, no
    host sync), ``"torch"`` (~40 torch ops below: the CPU path and the reference the Triton builder is tested
    against), or ``"auto"``: Triton on CUDA tensors, torch elsewhere. Both give the same valid list entries, counts,
    ``col_idx`` and ``col_bits``; the padding of the tile lists past the counts differs (0 in the Triton lists).
    """
    if _use_triton(backend, q_pos):
        from .list_builder import step_tile_lists_triton

        return step_tile_lists_triton(pt, q_pos, k_pos, columns, tiles)
    T = pt.tile
    dev = q_pos.device
    q_pos, k_pos = q_pos.to(torch.int64), k_pos.to(torch.int64)
    gq = q_pos[::T] // T  # [Mq] global tile indices, increasing
    Mq = gq.numel()
    U = pt.offsets.to(dev)  # [B, H, L]
    B, H, L = U.shape
    if not tiles:
        Nk = _cdiv(k_pos.numel(), T)
        zeros = lambda n: torch.zeros(B, H, n, dtype=torch.int32, device=dev)  # noqa: E731
        empty = TileLists(T, T, zeros(Mq)[..., None], zeros(Mq), zeros(Mq), zeros(Nk)[..., None], zeros(Nk),
                          zeros(Nk))
        return _with_columns(empty, pt, gq, k_pos, U) if columns else empty
    gk = k_pos[::T] // T  # [Nk]
    Nk = gk.numel()
    u_ok = U < pt.big
    # query-major: key tile gq[m] - u
    tg = gq[None, None, :, None] - U[:, :, None, :]  # [B, H, Mq, L]
    t = torch.searchsorted(gk, tg.clamp(min=0).reshape(-1)).clamp(max=Nk - 1).view(tg.shape)
    ok = u_ok[:, :, None, :] & (gk[t] == tg)
    f_idx, f_cnt = _compact(t, ok)  # u ascends, so the masked diagonal (u = 0) comes first
    f_nm = (ok & (U[:, :, None, :] == 0)).sum(-1, dtype=torch.int32)
    # key-major: query tile gk[t] + u
    mg = gk[None, None, :, None] + U[:, :, None, :]  # [B, H, Nk, L]
    m = torch.searchsorted(gq, mg.reshape(-1)).clamp(max=Mq - 1).view(mg.shape)
    ok = u_ok[:, :, None, :] & (gq[m] == mg)
    b_idx, b_cnt = _compact(m, ok)
    b_nm = (ok & (U[:, :, None, :] == 0)).sum(-1, dtype=torch.int32)
    lists = TileLists(T, T, f_idx, f_cnt, f_nm, b_idx, b_cnt, b_nm)
    return _with_columns(lists, pt, gq, k_pos, U) if columns else lists


def step_tile_lists_batched(
    pt: PatternTiles, q_pos: torch.Tensor, k_pos_steps: torch.Tensor, columns: bool = True, tiles: bool = True,
    backend: str = "auto",
) -> list[TileLists]:
    """:func:`step_tile_lists` for several key chunks of one length at once (``k_pos_steps [W, Sk]``, e.g. every
    ring step of a layer): ``[step_tile_lists(pt, q_pos, k_pos_steps[s], ...) for s in range(W)]``.

    With the Triton backend all W steps are built by one kernel launch (the lists of step s are views of one
    ``[W, ...]`` buffer per field); with torch, one :func:`step_tile_lists` call per step.
    """
    if k_pos_steps.dim() != 2:
        raise ValueError(f"k_pos_steps must be [W, Sk] (the key positions of one step per row); got shape "
                         f"{tuple(k_pos_steps.shape)}: torch.stack the steps' key positions (equal lengths)")
    if _use_triton(backend, q_pos):
        from .list_builder import step_tile_lists_batched_triton

        return step_tile_lists_batched_triton(pt, q_pos, k_pos_steps, columns, tiles)
    return [step_tile_lists(pt, q_pos, k, columns, tiles, backend="torch") for k in k_pos_steps]


def _with_columns(lists: TileLists, pt: PatternTiles, gq: torch.Tensor, k_pos: torch.Tensor, U: torch.Tensor
                  ) -> TileLists:
    """``lists`` plus the gathered columns: the pattern's verticals found in ``k_pos`` (see step_tile_lists)."""
    T, dev = pt.tile, k_pos.device
    B, H, L = U.shape
    Mq = gq.numel()
    col_idx = col_bits = None
    V = pt.verticals.to(dev)  # [B, H, NV]
    NV = V.shape[-1]
    if NV:
        loc = torch.searchsorted(k_pos, V.reshape(-1)).clamp(max=k_pos.numel() - 1).view(V.shape)
        here = (V < pt.big) & (k_pos[loc] == V)
        slot = torch.arange(NV, device=dev)
        order = torch.sort(torch.where(here, slot, slot + NV), dim=-1).indices  # this chunk's columns first, sorted
        loc, here, vpos = (torch.gather(x, -1, order) for x in (loc, here, V))
        NC = _cdiv(NV, COL_CHUNK) * COL_CHUNK
        if NC > NV:
            pad = NC - NV
            loc = torch.cat([loc, loc.new_zeros(B, H, pad)], -1)
            here = torch.cat([here, here.new_zeros(B, H, pad)], -1)
            vpos = torch.cat([vpos, vpos.new_full((B, H, pad), pt.big)], -1)
        qmax = gq * T + T - 1  # [Mq]
        u = gq[None, None, :, None] - vpos[:, :, None, :] // T  # [B, H, Mq, NC]
        j = torch.searchsorted(U, u.clamp(min=0).reshape(B, H, -1)).clamp(max=L - 1)
        covered = (u >= 0) & (torch.gather(U, -1, j).view(u.shape) == u)
        sel = here[:, :, None, :] & (vpos[:, :, None, :] <= qmax[None, None, :, None]) & ~covered
        shifts = torch.arange(COL_CHUNK, device=dev)
        bits = (sel.view(B, H, Mq, NC // COL_CHUNK, COL_CHUNK).to(torch.int64) << shifts).sum(-1)  # distinct bits
        col_bits = bits.contiguous()
        col_idx = torch.where(here, loc, 0).to(torch.int32).contiguous()
    return dataclasses.replace(lists, col_idx=col_idx, col_bits=col_bits)


def lists_have_work(tiles: TileLists) -> torch.Tensor:
    """0-dim bool tensor: whether the lists hold any tile pair or gathered column (no host sync)."""
    work = tiles.fwd_cnt.any()
    if tiles.col_bits is not None:
        work = work | (tiles.col_bits != 0).any()
    return work
