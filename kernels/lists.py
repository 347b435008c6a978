"""The work lists the kernels read: :class:`TileLists` (per query tile, the key tiles and gathered key columns one
block pair computes; per key tile, the query tiles, for the backward) and :class:`PatternTiles` (a global pattern
prepared for per-step lists). Built by :mod:`mtraining_kernels.indexing` (torch) and
:mod:`mtraining_kernels.list_builder` (Triton); their exact meaning is in :mod:`mtraining_kernels.indexing`.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["COL_CHUNK", "PatternTiles", "TileLists", "list_width_bounds", "size_class"]

COL_CHUNK = 64  # gathered columns per kernel step; one int64 of bits per (query tile, chunk)


def size_class(n: int, floor: int = 16, cap: int | None = None) -> int:
    """``n`` rounded up to a power of two, at least ``floor`` and at most ``cap`` (0 stays 0): a size from a few
    classes, for buffers sized by an upper bound (the list widths of ``widths="bounded"``), so that their shapes,
    and what the allocator and torch.compile see, take few values."""
    if n <= 0:
        return 0
    c = max(floor, 1 << (n - 1).bit_length())
    return c if cap is None else min(c, cap)


def list_width_bounds(n_slash: int, n_vert: int, seq_len: int, block_m: int, block_n: int) -> tuple[int, int]:
    """``(L, NC)``: a list width (computed tile offsets per head) and a gathered-column width (a multiple of
    ``COL_CHUNK``) that hold the lists of every pattern ``[B, H, n_slash]`` / ``[B, H, n_vert]`` on ``seq_len``
    tokens with ``block_m`` x ``block_n`` tiles, from these shapes alone (no host sync), as size classes.

    A slash s crosses the tile offsets u with u*BN - BN < s < u*BN + BM: at most r + 1 of them (r = BM / BN), out of
    the Nk + r - 1 offsets there are; the distinct valid verticals are at most n_vert and at most seq_len."""
    r = block_m // block_n
    n_offsets = -(-seq_len // block_n) + r - 1
    L = max(size_class((r + 1) * n_slash, 16, n_offsets), 1)
    return L, size_class(min(n_vert, seq_len), COL_CHUNK)


@dataclasses.dataclass(frozen=True)
class TileLists:
    """Per-query-tile work lists for one (q, k) block pair; see the module docstring for the exact meaning."""

    block_m: int
    block_n: int
    fwd_idx: torch.Tensor  # [B', H', Mq, Lf] int32 key tiles (masked ones first)
    fwd_cnt: torch.Tensor  # [B', H', Mq] int32
    fwd_nmask: torch.Tensor  # [B', H', Mq] int32
    bwd_idx: torch.Tensor  # [B', H', Nk, Lb] int32 query tiles (masked ones first)
    bwd_cnt: torch.Tensor  # [B', H', Nk] int32
    bwd_nmask: torch.Tensor  # [B', H', Nk] int32
    col_idx: torch.Tensor | None = None  # [B', H', NC] int32 key indices (padding: 0 with bit unset)
    col_bits: torch.Tensor | None = None  # [B', H', Mq, NC // COL_CHUNK] int64

    @property
    def num_q_tiles(self) -> int:
        return self.fwd_idx.shape[2]

    @property
    def num_k_tiles(self) -> int:
        return self.bwd_idx.shape[2]

    def tile_pairs(self) -> torch.Tensor:
        """Number of computed (query tile, key tile) pairs per [B', H'] (for FLOP counts)."""
        return self.fwd_cnt.sum(-1)

    def gathered_columns(self) -> torch.Tensor:
        """Number of gathered (query tile, column) pairs per [B', H'] (each costs block_m query rows)."""
        if self.col_bits is None:
            return torch.zeros_like(self.fwd_cnt[..., 0])
        bits = self.col_bits
        count = torch.zeros(bits.shape, dtype=torch.int64, device=bits.device)
        for i in range(COL_CHUNK):  # popcount, 64 cheap passes over a small tensor
            count += (bits >> i) & 1
        return count.sum((-1, -2))


@dataclasses.dataclass(frozen=True)
class PatternTiles:
    """A global pattern prepared for per-step lists (built once per layer; one host sync, none with bounded widths).

    Per ``[B, H]`` row: ``offsets`` the ascending computed tile offsets u >= 0 (global tile diagonals, see the module
    docstring, square tiles of ``tile``), ``verticals`` the sorted unique vertical positions; both padded with
    ``big`` (larger than any entry). ``counts``: optionally, ``[2, B * H]`` int32, the number of real entries of each
    row of ``offsets`` and of ``verticals`` (the list builder counts them itself where absent).
    """

    tile: int
    offsets: torch.Tensor  # [B, H, L] int64
    verticals: torch.Tensor  # [B, H, NV] int64
    big: int
    counts: torch.Tensor | None = None
