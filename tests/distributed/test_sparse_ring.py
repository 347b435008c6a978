"""Sparse ring attention against single-device ``sparse_attention`` on the unsharded tensors, on 1..8 gloo processes.

Protocol (the one every distributed test follows: the result against a single-process reference in float64, for the
output and every gradient, at uneven sizes and several world sizes): the same random full-sequence q, k, v, output
gradient and global pattern on every rank; each rank shards q/k/v, runs ``ring_attention(..., sparsity=pattern)``
forward and backward, and returns its shards of out, dq, dk, dv; the parent unshards them and compares with
``sparse_attention`` (the reference path: dense-masked attention, float64) on the whole sequence. Patterns: random
verticals (with padding and duplicates), the local diagonal, near slashes and an isolated far slash; per query head (G =
H) and per KV group (G = Hkv); GQA 6 query heads on 2 KV heads; batch 2; tile T = 16; lengths 3 x the layout's unit; all
three layouts; flat rings W in 1, 2, 3, 4, 8 and hierarchical rings 2x2, 2x4, 4x2.

Tolerances: float64 inputs differ from the reference only in summation order (ring merge vs one softmax), ~1e-15
relative; 1e-12 leaves room and catches any wrong pair (an extra or missing pair changes outputs by ~1e-2). float32
runs are checked against the float64 reference at 2e-5 (float32 epsilon 1.2e-7 times O(100) accumulated terms), a
bound that does not depend on W, so error growing with the ring size fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.dist import hierarchical_groups, run_distributed
from helpers.ops import CountingOp
from lightning_mtraining import ring_attention, shard_sequence, unshard_sequence
from lightning_mtraining.core.layouts import LAYOUTS, layout_unit
from lightning_mtraining.ring.block_ops import TorchBlockOp
from lightning_mtraining.sparsity.attention import sparse_attention
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.estimation import estimate_pattern
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern

B, H, HKV, D, T = 2, 6, 2, 16, 16


def seq_len_for(layout: str, w: int) -> int:
    # whole, aligned T-tiles on every rank: striped block = T; contiguous N/W and zigzag N/2W multiples of T
    unit = {"striped": w * T, "contiguous": w * T, "zigzag": 2 * w * T}[layout]
    assert unit % layout_unit(layout, w, T) == 0
    return 3 * unit if layout != "zigzag" else 2 * unit


def make_case(n: int, per_kv: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    G = HKV if per_kv else H
    vert = torch.randint(-1, n, (B, G, 6), generator=g)
    vert[:, :, 0] = vert[:, :, 1]  # a duplicate
    near = torch.randint(1, 2 * T, (B, G, 2), generator=g)
    far = torch.full((B, G, 1), n - T - 3)  # one isolated far slash (crosses 1-2 tile diagonals)
    slash = torch.cat([torch.zeros(B, G, 1, dtype=torch.int64), near, far, torch.full((B, G, 1), -1)], dim=-1)
    return q, k, v, do, VerticalSlashPattern(vert, slash, tile_size=T)


CASES = [(layout, per_kv, dtype) for layout in LAYOUTS for per_kv in (False, True)
         for dtype in (torch.float64, torch.float32)]


def run_cases(rank, w, group=None, inner_group=None, outer_group=None, verticals="gathered"):
    results = {}
    op = TorchBlockOp(max_rows=24)  # chunks that straddle tiles: exercises the row-chunked tile masks
    for i, (layout, per_kv, dtype) in enumerate(CASES):
        n = seq_len_for(layout, w)
        q, k, v, do, pattern = make_case(n, per_kv, seed=10 * i + w)
        sh = lambda x: shard_sequence(x, 2, rank, w, layout, T).to(dtype)  # noqa: E731
        ql, kl, vl = (sh(t).requires_grad_(True) for t in (q, k, v))
        out = ring_attention(ql, kl, vl, group=group, layout=layout, block_size=T, sparsity=pattern,
                             inner_group=inner_group, outer_group=outer_group, op=op, verticals=verticals)
        out.backward(sh(do))
        results[(layout, per_kv, dtype)] = [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]
    return results


def worker_flat(rank, w, verticals="gathered"):
    return run_cases(rank, w, group=dist.group.WORLD, verticals=verticals)


def worker_hierarchical(rank, w, inner_size):
    inner_group, outer_group = hierarchical_groups(rank, w, inner_size)
    return run_cases(rank, w, group=dist.group.WORLD, inner_group=inner_group, outer_group=outer_group)


def check_against_reference(per_rank, w):
    worst = {}
    for i, (layout, per_kv, dtype) in enumerate(CASES):
        n = seq_len_for(layout, w)
        q, k, v, do, pattern = make_case(n, per_kv, seed=10 * i + w)
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = sparse_attention(qr, kr, vr, pattern.vertical_idx, pattern.slash_idx, block_size=T)
        ref.backward(do)
        want = [ref.detach(), qr.grad, kr.grad, vr.grad]
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = unshard_sequence([r[(layout, per_kv, dtype)][j] for r in per_rank], 2, layout, T).double()
            err = float((got - want[j]).abs().max() / want[j].abs().max())
            tol = 1e-12 if dtype == torch.float64 else 2e-5
            assert err < tol, (layout, per_kv, dtype, name, err)
            worst[(dtype, name)] = max(worst.get((dtype, name), 0.0), err)
    return worst


@pytest.mark.parametrize("w", [1, 2, 3, 8])  # W = 4: the 2 x 2 hierarchy below
def test_flat_sparse_ring_matches_sparse_attention(w):
    check_against_reference(run_distributed(worker_flat, w, timeout=600), w)


@pytest.mark.parametrize("w", [2, 3])
def test_flat_sparse_ring_with_verticals_at_arrival(w):
    """The same result with each vertical computed at the step its key's chunk arrives (no gather)."""
    check_against_reference(run_distributed(worker_flat, w, "arrival", timeout=600), w)


@pytest.mark.parametrize("inner,outer", [(2, 2), (2, 4)])
def test_hierarchical_sparse_ring_matches_sparse_attention(inner, outer):
    w = inner * outer
    check_against_reference(run_distributed(worker_hierarchical, w, inner, timeout=600), w)


# --- a pattern covering every key is the dense ring; an estimated pattern is the estimator's --------------------


def worker_full_and_estimated(rank, w):
    out = {}
    for layout in LAYOUTS:
        n = seq_len_for(layout, w)
        q, k, v, do, _ = make_case(n, False, seed=77)
        sh = lambda x: shard_sequence(x, 2, rank, w, layout, T)  # noqa: E731
        res = []
        for sparsity in (None, VerticalSlashPattern.full(B, H, n, tile_size=T)):
            ql, kl, vl = (sh(t).requires_grad_(True) for t in (q, k, v))
            o = ring_attention(ql, kl, vl, layout=layout, block_size=T, sparsity=sparsity)
            o.backward(sh(do))
            res.append([t.detach() for t in (o, ql.grad, kl.grad, vl.grad)])
        cfg = SparsityConfig(vertical_topk=3, slash_topk=2, last_q=8, sink_tokens=1, local_window=1, tile_size=T)
        ql, kl, vl = (sh(t).requires_grad_(True) for t in (q, k, v))
        o = ring_attention(ql, kl, vl, layout=layout, block_size=T, sparsity=cfg, seq_len=n - 5)
        o.backward(sh(do))
        p = estimate_pattern(sh(q), sh(k), cfg, layout=layout, block_size=T, seq_len=n - 5)
        res.append([t.detach() for t in (o, ql.grad, kl.grad, vl.grad)] + [p.vertical_idx, p.slash_idx])
        out[layout] = res
    return out


def test_full_pattern_is_dense_ring_and_config_uses_the_estimator():
    w = 3
    per_rank = run_distributed(worker_full_and_estimated, w)
    for layout in LAYOUTS:
        n = seq_len_for(layout, w)
        q, k, v, do, _ = make_case(n, False, seed=77)
        for j in range(4):
            dense = unshard_sequence([r[layout][0][j] for r in per_rank], 2, layout, T)
            full = unshard_sequence([r[layout][1][j] for r in per_rank], 2, layout, T)
            torch.testing.assert_close(full, dense, rtol=0, atol=1e-12)  # float64, summation order only
        vi, si = per_rank[0][layout][2][4:]
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = sparse_attention(qr, kr, vr, vi, si, block_size=T)
        ref.backward(do)
        for j, want in enumerate((ref.detach(), qr.grad, kr.grad, vr.grad)):
            got = unshard_sequence([r[layout][2][j] for r in per_rank], 2, layout, T)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# --- exact counts of communication and of skipped steps --------------------------------------------------------


def _count_collectives(monkeypatch_targets):
    counts = {}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    for name in monkeypatch_targets:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    return counts


def worker_counts(rank, w):
    import lightning_mtraining.core.collectives as coll

    n = seq_len_for("contiguous", w)
    q, k, v, do, _ = make_case(n, False, seed=5)
    # the main diagonal only (tile diagonal 0): under the contiguous layout only each rank's own chunk has work
    pattern = VerticalSlashPattern(torch.full((B, H, 1), -1), torch.zeros(B, H, 1, dtype=torch.int64), T)
    sh = lambda x: shard_sequence(x, 2, rank, w, "contiguous", T)  # noqa: E731
    # dense_above=None: these counts are the sparse ring's (at 2 + 2 entries of a short sequence it covers most pairs)
    cfg = SparsityConfig(vertical_topk=2, slash_topk=2, last_q=4, tile_size=T, dense_above=None)
    ql, kl, vl = (sh(t).requires_grad_(True) for t in (q, k, v))
    estimate_pattern(ql, kl, cfg, layout="contiguous", block_size=T)  # the one-time shape check happens here
    names = ["batch_isend_irecv", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
             "reduce_scatter_tensor", "reduce_scatter_single", "broadcast"]
    counts = _count_collectives(names)
    coll._ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    coll._REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    result = {}
    for name, sparsity in (("given", pattern), ("estimated", cfg)):
        op = CountingOp()
        counts.clear()
        o = ring_attention(ql, kl, vl, layout="contiguous", block_size=T, sparsity=sparsity, op=op)
        fwd = dict(counts)
        counts.clear()
        o.backward(sh(do))
        result[name] = (fwd, dict(counts), dict(op.calls))
    return result


def test_exact_counts_of_p2p_collectives_and_skipped_steps():
    w = 3
    per_rank = run_distributed(worker_counts, w)
    for res in per_rank:
        fwd, bwd, calls = res["given"]
        # forward: W - 1 K/V transfers; backward: W - 1 K/V transfers and W dK/dV transfers; no collective
        assert fwd == {"batch_isend_irecv": w - 1}, fwd
        assert bwd == {"batch_isend_irecv": 2 * w - 1}, bwd
        # only the rank's own chunk holds pairs of the diagonal band: the other W - 1 steps run no op at all
        assert calls == {"forward": 1, "backward": 1}, calls
        fwd, bwd, calls = res["estimated"]
        # estimation: probes all-reduced, normalisers gathered, slash partials reduce-scattered, then the vertical
        # and slash candidates gathered (the one-time cross-rank shape check ran before counting); the gathered
        # verticals: one all-reduce of their K/V in the forward, one of their dK/dV in the backward
        gathers = fwd.get("all_gather_single", 0) + fwd.get("all_gather_into_tensor", 0)
        scatters = fwd.get("reduce_scatter_single", 0) + fwd.get("reduce_scatter_tensor", 0)
        assert fwd.get("all_reduce") == 2 and gathers == 3 and scatters == 1, fwd
        assert fwd["batch_isend_irecv"] == w - 1, fwd
        assert bwd == {"batch_isend_irecv": 2 * w - 1, "all_reduce": 1}, bwd


# --- clear errors ------------------------------------------------------------------------------------------------


def test_sparse_errors_are_clear():
    n = 64
    q, k, v, _, pattern = make_case(n, False, seed=1)
    with pytest.raises(ValueError, match="computes dense blocks only"):
        from lightning_mtraining.ring.block_ops import FlexBlockOp

        ring_attention(q, k, v, block_size=T, sparsity=pattern, op=FlexBlockOp())
    with pytest.raises(ValueError, match="holds .* >= sequence length 32"):
        ring_attention(q[:, :, :32], k[:, :, :32], v[:, :, :32], block_size=T, sparsity=pattern)
    with pytest.raises(ValueError, match="expected H=6 \\(per query head\\) or H_kv=2"):
        bad = VerticalSlashPattern(pattern.vertical_idx[:, :3], pattern.slash_idx[:, :3], T)
        ring_attention(q, k, v, block_size=T, sparsity=bad)
    with pytest.raises(TypeError, match="sparsity must be None"):
        ring_attention(q, k, v, block_size=T, sparsity={"top_p": 0.9})


def _misaligned_worker(rank, w):
    q, k, v, _, _ = make_case(40 * w, False, seed=2)  # contiguous, 40 tokens per rank: 2.5 tiles of 16
    sh = lambda x: shard_sequence(x, 2, rank, w, "contiguous", T)  # noqa: E731
    pattern = VerticalSlashPattern.full(B, H, 40 * w, tile_size=T)
    try:
        ring_attention(sh(q), sh(k), sh(v), layout="contiguous", block_size=T, sparsity=pattern)
    except ValueError as e:
        return str(e)
    return "no error"


def test_misaligned_layout_is_a_clear_error():
    msgs = run_distributed(_misaligned_worker, 2)
    assert all("does not give rank 0 whole tiles" in m and "pad the sequence to a multiple of 32" in m for m in msgs)
