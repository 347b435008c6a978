"""The Triton builder of the per-ring-step lists (``step_tile_lists(..., backend="triton")``) against the torch
builder (``backend="torch"``, itself tested against the global reference mask in ``test_step_lists.py``).

What is compared, exactly (integers, no tolerance): shapes and dtypes of every field; the valid entries of every
list row (``fwd_idx[..., :fwd_cnt]``, ``bwd_idx[..., :bwd_cnt]``); the counts ``fwd_cnt``, ``fwd_nmask``,
``bwd_cnt``, ``bwd_nmask``; ``col_idx`` and ``col_bits`` whole (padding included). The padding of the tile lists past
the counts is not the torch builder's (which leaves whatever its sort put there); the Triton builder's is asserted
to be 0. Cases: every (query rank, key rank) pair of striped (W 1, 3, 4; stripe blocks 16 and 32), contiguous and
zigzag layouts with T = 16, B = 2, H = 3, random patterns (verticals with padding, duplicates and out-of-range
entries, heads without verticals or slashes, slashes near and far), ``columns=False``, ``tiles=False`` over arbitrary
increasing key positions, lists wider than one kernel chunk, and the batched builder (all key ranks in one launch).

The interpreter checks run in ONE subprocess with ``TRITON_INTERPRET=1`` set before triton is imported (as in
``test_kernels_interpreter.py``, whose interpreter shim they reuse), one JSON result per check; run this file
directly to see them: ``TRITON_INTERPRET=1 python tests/unit/test_step_lists_triton.py``. The GPU test compares both
builders at a realistic size (128K tokens, W = 8 striped, T = 128, 16 heads, ~1000 verticals, ~20 tile offsets).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from helpers.interpreter import run_interpreter_checks

pytestmark = pytest.mark.slow  # a Triton-interpreter subprocess: minutes on 2 cores

# (layout, W, sequence length, stripe block); T = 16 throughout. 384 = 2^7 * 3 fits every striped case.
LAYOUTS = [
    ("striped", 1, 384, 16), ("striped", 3, 384, 16), ("striped", 3, 384, 32),
    ("striped", 4, 384, 16), ("contiguous", 3, 288, 16), ("contiguous", 4, 256, 16),
    ("zigzag", 2, 256, 16), ("zigzag", 3, 288, 16),
]
CHECKS = [f"{lay}_w{w}_n{n}_b{blk}" for lay, w, n, blk in LAYOUTS] + [
    "columns_only_over_gathered_keys",
    "wide_lists_and_many_columns",
    "every_vertical_here",
    "no_verticals_no_slashes",
]
T = 16


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_checks(__file__, timeout=900)


@pytest.mark.parametrize("name", CHECKS)
def test_interpreter(interpreter_results, name):
    assert interpreter_results.get(name) == "ok", interpreter_results.get(name, "missing")


# ---------------------------------------------------------------------------------------------------------------
# shared by the interpreter checks and the GPU test
# ---------------------------------------------------------------------------------------------------------------


def assert_same_lists(ref, got, where: str) -> None:
    """``got`` (Triton) equals ``ref`` (torch): see the module docstring for what "equal" means here."""
    for name in ("fwd_idx", "fwd_cnt", "fwd_nmask", "bwd_idx", "bwd_cnt", "bwd_nmask", "col_idx", "col_bits"):
        a, b = getattr(ref, name), getattr(got, name)
        assert (a is None) == (b is None), f"{where}: {name} present in one builder only"
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where}: {name} {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        assert a.device == b.device, f"{where}: {name} on {a.device} vs {b.device}"
        if name.endswith("_idx") and not name.startswith("col"):
            cnt = getattr(ref, name[:3] + "_cnt")
            valid = torch.arange(a.shape[-1], device=a.device) < cnt[..., None]
            assert torch.equal(a[valid], b[valid]), f"{where}: {name} differs in a valid entry"
            assert not b[~valid].any(), f"{where}: {name} padding is not 0"
        else:
            assert torch.equal(a, b), f"{where}: {name} differs"
    assert ref.block_m == got.block_m and ref.block_n == got.block_n, where


def random_pattern(B: int, H: int, n: int, n_vert: int, n_far: int, g: torch.Generator):
    """Verticals with padding (-1), duplicates and out-of-range entries (>= n: ignored); slashes 0, one near (< T)
    and ``n_far`` anywhere, some padding; head (0, 1) has no vertical, head (1, 2) no slash."""
    vi = torch.randint(-1, n + 2, (B, H, n_vert), generator=g)
    vi[:, :, 1] = vi[:, :, 0]
    vi[0, 1] = -1
    near = torch.randint(1, T, (B, H, 1), generator=g)
    far = torch.randint(-1, n, (B, H, n_far), generator=g)
    si = torch.cat([torch.zeros(B, H, 1, dtype=torch.int64), near, far], -1)
    si[1, 2] = -1
    return vi, si


# ---------------------------------------------------------------------------------------------------------------
# The interpreter checks (run only in the subprocess, with TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------------------------


def _run_checks() -> dict[str, str]:
    import traceback

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from helpers.interpreter import shim_interpreter

    shim_interpreter()
    from lightning_mtraining.core.layouts import global_positions
    from mtraining_kernels.indexing import prepare_pattern_tiles, step_tile_lists, step_tile_lists_batched

    def every_pair(pt, layout, w, n, blk, batched=True):
        """Every (query rank, key rank) pair: one launch per pair (step_tile_lists), and, without columns, one
        launch per query rank for all key ranks (step_tile_lists_batched). Returns the totals of tile pairs and
        gathered columns seen, so that a check can assert it compared non-trivial lists."""
        pairs = cols = 0
        for r in range(w):
            qp = global_positions(n, r, w, layout, blk)
            kps = torch.stack([global_positions(n, s, w, layout, blk) for s in range(w)])
            for s, kp in enumerate(kps):
                ref = step_tile_lists(pt, qp, kp, backend="torch")
                assert_same_lists(ref, step_tile_lists(pt, qp, kp, backend="triton"), f"{layout} W={w} q {r} k {s}")
                pairs += int(ref.tile_pairs().sum())
                cols += int(ref.gathered_columns().sum())
            if batched:
                got = step_tile_lists_batched(pt, qp, kps, columns=False, backend="triton")
                for s, kp in enumerate(kps):
                    ref = step_tile_lists(pt, qp, kp, columns=False, backend="torch")
                    assert_same_lists(ref, got[s], f"batched columns=False {layout} W={w} q {r} k {s}")
        return pairs, cols

    def layout_check(layout, w, n, blk):
        def check():
            g = torch.Generator().manual_seed(n * 10 + w + blk)
            vi, si = random_pattern(2, 3, n, 100, 4, g)  # 100 verticals (two 64-slot words), spread over the ranks
            pt = prepare_pattern_tiles(vi, si, n, T)
            pairs, cols = every_pair(pt, layout, w, n, blk)
            assert pairs > 0 and cols > 0, (pairs, cols)
        return check

    checks = {f"{lay}_w{w}_n{n}_b{blk}": layout_check(lay, w, n, blk) for lay, w, n, blk in LAYOUTS}

    def columns_only_over_gathered_keys():
        # tiles=False: the ring's step over the verticals gathered from every rank: key positions that are no
        # whole tiles (any increasing positions, Sk not a multiple of T), here as int32; and no lists at all
        n = 288
        g = torch.Generator().manual_seed(5)
        vi, si = random_pattern(2, 3, n, 70, 3, g)
        pt = prepare_pattern_tiles(vi, si, n, T)
        keys = torch.unique(vi[(vi >= 0) & (vi < n)]).to(torch.int32)
        assert keys.numel() % T, "want a ragged key count"
        for layout, w in (("striped", 3), ("zigzag", 3), ("contiguous", 2)):
            for r in range(w):
                qp = global_positions(n, r, w, layout, T)
                for cols in (True, False):
                    ref = step_tile_lists(pt, qp, keys, columns=cols, tiles=False, backend="torch")
                    got = step_tile_lists(pt, qp, keys, columns=cols, tiles=False, backend="triton")
                    assert_same_lists(ref, got, f"tiles=False columns={cols} {layout} rank {r}")
                # a subset of the keys, batched: two "steps" of the same length
                ks = torch.stack([keys[: keys.numel() // 2], keys[keys.numel() - keys.numel() // 2:]])
                for s, got in enumerate(step_tile_lists_batched(pt, qp, ks, tiles=False, backend="triton")):
                    ref = step_tile_lists(pt, qp, ks[s], tiles=False, backend="torch")
                    assert_same_lists(ref, got, f"batched tiles=False {layout} rank {r} part {s}")

    def wide_lists_and_many_columns():
        # L > 64 computed offsets (more than one kernel chunk of offsets) and ~600 verticals (10 words; the here
        # ones of a step spread over chunks, so words fill across chunks)
        n, w = 2048, 2
        g = torch.Generator().manual_seed(7)
        vi = torch.randint(-1, n, (1, 2, 640), generator=g)
        si = torch.randint(0, n, (1, 2, 90), generator=g)
        si[..., 0] = 0
        pt = prepare_pattern_tiles(vi, si, n, T)
        assert pt.offsets.shape[-1] > 64 and pt.verticals.shape[-1] > 512, (pt.offsets.shape, pt.verticals.shape)
        assert min(every_pair(pt, "striped", w, n, 16)) > 0
        assert min(every_pair(pt, "zigzag", w, n, 16, batched=False)) > 0

    def every_vertical_here():
        # W = 1: every vertical is in the key chunk; 128 unique verticals fill exactly two words (NC = NV)
        n = 384
        vi = torch.arange(0, n, 3).view(1, 1, -1).expand(2, 3, -1).clone()
        si = torch.tensor([0, 20, 200]).view(1, 1, 3).expand(2, 3, -1).clone()
        pt = prepare_pattern_tiles(vi, si, n, T)
        assert pt.verticals.shape[-1] == 128
        assert min(every_pair(pt, "striped", 1, n, 16)) > 0

    def no_verticals_no_slashes():
        n, w = 256, 2
        vi = torch.full((2, 3, 4), -1)
        si = torch.tensor([0, 40]).view(1, 1, 2).expand(2, 3, -1).clone()
        pt = prepare_pattern_tiles(vi, si, n, T)
        assert pt.verticals.shape[-1] == 0  # no column slots: col_idx / col_bits None in both builders
        assert every_pair(pt, "zigzag", w, n, 16)[0] > 0
        vi = torch.randint(0, n, (2, 3, 9))
        pt = prepare_pattern_tiles(vi, torch.full((2, 3, 2), -1), n, T)  # no slash: only columns, empty lists
        assert not (pt.offsets < pt.big).any()
        pairs, cols = every_pair(pt, "striped", w, n, 16)
        assert pairs == 0 and cols > 0, (pairs, cols)

    for f in (columns_only_over_gathered_keys, wide_lists_and_many_columns, every_vertical_here,
              no_verticals_no_slashes):
        checks[f.__name__] = f

    results = {}
    only = os.environ.get("MT_CHECKS")  # comma-separated subset, for a quick local run
    for name in (only.split(",") if only else CHECKS):
        torch.manual_seed(0)
        try:
            checks[name]()
            results[name] = "ok"
        except Exception:  # report, do not stop: each check has its own pytest test
            results[name] = traceback.format_exc(limit=4)
        print(name, "ok" if results[name] == "ok" else results[name], flush=True)
    return results


# ---------------------------------------------------------------------------------------------------------------
# GPU: both builders at a realistic size
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_triton_step_lists_equal_torch_at_128k():
    """128K tokens, W = 8 striped (block 128), T = 128, 16 heads: ~1000 verticals (sinks included) and slashes
    0..127 plus far ones (~20 computed tile offsets per head), per-head budgets differing; every rank pair, the
    batched builder, and the columns-only step over the gathered verticals."""
    from lightning_mtraining.core.layouts import global_positions
    from mtraining_kernels.indexing import prepare_pattern_tiles, step_tile_lists, step_tile_lists_batched

    S, W, TT, H = 131072, 8, 128, 16
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    vi = torch.randint(0, S, (1, H, 1000), generator=g)
    vi[..., :4] = torch.arange(4)
    vi[:, 1::2, -100:] = -1
    si = torch.cat([torch.arange(0, 128, 16).expand(1, H, -1), torch.randint(128, S, (1, H, 10), generator=g)], -1)
    si[:, ::3, -3:] = -1
    pt = prepare_pattern_tiles(vi.to(dev), si.to(dev), S, TT)
    assert 10 <= pt.offsets.shape[-1] <= 40, pt.offsets.shape
    keys = torch.unique(pt.verticals[pt.verticals < pt.big])
    for r in range(W):
        qp = global_positions(S, r, W, "striped", TT, device=dev)
        kps = torch.stack([global_positions(S, s, W, "striped", TT, device=dev) for s in range(W)])
        refs = [step_tile_lists(pt, qp, kp, backend="torch") for kp in kps]
        for s in range(W):
            assert_same_lists(refs[s], step_tile_lists(pt, qp, kps[s], backend="triton"), f"q {r} k {s}")
            assert_same_lists(refs[s], step_tile_lists(pt, qp, kps[s]), f"auto q {r} k {s}")
        for s, got in enumerate(step_tile_lists_batched(pt, qp, kps)):
            assert_same_lists(refs[s], got, f"batched q {r} k {s}")
        ref = step_tile_lists(pt, qp, keys, tiles=False, backend="torch")
        assert_same_lists(ref, step_tile_lists(pt, qp, keys, tiles=False, backend="triton"), f"columns only q {r}")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    res = _run_checks()
    if "--json" in sys.argv:
        print("RESULTS " + json.dumps(res))
    sys.exit(0 if all(r == "ok" for r in res.values()) else 1)
