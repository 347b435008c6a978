"""List widths without a host sync (``widths="bounded"``) and the sync-free union of the verticals
(``sorted_union``), torch builders on CPU.

What is compared, exactly (integers and booleans, no tolerance): the bounded lists against the exact ones (one host
sync) of the same pattern: the pairs they name (``tile_lists_mask``, the kernels' meaning of a list), the counts,
the valid entries of every row, the column slots and bit words (the bounded ones hold the exact ones followed by
padding: column 0, no bit); their widths equal :func:`list_width_bounds` whatever the pattern's values. No host sync:
the bounded builders run on the ``meta`` device (no data: any read back to the host raises there, as the exact ones
do). The Triton builders' bounded widths are checked in the interpreter (``test_launch_keys.py``).
"""

from __future__ import annotations

import pytest
import torch

from lightning_mtraining.core.layouts import global_positions
from mtraining_kernels.indexing import (
    COL_CHUNK,
    list_width_bounds,
    pattern_tile_lists,
    prepare_pattern_tiles,
    size_class,
    sorted_union,
    step_tile_lists,
)
from mtraining_kernels.testing import tile_lists_mask


def _patterns(B: int, H: int, S: int, seed: int, widths=((1, 1), (5, 2), (40, 3), (70, 9), (130, 17))):
    """Top-k-like (every head full) and top-p-like patterns (random counts per head, -1 padding, an empty head,
    duplicates and out-of-range verticals), of the given ``(verticals, slashes)`` widths."""
    g = torch.Generator().manual_seed(seed)
    for n_v, n_s in widths:
        vi = torch.randint(0, S, (B, H, n_v), generator=g)
        si = torch.randint(0, S, (B, H, n_s), generator=g)
        si[..., 0] = 0
        yield vi, si
        keep_v = torch.rand(B, H, n_v, generator=g) < 0.6
        keep_s = torch.rand(B, H, n_s, generator=g) < 0.6
        vi2 = torch.where(keep_v, vi, -1)
        vi2[..., -1] = S + 3  # out of range: ignored
        si2 = torch.where(keep_s, si, -1)
        vi2[0, 0], si2[0, 0] = -1, -1  # an empty head
        yield vi2, si2


def _assert_same_pairs(exact, bounded, q_pos, k_pos, where: str) -> None:
    assert torch.equal(tile_lists_mask(exact, q_pos, k_pos), tile_lists_mask(bounded, q_pos, k_pos)), where
    for which in ("fwd", "bwd"):
        cnt = getattr(exact, f"{which}_cnt")
        assert torch.equal(cnt, getattr(bounded, f"{which}_cnt")), f"{where}: {which}_cnt"
        assert torch.equal(getattr(exact, f"{which}_nmask"), getattr(bounded, f"{which}_nmask")), where
        a, b = getattr(exact, f"{which}_idx"), getattr(bounded, f"{which}_idx")
        assert b.shape[-1] >= a.shape[-1], where
        valid = torch.arange(a.shape[-1]) < cnt[..., None]
        assert torch.equal(a[valid], b[..., : a.shape[-1]][valid]), f"{where}: {which}_idx"
    if exact.col_idx is None:
        assert bounded.col_idx is None or not bounded.col_bits.any(), where
        return
    nc, j = exact.col_idx.shape[-1], exact.col_bits.shape[-1]
    assert torch.equal(exact.col_idx, bounded.col_idx[..., :nc]) and not bounded.col_idx[..., nc:].any(), where
    assert torch.equal(exact.col_bits, bounded.col_bits[..., :j]) and not bounded.col_bits[..., j:].any(), where


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 16)])
def test_pattern_lists_bounded_widths_hold_the_exact_lists(block_m, block_n):
    B, H, S = 2, 3, 200
    pos = torch.arange(S)
    for i, (vi, si) in enumerate(_patterns(B, H, S, seed=block_m)):
        exact = pattern_tile_lists(vi, si, S, block_m, block_n, backend="torch")
        bounded = pattern_tile_lists(vi, si, S, block_m, block_n, backend="torch", widths="bounded")
        _assert_same_pairs(exact, bounded, pos, pos, f"pattern {i}")
        L, NC = list_width_bounds(si.shape[-1], vi.shape[-1], S, block_m, block_n)
        assert bounded.fwd_idx.shape[-1] == bounded.bwd_idx.shape[-1] == L
        assert bounded.col_idx.shape[-1] == NC and NC % COL_CHUNK == 0


@pytest.mark.parametrize("layout, w, n", [("striped", 3, 240), ("zigzag", 2, 192)])
def test_step_lists_from_bounded_pattern_tiles_hold_the_exact_lists(layout, w, n):
    B, H, T = 1, 2, 16
    for i, (vi, si) in enumerate(_patterns(B, H, n, seed=n, widths=((5, 2), (70, 9), (130, 17)))):
        exact = prepare_pattern_tiles(vi, si, n, T)
        bounded = prepare_pattern_tiles(vi, si, n, T, widths="bounded")
        L, NV = list_width_bounds(si.shape[-1], vi.shape[-1], n, T, T)
        assert bounded.offsets.shape[-1] == L and bounded.verticals.shape[-1] == NV
        assert exact.big == bounded.big
        for name in ("offsets", "verticals"):
            a, b = getattr(exact, name), getattr(bounded, name)
            assert torch.equal(a, b[..., : a.shape[-1]]) and (b[..., a.shape[-1]:] == exact.big).all(), name
        for r in range(w):
            qp = global_positions(n, r, w, layout, T)
            for s in range(w):
                kp = global_positions(n, s, w, layout, T)
                _assert_same_pairs(step_tile_lists(exact, qp, kp, backend="torch"),
                                   step_tile_lists(bounded, qp, kp, backend="torch"), qp, kp,
                                   f"pattern {i} q {r} k {s}")


def test_bounded_widths_need_no_host_sync():
    # the meta device holds no data: a read back to the host raises there
    B, H, S = 2, 3, 200
    vi = torch.randint(-1, S, (B, H, 20), device="meta")
    si = torch.randint(-1, S, (B, H, 5), device="meta")
    tiles = pattern_tile_lists(vi, si, S, 16, backend="torch", widths="bounded")
    assert tiles.fwd_idx.shape[-1] == list_width_bounds(5, 20, S, 16, 16)[0]
    pt = prepare_pattern_tiles(vi, si, S, 16, widths="bounded")
    lists = step_tile_lists(pt, torch.arange(96, device="meta"), torch.arange(96, 200, device="meta"),
                            backend="torch")
    assert lists.col_bits.shape[-1] == pt.verticals.shape[-1] // COL_CHUNK
    union, count = sorted_union(pt.verticals, pt.big)
    assert union.shape == (size_class(pt.verticals.numel(), 64, pt.big),) and count.shape == ()
    with pytest.raises(NotImplementedError):  # the exact widths read the counts back
        prepare_pattern_tiles(vi, si, S, 16)


def test_size_classes():
    assert [size_class(n) for n in (0, 1, 16, 17, 100, 1000)] == [0, 16, 16, 32, 128, 1024]
    assert size_class(5, 64) == 64 and size_class(100, 16, 40) == 40
    # the list widths depend on the pattern's shapes only, in few classes
    assert list_width_bounds(3, 70, 1000, 16, 16) == (16, 128)
    assert list_width_bounds(30, 0, 1000, 16, 16) == (63, 0)  # capped at the 63 tile offsets there are
    assert list_width_bounds(0, 5, 1000, 32, 16) == (1, 64)


def test_sorted_union_is_the_unique_valid_entries_padded():
    g = torch.Generator().manual_seed(0)
    big = 500
    for shape in ((2, 3, 40), (1, 1, 1), (4, 2, 300), (3, 0)):
        x = torch.randint(-5, big + 20, shape, generator=g)
        if x.numel():
            x.view(-1)[: x.numel() // 2] = x.view(-1)[x.numel() // 2: 2 * (x.numel() // 2)]  # duplicates
        want = torch.unique(x[(x >= 0) & (x < big)])
        union, count = sorted_union(x, big)
        assert union.dtype == torch.int64 and union.shape == (size_class(x.numel(), 64, big),)
        assert int(count) == want.numel()
        assert torch.equal(union[: want.numel()], want) and (union[want.numel():] == big).all()
        union, count = sorted_union(x, big, size=max(want.numel(), 1) + 7, fill=2**31 - 1)
        assert union.shape == (max(want.numel(), 1) + 7,) and torch.equal(union[: want.numel()], want)
        assert (union[want.numel():] == 2**31 - 1).all()
