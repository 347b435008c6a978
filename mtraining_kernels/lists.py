"""The work lists the kernels read: :class:`TileLists` (per query tile, the key tiles and gathered key columns one
block pair computes; per key tile, the query tiles, for the backward) and :class:`PatternTiles` (a global pattern
prepared for per-step lists). Built by :mod:`mtraining_kernels.indexing` (torch) and
:mod:`mtraining_kernels.list_builder` (Triton); their exact meaning is in :mod:`mtraining_kernels.indexing`.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["COL_CHUNK", "PatternTiles", "TileLists"]

COL_CHUNK = 64  # gathered columns per kernel step; one int64 of bits per (query tile, chunk)


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
    """A global pattern prepared for per-step lists (built once per layer, one host sync).

    Per ``[B, H]`` row: ``offsets`` the ascending computed tile offsets u >= 0 (global tile diagonals, see the module
    docstring, square tiles of ``tile``), ``verticals`` the sorted unique vertical positions; both padded with
    ``big`` (larger than any entry).
    """

    tile: int
    offsets: torch.Tensor  # [B, H, L] int64
    verticals: torch.Tensor  # [B, H, NV] int64
    big: int
