"""Torch references of the kernels for tests and benchmarks (not used at run time): the pairs a kernel computes from
its lists (:func:`tile_lists_mask`), a whole-sequence reference for a pattern (:func:`vertical_slash_attention_ref`),
and the forward and backward in torch chunked over queries at a chosen precision (:func:`attention_chunked_ref`, the
half-precision rule's measure, :mod:`mtraining_kernels.testing.precision`).

Shape legend: B batch, H query heads, Hkv key/value heads, Sq / Sk query / key lengths, D head dim.
"""

from __future__ import annotations

import torch

from ..indexing import TileLists, expand_pattern
from ..reference import attention_ref, tile_rows_mask, vertical_slash_mask

__all__ = ["attention_chunked_ref", "tile_lists_mask", "vertical_slash_attention_ref"]


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


def vertical_slash_attention_ref(q, k, v, vertical_idx, slash_idx, block_size: int, scale: float,
                                 block_n: int | None = None):
    """Whole-sequence reference for a pattern (G = H or Hkv): (out, lse) in the inputs' dtype."""
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
