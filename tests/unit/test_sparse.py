"""Public ``sparse_attention`` on CPU (the chunked torch path), its pattern semantics, and its validation errors.

References are float64 dense-masked attention (``attention_ref``) with the mask built independently, by brute
force from the written definition (a Python loop over pairs at tiny sizes), so the vectorised mask, the
chunked path and the tile lists are all checked against the words in the docstring. float64 end to end: the
only differences are summation order, hence 1e-10.
"""

from __future__ import annotations

import pytest
import torch

from lightning_mtraining.sparsity.attention import sparse_attention
from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists
from mtraining_kernels.reference import attention_ref, vertical_slash_mask
from mtraining_kernels.testing import tile_lists_mask


def _brute_mask(vi, si, S, BM, BN=None):
    """[S, S] mask for ONE head, straight from the definition: a key tile is computed for a query tile iff a
    selected diagonal crosses the (full, virtually padded) BM x BN tile; verticals are token level; j <= i."""
    BN = BM if BN is None else BN
    verticals = {int(x) for x in vi if 0 <= x < S}
    offsets = [int(x) for x in si if 0 <= x < S]
    mask = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        for j in range(i + 1):
            m, t = i // BM, j // BN
            crossed = any(m * BM - (t * BN + BN - 1) <= s <= m * BM + BM - 1 - t * BN for s in offsets)
            mask[i, j] = crossed or j in verticals
    return mask


@pytest.mark.parametrize("BM,BN", [(16, 16), (32, 16), (64, 16)])
def test_mask_definition_matches_brute_force_and_lists(BM, BN):
    S = 83
    g = torch.Generator().manual_seed(BM + BN)
    vi = torch.randint(-1, S, (2, 3, 7), generator=g)
    si = torch.randint(-1, S, (2, 3, 3), generator=g)
    mask = vertical_slash_mask(vi, si, S, BM, block_n=BN)
    tiles = pattern_tile_lists(vi, si, S, BM, BN)
    pos = torch.arange(S)
    assert torch.equal(mask, tile_lists_mask(tiles, pos, pos))
    for b in range(2):
        for h in range(3):
            assert torch.equal(mask[b, h], _brute_mask(vi[b, h], si[b, h], S, BM, BN)), (b, h)
    rows = vertical_slash_mask(vi, si, S, BM, rows=(17, 40), block_n=BN)
    assert torch.equal(rows, mask[:, :, 17:40])


@pytest.mark.parametrize("G_is_kv,blocks", [(False, 16), (True, 16), (True, (32, 16))])
def test_cpu_path_forward_backward_matches_reference(G_is_kv, blocks, monkeypatch):
    import lightning_mtraining.sparsity.attention as sp

    monkeypatch.setattr(sp, "_MAX_SCORES", 2 * 3 * 4 * 97)  # force several query chunks
    B, H, Hkv, S, D = 2, 6, 3, 97, 8
    BM, BN = (blocks, blocks) if isinstance(blocks, int) else blocks
    G = Hkv if G_is_kv else H
    q = torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, dtype=torch.float64, requires_grad=True)
    vi = torch.randint(-1, S, (B, G, 5))
    si = torch.randint(-1, S, (B, G, 2))
    out = sparse_attention(q, k, v, vi, si, scale=0.4, block_size=blocks)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    vih, sih = expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv)
    mask = torch.stack([torch.stack([_brute_mask(vih[b, h], sih[b, h], S, BM, BN) for h in range(H)])
                        for b in range(B)])
    ref, _ = attention_ref(q, k, v, mask, 0.4)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for g_, r in zip(grads, ref_grads):
        torch.testing.assert_close(g_, r, atol=1e-10, rtol=0)


def test_covering_pattern_is_dense_causal_and_empty_is_zero():
    B, H, S, D = 1, 2, 40, 8
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    all_cols = torch.arange(S).view(1, 1, S).expand(B, H, S)
    no_slash = torch.full((B, H, 1), -1)
    torch.testing.assert_close(sparse_attention(q, k, v, all_cols, no_slash), dense, atol=1e-12, rtol=0)
    all_diag = torch.arange(0, S, 16).view(1, 1, -1).expand(B, H, -1)
    torch.testing.assert_close(sparse_attention(q, k, v, no_slash, all_diag, block_size=16), dense, atol=1e-12,
                               rtol=0)
    empty = sparse_attention(q, k, v, no_slash, no_slash)
    assert (empty == 0).all()


def test_bf16_cpu_path_keeps_dtype():
    q, k, v = (torch.randn(1, 2, 33, 16, dtype=torch.bfloat16) for _ in range(3))
    out = sparse_attention(q, k, v, torch.zeros(1, 2, 1, dtype=torch.long), torch.zeros(1, 2, 1, dtype=torch.int32))
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "change,err,match",
    [
        (dict(q=torch.randn(1, 3, 20, 8)), ValueError, r"sparse_attention: query heads \(3\) must be a multiple of "
                                                        r"key/value heads \(2\)"),
        (dict(k=torch.randn(1, 2, 21, 8)), ValueError, "k and v must have the same shape"),
        (dict(q=torch.randn(1, 4, 20, 8, dtype=torch.float64)), TypeError, "q, k, v must share a dtype"),
        (dict(vi=torch.zeros(1, 4, 2)), TypeError, "vertical_idx must be an integer"),
        (dict(si=torch.zeros(1, 3, 2, dtype=torch.long)), ValueError, "G = H=4"),
        (dict(vi=torch.zeros(4, 2, dtype=torch.long)), ValueError, r"\[B, G, n\]"),
        (dict(vi=torch.full((1, 2, 2), 20)), ValueError, "20 >= S=20"),
        (dict(si=torch.full((1, 4, 1), 25)), ValueError, "slash_idx holds 25"),
        (dict(block_size=24), ValueError, "powers of two"),
        (dict(block_size=(32, 64)), ValueError, "multiple of BN"),
    ],
)
def test_validation_errors(change, err, match):
    args = dict(q=torch.randn(1, 4, 20, 8), k=torch.randn(1, 2, 20, 8), v=torch.randn(1, 2, 20, 8),
                vi=torch.zeros(1, 2, 2, dtype=torch.long), si=torch.zeros(1, 4, 1, dtype=torch.long), block_size=16)
    args.update(change)
    with pytest.raises(err, match=match):
        sparse_attention(args["q"], args["k"], args["v"], args["vi"], args["si"], block_size=args["block_size"])


@pytest.mark.parametrize("kwargs,match", [(dict(sub_m=24), "sub_m=24"), (dict(sub_n=8), "sub_n=8"),
                                          (dict(col_split=0), "col_split=0"),
                                          (dict(col_sub_m=24), "col_sub_m=24"),
                                          (dict(col_block=96), "col_block=96"),
                                          (dict(col_step=32), "col_step=32"),
                                          (dict(q_rows=48), "q_rows=48")])
def test_kernel_config_rejects_bad_values(kwargs, match):
    from mtraining_kernels.vertical_slash import KernelConfig

    with pytest.raises(ValueError, match=match):
        KernelConfig(**kwargs)


def test_pattern_tile_lists_rejects_bad_backend_and_shapes():
    from mtraining_kernels.indexing import pattern_tile_lists

    vi, si = torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="backend='cuda'"):
        pattern_tile_lists(vi, si, 100, 16, backend="cuda")
    for backend in ("torch", "triton"):  # checked once, before dispatch (no kernel launch)
        with pytest.raises(ValueError, match="must share"):
            pattern_tile_lists(vi, si[:, :1], 100, 16, backend=backend)
        with pytest.raises(ValueError, match="slash_idx is on meta"):
            pattern_tile_lists(vi, si.to("meta"), 100, 16, backend=backend)
        with pytest.raises(ValueError, match="multiple of block_n"):
            pattern_tile_lists(vi, si, 100, 16, 32, backend=backend)
