"""Token layouts: exact indices against hand-derived formulas, round trips, positions, errors."""

import pytest
import torch

from lightning_mtraining.core.layouts import LAYOUTS, global_positions, layout_unit, shard_sequence, unshard_sequence


def expected_indices(n: int, rank: int, w: int, layout: str, bs: int) -> list[int]:
    """Positions written straight from each layout's definition, token by token (no shared code)."""
    if layout == "contiguous":
        return [t for t in range(n) if t // (n // w) == rank]
    if layout == "zigzag":
        chunk = n // (2 * w)
        return [t for t in range(n) if t // chunk in (rank, 2 * w - 1 - rank)]
    return [t for t in range(n) if (t // bs) % w == rank]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("w", range(1, 9))
def test_exact_indices_and_round_trip(layout, w):
    bs = 3
    unit = layout_unit(layout, w, bs)
    n = unit * 5  # odd multiples: never a power of two
    x = torch.arange(n).repeat(2, 1) * 10 + torch.arange(2)[:, None]  # [2, n], distinct per row
    shards = []
    for r in range(w):
        pos = global_positions(n, r, w, layout, bs)
        assert pos.tolist() == expected_indices(n, r, w, layout, bs)
        assert pos.dtype == torch.int64 and bool((pos[1:] > pos[:-1]).all())  # increasing: ops rely on it
        s = shard_sequence(x, 1, r, w, layout, bs)
        assert torch.equal(s, x[:, pos])
        shards.append(s)
    assert torch.equal(unshard_sequence(shards, 1, layout, bs), x)
    # the shards partition the sequence
    allpos = torch.cat([global_positions(n, r, w, layout, bs) for r in range(w)])
    assert torch.equal(allpos.sort().values, torch.arange(n))


def test_negative_dim_and_multi_dim():
    x = torch.randn(2, 3, 24, 4)
    s = shard_sequence(x, -2, 1, 3, "striped", 4)
    assert s.shape == (2, 3, 8, 4)
    assert torch.equal(s, x[:, :, global_positions(24, 1, 3, "striped", 4)])
    shards = [shard_sequence(x, -2, r, 3, "striped", 4) for r in range(3)]
    assert torch.equal(unshard_sequence(shards, -2, "striped", 4), x)


def test_units():
    assert layout_unit("contiguous", 3) == 3
    assert layout_unit("zigzag", 3) == 6
    assert layout_unit("striped", 3, 128) == 384


@pytest.mark.parametrize(
    "layout, n, match",
    [("striped", 100, r"100 .*unit 384 .*pad the sequence to 384"),
     ("zigzag", 7, r"7 .*unit 6 .*pad the sequence to 12"),
     ("contiguous", 4, r"4 .*unit 3")],
)
def test_bad_length_is_a_clear_error(layout, n, match):
    with pytest.raises(ValueError, match=match):
        shard_sequence(torch.zeros(n), 0, 0, 3, layout, 128)
    with pytest.raises(ValueError, match=match):
        global_positions(n, 0, 3, layout, 128)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown layout 'ring'"):
        global_positions(8, 0, 2, "ring")
    with pytest.raises(ValueError, match="rank 2 is out of range for world_size 2"):
        shard_sequence(torch.zeros(8), 0, 2, 2, "contiguous")
    with pytest.raises(ValueError, match="shard 1 has shape"):
        unshard_sequence([torch.zeros(4), torch.zeros(5)], 0, "contiguous")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        layout_unit("striped", 2, 0)
