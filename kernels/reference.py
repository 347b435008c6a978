"""Dense-masked torch references of the vertical-slash kernels that the package also runs: the CPU path of
``sparse_attention`` and the pattern's meaning (:mod:`lightning_mtraining.sparsity`), the torch block op of the ring.

Shape legend: B batch, H query heads, Hkv key/value heads, Sq / Sk query / key lengths, D head dim.

- :func:`vertical_slash_mask`: the boolean mask [B', H', rows, Sk] of computed pairs straight from the *definition*
  in :mod:`mtraining_kernels.indexing` (pattern, block size), without building any list; the CPU path of
  ``sparse_attention`` uses it chunk by chunk.
- :func:`tile_rows_mask`: per query tile, the keys a :class:`~mtraining_kernels.indexing.TileLists` names, i.e.
  what the kernel is told to compute before the token mask.
- :func:`attention_ref`: masked softmax attention in the inputs' dtype (use float64 for references).

The tooling for tests and benchmarks (the pairs of a list with positions, the chunked reference at a chosen
precision, the half-precision rule) is in :mod:`mtraining_kernels.testing`; its names still resolve from here, with
a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings

import torch

from .indexing import COL_CHUNK, TileLists

__all__ = ["attention_ref", "tile_rows_mask", "vertical_slash_mask"]

# names that moved to mtraining_kernels.testing: they resolve from here with a DeprecationWarning (PEP 562)
_MOVED = frozenset({
    "HALF_PRECISION_CASES", "attention_chunked_ref", "check_half_precision", "half_precision_case",
    "half_precision_floor", "kernel_config", "max_abs_errors", "random_pattern", "tile_lists_mask",
    "vertical_slash_attention_ref",
})


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(f"mtraining_kernels.reference.{name} is deprecated: use mtraining_kernels.testing.{name}",
                      DeprecationWarning, stacklevel=2)
        # by name: the dependency runs from the testing tools to this module, and this alias is no edge back
        return getattr(importlib.import_module("mtraining_kernels.testing"), name)
    raise AttributeError(f"module 'mtraining_kernels.reference' has no attribute {name!r}")


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
    if tiles.col_idx is not None and tiles.col_bits is not None:  # (set together)
        J = tiles.col_bits.shape[-1]
        bit = (tiles.col_bits[:, :, m0:m1, :, None] >> torch.arange(COL_CHUNK, device=dev)) & 1  # [B',H',Mr,J,64]
        bit = bit.reshape(Bp, Hp, Mr, J * COL_CHUNK)
        cols = torch.zeros(Bp, Hp, Mr, Sk, dtype=torch.int64, device=dev)
        # padding slots hold index 0 with bit 0: adding 0 changes nothing
        cols.scatter_add_(3, tiles.col_idx.long()[:, :, None, :].expand(Bp, Hp, Mr, -1).contiguous(), bit)
        mask |= cols > 0
    return mask


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
