"""Launch keys do not grow with the data: over a sequence of varying patterns, every kernel of a single-device
forward+backward and of the ring's step-list builder asks for at most a fixed number of compiled specialisations,
and a second sequence of other patterns asks for none that the first did not.

How it is counted: :func:`mtraining_kernels.launch.record_launch_keys` collects the specialisation key of every
launch (the key of the JIT's cache of compiled kernels: what it specialises on, ``do_not_specialize`` included;
``tests/unit/test_launch.py`` checks it against the JIT), here in the Triton interpreter on CPU, where nothing is
compiled but the keys are computed the same way. ``tests/gpu/test_launch_keys_gpu.py`` counts the JIT's own
compiled kernels on a GPU.

The patterns: top-k-like (every head the same number of verticals and slashes) and top-p-like (a random number per
head, ``-1`` padding, an empty head), widths from 1 to 150 verticals and 1 to 20 slashes; the second sequence uses
widths the first never did. The bounds per kernel (:data:`BOUNDS`) are the product of the classes of its
constexprs that follow the data: ``HAS_COLS`` (whether the lists have gathered columns: 2), the list builders'
``BLOCK_L`` (16 or 64: 2), the step builder's ``TILES`` / ``COLUMNS`` combinations the ring uses (3). Every other
argument from a pattern is unspecialised, and the rest (model shapes, tile sizes, dtypes, options) is fixed here.

Also here: the Triton builders' bounded list widths (``widths="bounded"``, no host sync) hold the same lists as the
exact ones, and a forward+backward over them gives bit-identical results in the interpreter (the torch builders:
``test_sync_free_lists.py``).

The checks run in ONE subprocess with ``TRITON_INTERPRET=1`` (``run_interpreter_checks``); run this file directly
to see them: ``TRITON_INTERPRET=1 python tests/unit/test_launch_keys.py``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers.interpreter import run_interpreter_checks

pytestmark = pytest.mark.slow  # a Triton-interpreter subprocess: about a minute on 2 cores

CHECKS = ["keys_bounded_over_patterns", "bounded_widths_triton_builders"]

# most distinct launch keys per kernel over any sequence of patterns (fixed model shapes, tiles, dtypes, options)
BOUNDS = {
    "_mark_kernel": 1, "_compact_kernel": 1, "_fwd_lists_kernel": 2, "_bwd_lists_kernel": 2, "_col_bits_kernel": 1,
    "_step_lists_kernel": 5,  # BLOCK_L x (tiles and columns, tiles only) + (columns only: BLOCK_L fixed)
    "_vs_fwd_kernel": 2, "_vs_bwd_dq_kernel": 2, "_bwd_preprocess_kernel": 1, "_vs_bwd_dkdv_kernel": 1,
    "_vs_bwd_dkdv_cols_kernel": 1, "_dkdv_cols_epilogue_kernel": 1,
}


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_checks(__file__, timeout=900)


@pytest.mark.parametrize("name", CHECKS)
def test_interpreter(interpreter_results, name):
    assert interpreter_results.get(name) == "ok", interpreter_results.get(name, "missing")


# ---------------------------------------------------------------------------------------------------------------
# The checks (run only in the subprocess, with TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------------------------


def _run_checks() -> dict[str, str]:
    import traceback

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from helpers.interpreter import shim_interpreter

    shim_interpreter()
    import torch

    from helpers.patterns import varying_patterns as patterns
    from lightning_mtraining.core.layouts import global_positions
    from mtraining_kernels.indexing import (
        pattern_tile_lists,
        prepare_pattern_tiles,
        sorted_union,
        step_tile_lists,
        step_tile_lists_batched,
    )
    from mtraining_kernels.launch import record_launch_keys
    from mtraining_kernels.vertical_slash import vertical_slash_attention

    B, H, Hkv, S, D, T = 1, 2, 1, 192, 16, 16  # single device: 12 query tiles, up to 192 columns (3 bit words)
    N, W = 384, 3  # the ring: 384 tokens striped over 3 ranks in 16-token tiles (24 tiles: lists up to 24 wide)

    def single_device(vi, si, widths="exact"):
        """Lists (Triton builder) and a forward+backward (Triton kernels) over them; returns (out, dq, dk, dv)."""
        tiles = pattern_tile_lists(vi, si, S, T, backend="triton", widths=widths)
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(B, h, S, D, generator=g).requires_grad_(True) for h in (H, Hkv, Hkv))
        out = vertical_slash_attention(q, k, v, tiles)
        out.backward(torch.randn(B, H, S, D, generator=g))
        return out.detach(), q.grad, k.grad, v.grad

    def ring_lists(vi, si, widths="exact"):
        """Every rank's step lists: columns at their keys' steps ("arrival"), and tiles only plus the columns
        against the gathered vertical keys ("gathered")."""
        pt = prepare_pattern_tiles(vi, si, N, T, widths=widths)
        vert_pos, _ = sorted_union(pt.verticals, pt.big)
        qp = global_positions(N, 1, W, "striped", T)  # (one rank: the keys do not depend on which)
        kps = torch.stack([global_positions(N, s, W, "striped", T) for s in range(W)])
        out = [step_tile_lists_batched(pt, qp, kps, columns=True, backend="triton"),
               step_tile_lists_batched(pt, qp, kps, columns=False, backend="triton")]
        if pt.verticals.shape[-1]:
            out.append([step_tile_lists(pt, qp, vert_pos, tiles=False, backend="triton")])
        return out

    def run(seq):
        with record_launch_keys() as keys:
            for vi, si in seq:
                single_device(vi, si)
                ring_lists(vi, si)
        return keys

    def keys_bounded_over_patterns():
        first = [(1, 1), (3, 2), (16, 3), (40, 5), (70, 9), (150, 20), (0, 4), (24, 12), (100, 1), (64, 16),
                 (5, 17), (130, 7), (1, 20), (33, 3)]
        second = [(2, 1), (7, 6), (12, 11), (50, 2), (90, 14), (140, 19), (0, 1), (20, 8), (110, 3), (60, 15),
                  (9, 18), (120, 13)]
        assert not set(first) & set(second)
        keys1 = run(patterns(B, H, N, first, seed=0))  # (entries >= S: ignored on the single device)
        counts = {name: len(k) for name, k in keys1.items()}
        print("keys per kernel:", counts, flush=True)
        assert set(counts) == set(BOUNDS), f"kernels launched {sorted(counts)} vs bounded {sorted(BOUNDS)}"
        for name, n in counts.items():
            assert n <= BOUNDS[name], f"{name}: {n} launch keys > bound {BOUNDS[name]}"
        # the classes the bounds count are reached, so the check is not vacuous: lists with and without columns,
        # ring lists of both list blocks (single-device lists here are at most 12 wide: one block)
        assert counts["_vs_fwd_kernel"] == counts["_vs_bwd_dq_kernel"] == 2, counts
        assert counts["_step_lists_kernel"] == 5, counts
        keys2 = run(patterns(B, H, N, second, seed=1))
        for name, k in keys2.items():
            assert k <= keys1[name], f"{name}: {len(k - keys1[name])} new launch key(s) after the first sequence"

    def bounded_widths_triton_builders():
        from mtraining_kernels.testing import tile_lists_mask

        widths = [(1, 1), (40, 5), (150, 20), (0, 4), (70, 9)]
        pos = torch.arange(S)
        for i, (vi, si) in enumerate(patterns(B, H, S, widths, seed=2)):
            exact = pattern_tile_lists(vi, si, S, T, backend="triton")
            bounded = pattern_tile_lists(vi, si, S, T, backend="triton", widths="bounded")
            ref = pattern_tile_lists(vi, si, S, T, backend="torch", widths="bounded")
            for name in ("fwd_cnt", "fwd_nmask", "bwd_cnt", "bwd_nmask"):
                assert torch.equal(getattr(exact, name), getattr(bounded, name)), (i, name)
            assert torch.equal(tile_lists_mask(exact, pos, pos), tile_lists_mask(bounded, pos, pos)), i
            for name in ("col_idx", "col_bits"):  # the bounded Triton builder equals the bounded torch one
                a, b = getattr(ref, name), getattr(bounded, name)
                assert (a is None and b is None) or torch.equal(a, b), (i, name)
            # the kernels over either lists: the same pairs in the same order, bit-identical results
            for a, b in zip(single_device(vi, si), single_device(vi, si, "bounded")):
                assert torch.equal(a, b), f"pattern {i}: results differ between exact and bounded widths"
            # ring steps: the bounded pattern tiles give the same step lists' pairs
            pe, pb = prepare_pattern_tiles(vi, si, N, T), prepare_pattern_tiles(vi, si, N, T, widths="bounded")
            qp = global_positions(N, 1, W, "striped", T)
            kps = torch.stack([global_positions(N, s, W, "striped", T) for s in range(W)])
            for s, (le, lb) in enumerate(zip(step_tile_lists_batched(pe, qp, kps, backend="triton"),
                                             step_tile_lists_batched(pb, qp, kps, backend="triton"))):
                assert torch.equal(tile_lists_mask(le, qp, kps[s]), tile_lists_mask(lb, qp, kps[s])), (i, s)
                assert torch.equal(le.fwd_cnt, lb.fwd_cnt) and torch.equal(le.bwd_cnt, lb.bwd_cnt), (i, s)

    results = {}
    only = os.environ.get("MT_CHECKS")  # comma-separated subset, for a quick local run
    for name in (only.split(",") if only else CHECKS):
        torch.manual_seed(0)
        try:
            locals()[name]()
            results[name] = "ok"
        except Exception:  # report, do not stop: each check has its own pytest test
            results[name] = traceback.format_exc(limit=4)
        print(name, "ok" if results[name] == "ok" else results[name], flush=True)
    return results


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    res = _run_checks()
    if "--json" in sys.argv:
        print("RESULTS " + json.dumps(res))
    sys.exit(0 if all(r == "ok" for r in res.values()) else 1)
