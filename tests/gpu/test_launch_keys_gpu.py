"""No recompiles after warm-up, and no host sync in the sync-free list builders, on a CUDA GPU (skipped without one).

After a warm-up over patterns that reach every class of the data-dependent constexprs (lists with and without
gathered columns, short and long lists, both list widths modes), a sequence of other patterns (other widths and
counts, top-k-like and top-p-like, empty heads) compiles nothing: the JIT's own caches of compiled kernels
(``JITFunction.device_caches``, through :meth:`mtraining_kernels.launch.Launcher.compiled`) keep their sizes, for
every kernel of this package, on the Gluon path (the default on sm_90) and on the Triton kernels, for the
single-device forward+backward and the ring's step lists. The interpreter's count of launch keys is
``tests/unit/test_launch_keys.py``.

No host sync: the bounded-width builders (``widths="bounded"``), the step lists and ``sorted_union`` run under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising CUDA call; and so does a
forward+backward over lists built that way.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from helpers.patterns import varying_patterns
from lightning_mtraining.core.layouts import global_positions
from mtraining_kernels import (
    gluon_backward,
    gluon_common,
    gluon_forward,
    list_builder,
    probe_scores,
    triton_backward,
    triton_forward,
)
from mtraining_kernels.indexing import (
    pattern_tile_lists,
    prepare_pattern_tiles,
    sorted_union,
    step_tile_lists,
    step_tile_lists_batched,
)
from mtraining_kernels.launch import Launcher
from mtraining_kernels.vertical_slash import KernelConfig, vertical_slash_attention

pytestmark = pytest.mark.gpu

B, H, HKV, S, D, T = 1, 8, 2, 16384, 128, 128  # single device: 128 query tiles, lists up to ~80 offsets wide
N, W = 32768, 4  # the ring: striped over 4 ranks in 128-token tiles
TRITON = KernelConfig(forward="triton", dq="triton", dkdv="triton", dkdv_cols="triton")


def _launchers() -> list[Launcher]:
    mods = (triton_forward, triton_backward, list_builder, probe_scores, gluon_common, gluon_forward, gluon_backward)
    return [obj for m in mods for obj in vars(m).values() if isinstance(obj, Launcher)]


def _compiled() -> dict[str, int]:
    return {f"{la.name}@{id(la)}": la.compiled() for la in _launchers()}


def _step(vi, si, config, widths):
    """One layer's work on a pattern: single-device lists and a forward+backward, and one rank's ring step lists
    (columns at their steps, tiles only, and the columns against the gathered verticals)."""
    dev = torch.device("cuda")
    tiles = pattern_tile_lists(vi, si, S, T, widths=widths)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k, v = (torch.randn(B, HKV, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
            for _ in range(2))
    out = vertical_slash_attention(q, k, v, tiles, config=config)
    out.backward(torch.randn_like(out))
    _ring_lists(vi, si, widths)


@functools.lru_cache(maxsize=1)
def _positions() -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 1's query positions and every rank's key positions (built once: not inside a no-sync block)."""
    dev = torch.device("cuda")
    qp = global_positions(N, 1, W, "striped", T, device=dev)
    return qp, torch.stack([global_positions(N, s, W, "striped", T, device=dev) for s in range(W)])


def _ring_lists(vi, si, widths):
    pt = prepare_pattern_tiles(vi, si, N, T, widths=widths)
    qp, kps = _positions()
    step_tile_lists_batched(pt, qp, kps, columns=True)
    step_tile_lists_batched(pt, qp, kps, columns=False)
    vert_pos, _ = sorted_union(pt.verticals, pt.big)
    if vert_pos.numel():
        step_tile_lists(pt, qp, vert_pos, tiles=False)


def _patterns(widths, seed):
    return varying_patterns(B, H, S, widths, seed, device="cuda")


WARMUP = [(0, 2), (3, 1), (200, 3), (1000, 40), (64, 12), (500, 30)]
LATER = [(1, 1), (17, 5), (129, 2), (333, 25), (0, 7), (999, 39), (2, 16), (700, 33), (48, 9), (250, 20), (5, 3),
         (640, 11)]


@pytest.mark.parametrize("config", [None, TRITON], ids=["default", "triton"])
def test_no_compiles_after_warmup(config):
    assert not set(WARMUP) & set(LATER)
    for widths in ("exact", "bounded"):
        for vi, si in _patterns(WARMUP, seed=0):
            _step(vi, si, config, widths)
    torch.cuda.synchronize()
    before = _compiled()
    assert sum(before.values()) > 0
    for widths in ("exact", "bounded"):
        for vi, si in _patterns(LATER, seed=1):
            _step(vi, si, config, widths)
    torch.cuda.synchronize()
    after = _compiled()
    grown = {name: (before[name], n) for name, n in after.items() if n != before[name]}
    assert not grown, f"kernels compiled after the warm-up (before, after): {grown}"


@contextlib.contextmanager
def _no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bounded_list_builders_do_not_sync():
    pats = list(_patterns(WARMUP + LATER[:4], seed=2))
    for vi, si in pats:  # warm-up: compiles (and the caching allocator's first allocations) outside the check
        pattern_tile_lists(vi, si, S, T, widths="bounded")
        _ring_lists(vi, si, "bounded")
    for vi, si in pats:
        with _no_sync():
            pattern_tile_lists(vi, si, S, T, widths="bounded")
            _ring_lists(vi, si, "bounded")


@pytest.mark.parametrize("config", [None, TRITON], ids=["default", "triton"])
def test_forward_backward_over_bounded_lists_does_not_sync(config):
    dev = torch.device("cuda")
    q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(B, HKV, S, D, device=dev, dtype=torch.bfloat16).requires_grad_(True) for _ in range(2))
    pats = list(_patterns(WARMUP, seed=3))
    for vi, si in pats:
        out = vertical_slash_attention(q, k, v, pattern_tile_lists(vi, si, S, T, widths="bounded"), config=config)
        out.backward(torch.ones_like(out))
    dout = torch.ones(B, H, S, D, device=dev, dtype=torch.bfloat16)
    for vi, si in pats:
        with _no_sync():
            out = vertical_slash_attention(q, k, v, pattern_tile_lists(vi, si, S, T, widths="bounded"),
                                           config=config)
            out.backward(dout)
