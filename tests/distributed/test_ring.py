"""Dense ring attention against a float64 single-process reference, on 1..8 gloo processes.

Protocol (the one every distributed test follows: the result against a single-process reference in float64, for the
output and every gradient, at uneven sizes and several world sizes): the same random full-sequence q, k, v and output
gradient on every rank; each rank shards them, runs ring_attention forward and backward, and returns its shards of the
output and of dq, dk, dv; the parent unshards and compares with dense causal attention computed in float64. Sizes are
uneven (sequence lengths 3x the layout unit, never powers of two), GQA 6 query heads on 2 KV heads, batch 2, head dims
16 and 64, odd world sizes, flat and hierarchical rings.
"""

import math

import pytest
import torch
import torch.distributed as dist

from helpers.dist import hierarchical_groups, run_distributed
from helpers.references import dense_reference
from lightning_mtraining import global_positions, ring_attention, shard_sequence, unshard_sequence
from lightning_mtraining.core.layouts import LAYOUTS, layout_unit
from lightning_mtraining.ring.block_ops import TorchBlockOp, merge_attention, tile_classes
from lightning_mtraining.ring.simulated import SimulatedRing

B, H, HKV, BS = 2, 6, 2, 4


def make_inputs(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, n, d, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, n, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def seq_len(layout, w):
    return 3 * layout_unit(layout, w, BS)


def cases():
    return [(layout, d, dtype) for layout in LAYOUTS for d in (16, 64) for dtype in (torch.float64, torch.float32)]


def run_cases(rank, w, group=None, inner_group=None, outer_group=None, max_scores=1 << 25):
    """Each case's shards of (out, dq, dk, dv) computed by this rank."""
    results = {}
    for i, (layout, d, dtype) in enumerate(cases()):
        n = seq_len(layout, w)
        q, k, v, do = make_inputs(n, d, seed=1000 + i)
        sh = lambda x: shard_sequence(x, 2, rank, w, layout, BS).to(dtype).requires_grad_(True)  # noqa: E731
        ql, kl, vl = sh(q), sh(k), sh(v)
        out = ring_attention(ql, kl, vl, group=group, layout=layout, block_size=BS, inner_group=inner_group,
                             outer_group=outer_group, op=TorchBlockOp(max_scores=max_scores))
        out.backward(shard_sequence(do, 2, rank, w, layout, BS).to(dtype))
        results[(layout, d, dtype)] = [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]
    return results


def worker_flat(rank, w):
    return run_cases(rank, w, max_scores=600)  # small chunks (a few rows): exercises chunk boundaries in the op


def worker_hierarchical(rank, w, inner_size):
    inner_group, outer_group = hierarchical_groups(rank, w, inner_size)
    return run_cases(rank, w, group=dist.group.WORLD, inner_group=inner_group, outer_group=outer_group)


def rel_errors(per_rank, w):
    """Relative max errors {case: [out, dq, dk, dv]} against the float64 reference."""
    errs = {}
    for ci, case in enumerate(cases()):
        layout, d, dtype = case
        q, k, v, do = make_inputs(seq_len(layout, w), d, seed=1000 + ci)
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = dense_reference(q, k, v)
        refs = [ref.detach(), *torch.autograd.grad(ref, (q, k, v), do)]
        got = [unshard_sequence([per_rank[r][case][j] for r in range(w)], 2, layout, BS) for j in range(4)]
        errs[case] = [((g.double() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, refs)]
    return errs


# Tolerances. float64: every op is float64, so errors are a few ulps times the reduction length: 1e-12.
# float32: inputs rounded to float32 (2^-24 ~ 6e-8 relative) and accumulation in float32 over at most 240 keys
# gives ~1e-6 relative; 2e-5 leaves room for the softmax's exp amplification, far below a wrong mask (O(1)).
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}

_errors_by_w: dict[int, dict] = {}


def _check(per_rank, w):
    errs = rel_errors(per_rank, w)
    for case, e in errs.items():
        assert max(e) < TOL[case[2]], f"W={w} {case}: relative errors out/dq/dk/dv = {e}"
    return errs


@pytest.mark.parametrize("w", [1, 2, 3, 8])  # W = 4: the 2 x 2 hierarchy below and test_sparse_ring.py
def test_flat_ring_matches_dense(w):
    per_rank = [run_cases(0, 1, max_scores=600)] if w == 1 else run_distributed(worker_flat, w)
    _errors_by_w[w] = _check(per_rank, w)


@pytest.mark.parametrize("w, inner", [(4, 2), (6, 3), (3, 1)])  # W = 8 hierarchies: test_sparse_ring.py
def test_hierarchical_ring_matches_dense(w, inner):
    _check(run_distributed(worker_hierarchical, w, inner), w)


def test_error_does_not_grow_with_world_size():
    for w in (1, 2, 3, 4, 8):
        if w not in _errors_by_w:
            test_flat_ring_matches_dense(w)
    for case in cases():
        if case[2] != torch.float32:
            continue
        base = max(_errors_by_w[1][case])
        for w in (2, 3, 4, 8):
            # One extra float32 rescale per ring step (a few ulps each) must not show against the rounding of the
            # inputs themselves: the error at W ranks stays within 4x the single-rank error.
            assert max(_errors_by_w[w][case]) <= 4 * base + 1e-7, (w, case, _errors_by_w[w][case], base)


def worker_simulated_equivalence(rank, w, inner):
    outer = w // inner
    inner_groups = [dist.new_group([o * inner + i for i in range(inner)]) for o in range(outer)]
    outer_groups = [dist.new_group([o * inner + i for o in range(outer)]) for i in range(inner)]
    o, i = divmod(rank, inner)
    kw = dict(inner_group=inner_groups[o], outer_group=outer_groups[i]) if outer > 1 else {}
    q, k, v, do = make_inputs(seq_len("striped", w), 16, seed=7)
    sh = lambda x: shard_sequence(x, 2, rank, w, "striped", BS).requires_grad_(True)  # noqa: E731
    ql, kl, vl = sh(q), sh(k), sh(v)
    out = ring_attention(ql, kl, vl, layout="striped", block_size=BS, op=TorchBlockOp(), **kw)
    out.backward(shard_sequence(do, 2, rank, w, "striped", BS))
    return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]


@pytest.mark.parametrize("w, inner", [(6, 3)])
def test_simulated_ring_equals_real_ring(w, inner):
    real = run_distributed(worker_simulated_equivalence, w, inner)
    q, k, v, do = make_inputs(seq_len("striped", w), 16, seed=7)
    sim = SimulatedRing(w, "striped", BS, inner_size=inner, op=TorchBlockOp(), time_steps=True)
    outs = sim.forward(q, k, v)
    dqs, dks, dvs = sim.backward([shard_sequence(do, 2, r, w, "striped", BS) for r in range(w)])
    for r in range(w):
        # Same per-step functions in the same order; only BLAS threading may differ between processes, so allow
        # float64 rounding noise (1e-13), nothing more.
        for name, a, b in zip(("out", "dq", "dk", "dv"), (outs[r], dqs[r], dks[r], dvs[r]), real[r]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13, msg=f"rank {r} {name}")
    assert len(sim.timings) == 2 * w * w and all(t >= 0 for t in sim.timings.values())


def test_merge_handles_empty_rows():
    out = torch.zeros(1, 1, 2, 3)
    lse = torch.tensor([[[float("-inf"), 0.0]]])
    merge_attention(out, lse, torch.ones(1, 1, 2, 3), torch.tensor([[[float("-inf"), 0.0]]]))
    assert torch.equal(out[0, 0, 0], torch.zeros(3)) and lse[0, 0, 0] == float("-inf")  # no NaN from -inf - -inf
    torch.testing.assert_close(out[0, 0, 1], torch.full((3,), 0.5))  # equal weights: the mean
    torch.testing.assert_close(lse[0, 0, 1], torch.tensor(math.log(2.0)))


@pytest.mark.parametrize("w", [1, 2, 3, 5])
def test_striped_only_diagonal_blocks_are_masked(w):
    """Tile = block_size: every tile pair of every (rank, source) is full or empty except the own-diagonal ones."""
    bs, nb = 4, 7
    n = w * bs * nb
    for r in range(w):
        for src in range(w):
            full, partial, _, _ = tile_classes(global_positions(n, r, w, "striped", bs),
                                               global_positions(n, src, w, "striped", bs), bs, bs)
            i, j = torch.meshgrid(torch.arange(nb), torch.arange(nb), indexing="ij")
            glob_q, glob_k = i * w + r, j * w + src  # global block indices
            assert torch.equal(full, glob_k < glob_q)
            assert torch.equal(partial, (glob_k == glob_q))  # only when src == r, on the diagonal
    # exact causal work per rank over the whole ring: query block i of rank r sees global key blocks
    # 0..i*w+r, i.e. i*w+r+1 tiles; ranks differ by at most (w-1) tiles per row (balanced up to one block)
    for r in range(w):
        tiles = 0
        for s in range(w):
            full, partial, _, _ = tile_classes(global_positions(n, r, w, "striped", bs),
                                               global_positions(n, s, w, "striped", bs), bs, bs)
            tiles += int((full | partial).sum())
        assert tiles == sum(i * w + r + 1 for i in range(nb))


def test_bad_inputs_are_clear_errors():
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"q must be \[batch, heads, seq, head_dim\]"):
        ring_attention(q[0], k, v, block_size=4)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key/value heads \(3\)"):
        ring_attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), block_size=4)
    with pytest.raises(ValueError, match=r"local sequence length 8 on 1 ranks gives 8 tokens, not a positive multiple"):
        ring_attention(q, k, v, block_size=128)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        ring_attention(q, k, v[:, :, :4], block_size=4)
    with pytest.raises(ValueError, match="must agree on batch"):
        ring_attention(q, k[:, :, :4], v[:, :, :4], block_size=4)
    with pytest.raises(TypeError, match="share a dtype"):
        ring_attention(q, k.double(), v.double(), block_size=4)
    with pytest.raises(ValueError, match="one device"):
        ring_attention(q, k.to("meta"), v.to("meta"), block_size=4)
    with pytest.raises(TypeError, match="floating-point"):
        ring_attention(q.long(), k, v, block_size=4)
    with pytest.raises(ValueError, match="unknown layout"):
        ring_attention(q, k, v, layout="ring")
    with pytest.raises(ValueError, match="needs both inner_group"):
        ring_attention(q, k, v, block_size=4, inner_group=object())
    with pytest.raises(TypeError, match="sparsity must be None .* a SparsityConfig .* or a VerticalSlashPattern"):
        ring_attention(q, k, v, block_size=4, sparsity=object())


@pytest.mark.parametrize("layout, w, r, src", [("striped", 3, 0, 2), ("striped", 3, 2, 0), ("striped", 3, 1, 1),
                                               ("contiguous", 3, 0, 1), ("zigzag", 2, 1, 0)])
def test_fused_cpu_path_equals_plain_path(layout, w, r, src):
    """The ATen fused CPU kernels compute the same pairs as the plain torch path, empty rows included.

    float32 on both sides; differences are reduction-order rounding (~1e-6 relative): 1e-5 absolute on O(1)
    values, while a wrong mask or a wrong empty-row lse would be O(1) or inf.
    """
    n = 3 * layout_unit(layout, w, BS)
    qp, kp = global_positions(n, r, w, layout, BS), global_positions(n, src, w, layout, BS)
    g = torch.Generator().manual_seed(r * 10 + src)
    q, do = torch.randn(2, 6, len(qp), 16, generator=g), torch.randn(2, 6, len(qp), 16, generator=g)
    k, v = torch.randn(2, 2, len(kp), 16, generator=g), torch.randn(2, 2, len(kp), 16, generator=g)
    fused, plain = TorchBlockOp(max_scores=60, fused=True), TorchBlockOp(max_scores=60, fused=False)
    (of, lf), (op_, lp) = fused.forward(q, k, v, qp, kp, 0.3), plain.forward(q, k, v, qp, kp, 0.3)
    assert torch.equal(torch.isinf(lf), torch.isinf(lp))
    finite = torch.isfinite(lp)
    torch.testing.assert_close(lf[finite], lp[finite], rtol=0, atol=1e-5)
    torch.testing.assert_close(of, op_, rtol=0, atol=1e-5)
    # backward with the final lse of a full ring: here the block's own lse, made finite where rows saw nothing
    lse = torch.where(finite, lp, torch.zeros_like(lp))
    for a, b in zip(fused.backward(q, k, v, op_, lse, do, qp, kp, 0.3),
                    plain.backward(q, k, v, op_, lse, do, qp, kp, 0.3)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
