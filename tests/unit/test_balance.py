"""Exact work counts (lightning_mtraining.sparsity.balance) against pair-by-pair counts of the reference mask.

The reference is ``vertical_slash_mask`` (the kernels' dense-mask reference) with token ownership from
``global_positions``: every count here must be EQUAL, integer for integer, not close.
"""

import math

import pytest
import torch

from lightning_mtraining.core.layouts import LAYOUTS, global_positions
from lightning_mtraining.sparsity.balance import allowed_pairs, imbalance, ring_step_work, ring_work
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern
from mtraining_kernels.reference import vertical_slash_mask


def random_pattern(B: int, G: int, seq_len: int, T: int, n_vert: int, n_slash: int, seed: int = 0):
    """Verticals uniform over the sequence, slashes half near the diagonal and half anywhere; about a quarter of
    the entries are padding (-1) and a few are repeated (duplicates must count once). All entries < seq_len."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, seq_len, (B, G, n_vert), generator=g)
    near = torch.randint(0, min(seq_len, 3 * T), (B, G, n_slash - n_slash // 2), generator=g)
    s = torch.cat([near, torch.randint(0, seq_len, (B, G, n_slash // 2), generator=g)], dim=-1)
    for idx in (v, s):
        idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
        if idx.shape[-1] > 1:
            idx[..., -1] = idx[..., 0]  # a duplicate (or a second padding entry)
    return VerticalSlashPattern(v, s, T)


def empty_pattern(B: int, G: int, T: int):
    return VerticalSlashPattern(torch.full((B, G, 3), -1), torch.full((B, G, 2), -1), T)


def mask_ring_work(pattern, seq_len: int, cp_size: int, layout: str, block_size: int) -> torch.Tensor:
    """[W, W] pairs of the reference mask by (query rank, key rank), counted pair by pair."""
    mask = pattern.mask(seq_len).sum((0, 1)).double()  # [N, N] allowed pairs, summed over rows
    owner = torch.empty(seq_len, dtype=torch.int64)
    for rank in range(cp_size):
        owner[global_positions(seq_len, rank, cp_size, layout, block_size)] = rank
    onehot = torch.nn.functional.one_hot(owner, cp_size).double()  # [N, W]
    return (onehot.T @ mask @ onehot).round().long()


def aligned_length(layout: str, cp_size: int, block_size: int, T: int, at_least: int = 320) -> int:
    """The smallest valid length >= at_least that keeps whole tiles on one rank."""
    unit = {"striped": cp_size * block_size, "contiguous": cp_size * T, "zigzag": 2 * cp_size * T}[layout]
    return unit * math.ceil(at_least / unit)


@pytest.mark.parametrize("seq_len", [37, 100, 163, 256])
@pytest.mark.parametrize("T", [16, 32])
def test_allowed_pairs_equals_mask_count(seq_len, T):
    # allowed_pairs (per tile) vs the reference mask summed pair by pair, per [B, G] row; seq_len mostly not a
    # multiple of T (ragged last tile), padding and duplicates in both index lists.
    p = random_pattern(2, 3, seq_len, T, n_vert=9, n_slash=6, seed=seq_len + T)
    want = vertical_slash_mask(p.vertical_idx, p.slash_idx, seq_len, T).sum((-1, -2))
    got = allowed_pairs(p, seq_len)
    assert got.dtype == torch.int64 and got.shape == (2, 3)
    assert torch.equal(got, want)


def test_allowed_pairs_edge_patterns():
    # empty pattern: nothing; full pattern: every causal pair (ragged N); entries >= N count as padding.
    N, T = 75, 16
    assert torch.equal(allowed_pairs(empty_pattern(1, 2, T), N), torch.zeros(1, 2, dtype=torch.int64))
    full = VerticalSlashPattern.full(2, 1, N, T)
    assert torch.equal(allowed_pairs(full, N), torch.full((2, 1), N * (N + 1) // 2))
    assert torch.equal(full.density(N), torch.ones(2, 1, dtype=torch.float64))
    p = random_pattern(1, 4, N, T, 5, 4, seed=3)
    far = VerticalSlashPattern(torch.cat([p.vertical_idx, torch.full((1, 4, 2), N + 7)], -1),
                               torch.cat([p.slash_idx, torch.full((1, 4, 1), N)], -1), T)
    assert torch.equal(allowed_pairs(far, N), allowed_pairs(p, N))


def pattern_kinds(B: int, G: int, seq_len: int, T: int) -> dict:
    rnd = random_pattern(B, G, seq_len, T, n_vert=12, n_slash=5, seed=seq_len)
    none_v = torch.full_like(rnd.vertical_idx, -1)
    none_s = torch.full_like(rnd.slash_idx, -1)
    return {
        "random": rnd,
        "empty": empty_pattern(B, G, T),
        "full": VerticalSlashPattern.full(B, G, seq_len, T),
        "verticals_only": VerticalSlashPattern(rnd.vertical_idx, none_s, T),
        "slashes_only": VerticalSlashPattern(none_v, rnd.slash_idx, T),
    }


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("tiles_per_block", [1, 2])
def test_ring_work_equals_mask_count(layout, cp_size, tiles_per_block):
    # ring_work (per tile, per residue / per block) vs the reference mask counted pair by pair with token owners
    # from global_positions, for random, empty, full, verticals-only and slashes-only patterns (B = 2, G = 2).
    T = 16
    block_size = tiles_per_block * T
    N = aligned_length(layout, cp_size, block_size, T)
    for kind, p in pattern_kinds(2, 2, N, T).items():
        got = ring_work(p, N, cp_size, layout, block_size)
        want = mask_ring_work(p, N, cp_size, layout, block_size)
        assert got.dtype == torch.int64 and got.shape == (cp_size, cp_size)
        assert torch.equal(got, want), (kind, got, want)
        assert int(got.sum()) == int(allowed_pairs(p, N).sum()), kind


def test_ring_work_full_pattern_is_causal_count():
    # A full pattern is dense causal attention: each rank pair holds exactly the causal pairs between its tokens.
    N, T, W = 1024, 32, 4
    p = VerticalSlashPattern.full(1, 1, N, T)
    for layout in LAYOUTS:
        got = ring_work(p, N, W, layout, 64)
        pos = [global_positions(N, r, W, layout, 64) for r in range(W)]
        want = torch.tensor([[int((pos[s][None, :] <= pos[r][:, None]).sum()) for s in range(W)] for r in range(W)])
        assert torch.equal(got, want), layout


def hand_sources(cp_rank: int, inner_size: int, outer_size: int) -> list[int]:
    """The ring Note's schedule written out: rank (o, i) at (so, si) holds the chunk of ((o-so) % Wo, (i-si) % Wi)."""
    o, i = divmod(cp_rank, inner_size)
    return [((o - so) % outer_size) * inner_size + (i - si) % inner_size
            for so in range(outer_size) for si in range(inner_size)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inner,outer", [(4, 1), (8, 1), (2, 2), (2, 4), (4, 2)])
def test_ring_step_work_follows_schedule(layout, inner, outer):
    # Arrival: step k of rank r equals ring_work[r, source], source from the ring Note's schedule written out
    # by hand; rows sum to ring_work's rows. Gathered: ring steps equal the ring work of the same pattern
    # without verticals, the extra step 0 holds the rest, and the total is the same.
    W, T, bs = inner * outer, 16, 32
    N = aligned_length(layout, W, bs, T, at_least=640)
    p = random_pattern(1, 3, N, T, n_vert=10, n_slash=5, seed=W + inner)
    inner_size = None if outer == 1 else inner  # None: the flat ring
    work = ring_work(p, N, W, layout, bs)
    arrival = ring_step_work(p, N, W, layout, bs, inner_size=inner_size)
    assert arrival.shape == (W, W)
    for r in range(W):
        assert arrival[r].tolist() == [int(work[r, s]) for s in hand_sources(r, inner, outer)]
    assert torch.equal(arrival.sum(1), work.sum(1))

    gathered = ring_step_work(p, N, W, layout, bs, inner_size=inner_size, verticals="gathered")
    no_verticals = VerticalSlashPattern(torch.full_like(p.vertical_idx, -1), p.slash_idx, T)
    tiles = ring_work(no_verticals, N, W, layout, bs)
    assert gathered.shape == (W, W + 1)
    for r in range(W):
        assert gathered[r, 1:].tolist() == [int(tiles[r, s]) for s in hand_sources(r, inner, outer)]
    assert torch.equal(gathered[:, 0], (work - tiles).sum(1))
    assert int(gathered.sum()) == int(work.sum()) == int(allowed_pairs(p, N).sum())


def test_imbalance_hand_computed():
    # [[4, 0], [2, 2]]: both ranks do 4 (total 1.0); steps wait for 4 then 2 = 6 against means 3 + 1 = 4 (1.5).
    out = imbalance(torch.tensor([[4, 0], [2, 2]]))
    assert out["total"] == 1.0 and out["critical_path"] == 1.5
    # [[3, 1], [1, 1]]: ranks 4 and 2, mean 3 (4/3); steps 3 + 1 = 4 against 2 + 1 = 3 (4/3).
    out = imbalance(torch.tensor([[3, 1], [1, 1]]))
    assert out["total"] == pytest.approx(4 / 3) and out["critical_path"] == pytest.approx(4 / 3)
    # three ranks, one step each of 0, 0, 6: max 6 over mean 2 for both.
    out = imbalance(torch.tensor([[0], [0], [6]]))
    assert out == {"total": 3.0, "critical_path": 3.0}
    assert imbalance(torch.zeros(4, 5, dtype=torch.int64)) == {"total": 1.0, "critical_path": 1.0}
    with pytest.raises(ValueError, match=r"\[ranks, steps\]"):
        imbalance(torch.zeros(4))


def test_errors_name_values_and_fix():
    T = 16
    p = random_pattern(1, 1, 512, T, 4, 3)
    with pytest.raises(ValueError, match=r"block_size=24 .* tile_size=16"):
        ring_work(p, 24 * 4, 4, "striped", 24)
    with pytest.raises(ValueError,
                       match=r"contiguous layout: each rank's 24 tokens .* pad seq_len to a multiple of "
                             r"cp_size \* 16 = 64"):
        ring_work(p, 96, 4, "contiguous")
    with pytest.raises(ValueError, match=r"zigzag layout: each chunk's 8 tokens .* multiple of 2 \* cp_size"):
        ring_work(p, 64, 4, "zigzag")
    with pytest.raises(ValueError, match=r"not a positive multiple .* pad the sequence to 512"):
        ring_work(p, 500, 4, "striped", 16)
    with pytest.raises(ValueError, match="unknown layout"):
        ring_work(p, 512, 4, "diagonal")
    with pytest.raises(ValueError, match=r"inner_size=3 must be a positive int dividing cp_size=4"):
        ring_step_work(p, 512, 4, "striped", 16, inner_size=3)
    with pytest.raises(ValueError, match="'arrival' or 'gathered'"):
        ring_step_work(p, 512, 4, "striped", 16, verticals="late")
    with pytest.raises(TypeError, match=r"has no \['vertical_idx', 'slash_idx', 'tile_size'\]"):
        ring_work(object(), 512, 4)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        allowed_pairs(p, 0)


def test_moderately_large_pattern_runs():
    # 128K tokens, W = 8, 16 heads of a local band plus sinks and spread verticals and a few far slashes (T = 128):
    # the three layouts conserve the exact total of allowed_pairs, and striped is the best balanced of the three.
    N, T, W, G = 131072, 128, 8, 16
    g = torch.Generator().manual_seed(1)
    vertical = torch.cat([torch.arange(16).expand(1, G, 16), torch.randint(0, N, (1, G, 300), generator=g)], -1)
    slash = torch.cat([torch.arange(512).expand(1, G, 512), torch.randint(0, N, (1, G, 8), generator=g)], -1)
    p = VerticalSlashPattern(vertical, slash, T)
    total = int(allowed_pairs(p, N).sum())
    stats = {}
    for layout in LAYOUTS:
        work = ring_work(p, N, W, layout)
        assert int(work.sum()) == total
        stats[layout] = imbalance(ring_step_work(p, N, W, layout))
    others = min(stats["zigzag"]["critical_path"], stats["contiguous"]["critical_path"])
    assert stats["striped"]["critical_path"] < others
