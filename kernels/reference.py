"""Dense-masked torch references for the vertical-slash kernels (the ``*_ref`` functions).

Shape legend: B batch, H query heads, Hkv key/value heads, Sq / Sk query / key lengths, D head dim.

Two ways to get the boolean mask of computed pairs, both [B', H', rows, Sk]:

- :func:`vertical_slash_mask`: straight from the *definition* in :mod:`mtraining_kernels.indexing` (pattern,
  block size), without building any list; the CPU path of ``sparse_attention`` uses it chunk by chunk.
- :func:`tile_lists_mask`: from a :class:`~mtraining_kernels.indexing.TileLists` and positions, i.e. exactly
  what the kernel is told to compute.

:func:`attention_ref` then runs masked softmax attention in the inputs' dtype (use float64 for references).
"""

from __future__ import annotations

import torch

from mtraining_kernels.indexing import COL_CHUNK, TileLists

__all__ = [
    "attention_chunked_ref", "attention_ref", "tile_lists_mask", "tile_rows_mask", "vertical_slash_attention_ref", "vertical_slash_mask",
]


def vertical_slash_mask(
    vertical_idx: torch.Tensor,
    slash_idx: torch.Tensor,
    seq_len: int,
    block_size: int,
    rows: tuple[int, int] | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Mask [B, G, r1 - r0, S] of the pairs computed for pattern ``[B, G, n]`` (see indexing's docstring).

    Tiles are BM x BN = ``block_size`` x ``block_n`` (default square), r = BM / BN. Query i sees key j iff
    j <= i and (the tile offset u = (i // BM) * r - j // BN is computed, or j is a vertical), where offset u is
    computed iff some slash s has u*BN - BN < s < u*BN + BM. Negative entries are padding.
    """
    BM = block_size
    BN = block_size if block_n is None else block_n
    S = seq_len
    r = BM // BN
    r0, r1 = (0, S) if rows is None else rows
    dev = vertical_idx.device
    B, G = vertical_idx.shape[:2]
    Nk = -(-S // BN)
    s = slash_idx.to(torch.int64)
    s_ok = (s >= 0) & (s < S)
    u = torch.arange(-(r - 1), Nk, device=dev)  # [UN]
    hit = (u * BN - BN < s[..., None]) & (s[..., None] < u * BN + BM) & s_ok[..., None]  # [B, G, n, UN]
    comp = hit.any(-2) if s.shape[-1] else torch.zeros(B, G, u.numel(), dtype=torch.bool, device=dev)
    i = torch.arange(r0, r1, device=dev)
    j = torch.arange(S, device=dev)
    uu = (i[:, None] // BM) * r - j[None, :] // BN + (r - 1)  # [rows, S], index into comp
    causal = j[None, :] <= i[:, None]
    tile = torch.gather(comp[:, :, None, :].expand(B, G, r1 - r0, u.numel()), 3,
                        uu.clamp(0, u.numel() - 1)[None, None].expand(B, G, r1 - r0, S))
    v = vertical_idx.to(torch.int64)
    col = torch.zeros(B, G, S + 1, dtype=torch.bool, device=dev)
    col.scatter_(2, torch.where((v >= 0) & (v < S), v, S), torch.ones_like(v, dtype=torch.bool))
    return causal & (tile | col[:, :, None, :S])


def tile_rows_mask(tiles: TileLists, num_keys: int, tiles_range: tuple[int, int] | None = None) -> torch.Tensor:
    """Bool [B', H', tiles, Sk]: for each query tile, the keys its lists name (tiles and gathered columns), before
    the token mask ``k_pos <= q_pos``; ``tiles_range=(m0, m1)`` restricts to query tiles [m0, m1)."""
    Sk, BN = num_keys, tiles.block_n
    Bp, Hp, Mq = tiles.fwd_idx.shape[:3]
    m0, m1 = (0, Mq) if tiles_range is None else tiles_range
    Mr = m1 - m0
    Nk = -(-Sk // BN)
    dev = tiles.fwd_idx.device
    f_idx, f_cnt = tiles.fwd_idx[:, :, m0:m1], tiles.fwd_cnt[:, :, m0:m1]
    slot = torch.arange(f_idx.shape[-1], device=dev)
    live = slot < f_cnt[..., None]
    grid = torch.zeros(Bp, Hp, Mr, Nk + 1, dtype=torch.bool, device=dev)
    grid.scatter_(3, torch.where(live, f_idx.long(), Nk), torch.ones_like(live))
    mask = grid[..., torch.arange(Sk, device=dev) // BN]  # [B', H', Mr, Sk]
    if tiles.col_idx is not None:
        J = tiles.col_bits.shape[-1]
        bit = (tiles.col_bits[:, :, m0:m1, :, None] >> torch.arange(COL_CHUNK, device=dev)) & 1  # [B',H',Mr,J,64]
        bit = bit.reshape(Bp, Hp, Mr, J * COL_CHUNK)
        cols = torch.zeros(Bp, Hp, Mr, Sk, dtype=torch.int64, device=dev)
        # padding slots hold index 0 with bit 0: adding 0 changes nothing
        cols.scatter_add_(3, tiles.col_idx.long()[:, :, None, :].expand(Bp, Hp, Mr, -1).contiguous(), bit)
        mask |= cols > 0
    return mask


def tile_lists_mask(
    tiles: TileLists, q_pos: torch.Tensor, k_pos: torch.Tensor, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """Mask [B', H', Sq, Sk] of the pairs a kernel computes from ``tiles`` (token mask k_pos <= q_pos on all);
    with ``rows=(r0, r1)`` only the query rows [r0, r1): [B', H', r1 - r0, Sk]."""
    Sq = q_pos.shape[0]
    r0, r1 = (0, Sq) if rows is None else rows
    BM = tiles.block_m
    m0, m1 = r0 // BM, -(-r1 // BM)  # the query tiles holding rows [r0, r1)
    per_tile = tile_rows_mask(tiles, k_pos.shape[0], (m0, m1))
    qt = torch.arange(r0, r1, device=q_pos.device) // BM - m0
    return per_tile[:, :, qt] & (k_pos[None, :] <= q_pos[r0:r1, None])


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention in the inputs' dtype: (out [B,H,Sq,D], lse [B,H,Sq]); rows with no key: out 0, lse -inf.

    K/V are repeated over the query heads of their group here only (this is the reference); ``mask`` broadcasts
    to [B, H, Sq, Sk]. ``softcap``: scores ``softcap * tanh(s / softcap)`` before masking.
    """
    H, Hkv = q.shape[1], k.shape[1]
    kr = k.repeat_interleave(H // Hkv, dim=1)
    vr = v.repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(q, kr.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None])
    return torch.matmul(p, vr), lse


def vertical_slash_attention_ref(q, k, v, vertical_idx, slash_idx, block_size: int, scale: float,
                                 block_n: int | None = None):
    """Whole-sequence reference for a pattern (G = H or Hkv): (out, lse) in the inputs' dtype."""
    from mtraining_kernels.indexing import expand_pattern

    H, Hkv, S = q.shape[1], k.shape[1], q.shape[2]
    vi = expand_pattern(vertical_idx, H, Hkv)
    si = expand_pattern(slash_idx, H, Hkv)
    return attention_ref(q, k, v, vertical_slash_mask(vi, si, S, block_size, block_n=block_n), scale)


def attention_chunked_ref(q, k, v, dout, mask_rows, scale: float, dtype: torch.dtype, chunk: int = 1024,
                          softcap: float | None = None):
    """Forward and flash-style backward in torch, chunked over queries, every tensor in ``dtype``.

    ``mask_rows(r0, r1)`` returns the mask [B', H', r1 - r0, Sk] of computed pairs for query rows [r0, r1). Used
    on the GPU at 8K-32K where an S x S float32 tensor would not fit: with ``dtype=float32`` it is the reference,
    with ``dtype=bfloat16`` it is "the same computation in torch at the kernel's precision". Returns
    (out, lse, dq, dk, dv), out/dq/dk/dv in ``dtype``, lse float32; K/V gradients summed over each KV group.
    ``softcap``: scores ``softcap * tanh(s / softcap)`` (computed in float32, the kernels' precision for scores).
    """

    def scores(r0, r1):
        s = torch.matmul(qd[:, :, r0:r1], kr.transpose(-1, -2)) * scale
        if softcap is None:
            return s, None
        t = torch.tanh(s.float() / softcap)
        return (t * softcap).to(s.dtype), 1 - t * t

    B, H, Sq, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qd, kd, vd, dod = (t.to(dtype) for t in (q, k, v, dout))
    kr, vr = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
    out = torch.empty_like(qd)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    for r0 in range(0, Sq, chunk):
        r1 = min(Sq, r0 + chunk)
        s, _ = scores(r0, r1)
        s = s.masked_fill(~mask_rows(r0, r1), float("-inf"))
        lse_c = torch.logsumexp(s.float(), -1)
        safe = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
        p = torch.exp(s.float() - safe[..., None]).to(dtype)
        out[:, :, r0:r1] = torch.matmul(p, vr)
        lse[:, :, r0:r1] = lse_c
    delta = (dod.float() * out.float()).sum(-1)
    dq = torch.empty_like(qd)
    dkr = torch.zeros_like(kr, dtype=torch.float32)  # accumulate over chunks in float32, as one matmul would
    dvr = torch.zeros_like(vr, dtype=torch.float32)
    for r0 in range(0, Sq, chunk):
        r1 = min(Sq, r0 + chunk)
        m = mask_rows(r0, r1)
        s, dcap = scores(r0, r1)
        lse_c = lse[:, :, r0:r1]
        safe = torch.where(torch.isfinite(lse_c), lse_c, torch.full_like(lse_c, float("inf")))
        p = torch.where(m, torch.exp(s.float() - safe[..., None]), 0.0).to(dtype)
        do_c = dod[:, :, r0:r1]
        dvr += torch.matmul(p.transpose(-1, -2), do_c).float()
        dp = torch.matmul(do_c, vr.transpose(-1, -2))
        ds = p.float() * (dp.float() - delta[:, :, r0:r1, None])
        ds = (ds if dcap is None else ds * dcap).to(dtype)
        dq[:, :, r0:r1] = torch.matmul(ds, kr) * scale
        dkr += torch.matmul(ds.transpose(-1, -2), qd[:, :, r0:r1]).float() * scale
    dk = dkr.view(B, Hkv, G, -1, D).sum(2).to(dtype)
    dv = dvr.view(B, Hkv, G, -1, D).sum(2).to(dtype)
    return out, lse, dq, dk, dv
