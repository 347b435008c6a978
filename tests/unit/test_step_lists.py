"""Per-ring-step tile lists (``step_tile_lists``) against the global reference mask.

For random patterns (verticals with padding and duplicates, slashes near and far), every (query rank, key rank) pair
of every layout: the pairs the step's lists name (``tile_lists_mask``) must equal the whole-sequence reference mask
(``vertical_slash_mask``, the definition of ``sparse_attention``) restricted to those two shards' positions; the
query-major and key-major lists must name the same tile pairs, masked (diagonal) tiles first. Exact boolean
comparisons: no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from lightning_mtraining.core.layouts import global_positions
from mtraining_kernels.indexing import (
    check_tile_aligned,
    lists_have_work,
    prepare_pattern_tiles,
    step_tile_lists,
)
from mtraining_kernels.reference import vertical_slash_mask
from mtraining_kernels.testing import tile_lists_mask

T = 16


def _grids(tiles, mq, nk):
    """Boolean [B, H, Mq, Nk] tile grids from the query-major and the key-major lists."""
    B, H = tiles.fwd_cnt.shape[:2]
    fwd = torch.zeros(B, H, mq, nk + 1, dtype=torch.bool)
    slot = torch.arange(tiles.fwd_idx.shape[-1])
    live = slot < tiles.fwd_cnt[..., None].long()
    fwd.scatter_(3, torch.where(live, tiles.fwd_idx.long(), nk), True)
    bwd = torch.zeros(B, H, nk, mq + 1, dtype=torch.bool)
    slot = torch.arange(tiles.bwd_idx.shape[-1])
    live = slot < tiles.bwd_cnt[..., None].long()
    bwd.scatter_(3, torch.where(live, tiles.bwd_idx.long(), mq), True)
    return fwd[..., :nk], bwd[..., :mq].transpose(-1, -2)


@pytest.mark.parametrize("layout, w, n, block", [
    ("striped", 1, 160, 16), ("striped", 3, 240, 16), ("striped", 4, 384, 32), ("contiguous", 3, 288, 16),
    ("zigzag", 2, 256, 16), ("zigzag", 3, 288, 16),
])
def test_step_lists_equal_the_reference_mask(layout, w, n, block):
    g = torch.Generator().manual_seed(n + w)
    B, H = 2, 3
    vi = torch.randint(-1, n, (B, H, 7), generator=g)
    vi[:, :, 1] = vi[:, :, 0]
    si = torch.cat([torch.zeros(B, H, 1, dtype=torch.int64), torch.randint(-1, n, (B, H, 3), generator=g)], -1)
    ref = vertical_slash_mask(vi, si, n, T)
    pt = prepare_pattern_tiles(vi, si, n, T)
    for r in range(w):
        qp = global_positions(n, r, w, layout, block)
        assert check_tile_aligned(qp, T)
        for s in range(w):
            kp = global_positions(n, s, w, layout, block)
            tiles = step_tile_lists(pt, qp, kp)
            want = ref[:, :, qp][:, :, :, kp]
            assert torch.equal(tile_lists_mask(tiles, qp, kp), want), (r, s)
            assert bool(lists_have_work(tiles)) == bool(want.any())
            fwd, bwd = _grids(tiles, qp.numel() // T, kp.numel() // T)
            assert torch.equal(fwd, bwd)
            # the masked (token-level) tiles are exactly the global diagonal ones, and they come first
            gq, gk = qp[::T] // T, kp[::T] // T
            diag = (gq[:, None] == gk[None, :]) & fwd
            assert torch.equal(tiles.fwd_nmask.long(), diag.sum(-1))
            first = torch.gather(tiles.fwd_idx.long(), -1, torch.zeros_like(tiles.fwd_idx[..., :1]).long())[..., 0]
            has = tiles.fwd_nmask > 0
            assert torch.equal(gk[first][has], gq.expand(B, H, -1)[has])


def test_columns_only_lists_over_gathered_keys():
    """tiles=False: no tile pairs; the columns are the pattern's verticals found among arbitrary key positions."""
    n, w = 240, 3
    g = torch.Generator().manual_seed(1)
    vi = torch.randint(-1, n, (1, 2, 9), generator=g)
    si = torch.tensor([[[0, 40]], [[0, 3]]]).view(1, 2, 2)
    pt = prepare_pattern_tiles(vi, si, n, T)
    keys = torch.unique(vi[vi >= 0])  # the verticals of every head, gathered
    ref = vertical_slash_mask(vi, si, n, T)
    tile_only = vertical_slash_mask(torch.full_like(vi, -1), si, n, T)
    for r in range(w):
        qp = global_positions(n, r, w, "striped", T)
        tiles = step_tile_lists(pt, qp, keys, tiles=False)
        assert int(tiles.fwd_cnt.sum()) == 0 and int(tiles.bwd_cnt.sum()) == 0
        want = (ref & ~tile_only)[:, :, qp][:, :, :, keys]  # vertical pairs not covered by a computed tile
        assert torch.equal(tile_lists_mask(tiles, qp, keys), want)
        # and the per-step lists without columns give exactly the tile pairs
        for s in range(w):
            kp = global_positions(n, s, w, "striped", T)
            assert torch.equal(tile_lists_mask(step_tile_lists(pt, qp, kp, columns=False), qp, kp),
                               tile_only[:, :, qp][:, :, :, kp])
