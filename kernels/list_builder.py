"""Triton builders of the vertical-slash tile lists: the single-device lists of
:func:`mtraining_kernels.indexing.pattern_tile_lists` in five kernel launches and about twenty torch calls (the torch
builder issues ~190 small ops, whose launch overhead, not their GPU time, made the conversion 8-12% of the attention
at 128K and 2% density on an H200), and the lists of ring steps of :func:`mtraining_kernels.indexing.step_tile_lists`
in one launch (the torch builder: ~40 ops per step, W steps per layer), see the end of this docstring.

Shape legend as in :mod:`mtraining_kernels.indexing`: B batch, H heads of the (expanded) pattern, S sequence length,
BM x BN tiles with BM = R * BN, Mq = ceil(S / BM) query tiles, Nk = ceil(S / BN) key tiles, UN = Nk + R - 1 tile
offsets u = m * R - t in [-(R - 1), Nk - 1], L = the most computed offsets of any head, NC = gathered-column slots.

Single-device kernels (one head per program row, no Python loop over tiles or heads):

1. ``_mark_kernel`` (B*H, slash chunks): flags in ``comp[bh, u + R - 1]`` every offset u crossed by a slash s,
   ``u*BN - BN < s < u*BN + BM`` (at most R + 1 offsets per slash; concurrent stores all write 1).
2. ``_compact_kernel`` (B*H): ``comp`` -> the ascending computed offsets ``u_asc[bh, :]`` (a prefix sum per
   chunk), and the sorted verticals (``torch.sort`` beforehand) -> their unique valid values; writes both counts.
   One host sync then reads L and the column count together (with ``bounded`` widths: none, the widths come from
   the pattern's shapes, :func:`mtraining_kernels.lists.list_width_bounds`).
3. ``_fwd_lists_kernel`` (query-tile blocks, B*H): query tile m gets the key tiles t = m*R - u for the computed u in
   [m*R - Nk + 1, m*R] (a contiguous run of ``u_asc``); masked (u <= 0) ones come first because u ascends.
4. ``_bwd_lists_kernel`` (key-tile blocks, B*H): key tile t gets the query tiles (t + u) / R where divisible and in
   range, in ascending u (masked first), compacted by a prefix sum.
5. ``_col_bits_kernel`` (query-tile blocks, column chunks, B*H): bit i of ``col_bits[bh, m, j]`` is set iff column
   c = ``col_idx[bh, j*64 + i]`` is valid, c <= the last query of tile m, and offset m*R - c // BN is not computed.

The valid entries (``[:cnt]`` of every row), counts, ``col_idx`` and ``col_bits`` equal the torch builder's
exactly (tested in the Triton interpreter); only the unused padding of the key-major lists differs (0 here).

Lists of ring steps (:func:`mtraining_kernels.indexing.step_tile_lists`, T x T tiles; this rank's queries at global
positions ``q_pos`` against the key chunk ``k_pos`` of rank s, or of every rank at once, ``k_pos_steps [W, Sk]``):
ONE launch of ``_step_lists_kernel`` and no host sync (the widths are the shapes of the prepared pattern: L computed
offsets, NV verticals, NC = NV rounded up to 64). Local query tile m is global tile gq[m] = q_pos[m*T] // T, key
tile t is gk[t] = k_pos[t*T] // T (both increasing). Grid (column blocks + query-tile blocks + key-tile blocks,
B*H, W); each program is one of three kinds:

- query-tile block: for every computed offset u (ascending), binary search of gq[m] - u among the gk; the hits
  are compacted by a prefix sum (so the masked diagonal tile, u = 0, comes first), the rest of the row set to 0;
- key-tile block: the same with gk[t] + u among the gq;
- column block (query tiles of a block, all NV verticals in chunks of 64): binary search of each vertical in
  ``k_pos``; the ones found take the column slots 0, 1, ... in order (prefix sum; ``col_idx`` = their local key
  index, written by block 0); bit i of word j is set for query tile m iff slot j*64 + i's key is <= the tile's
  last query and its tile offset gq[m] - key // T is not computed (binary search among the offsets). A chunk's
  slots straddle at most two words: the current word is carried in registers until it is full.

Same valid entries, counts, ``col_idx`` and ``col_bits`` as the torch builder (tested in the interpreter and on the
GPU); the tile lists' padding past the counts is 0 here (the torch builder leaves its sort's leftovers there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launcher
from .lists import COL_CHUNK, PatternTiles, TileLists, list_width_bounds

__all__ = ["pattern_tile_lists_triton", "step_tile_lists_batched_triton", "step_tile_lists_triton"]


# Launch keys (mtraining_kernels.launch): the integers these kernels take (counts, list widths and the strides they
# make, sequence sizes) and the tensors they read that may be views at any offset (the pattern, positions, the lists
# of one ring step) are not specialised, and the block sizes are fixed or one of two (``_block_l``), so the same
# few compiled kernels serve every pattern. Their loads are gathers and short rows, which specialisation would not
# vectorise anyway. The buffers they allocate themselves are always 16-byte aligned.
@triton.jit(do_not_specialize=["Slash", "n_s", "S", "Nk", "UN"])
def _mark_kernel(Slash, Comp, n_s, S, Nk, UN, BM: tl.constexpr, BN: tl.constexpr, R: tl.constexpr,
                 BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s_raw = tl.load(Slash + bh.to(tl.int64) * n_s + offs, mask=offs < n_s, other=-1)
    ok = (s_raw >= 0) & (s_raw < S)  # in the input dtype: a huge int64 must not wrap into range
    s = tl.where(ok, s_raw, 0).to(tl.int32)
    # lo = ceil((s - BM + 1) / BN) = (s + BN) // BN - R (operands >= 0: C division is floor division)
    lo = tl.maximum((s + BN) // BN - R, -(R - 1))
    hi = (s + BN - 1) // BN
    one = tl.full([BLOCK], 1, tl.int32)
    for j in tl.static_range(R + 2):
        u = lo + j
        tl.store(Comp + bh * UN + u + (R - 1), one, mask=ok & (u <= hi) & (u <= Nk - 1))


@triton.jit(do_not_specialize=["VSort", "UN", "n_v", "NVW", "S", "BH"])
def _compact_kernel(Comp, UAsc, VSort, VUniq, Counts, UN, n_v, NVW, S, BH, R: tl.constexpr,
                    BLOCK_U: tl.constexpr, BLOCK_V: tl.constexpr):
    bh = tl.program_id(0)
    n_off = 0
    for u0 in range(0, UN, BLOCK_U):
        offs = u0 + tl.arange(0, BLOCK_U)
        c = tl.load(Comp + bh * UN + offs, mask=offs < UN, other=0)
        pos = n_off + tl.cumsum(c, 0) - 1
        tl.store(UAsc + bh * UN + pos, offs - (R - 1), mask=c != 0)
        n_off += tl.sum(c, 0)
    tl.store(Counts + bh, n_off)
    n_col = 0
    for i0 in range(0, n_v, BLOCK_V):
        offs = i0 + tl.arange(0, BLOCK_V)
        x = tl.load(VSort + bh.to(tl.int64) * n_v + offs, mask=offs < n_v, other=-1)
        prev = tl.load(VSort + bh.to(tl.int64) * n_v + offs - 1, mask=(offs > 0) & (offs < n_v), other=-1)
        keep = (x >= 0) & (x < S) & (x != prev)  # sorted: a repeat equals its predecessor; padding (< 0) first
        k = keep.to(tl.int32)
        pos = n_col + tl.cumsum(k, 0) - 1
        tl.store(VUniq + bh * NVW + pos, tl.where(keep, x, 0).to(tl.int32), mask=keep)
        n_col += tl.sum(k, 0)
    tl.store(Counts + BH + bh, n_col)


@triton.jit(do_not_specialize=["L", "UN", "Mq", "Nk", "BIG"])
def _fwd_lists_kernel(UAsc, FIdx, FCnt, FNm, L, UN, Mq, Nk, BIG, R: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_L: tl.constexpr):
    bh = tl.program_id(1)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < Mq
    mr = m * R
    lo_u = mr - Nk + 1
    first = tl.zeros([BLOCK_M], dtype=tl.int32)
    end = tl.zeros([BLOCK_M], dtype=tl.int32)
    n_le0 = 0  # computed offsets u <= 0 (the same for every row)
    u_row = UAsc + bh * UN
    for l0 in range(0, L, BLOCK_L):
        sl = l0 + tl.arange(0, BLOCK_L)
        u = tl.load(u_row + sl, mask=sl < L, other=BIG)
        first += tl.sum((u[None, :] < lo_u[:, None]).to(tl.int32), 1)
        end += tl.sum((u[None, :] <= mr[:, None]).to(tl.int32), 1)
        n_le0 += tl.sum((u <= 0).to(tl.int32), 0)
    cnt = end - first
    tl.store(FCnt + bh * Mq + m, cnt, mask=m_ok)
    tl.store(FNm + bh * Mq + m, tl.minimum(tl.maximum(n_le0 - first, 0), cnt), mask=m_ok)
    row = (bh * Mq + m).to(tl.int64) * L
    for l0 in range(0, L, BLOCK_L):
        sl = l0 + tl.arange(0, BLOCK_L)
        ok = m_ok[:, None] & (sl < L)[None, :]
        src = tl.minimum(first[:, None] + sl[None, :], L - 1)
        u = tl.load(u_row + src, mask=ok, other=BIG)
        t = tl.minimum(tl.maximum(mr[:, None] - u, 0), Nk - 1)
        tl.store(FIdx + row[:, None] + sl[None, :], t, mask=ok)


@triton.jit(do_not_specialize=["L", "UN", "Mq", "Nk", "BIG"])
def _bwd_lists_kernel(UAsc, BIdx, BCnt, BNm, L, UN, Mq, Nk, BIG, R: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_L: tl.constexpr):
    bh = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < Nk
    cnt = tl.zeros([BLOCK_T], dtype=tl.int32)
    nm = tl.zeros([BLOCK_T], dtype=tl.int32)
    row = (bh * Nk + t).to(tl.int64) * L
    for l0 in range(0, L, BLOCK_L):
        sl = l0 + tl.arange(0, BLOCK_L)
        u = tl.load(UAsc + bh * UN + sl, mask=sl < L, other=BIG)
        m_num = t[:, None] + u[None, :]
        ok = t_ok[:, None] & (u < BIG)[None, :] & (m_num >= 0) & (m_num < Mq * R)
        if R > 1:
            ok = ok & (m_num % R == 0)
        k = ok.to(tl.int32)
        pos = cnt[:, None] + tl.cumsum(k, 1) - 1
        tl.store(BIdx + row[:, None] + pos, m_num // R, mask=ok)
        cnt += tl.sum(k, 1)
        nm += tl.sum((ok & (u <= 0)[None, :]).to(tl.int32), 1)
    tl.store(BCnt + bh * Nk + t, cnt, mask=t_ok)
    tl.store(BNm + bh * Nk + t, nm, mask=t_ok)


@triton.jit(do_not_specialize=["NVW", "UN", "NC", "J", "Mq", "S"])
def _col_bits_kernel(VUniq, Comp, ColIdx, ColBits, NVW, UN, NC, J, Mq, S, BM: tl.constexpr, BN: tl.constexpr,
                     R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    j = tl.program_id(1)
    bh = tl.program_id(2)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, BLOCK_C)
    c = tl.load(VUniq + bh * NVW + j * BLOCK_C + i)  # padding slots hold S
    valid = c < S
    qmax = tl.minimum(m * BM + BM - 1, S - 1)
    vis = valid[None, :] & (c[None, :] <= qmax[:, None]) & (m < Mq)[:, None]
    cu = m[:, None] * R - (c // BN)[None, :] + (R - 1)  # comp index of the tile offset holding (m, c)
    cov = tl.load(Comp + bh * UN + cu, mask=vis & (cu >= 0), other=0)
    bit = vis & (cov == 0)
    one = tl.full([BLOCK_C], 1, tl.int64)
    word = tl.sum(tl.where(bit, (one << i.to(tl.int64))[None, :], 0), 1)  # distinct powers of two: sum == OR
    tl.store(ColBits + (bh * Mq + m).to(tl.int64) * J + j, word, mask=m < Mq)
    if tl.program_id(0) == 0:
        tl.store(ColIdx + bh * NC + j * BLOCK_C + i, tl.where(valid, c, 0))


_LAUNCH_MARK, _LAUNCH_COMPACT, _LAUNCH_FWD, _LAUNCH_BWD, _LAUNCH_BITS = (
    Launcher(fn) for fn in (_mark_kernel, _compact_kernel, _fwd_lists_kernel, _bwd_lists_kernel, _col_bits_kernel))


def _block_l(width: int) -> int:
    """List slots per step of the loops over a list of ``width`` offsets: one of two fixed sizes (a size per width
    would compile a kernel per width class); the lists do not depend on it."""
    return 16 if width <= 16 else 64


def pattern_tile_lists_triton(
    vertical_idx: torch.Tensor, slash_idx: torch.Tensor, seq_len: int, block_m: int, block_n: int,
    bounded: bool = False,
) -> TileLists:
    """The lists of :func:`mtraining_kernels.indexing.pattern_tile_lists` (patterns ``[B, H, n]``), in Triton.

    Called through ``pattern_tile_lists``, which validates the arguments (tile shapes, [B, H] and devices).
    ``bounded``: list widths from the shapes (:func:`mtraining_kernels.lists.list_width_bounds`), no host sync."""
    BM, BN = block_m, block_n
    R, S = BM // BN, seq_len
    dev = vertical_idx.device
    B, H = vertical_idx.shape[:2]
    BH = B * H
    Mq, Nk = triton.cdiv(S, BM), triton.cdiv(S, BN)
    UN, BIG = Nk + R - 1, Nk + R
    i32 = torch.int32
    n_s, n_v = slash_idx.shape[-1], vertical_idx.shape[-1]
    comp = torch.zeros(BH, UN, dtype=i32, device=dev)
    if n_s and BH:
        _LAUNCH_MARK((BH, triton.cdiv(n_s, 256)), (slash_idx.contiguous(), comp, n_s, S, Nk, UN),
                     dict(BM=BM, BN=BN, R=R, BLOCK=256))
    u_asc = torch.full((BH, UN), BIG, dtype=i32, device=dev)
    nvw = max(triton.cdiv(n_v, COL_CHUNK), 1) * COL_CHUNK
    if bounded:  # widths that hold any pattern of these shapes: no host sync
        L, NC = list_width_bounds(n_s, n_v, S, BM, BN)
        nvw = max(nvw, NC)  # (_col_bits_kernel reads NC slots of each row)
    v_uniq = torch.full((BH, nvw), S, dtype=i32, device=dev)
    counts = torch.zeros(2, BH, dtype=i32, device=dev)
    v_sorted = vertical_idx.reshape(BH, n_v).sort(-1).values if n_v else vertical_idx.reshape(BH, 0)
    if BH:
        _LAUNCH_COMPACT((BH,), (comp, u_asc, v_sorted, v_uniq, counts, UN, n_v, nvw, S, BH),
                        dict(R=R, BLOCK_U=1024, BLOCK_V=1024))
    if not bounded:
        n_off, n_col = counts.amax(1).tolist() if BH else (0, 0)  # the one host sync
        L, NC = max(n_off, 1), triton.cdiv(n_col, COL_CHUNK) * COL_CHUNK
    f_idx = torch.empty(B, H, Mq, L, dtype=i32, device=dev)
    f_cnt = torch.empty(B, H, Mq, dtype=i32, device=dev)
    f_nm = torch.empty_like(f_cnt)
    b_idx = torch.zeros(B, H, Nk, L, dtype=i32, device=dev)
    b_cnt = torch.empty(B, H, Nk, dtype=i32, device=dev)
    b_nm = torch.empty_like(b_cnt)
    if BH:
        _LAUNCH_FWD((triton.cdiv(Mq, 32), BH), (u_asc, f_idx, f_cnt, f_nm, L, UN, Mq, Nk, BIG),
                    dict(R=R, BLOCK_M=32, BLOCK_L=_block_l(L)))
        _LAUNCH_BWD((triton.cdiv(Nk, 32), BH), (u_asc, b_idx, b_cnt, b_nm, L, UN, Mq, Nk, BIG),
                    dict(R=R, BLOCK_T=32, BLOCK_L=_block_l(L)))
    col_idx = col_bits = None
    if NC > 0:
        J = NC // COL_CHUNK
        col_idx = torch.empty(B, H, NC, dtype=i32, device=dev)
        col_bits = torch.empty(B, H, Mq, J, dtype=torch.int64, device=dev)
        _LAUNCH_BITS((triton.cdiv(Mq, 32), J, BH), (v_uniq, comp, col_idx, col_bits, nvw, UN, NC, J, Mq, S),
                     dict(BM=BM, BN=BN, R=R, BLOCK_M=32, BLOCK_C=COL_CHUNK))
    return TileLists(BM, BN, f_idx, f_cnt, f_nm, b_idx, b_cnt, b_nm, col_idx, col_bits)


# --------------------------------------------------------------------------------------------------------------
# lists of ring steps: this rank's queries against the key chunk of another rank (indexing.step_tile_lists)
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _lower_bound(base, stride, n, x, top, n_iter, DIV: tl.constexpr):
    """Per lane: the first i < n with ``base[i * stride] // DIV >= x`` (n if none), for a non-decreasing sequence
    (torch.searchsorted's left side). Branch-free binary search by decreasing powers of two: ``top`` is the largest
    power of two <= n (0 if n = 0) and ``n_iter`` = top.bit_length(); the steps add up to >= n, and ``pos`` only
    moves past entries that are < x."""
    pos = tl.zeros_like(x)
    step = top
    for _ in range(n_iter):
        cand = pos + step
        ok = cand <= n
        val = tl.load(base + (cand - 1) * stride, mask=ok, other=0).to(tl.int32)
        if DIV > 1:
            val = val // DIV  # positions >= 0: floor division
        pos = tl.where(ok & (val < x), cand, pos)
        step = step // 2
    return pos


@triton.jit
def _step_rows(Own, Other, URow, Idx, Cnt, Nm, blk, n_own, n_other, L, n_u, BIG, top, n_iter, SIGN: tl.constexpr,
               T: tl.constexpr, BLOCK: tl.constexpr, BLOCK_L: tl.constexpr):
    """One block of list rows. Query-major (SIGN = -1, Own = q_pos, Other = k_pos): row m lists the key tiles t with
    gk[t] = gq[m] - u; key-major (SIGN = +1, Own = k_pos, Other = q_pos): row t lists the query tiles m with
    gq[m] = gk[t] + u; for the computed u in ascending order, so the masked diagonal tile (u = 0) comes first.
    ``n_u``: the row's computed offsets (its first ``n_u`` entries; the rest of its L are padding), so the searches
    follow the pattern, not the width the lists were sized to."""
    r = blk * BLOCK + tl.arange(0, BLOCK)
    r_ok = r < n_own
    g_own = tl.load(Own + r.to(tl.int64) * T, mask=r_ok, other=0).to(tl.int32) // T
    cnt = tl.zeros([BLOCK], dtype=tl.int32)
    nm = tl.zeros([BLOCK], dtype=tl.int32)
    row = r.to(tl.int64) * L
    for l0 in range(0, n_u, BLOCK_L):
        sl = l0 + tl.arange(0, BLOCK_L)
        u = tl.load(URow + sl, mask=sl < n_u, other=BIG).to(tl.int32)
        target = g_own[:, None] + SIGN * u[None, :]
        # the torch builder's test: searchsorted of max(target, 0) (only gq - u can be < 0), clamped, then equality
        idx = tl.minimum(_lower_bound(Other, T, n_other, tl.maximum(target, 0), top, n_iter, T), n_other - 1)
        g_other = tl.load(Other + idx * T).to(tl.int32) // T
        ok = r_ok[:, None] & (u < BIG)[None, :] & (g_other == target)
        k = ok.to(tl.int32)
        pos = cnt[:, None] + tl.cumsum(k, 1) - 1  # compaction by a prefix sum, in ascending u
        tl.store(Idx + row[:, None] + pos, idx, mask=ok)
        cnt += tl.sum(k, 1)
        nm += tl.sum((ok & (u == 0)[None, :]).to(tl.int32), 1)
    tl.store(Cnt + r, cnt, mask=r_ok)
    tl.store(Nm + r, nm, mask=r_ok)
    for l0 in range(0, L, BLOCK_L):  # padding past the count: 0 (a valid tile index)
        sl = l0 + tl.arange(0, BLOCK_L)
        pad = r_ok[:, None] & (sl[None, :] >= cnt[:, None]) & (sl < L)[None, :]
        tl.store(Idx + row[:, None] + sl[None, :], tl.zeros([BLOCK, BLOCK_L], dtype=tl.int32), mask=pad)


@triton.jit
def _step_columns(QPos, KPos, URow, VRow, ColIdx, ColBits, blk, Mq, Sk, L, NV, n_v, NC, J, BIG, top_s, it_s, top_u,
                  it_u, T: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_J: tl.constexpr):
    """The column bit words of the query tiles of one block (and, for block 0, ``col_idx``).

    Walks the verticals in chunks of CHUNK, in order. The verticals found in this key chunk ("here") take the
    column slots 0, 1, ... in order; a chunk's here-verticals fill the slots [n0, n0 + count), which span the
    current word w (= n0 // CHUNK) and possibly the next: ``carry`` holds word w's bits until it is full."""
    m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < Mq
    gq = tl.load(QPos + m.to(tl.int64) * T, mask=m_ok, other=0).to(tl.int32) // T
    qmax = gq * T + T - 1
    i = tl.arange(0, CHUNK)
    first = blk == 0
    one = tl.full([CHUNK], 1, tl.int64)
    words = ColBits + m.to(tl.int64) * J
    carry = tl.zeros([BLOCK_M], dtype=tl.int64)
    n0 = 0  # here-verticals so far (the next free slot)
    w = 0  # the word being filled
    for c0 in range(0, n_v, CHUNK):  # the row's n_v verticals (the rest of its NV slots are padding)
        vi = c0 + i
        v = tl.load(VRow + vi, mask=vi < n_v, other=BIG).to(tl.int32)
        loc = tl.minimum(_lower_bound(KPos, 1, Sk, v, top_s, it_s, 1), Sk - 1)
        here = (v < BIG) & (tl.load(KPos + loc).to(tl.int32) == v)
        h = here.to(tl.int32)
        p = n0 + tl.cumsum(h, 0) - h  # slot of each here-vertical
        tl.store(ColIdx + p, loc, mask=here & first)
        # gathered for query tile m unless past its last query or inside a computed tile (offset gq - v // T)
        uu = gq[:, None] - (v // T)[None, :]
        j = tl.minimum(_lower_bound(URow, 1, L, tl.maximum(uu, 0), top_u, it_u, 1), L - 1)
        covered = (uu >= 0) & (tl.load(URow + j).to(tl.int32) == uu)
        sel = m_ok[:, None] & here[None, :] & (v[None, :] <= qmax[:, None]) & ~covered
        bit = one << (p % CHUNK).to(tl.int64)
        word = p // CHUNK
        lo = tl.sum(tl.where(sel & (word == w)[None, :], bit[None, :], 0), 1)  # distinct bits: sum == OR
        hi = tl.sum(tl.where(sel & (word == w + 1)[None, :], bit[None, :], 0), 1)
        cur = carry | lo
        n1 = n0 + tl.sum(h, 0)
        full = (n1 // CHUNK) > w
        tl.store(words + w, cur, mask=m_ok & full)
        carry = tl.where(full, hi, cur)
        w = tl.where(full, w + 1, w)
        n0 = n1
    tl.store(words + w, carry, mask=m_ok & (w < J))
    for j0 in range(0, J, BLOCK_J):  # words past the last filled one
        jj = j0 + tl.arange(0, BLOCK_J)
        pad = m_ok[:, None] & ((jj > w) & (jj < J))[None, :]
        tl.store(words[:, None] + jj[None, :], tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.int64), mask=pad)
    for c0 in range(0, NC, CHUNK):  # col_idx slots past the here-verticals: 0
        slot = c0 + i
        tl.store(ColIdx + slot, tl.zeros([CHUNK], dtype=tl.int32), mask=first & (slot >= n0) & (slot < NC))


@triton.jit(do_not_specialize=["QPos", "KPos", "U", "V", "UCnt", "VCnt", "FIdx", "FCnt", "FNm", "BIdx", "BCnt",
                               "BNm", "ColIdx", "ColBits", "Mq", "Nk", "Sk", "L", "NV", "NC", "J", "BIG", "BH", "v_off",
                               "n_col", "n_fwd", "top_q", "it_q", "top_k", "it_k", "top_s", "it_s", "top_u", "it_u"])
def _step_lists_kernel(QPos, KPos, U, V, UCnt, VCnt, FIdx, FCnt, FNm, BIdx, BCnt, BNm, ColIdx, ColBits,
                       Mq, Nk, Sk, L, NV, NC, J, BIG, BH, v_off, n_col, n_fwd, top_q, it_q, top_k, it_k, top_s, it_s,
                       top_u, it_u,
                       T: tl.constexpr, TILES: tl.constexpr, COLUMNS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_L: tl.constexpr, CHUNK: tl.constexpr, BLOCK_J: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    st = tl.program_id(2)  # ring step (key chunk)
    sbh = (st * BH + bh).to(tl.int64)
    KRow = KPos + st.to(tl.int64) * Sk
    URow = U + bh.to(tl.int64) * L
    if pid < n_col:  # the column programs first: they are the longest (n_col = 0 without COLUMNS)
        if COLUMNS:
            _step_columns(QPos, KRow, URow, V + bh.to(tl.int64) * NV, ColIdx + sbh * NC, ColBits + sbh * Mq * J,
                          pid, Mq, Sk, L, NV, tl.load(VCnt + v_off + bh), NC, J, BIG, top_s, it_s, top_u, it_u, T,
                          BLOCK_M, CHUNK, BLOCK_J)
    else:
        if TILES:
            blk = pid - n_col
            n_u = tl.load(UCnt + bh)
            if blk < n_fwd:
                _step_rows(QPos, KRow, URow, FIdx + sbh * Mq * L, FCnt + sbh * Mq, FNm + sbh * Mq, blk, Mq, Nk, L,
                           n_u, BIG, top_k, it_k, -1, T, BLOCK_M, BLOCK_L)
            else:
                _step_rows(KRow, QPos, URow, BIdx + sbh * Nk * L, BCnt + sbh * Nk, BNm + sbh * Nk, blk - n_fwd, Nk,
                           Mq, L, n_u, BIG, top_q, it_q, 1, T, BLOCK_M, BLOCK_L)


_LAUNCH_STEPS = Launcher(_step_lists_kernel)


def _search_steps(n: int) -> tuple[int, int]:
    """(top, n_iter) of :func:`_lower_bound` over n entries."""
    top = 1 << (n.bit_length() - 1) if n > 0 else 0
    return top, top.bit_length()


def step_tile_lists_batched_triton(pt: PatternTiles, q_pos: torch.Tensor, k_pos_steps: torch.Tensor,
                                   columns: bool = True, tiles: bool = True) -> list[TileLists]:
    """:func:`mtraining_kernels.indexing.step_tile_lists` for W key chunks ``k_pos_steps [W, Sk]`` in one launch.

    Called through ``indexing.step_tile_lists`` / ``step_tile_lists_batched``. No host sync: the list widths come
    from the shapes of ``pt`` (L offsets, NV verticals). Positions and the pattern's entries are computed on in
    int32 (sequences < 2**31 tokens)."""
    T = pt.tile
    dev = q_pos.device
    U = pt.offsets.to(dev).contiguous()  # [B, H, L] int64
    V = pt.verticals.to(dev).contiguous()  # [B, H, NV] int64
    B, H, L = U.shape
    NV = V.shape[-1]
    BH = B * H
    W, Sk = k_pos_steps.shape
    if not (q_pos.numel() and Sk):
        raise ValueError(f"empty positions: q_pos has {q_pos.numel()} entries, each key chunk {Sk}")
    Mq, Nk = triton.cdiv(q_pos.numel(), T), triton.cdiv(Sk, T)
    q_pos, k_pos_steps = q_pos.contiguous(), k_pos_steps.contiguous()
    do_cols = columns and NV > 0
    NC = triton.cdiv(NV, COL_CHUNK) * COL_CHUNK
    J = NC // COL_CHUNK
    i32 = torch.int32
    # one step: its lists without the leading step dimension (the same memory; no view per list)
    lead = (W,) if W > 1 else ()
    if tiles:
        f_idx = torch.empty(*lead, B, H, Mq, L, dtype=i32, device=dev)
        f_cnt = torch.empty(*lead, B, H, Mq, dtype=i32, device=dev)
        f_nm = torch.empty(*lead, B, H, Mq, dtype=i32, device=dev)
        b_idx = torch.empty(*lead, B, H, Nk, L, dtype=i32, device=dev)
        b_cnt = torch.empty(*lead, B, H, Nk, dtype=i32, device=dev)
        b_nm = torch.empty(*lead, B, H, Nk, dtype=i32, device=dev)
    else:  # empty lists, as the torch builder's: width 1, all zero (one buffer, one fill)
        zf, zb = torch.zeros(3 * W * BH * (Mq + Nk), dtype=i32, device=dev).split([3 * W * BH * Mq, 3 * W * BH * Nk])
        f_idx, f_cnt, f_nm = zf.view(3, W, B, H, Mq)
        b_idx, b_cnt, b_nm = zb.view(3, W, B, H, Nk)
        f_idx, b_idx = f_idx[..., None], b_idx[..., None]
        if not lead:
            f_idx, f_cnt, f_nm, b_idx, b_cnt, b_nm = (t[0] for t in (f_idx, f_cnt, f_nm, b_idx, b_cnt, b_nm))
    col_idx = torch.empty(*lead, B, H, NC, dtype=i32, device=dev) if do_cols else None
    col_bits = torch.empty(*lead, B, H, Mq, J, dtype=torch.int64, device=dev) if do_cols else None
    BLOCK_M = 32
    n_blk_m, n_blk_k = triton.cdiv(Mq, BLOCK_M), triton.cdiv(Nk, BLOCK_M)
    n_col = n_blk_m if do_cols else 0
    n_prog = n_col + (n_blk_m + n_blk_k if tiles else 0)
    if n_prog and BH and W:
        dummy = q_pos  # stands in for the outputs a launch does not write (never dereferenced)
        # each row's real entries (sorted, padding ``big`` last): the kernel's loops stop there, so bounded widths
        # (lists sized from the pattern's shapes) cost the builder nothing
        if pt.counts is not None:  # [2, BH]: the offsets' counts, then the verticals' (at v_off)
            u_cnt = v_cnt = pt.counts
            v_off = BH
        else:
            u_cnt = (U < pt.big).sum(-1, dtype=i32).reshape(BH)
            v_cnt = (V < pt.big).sum(-1, dtype=i32).reshape(BH) if NV else u_cnt
            v_off = 0
        _LAUNCH_STEPS(
            (n_prog, BH, W),
            (q_pos, k_pos_steps, U, V if NV else dummy, u_cnt, v_cnt,
             *((f_idx, f_cnt, f_nm, b_idx, b_cnt, b_nm) if tiles else (dummy,) * 6),
             *((col_idx, col_bits) if do_cols else (dummy,) * 2),
             Mq, Nk, Sk, L, NV, NC, J, pt.big, BH, v_off, n_col, n_blk_m,
             *_search_steps(Mq), *_search_steps(Nk), *_search_steps(Sk), *_search_steps(L)),
            # (BLOCK_L only matters for the tile rows: fixed without them)
            dict(T=T, TILES=tiles, COLUMNS=do_cols, BLOCK_M=BLOCK_M, BLOCK_L=_block_l(L) if tiles else 16,
                 CHUNK=COL_CHUNK, BLOCK_J=16),
        )
    if not lead:
        return [TileLists(T, T, f_idx, f_cnt, f_nm, b_idx, b_cnt, b_nm, col_idx, col_bits)]
    return [
        TileLists(T, T, f_idx[s], f_cnt[s], f_nm[s], b_idx[s], b_cnt[s], b_nm[s],
                  None if col_idx is None else col_idx[s], None if col_bits is None else col_bits[s])
        for s in range(W)
    ]


def step_tile_lists_triton(pt: PatternTiles, q_pos: torch.Tensor, k_pos: torch.Tensor, columns: bool = True,
                           tiles: bool = True) -> TileLists:
    """:func:`mtraining_kernels.indexing.step_tile_lists` (one ring step) in one kernel launch."""
    return step_tile_lists_batched_triton(pt, q_pos, k_pos[None], columns, tiles)[0]
