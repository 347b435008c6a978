"""Sliding-window layers and logit soft-capping in the block ops and the ring, against float64 references.

A sliding window of w: query q sees key k iff ``q - w < k <= q`` (Hugging Face's ``sliding_window_overlay``).
Soft-capping c: scores become ``c * tanh(s / c)`` before the softmax (Gemma 2's ``attn_logit_softcapping``).
The reference computes both on the whole sequence in float64; the ring runs on 1-4 gloo ranks, every layout, GQA,
uneven lengths, windows shorter and longer than the sequence.
"""

import math

import pytest
import torch

from helpers.dist import hierarchical_groups, run_distributed
from helpers.ops import CountingOp
from lightning_mtraining import SparsityConfig, global_positions, ring_attention, shard_sequence, unshard_sequence
from lightning_mtraining.core.layouts import LAYOUTS, layout_unit
from lightning_mtraining.ring.block_ops import TorchBlockOp, tile_classes
from lightning_mtraining.ring.steps import window_skips

B, H, HKV, BS, D = 2, 6, 2, 4, 16


def variant_reference(q, k, v, window=None, softcap=None, q_pos=None, k_pos=None, mask=None):
    """Masked softmax attention in float64 (K/V heads repeated; the reference may repeat, the ring may not);
    ``mask`` (broadcast to [B, H, Sq, Sk]) further restricts the causal pairs."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qp = torch.arange(q.shape[2]) if q_pos is None else q_pos
    kp = torch.arange(k.shape[2]) if k_pos is None else k_pos
    allowed = kp[None, :] <= qp[:, None]
    if window is not None:
        allowed &= kp[None, :] > qp[:, None] - window
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(torch.isfinite(lse), torch.exp(s - lse), torch.zeros_like(s))
    return p @ v


def make_inputs(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64) * 2  # * 2: scores reach the cap's bend
    k = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype)


def _grads(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), do)]


def _rel(got, ref):
    """Largest max error relative to max(|reference|, 1): relative for the O(1) outputs and gradients, absolute
    where the reference vanishes (a block no query sees into; dq of a window of 1, which is 0 up to rounding)."""
    return max(((g.double() - r).abs().max() / r.abs().max().clamp_min(1.0)).item() for g, r in zip(got, ref))


# float64 everywhere: a few ulps times the reduction length (< 100 keys): 1e-12. float32 inputs and accumulation
# over < 100 keys: ~1e-6 relative; 2e-5 leaves room for exp's amplification, far below a wrong mask (O(1)).
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


@pytest.mark.parametrize("window, softcap", [(5, None), (1, None), (None, 3.0), (7, 2.5), (200, None)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_op_matches_reference(window, softcap, fused, dtype):
    """Blocks of striped positions at W=3 (rank 1 against rank 0's keys, rank 0 against rank 2's, rank 2's own)."""
    n, w = 3 * layout_unit("striped", 3, BS), 3
    q, k, v, do = make_inputs(n, seed=7, dtype=dtype)
    op = TorchBlockOp(fused=fused, max_rows=5)  # 5-row chunks: window ranges and chunk edges disagree
    for r, src in ((1, 0), (0, 2), (2, 2)):
        qp, kp = global_positions(n, r, w, "striped", BS), global_positions(n, src, w, "striped", BS)
        ql, kl, vl, dol = q[:, :, qp], k[:, :, kp], v[:, :, kp], do[:, :, qp]
        ref = _grads(lambda a, b, c: variant_reference(a, b, c, window, softcap, qp, kp), ql, kl, vl, dol)
        out, lse = op.forward(ql, kl, vl, qp, kp, 1 / math.sqrt(D), window=window, softcap=softcap)
        # the block's own gradients: the backward takes the block's (out, lse) as the final ones here
        dq, dk, dv = op.backward(ql, kl, vl, out, lse, dol, qp, kp, 1 / math.sqrt(D), window=window, softcap=softcap)
        assert _rel([out, dq, dk, dv], ref) < TOL[dtype], (r, src)
        # rows that see no key of this block report lse -inf (the merge protocol), never 0 or NaN
        seen = (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - (window or n + 1))
        assert torch.equal(torch.isfinite(lse), seen.any(-1).expand_as(lse))


def test_tile_classes_with_window_agree_with_token_mask():
    """``full`` tiles are wholly visible, tiles in neither class wholly masked (what FlexBlockOp relies on)."""
    for layout, w, window in (("striped", 3, 9), ("contiguous", 2, 5), ("zigzag", 3, 13), ("striped", 2, 1)):
        n = 5 * layout_unit(layout, w, BS)
        for r in range(w):
            for src in range(w):
                qp, kp = global_positions(n, r, w, layout, BS), global_positions(n, src, w, layout, BS)
                full, partial, qpp, kpp = tile_classes(qp, kp, 8, 8, window)
                vis = (kpp[None, :] <= qpp[:, None]) & (kpp[None, :] > qpp[:, None] - window) & (qpp[:, None] >= 0)
                tiles = vis.view(full.shape[0], 8, full.shape[1], 8)
                assert torch.equal(full, tiles.all(3).all(1)), (layout, w, r, src)
                assert not (tiles.any(3).any(1) & ~(full | partial)).any(), (layout, w, r, src)


def run_variant_cases(rank, w, cases, inner=None, sparsity=None):
    groups = {}
    if inner is not None:
        import torch.distributed as dist

        inner_group, outer_group = hierarchical_groups(rank, w, inner)
        groups = dict(group=dist.group.WORLD, inner_group=inner_group, outer_group=outer_group)
    results = {}
    for i, (layout, window, softcap, dtype) in enumerate(cases):
        n = 3 * layout_unit(layout, w, BS)
        q, k, v, do = make_inputs(n, seed=100 + i, dtype=dtype)
        sh = lambda x: shard_sequence(x, 2, rank, w, layout, BS).requires_grad_(True)  # noqa: E731
        ql, kl, vl = sh(q), sh(k), sh(v)
        out = ring_attention(ql, kl, vl, layout=layout, block_size=BS, window=window, softcap=softcap,
                             sparsity=sparsity, op=TorchBlockOp(max_rows=3), **groups)
        out.backward(shard_sequence(do, 2, rank, w, layout, BS))
        results[i] = [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]
    return results


def _cases():
    out = []
    for layout in LAYOUTS:
        for window, softcap in ((6, None), (None, 2.0), (11, 1.5), (10_000, None)):
            out.append((layout, window, softcap, torch.float64))
    out += [("striped", 6, 2.0, torch.float32), ("zigzag", 2, None, torch.float32)]
    return out


def _check_ring(per_rank, w, cases):
    for i, (layout, window, softcap, dtype) in enumerate(cases):
        q, k, v, do = make_inputs(3 * layout_unit(layout, w, BS), seed=100 + i, dtype=dtype)
        ref = _grads(lambda a, b, c: variant_reference(a, b, c, window, softcap), q, k, v, do)
        got = [unshard_sequence([per_rank[r][i][j] for r in range(w)], 2, layout, BS) for j in range(4)]
        err = _rel(got, ref)
        assert err < TOL[dtype], f"W={w} {cases[i]}: relative error {err}"


@pytest.mark.parametrize("w", [1, 3])
def test_ring_with_window_and_softcap_matches_reference(w):
    cases = _cases()
    per_rank = run_distributed(run_variant_cases, w, cases) if w > 1 else [run_variant_cases(0, 1, cases)]
    _check_ring(per_rank, w, cases)


def test_hierarchical_ring_with_window_and_softcap():
    cases = [c for c in _cases() if c[0] == "striped"]
    _check_ring(run_distributed(run_variant_cases, 4, cases, inner=2), 4, cases)


def test_window_layer_ignores_sparsity_and_runs_its_band_exactly():
    """Sparse config + window: the band is the layer's pattern, computed exactly (no estimate)."""
    cases = [("striped", 6, None, torch.float64), ("striped", 5, 2.0, torch.float64)]
    sparsity = SparsityConfig(vertical_topk=1, slash_topk=1, last_q=4, tile_size=16)
    _check_ring(run_distributed(run_variant_cases, 3, cases, sparsity=sparsity), 3, cases)


def test_steps_outside_the_window_compute_nothing():
    """Contiguous layout, 3 ranks of 12 tokens, window 4: rank 2 needs only its own chunk and rank 1's last 3
    keys, so its step against rank 0 is skipped (asserted through the op's call count) and the result is exact."""
    n, w, window = 36, 3, 4
    pos = tuple(global_positions(n, r, w, "contiguous", BS) for r in range(w))
    assert window_skips(pos, 2, window) == {0: True, 1: False, 2: False}
    assert window_skips(pos, 0, window) == {0: False, 1: True, 2: True}  # later chunks: causality
    assert window_skips(pos, 1, None) is None
    per_rank = run_distributed(_counting_worker, w, n, window)
    calls = [c for _, c in per_rank]
    assert calls == [1, 2, 2], calls  # rank 0: its own chunk; ranks 1 and 2: own chunk and the previous one
    q, k, v, do = make_inputs(n, seed=5)
    ref = _grads(lambda a, b, c: variant_reference(a, b, c, window), q, k, v, do)
    got = [unshard_sequence([per_rank[r][0][j] for r in range(w)], 2, "contiguous", BS) for j in range(4)]
    assert _rel(got, ref) < TOL[torch.float64]


def _counting_worker(rank, w, n, window):
    q, k, v, do = make_inputs(n, seed=5)
    sh = lambda x: shard_sequence(x, 2, rank, w, "contiguous", BS).requires_grad_(True)  # noqa: E731
    ql, kl, vl = sh(q), sh(k), sh(v)
    op = CountingOp()
    out = ring_attention(ql, kl, vl, layout="contiguous", block_size=BS, window=window, op=op)
    out.backward(shard_sequence(do, 2, rank, w, "contiguous", BS))
    return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)], op.calls["forward"]


class DenseOnlyOp:
    """A block op that computes plain causal blocks only (no ``supports_window``/``supports_softcap``)."""

    def __init__(self):
        self.inner = TorchBlockOp()

    def forward(self, q, k, v, q_pos, k_pos, scale):
        return self.inner.forward(q, k, v, q_pos, k_pos, scale)

    def backward(self, q, k, v, out, lse, dout, q_pos, k_pos, scale):
        return self.inner.backward(q, k, v, out, lse, dout, q_pos, k_pos, scale)

    def __repr__(self):
        return "DenseOnlyOp()"


def test_variant_errors_are_clear():
    q, k, v, _ = make_inputs(12, seed=1)
    with pytest.raises(ValueError, match=r"window=4: the block op DenseOnlyOp\(\) does not compute it"):
        ring_attention(q, k, v, window=4, op=DenseOnlyOp(), block_size=BS)
    with pytest.raises(ValueError, match=r"softcap=2.0: the block op DenseOnlyOp\(\) does not compute it"):
        ring_attention(q, k, v, softcap=2.0, op=DenseOnlyOp(), block_size=BS)
    with pytest.raises(ValueError, match="window must be a positive int"):
        ring_attention(q, k, v, window=0, block_size=BS)
    with pytest.raises(ValueError, match="softcap must be a positive float"):
        ring_attention(q, k, v, softcap=-1.0, block_size=BS)
    # a window that spans the whole sequence masks nothing: any op will do
    out = ring_attention(q, k, v, window=12, op=DenseOnlyOp(), block_size=BS)
    torch.testing.assert_close(out, variant_reference(q, k, v), rtol=0, atol=1e-12)


def _sparse_softcap_worker(rank, w, n, pattern, softcap):
    q, k, v, do = make_inputs(n, seed=11)
    sh = lambda x: shard_sequence(x, 2, rank, w, "striped", 16).requires_grad_(True)  # noqa: E731
    ql, kl, vl = sh(q), sh(k), sh(v)
    out = ring_attention(ql, kl, vl, layout="striped", block_size=16, sparsity=pattern, softcap=softcap)
    out.backward(shard_sequence(do, 2, rank, w, "striped", 16))
    return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]


@pytest.mark.parametrize("w", [3])
def test_sparse_ring_with_softcap_matches_capped_pattern_reference(w):
    """A given pattern (torch op on CPU) with soft-capping: the capped softmax over exactly the pattern's pairs."""
    from lightning_mtraining import VerticalSlashPattern
    from mtraining_kernels.indexing import expand_pattern
    from mtraining_kernels.reference import vertical_slash_mask

    n = layout_unit("striped", w, 16) * 2  # 64 or 96 tokens: every shard holds whole 16-token tiles
    vert = torch.tensor([[[0, 5, 40], [3, -1, -1]]]).expand(B, HKV, 3)
    slash = torch.tensor([[[0, 17, 50], [0, 33, -1]]]).expand(B, HKV, 3)
    pattern = VerticalSlashPattern(vert.contiguous(), slash.contiguous(), tile_size=16)
    per_rank = run_distributed(_sparse_softcap_worker, w, n, pattern, 2.0)
    q, k, v, do = make_inputs(n, seed=11)
    mask = vertical_slash_mask(expand_pattern(vert, H, HKV), expand_pattern(slash, H, HKV), n, 16)
    ref = _grads(lambda a, b, c: variant_reference(a, b, c, softcap=2.0, mask=mask), q, k, v, do)
    got = [unshard_sequence([per_rank[r][j] for r in range(w)], 2, "striped", 16) for j in range(4)]
    assert _rel(got, ref) < TOL[torch.float64]
    # without the cap the result differs by O(1): the test sees the cap
    plain = _grads(lambda a, b, c: variant_reference(a, b, c, mask=mask), q, k, v, do)
    assert _rel(got, plain) > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window, softcap", [(300, None), (None, 2.0), (129, 1.5)])
def test_flex_block_op_window_and_softcap_gpu(window, softcap):
    """FlexAttention with the window in its BlockMask and mask_mod and the cap as a score_mod, on CUDA."""
    from lightning_mtraining.ring.block_ops import FlexBlockOp

    n, w, bs = 3 * 3 * 128 + 0, 3, 128
    q, k, v, do = (t.cuda().float() for t in make_inputs(n, seed=3))
    op, scale = FlexBlockOp(), 1 / math.sqrt(D)
    for r, src in ((1, 0), (2, 2)):
        qp, kp = (global_positions(n, x, w, "striped", bs, device="cuda") for x in (r, src))
        ql, kl, vl, dol = q[:, :, qp], k[:, :, kp], v[:, :, kp], do[:, :, qp]
        ref = _grads(lambda a, b, c: variant_reference(a, b, c, window, softcap, qp.cpu(), kp.cpu()),
                     *(t.cpu().double() for t in (ql, kl, vl, dol)))
        out, lse = op.forward(ql, kl, vl, qp, kp, scale, window=window, softcap=softcap)
        got = [out, *op.backward(ql, kl, vl, out, lse, dol, qp, kp, scale, window=window, softcap=softcap)]
        # float32 inputs, FlexAttention's float32 kernels (TF32 off by default for matmuls in torch): ~1e-6; 1e-4
        # leaves room for exp's amplification over ~1000 keys, far below a wrong mask (O(1))
        assert _rel([g.cpu() for g in got], ref) < 1e-4, (r, src)
    full = ring_attention(q.requires_grad_(True), k, v, window=window, softcap=softcap)  # W=1: differentiable
    ref = variant_reference(q.detach().cpu(), k.cpu(), v.cpu(), window, softcap)
    assert _rel([full.detach().cpu()], [ref]) < 1e-4
