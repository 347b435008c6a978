"""Triton builder of the vertical-slash tile lists: the lists of :func:`mtraining_kernels.indexing.pattern_tile_lists`
in five kernel launches and about twenty torch calls (the torch builder issues ~190 small ops, whose launch
overhead, not their GPU time, made the conversion 8-12% of the attention at 128K and 2% density on an H200).

Shape legend as in :mod:`mtraining_kernels.indexing`: B batch, H heads of the (expanded) pattern, S sequence length,
BM x BN tiles with BM = R * BN, Mq = ceil(S / BM) query tiles, Nk = ceil(S / BN) key tiles, UN = Nk + R - 1 tile
offsets u = m * R - t in [-(R - 1), Nk - 1], L = the most computed offsets of any head, NC = gathered-column slots.

Kernels (one head per program row, no Python loop over tiles or heads):

1. ``_mark_kernel`` (B*H, slash chunks): flags in ``comp[bh, u + R - 1]`` every offset u crossed by a slash s,
   ``u*BN - BN < s < u*BN + BM`` (at most R + 1 offsets per slash; concurrent stores all write 1).
2. ``_compact_kernel`` (B*H): ``comp`` -> the ascending computed offsets ``u_asc[bh, :]`` (a prefix sum per
   chunk), and the sorted verticals (``torch.sort`` beforehand) -> their unique valid values; writes both counts.
   One host sync then reads L and the column count together.
3. ``_fwd_lists_kernel`` (query-tile blocks, B*H): query tile m gets the key tiles t = m*R - u for the computed u in
   [m*R - Nk + 1, m*R] (a contiguous run of ``u_asc``); masked (u <= 0) ones come first because u ascends.
4. ``_bwd_lists_kernel`` (key-tile blocks, B*H): key tile t gets the query tiles (t + u) / R where divisible and in
   range, in ascending u (masked first), compacted by a prefix sum.
5. ``_col_bits_kernel`` (query-tile blocks, column chunks, B*H): bit i of ``col_bits[bh, m, j]`` is set iff column
   c = ``col_idx[bh, j*64 + i]`` is valid, c <= the last query of tile m, and offset m*R - c // BN is not computed.

The valid entries (``[:cnt]`` of every row), counts, ``col_idx`` and ``col_bits`` equal the torch builder's
exactly (tested in the Triton interpreter); only the unused padding of the key-major lists differs (0 here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtraining_kernels.indexing import COL_CHUNK, TileLists

__all__ = ["pattern_tile_lists_triton"]


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
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


def pattern_tile_lists_triton(
    vertical_idx: torch.Tensor, slash_idx: torch.Tensor, seq_len: int, block_m: int, block_n: int
) -> TileLists:
    """The lists of :func:`mtraining_kernels.indexing.pattern_tile_lists` (patterns ``[B, H, n]``), in Triton.

    Called through ``pattern_tile_lists``, which validates the arguments (tile shapes, [B, H] and devices)."""
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
        _mark_kernel[(BH, triton.cdiv(n_s, 256))](slash_idx.contiguous(), comp, n_s, S, Nk, UN, BM=BM, BN=BN, R=R,
                                                  BLOCK=256)
    u_asc = torch.full((BH, UN), BIG, dtype=i32, device=dev)
    nvw = max(triton.cdiv(n_v, COL_CHUNK), 1) * COL_CHUNK
    v_uniq = torch.full((BH, nvw), S, dtype=i32, device=dev)
    counts = torch.zeros(2, BH, dtype=i32, device=dev)
    v_sorted = vertical_idx.reshape(BH, n_v).sort(-1).values if n_v else vertical_idx.reshape(BH, 0)
    if BH:
        _compact_kernel[(BH,)](comp, u_asc, v_sorted, v_uniq, counts, UN, n_v, nvw, S, BH, R=R,
                               BLOCK_U=1024, BLOCK_V=1024)
        n_off, n_col = counts.amax(1).tolist()  # the one host sync
    else:
        n_off = n_col = 0
    L = max(n_off, 1)
    f_idx = torch.empty(B, H, Mq, L, dtype=i32, device=dev)
    f_cnt = torch.empty(B, H, Mq, dtype=i32, device=dev)
    f_nm = torch.empty_like(f_cnt)
    b_idx = torch.zeros(B, H, Nk, L, dtype=i32, device=dev)
    b_cnt = torch.empty(B, H, Nk, dtype=i32, device=dev)
    b_nm = torch.empty_like(b_cnt)
    block_l = min(triton.next_power_of_2(L), 64)
    if BH:
        _fwd_lists_kernel[(triton.cdiv(Mq, 32), BH)](u_asc, f_idx, f_cnt, f_nm, L, UN, Mq, Nk, BIG, R=R, BLOCK_M=32,
                                                     BLOCK_L=block_l)
        _bwd_lists_kernel[(triton.cdiv(Nk, 32), BH)](u_asc, b_idx, b_cnt, b_nm, L, UN, Mq, Nk, BIG, R=R, BLOCK_T=32,
                                                     BLOCK_L=block_l)
    NC = triton.cdiv(n_col, COL_CHUNK) * COL_CHUNK
    col_idx = col_bits = None
    if NC > 0:
        J = NC // COL_CHUNK
        col_idx = torch.empty(B, H, NC, dtype=i32, device=dev)
        col_bits = torch.empty(B, H, Mq, J, dtype=torch.int64, device=dev)
        _col_bits_kernel[(triton.cdiv(Mq, 32), J, BH)](v_uniq, comp, col_idx, col_bits, nvw, UN, NC, J, Mq, S, BM=BM,
                                                       BN=BN, R=R, BLOCK_M=32, BLOCK_C=COL_CHUNK)
    return TileLists(BM, BN, f_idx, f_cnt, f_nm, b_idx, b_cnt, b_nm, col_idx, col_bits)
