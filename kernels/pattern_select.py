"""The pattern estimator's selection in two Triton launches: from the probe scores to the finished global pattern, the
tiles the ring's list builder reads, and each head's exact pair count and dense decision.

Shape legend: B batch, G pattern heads, H query heads (G = H, or G = Hkv with GRP = H // G query heads per pattern
head), M entries one rank owns of each kind (its local keys for the verticals, its share of the diagonal offsets
for the slashes; M = N / W), N the padded global length, T the tile, NT = N / T tiles, K the top entries kept.

1. :func:`select_keys` (grid: chunks of M, B*G, 2 kinds): every candidate entry (a vertical key that is no sink,
   a diagonal offset outside the local window, both below the row's real length) becomes one int64 key
   ``bits(score) << 32 | (2^32 - 1 - index)``: non-negative float32 bits order like the floats, so the keys order as
   (score descending, index ascending) and are unique; other entries get -1. Each chunk also writes its float64
   sums of every score and of the forced ones (the total and forced mass of top-p), summed later in chunk order.
   ``torch.topk`` of the keys (and, over several ranks, of the gathered top keys) then gives each row's best K in
   the contract's order.
2. :func:`finish_pattern` (grid: B*H, one program per batch row and query head): keeps, within each head's budget,
   the top entries (top-p: while the forced mass plus the mass kept before an entry is below ``top_p`` times the
   total), marks them and the forced entries (sinks, local window) in zeroed scratch rows of N flags, and compacts
   the marks with prefix sums: that sorts and deduplicates them without a sort. In one pass over the slash marks it
   writes the pattern's slash row and flags the tile diagonals each slash crosses (``|s - u*T| < T``); one pass over
   those flags writes the ascending computed offsets (the list builder's ``PatternTiles.offsets``), counts the pairs
   of the tile bands inside the row's real length and keeps a prefix count of the computed offsets; one pass over
   the vertical marks writes the pattern's vertical row and the unique verticals (``PatternTiles.verticals``) and
   adds each vertical's pairs not under a computed tile. The head's allowed pairs (exactly
   :func:`lightning_mtraining.sparsity.balance.allowed_pairs` on the row's real length) decide, in float64, whether
   it allows more than ``dense_above`` of its causal pairs. Every pass writes zeros back over the flags it read, so
   the scratch is zero again for the next call (allocated once, at fixed addresses). A head marked dense by the
   caller (``dense``, the previous forward's decision) gets every tile diagonal and no vertical in its tiles, and its
   own pattern and count as estimated.

Every sum runs in a fixed order and every store of a flag writes 1, so the results are deterministic. The torch
functions of :mod:`lightning_mtraining.sparsity.estimation`, :mod:`mtraining_kernels.indexing` and
:mod:`lightning_mtraining.sparsity.balance` are the reference these kernels are tested against (in the Triton
interpreter): the same index sets, tiles, counts and decisions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launcher

__all__ = ["SELECT_CHUNK", "finish_pattern", "select_keys"]

SELECT_CHUNK = 1024  # entries per program of select_keys: one float64 partial sum of each mass per chunk
_LOW = 0xFFFFFFFF


@triton.jit(do_not_specialize=["off0", "sink", "window"])
def _select_keys_kernel(Vert, Slash, VPos, Lens, Keys, Mass, M, off0, sink, window, G, BG, C,
                        svb, svg, ssb, ssg, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1)
    kind = tl.program_id(2)
    b = row // G
    g = row % G
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M
    length = tl.load(Lens + b).to(tl.int64)
    if kind == 0:
        score = tl.load(Vert + b * svb + g * svg + offs, mask=ok, other=0.0)
        idx = tl.load(VPos + offs, mask=ok, other=0).to(tl.int64)
        forced = idx < sink
    else:
        score = tl.load(Slash + b * ssb + g * ssg + offs, mask=ok, other=0.0)
        idx = (off0 + offs).to(tl.int64)
        forced = idx < window
    cand = ok & (forced == 0) & (idx < length)
    bits = (score + 0.0).to(tl.int32, bitcast=True).to(tl.int64)  # + 0.0: -0.0 -> +0.0 (scores are >= 0)
    key = tl.where(cand, (bits << 32) | (4294967295 - idx), -1)
    out = (kind * BG + row).to(tl.int64) * M
    tl.store(Keys + out + offs, key, mask=ok)
    total = tl.sum(tl.where(ok, score, 0.0).to(tl.float64), 0)
    forced_mass = tl.sum(tl.where(ok & forced, score, 0.0).to(tl.float64), 0)
    mass = Mass + ((kind * BG + row) * C + c) * 2
    tl.store(mass, total)
    tl.store(mass + 1, forced_mass)


@triton.jit
def _masses(Mass, kind, row, W, smw, BG, C):
    """The total and forced mass of a row: the chunks' float64 partials over every rank, in rank then chunk order."""
    total = tl.zeros([1], tl.float64)
    forced = tl.zeros([1], tl.float64)
    for w in range(W):
        for c in range(C):
            base = Mass + w * smw + ((kind * BG + row) * C + c) * 2
            total += tl.load(base + tl.zeros([1], tl.int32))
            forced += tl.load(base + 1 + tl.zeros([1], tl.int32))
    return tl.sum(total, 0), tl.sum(forced, 0)


@triton.jit
def _mark_kept(Top, Mark, kind, row, BG, Kf, budget, total, forced, top_p, TOP_P: tl.constexpr,
               BLOCK: tl.constexpr):
    """Flag the entries a row keeps of its top keys (descending): within the budget, and in top-p mode while the
    forced mass plus the mass kept before the entry is below top_p times the total."""
    carry = tl.zeros([1], tl.float64)
    lane = tl.arange(0, BLOCK)
    for k0 in range(0, Kf, BLOCK):
        slot = k0 + lane
        key = tl.load(Top + (kind * BG + row).to(tl.int64) * Kf + slot, mask=slot < Kf, other=-1)
        valid = key >= 0
        value = tl.where(valid, (key >> 32).to(tl.int32).to(tl.float32, bitcast=True).to(tl.float64), 0.0)
        idx = 4294967295 - (key & 4294967295)
        keep = valid & (slot < budget)
        if TOP_P:
            csum = tl.sum(carry, 0) + tl.cumsum(value, 0)
            keep = keep & (forced + csum - value < top_p * total)
            carry = tl.sum(tl.where(lane == BLOCK - 1, csum, 0.0), 0) + tl.zeros([1], tl.float64)
        tl.store(Mark + idx, tl.full([BLOCK], 1, tl.int8), mask=keep)


@triton.jit
def _mark_first(Mark, count, BLOCK: tl.constexpr):
    """Flag entries 0 .. count - 1 (the forced sinks or local window)."""
    lane = tl.arange(0, BLOCK)
    for f0 in range(0, count, BLOCK):
        tl.store(Mark + f0 + lane, tl.full([BLOCK], 1, tl.int8), mask=f0 + lane < count)


@triton.jit
def _fill(Ptr, start, end, value, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    for p0 in range(start, end, BLOCK):
        tl.store(Ptr + p0 + lane, tl.zeros([BLOCK], tl.int64) + value, mask=p0 + lane < end)


@triton.jit(do_not_specialize=["Kf", "W", "smw", "C", "sink", "window", "nv", "ns", "L", "NV", "big"])
def _finish_kernel(Top, Mass, Budgets, Params, Lens, DenseIn, VMark, SMark, CMark, Prefix,
                   VertOut, SlashOut, Offsets, Verticals, Counts, Allowed, DenseOut,
                   Kf, W, smw, C, B, G, H, GRP, N, NT, T, sink, window, nv, ns, L, NV, big,
                   TOP_P: tl.constexpr, DECIDE: tl.constexpr, HAS_DENSE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    g = h // GRP
    BG = B * G
    row = b * G + g
    writer = (h % GRP) == 0  # one of a pattern head's query heads writes its pattern and count
    length = tl.load(Lens + b).to(tl.int64)
    vmark = VMark + pid.to(tl.int64) * N
    smark = SMark + pid.to(tl.int64) * N
    cmark = CMark + pid.to(tl.int64) * (NT + 1)
    prefix = Prefix + pid.to(tl.int64) * NT
    lane = tl.arange(0, BLOCK)
    # top_p and dense_above as float64 (a float argument would be rounded to float32)
    top_p = tl.load(Params)
    dense_above = tl.load(Params + 1)
    dense = 0
    if HAS_DENSE:
        dense = tl.load(DenseIn + row).to(tl.int32)

    # 1. flag the kept and forced entries
    total, forced = _masses(Mass, 0, row, W, smw, BG, C)
    _mark_kept(Top, vmark, 0, row, BG, Kf, tl.load(Budgets + g), total, forced, top_p, TOP_P, BLOCK)
    _mark_first(vmark, tl.minimum(length, sink), BLOCK)
    total, forced = _masses(Mass, 1, row, W, smw, BG, C)
    _mark_kept(Top, smark, 1, row, BG, Kf, tl.load(Budgets + G + g), total, forced, top_p, TOP_P, BLOCK)
    _mark_first(smark, tl.minimum(length, window), BLOCK)
    tl.debug_barrier()

    # 2. the slashes in ascending order; flag the tile diagonals u each one crosses (|s - u*T| < T: u = s // T and
    #    ceil(s / T))
    count = 0
    for o0 in range(0, N, BLOCK):
        o = o0 + lane
        m = tl.load(smark + o, mask=o < N, other=0).to(tl.int32)
        hit = m != 0
        tl.store(smark + o, tl.zeros([BLOCK], tl.int8), mask=hit)
        pos = count + tl.cumsum(m, 0) - 1
        tl.store(SlashOut + row.to(tl.int64) * ns + pos, o.to(tl.int64), mask=hit & writer)
        tl.store(cmark + o // T, tl.full([BLOCK], 1, tl.int8), mask=hit & (o // T < NT))
        tl.store(cmark + (o + T - 1) // T, tl.full([BLOCK], 1, tl.int8), mask=hit & ((o + T - 1) // T < NT))
        count += tl.sum(m, 0)
    if writer:
        _fill(SlashOut + row.to(tl.int64) * ns, count, ns, -1, BLOCK)
    tl.debug_barrier()

    # 3. the computed tile diagonals: the list builder's offsets (every one for a head run dense), the pairs of their
    #    bands inside the real length, and the prefix count of those u >= 1 (for the verticals' pairs)
    n_real = (length + T - 1) // T  # real tiles
    last = length - (n_real - 1) * T  # real tokens in the last one
    comp0 = tl.load(cmark + tl.zeros([1], tl.int32)).to(tl.int32)  # is the diagonal tile computed
    count = 0
    carry = 0
    tiles = tl.zeros([1], tl.int64)
    for u0 in range(0, NT, BLOCK):
        u = u0 + lane
        c = tl.load(cmark + u, mask=u < NT, other=0).to(tl.int32)
        hit = c != 0
        tl.store(cmark + u, tl.zeros([BLOCK], tl.int8), mask=hit)
        if dense != 0:
            tl.store(Offsets + pid.to(tl.int64) * L + u, u.to(tl.int64), mask=u < NT)
        else:
            tl.store(Offsets + pid.to(tl.int64) * L + count + tl.cumsum(c, 0) - 1, u.to(tl.int64), mask=hit)
        count += tl.sum(c, 0)
        real = hit & (u < n_real)
        band = tl.where(u == 0, (n_real - 1) * (T * (T + 1) // 2) + last * (last + 1) // 2,
                        (n_real - 1 - u) * T * T + last * T)
        tiles += tl.sum(tl.where(real, band, 0), 0)
        later = (real & (u >= 1)).to(tl.int32)
        tl.store(prefix + u, carry + tl.cumsum(later, 0), mask=u < NT)
        carry += tl.sum(later, 0)
    if dense != 0:
        count = NT
    _fill(Offsets + pid.to(tl.int64) * L, count, L, big, BLOCK)
    tl.store(Counts + pid, count)
    tl.debug_barrier()

    # 4. the verticals in ascending order (unique: each is flagged once), and their pairs outside computed tiles
    count = 0
    verts = tl.zeros([1], tl.int64)
    for p0 in range(0, N, BLOCK):
        p = p0 + lane
        m = tl.load(vmark + p, mask=p < N, other=0).to(tl.int32)
        hit = m != 0
        tl.store(vmark + p, tl.zeros([BLOCK], tl.int8), mask=hit)
        pos = count + tl.cumsum(m, 0) - 1
        tl.store(VertOut + row.to(tl.int64) * nv + pos, p.to(tl.int64), mask=hit & writer)
        tl.store(Verticals + pid.to(tl.int64) * NV + pos, p.to(tl.int64), mask=hit & (dense == 0))
        t = p // T
        x = n_real - 1 - t  # the largest offset with a query tile after this key's
        px = tl.load(prefix + x, mask=hit & (x >= 0), other=0).to(tl.int64)
        px1 = tl.load(prefix + x - 1, mask=hit & (x >= 1), other=0).to(tl.int64)
        covered = px * T - tl.where(x >= 1, px - px1, 0) * (T - last)
        after = tl.maximum(length - (t + 1) * T, 0)
        own = tl.where(tl.sum(comp0, 0) != 0, 0, tl.minimum((t + 1) * T, length) - p)
        verts += tl.sum(tl.where(hit, after - covered + own, 0), 0)
        count += tl.sum(m, 0)
    if writer:
        _fill(VertOut + row.to(tl.int64) * nv, count, nv, -1, BLOCK)
    if dense != 0:
        count = 0
    _fill(Verticals + pid.to(tl.int64) * NV, count, NV, big, BLOCK)
    tl.store(Counts + B * H + pid, count)

    # 5. the head's allowed pairs and its decision (float64: exact for counts below 2**53, the same in every pass)
    allowed = tl.sum(tiles + verts, 0)
    if writer:
        tl.store(Allowed + row, allowed)
        if DECIDE:
            causal = (length * (length + 1) // 2).to(tl.float64)
            tl.store(DenseOut + row, (allowed.to(tl.float64) > dense_above * causal).to(tl.int8))


_LAUNCH_KEYS, _LAUNCH_FINISH = Launcher(_select_keys_kernel), Launcher(_finish_kernel)


def select_keys(vert: torch.Tensor, slash: torch.Tensor, vpos: torch.Tensor, off0: int, lens: torch.Tensor,
                sink_tokens: int, local_window: int, keys: torch.Tensor | None = None,
                mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys [2, B, G, M] int64, mass [2, B, G, C, 2] float64)`` of this rank's scores: ``vert [B, G, M]`` (its
    keys, at global positions ``vpos [M]``) and ``slash [B, G, M]`` (the offsets ``off0 .. off0 + M - 1``), both
    float32 with a unit last stride; ``lens [B]`` the real lengths (device). ``keys`` / ``mass``: buffers to fill."""
    B, G, M = vert.shape
    if slash.shape != vert.shape or vert.stride(-1) != 1 or slash.stride(-1) != 1 or vpos.shape != (M,):
        raise ValueError(f"select_keys: vert {tuple(vert.shape)} / slash {tuple(slash.shape)} must match, unit last "
                         f"stride, with one position per entry (vpos {tuple(vpos.shape)})")
    C = triton.cdiv(M, SELECT_CHUNK)
    if keys is None:
        keys = torch.empty(2, B, G, M, dtype=torch.int64, device=vert.device)
    if mass is None:
        mass = torch.empty(2, B, G, C, 2, dtype=torch.float64, device=vert.device)
    _LAUNCH_KEYS((C, B * G, 2),
                 (vert, slash, vpos, lens, keys, mass, M, off0, sink_tokens, local_window, G, B * G, C,
                  vert.stride(0), vert.stride(1), slash.stride(0), slash.stride(1)),
                 dict(BLOCK=SELECT_CHUNK, num_warps=4))
    return keys, mass


def finish_pattern(top: torch.Tensor, mass: torch.Tensor, budgets: torch.Tensor, params: torch.Tensor,
                   lens: torch.Tensor, *, num_heads: int, seq_len: int, tile: int, sink_tokens: int,
                   local_window: int, top_p: bool, decide: bool, dense: torch.Tensor | None,
                   scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   out: tuple[torch.Tensor, ...]) -> None:
    """Finish the pattern from the top keys (see the module docstring), writing ``out``.

    ``top [2, B, G, Kf]`` int64 keys, each row descending (``torch.topk``); ``mass [W, 2, B, G, C, 2]`` the masses'
    partials of every rank (:func:`select_keys`'s, stacked; contiguous but for the rank stride), or one rank's
    ``[2, B, G, C, 2]``; ``budgets [2, G]`` int32 (the vertical and slash budget of
    each pattern head: top-k sizes, or top-p caps); ``params [2]`` float64 ``(top_p, dense_above)`` (their values
    where ``top_p`` / ``decide`` say they apply); ``lens [B]`` the real lengths; ``num_heads`` H (a multiple of G);
    ``seq_len`` N the padded length (a multiple of ``tile``); ``dense [B, G]`` int8 heads to give every tile (or None).
    ``scratch``: zeroed int8 flags ``[B*H, N]`` (verticals), ``[B*H, N]`` (slashes), ``[B*H, NT + 1]`` (tiles) and an
    int32 ``[B*H, NT]``; left zeroed. ``out``: ``(vertical_idx [B, G, nv], slash_idx [B, G, ns], offsets [B, H, L],
    verticals [B, H, NV], counts [2, B*H] int32, allowed [B, G] int64, decided [B, G] int8)``, every row written in
    full (-1 / ``big`` padding, ``big = max(N, NT) + 1``: the list builder's; ``counts`` the real entries of each row
    of ``offsets``, then of ``verticals``).
    """
    if mass.dim() == 5:  # one rank's
        W, smw, (_, B, G, C, _) = 1, 0, mass.shape
    else:
        W, smw, (_, _, B, G, C, _) = mass.shape[0], mass.stride(0), mass.shape
    Kf = top.shape[-1]
    H, N, T = num_heads, seq_len, tile
    NT = N // T
    vert_out, slash_out, offsets, verticals, counts, allowed, decided = out
    vmark, smark, cmark, prefix = scratch
    _LAUNCH_FINISH((B * H,),
                   (top, mass, budgets, params, lens, dense if dense is not None else decided, vmark, smark, cmark,
                    prefix, vert_out, slash_out, offsets, verticals, counts, allowed, decided,
                    Kf, W, smw, C, B, G, H, H // G, N, NT, T, sink_tokens, local_window,
                    vert_out.shape[-1], slash_out.shape[-1], offsets.shape[-1], verticals.shape[-1], max(N, NT) + 1),
                   dict(TOP_P=top_p, DECIDE=decide, HAS_DENSE=dense is not None, BLOCK=256, num_warps=4))
