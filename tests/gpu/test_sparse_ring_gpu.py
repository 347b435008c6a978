"""Sparse ring attention and the pattern estimator on a CUDA GPU at real sizes, bfloat16 (skipped without a GPU).

- The sparse ring (:class:`SimulatedRing` with a pattern: every virtual rank's steps through the default sparse op,
  the Triton/Gluon kernels, in one process, with the real ring's step lists and merge order) against the float32
  reference on the unsharded tensors (``attention_chunked_ref`` over the pattern's mask ``vertical_slash_mask``,
  the definition of ``sparse_attention``): out, dq, dk, dv under the rule of ``tests/gpu/test_kernels_gpu.py``
  (``mtraining_kernels.testing.check_half_precision``: error at most twice torch's own bfloat16 error against the
  same reference, plus 1e-3).
  The ring adds W log-sum-exp merges of bfloat16 block outputs in float32, each a convex combination, so its
  error stays at the level of one bfloat16 rounding, inside the rule.
- A block whose key count is not a multiple of the tile (Sk != Sq): the columns-only lists
  (``step_tile_lists(..., tiles=False)``) over the pattern's vertical keys gathered from the whole sequence, as a
  gathered-vertical ring step will run them, through ``block_forward`` / ``block_backward``; the reference is the
  same rule over the vertical pairs not under a computed tile.
- ``estimate_pattern`` on CUDA in bfloat16 against the same call on the CPU in float64 on the same (bf16-valued)
  inputs: the index sets must be equal up to near-ties (see ``_check_near_ties``), and a second call must not
  synchronise the host with the device (the estimator's contract: host syncs only on the first call).
"""

from __future__ import annotations

import os
import traceback
import warnings

import pytest
import torch

from helpers.pattern_ref import pattern_lists, reference_scores
from lightning_mtraining.core.layouts import global_positions, shard_sequence, unshard_sequence
from lightning_mtraining.ring.simulated import SimulatedRing
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.estimation import estimate_pattern
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern
from mtraining_kernels.testing import check_half_precision, random_pattern

pytestmark = pytest.mark.gpu

B, H, HKV, T = 1, 16, 2, 128


def _inputs(S, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (H, HKV, HKV, H)]


@pytest.mark.parametrize("S, W, D, layout, per_kv", [
    (8192, 4, 128, "striped", False),
    (16384, 8, 128, "striped", True),
    (8192, 8, 64, "striped", False),
    (16384, 4, 64, "striped", True),
    (8192, 4, 128, "zigzag", True),
])
def test_sparse_ring_bf16_matches_fp32_reference(S, W, D, layout, per_kv):
    from mtraining_kernels.indexing import expand_pattern
    from mtraining_kernels.reference import vertical_slash_mask

    q, k, v, dout = _inputs(S, D, seed=S + W + D)
    # sinks, 300 random verticals (duplicates possible), the local diagonal, near slashes, far slashes (a far one
    # off the tile grid), a per-head budget (heads after the first drop the last slash: -1 padding)
    vi, si = random_pattern(B, HKV if per_kv else H, S, 300, [0, 1, 64, 100, 1000, S - 200, 3333], seed=S + W,
                            device="cuda")
    sim = SimulatedRing(W, layout, T, pattern=VerticalSlashPattern(vi, si, T))
    outs = sim.forward(q, k, v)
    grads = sim.backward([shard_sequence(dout, 2, r, W, layout, T).contiguous() for r in range(W)])
    got = [unshard_sequence(x, 2, layout, T) for x in (outs, *grads)]
    skipped = sum(skip for plan in sim.step_lists for skip in plan.skip.values())
    assert skipped < W * W, "every step was skipped"
    vih, sih = expand_pattern(vi, H, HKV), expand_pattern(si, H, HKV)

    def mask_rows(r0, r1):
        return vertical_slash_mask(vih, sih, S, T, rows=(r0, r1))

    check_half_precision(got, q, k, v, dout, mask_rows, D**-0.5, torch.bfloat16, what=f"sparse ring W={W}")


@pytest.mark.parametrize("D", [128, 64])
def test_columns_only_block_over_gathered_verticals(D):
    # queries: rank 1 of a striped W = 4 ring (Sq = S / 4); keys: the sorted unique verticals of every head
    # (Sk ~ 600, made not a multiple of the tile), at their global positions
    from mtraining_kernels.indexing import expand_pattern, prepare_pattern_tiles, step_tile_lists
    from mtraining_kernels.reference import vertical_slash_mask
    from mtraining_kernels.vertical_slash import block_backward, block_forward

    S, W, rank = 8192, 4, 1
    q, k, v, dout = _inputs(S, D, seed=D)
    vi, si = random_pattern(B, HKV, S, 300, [0, 1, 64, 100, 1000, 3333], seed=11, device="cuda")
    vih, sih = expand_pattern(vi, H, HKV), expand_pattern(si, H, HKV)
    keys = torch.unique(vih[vih >= 0])
    if keys.numel() % T == 0:
        keys = keys[:-1]  # (then that vertical is simply not in this block, on both sides of the comparison)
    assert keys.numel() % T != 0
    q_pos = global_positions(S, rank, W, "striped", T, device="cuda")
    tiles = step_tile_lists(prepare_pattern_tiles(vih, sih, S, T), q_pos, keys, tiles=False)
    assert int(tiles.fwd_cnt.sum()) == 0 and tiles.col_idx is not None
    qs, ds = q[:, :, q_pos].contiguous(), dout[:, :, q_pos].contiguous()
    kg, vg = k[:, :, keys].contiguous(), v[:, :, keys].contiguous()
    scale = D**-0.5
    out, lse = block_forward(qs, kg, vg, q_pos, keys, scale, tiles=tiles)
    dq, dk, dv = block_backward(qs, kg, vg, out, lse, ds, q_pos, keys, scale, tiles=tiles, grad_dtype=torch.bfloat16)
    no_verticals = torch.full_like(vih, -1)

    def mask_rows(r0, r1):  # local query rows [r0, r1): whole striped blocks of T contiguous global positions
        assert r0 % T == 0 and r1 % T == 0
        parts = []
        for b in range(r0 // T, r1 // T):
            g0 = int(q_pos[b * T])
            rows = (g0, g0 + T)
            verts = vertical_slash_mask(vih, sih, S, T, rows=rows) & ~vertical_slash_mask(no_verticals, sih, S, T,
                                                                                          rows=rows)
            parts.append(verts[..., keys])
        return torch.cat(parts, dim=2)

    mask = mask_rows(0, qs.shape[2])
    assert mask.any(), "no vertical pair outside the tiles: the case tests nothing"
    scores = qs.float() @ kg.float().repeat_interleave(H // HKV, 1).transpose(-1, -2) * scale
    lse_ref = scores.masked_fill(~mask, float("-inf")).logsumexp(-1)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), fin)
    # lse: float32 sums of exact bf16 products (relative noise ~1e-6 on values below ~20): 1e-3 is a wide margin
    assert (lse[fin] - lse_ref[fin]).abs().max().item() < 1e-3
    check_half_precision((out, dq, dk, dv), qs, kg, vg, ds, mask_rows, scale, torch.bfloat16,
                         what=f"columns-only block (Sk={keys.numel()})")


# --------------------------------------------------------------------------------------------------------------
# the estimator on CUDA
# --------------------------------------------------------------------------------------------------------------

ESTIMATOR_CONFIGS = {
    "topk-query": SparsityConfig(vertical_topk=512, slash_topk=256, last_q=64),
    "topp-query": SparsityConfig(top_p=0.9, max_vertical=1024, max_slash=1024, last_q=64),
    "topp-kv": SparsityConfig(top_p=0.5, max_vertical=2048, max_slash=2048, last_q=64, pattern_heads="kv"),
}


@pytest.fixture
def no_tf32():
    """float32 matmuls in full float32 (the estimator's precision argument assumes it); restored afterwards."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _check_near_ties(got, want, scores, n_forced, length, budget, top_p):
    """Whether ``got`` (CUDA) is the selection ``want`` (CPU float64) up to near-ties; returns #differences.

    ``scores``: float64 scores of one head (from the definition, ``_pattern_ref.reference_scores``). The CUDA
    estimator computes in float32 from bf16-valued inputs: every score carries a relative error of ~1e-6 (exact
    products summed in float32 over head dim 128, then exp, then sums of 64 probabilities). So ``got`` must be
    what the rule selects under scores perturbed by at most ``tol`` each (tol = 1e-4 of the boundary score plus
    1e-9 of the total mass, ~100x the error):

    - the forced entries are in both;
    - every selected candidate scores at least every unselected candidate minus 2 tol (it is a top set of the
      perturbed scores);
    - top-k: the same count; top-p: a count at which the rule could stop under the perturbation (the mass before
      the last pick below p x total + delta, and the mass with it at least p x total - delta or the cap reached;
      delta = 1e-5 of the total).
    A wrong score, offset or normaliser moves entries far from the boundary and fails the second condition.
    """
    if got == want:
        return 0
    s = scores[:length]
    forced = set(range(min(n_forced, length)))
    assert forced <= set(got) and forced <= set(want), "a forced entry is missing"
    cand = torch.arange(n_forced, length)
    cs = s[cand]
    order = torch.sort(cs, descending=True, stable=True).indices
    m_want = len(set(want) - forced)
    boundary = float(cs[order[m_want - 1]]) if m_want else float(cs.max())
    total = float(s.sum())
    tol = 1e-4 * abs(boundary) + 1e-9 * total
    picked = torch.zeros(length, dtype=torch.bool)
    picked[torch.tensor(sorted(set(got) - forced), dtype=torch.int64)] = True
    sel, rest = s[cand][picked[cand]], s[cand][~picked[cand]]
    if sel.numel() and rest.numel():
        assert float(sel.min()) >= float(rest.max()) - 2 * tol, (
            f"a selected score {float(sel.min()):.9g} is below an unselected one {float(rest.max()):.9g} by more "
            f"than 2 x {tol:.2g}")
    m = int(sel.numel())
    if top_p is None:
        assert m == min(budget, cand.numel()), f"top-k count {m}, want {min(budget, cand.numel())}"
    else:
        forced_mass = float(s[sorted(forced)].sum()) if forced else 0.0
        prefix = forced_mass + torch.cat([torch.zeros(1, dtype=s.dtype), cs[order].cumsum(0)])  # mass of first m
        delta, goal = 1e-5 * total, top_p * total
        assert m == 0 or float(prefix[m - 1]) < goal + delta, f"top-p picked {m}: the mass was reached before"
        assert m == budget or m == cand.numel() or float(prefix[m]) >= goal - delta, f"top-p stopped early at {m}"
    return len(set(got) ^ set(want))


@pytest.mark.parametrize("name", list(ESTIMATOR_CONFIGS))
def test_estimator_bf16_cuda_equals_float64_cpu_up_to_near_ties(name, no_tf32):
    cfg = ESTIMATOR_CONFIGS[name]
    N, D = 8192, 128
    q, k, _, _ = _inputs(N, D, seed=5)
    q = (3 * q.float()).bfloat16()  # logits of std ~3: peaked enough for top-p to stop before the caps
    got = pattern_lists(estimate_pattern(q, k, cfg).to("cpu"))
    q64, k64 = q.double().cpu(), k.double().cpu()
    want = pattern_lists(estimate_pattern(q64, k64, cfg))
    G = H if cfg.pattern_heads == "query" else HKV
    v_budget, s_budget = cfg.head_budgets(G)
    vert, slash = reference_scores(q64, k64, [N], cfg.last_q, pattern_heads=cfg.pattern_heads)[0]
    diffs, sizes = 0, 0
    for g in range(G):
        (gv, gs), (wv, ws) = got[0][g], want[0][g]
        diffs += _check_near_ties(gv, wv, vert[g], cfg.sink_tokens, N, v_budget[g], cfg.top_p)
        diffs += _check_near_ties(gs, ws, slash[g], cfg.local_window, N, s_budget[g], cfg.top_p)
        sizes += len(wv) + len(ws)
    assert diffs <= 4 + 0.01 * sizes, f"{diffs} of {sizes} entries differ (all near-ties, but too many to be noise)"


PACKAGE_DIRS = ("lightning_mtraining", "mtraining_kernels")  # where a sync site is reported


def test_estimator_does_not_sync_after_the_first_call():
    # torch's sync debug mode turns every host-device synchronisation (a blocking copy, .item(), nonzero, ...)
    # into a warning; each is attributed to the innermost frame of this package on the Python stack
    q, k, _, _ = _inputs(16384, 128, seed=6)
    cfg = ESTIMATOR_CONFIGS["topp-query"]
    estimate_pattern(q, k, cfg)  # the first call may sync (host-side key pieces, cached per layout)
    torch.cuda.synchronize()
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        # ("Synchronization debug mode is a prototype feature" is set_sync_debug_mode's own notice, not a sync)
        if "synchroniz" in str(message).lower() and "prototype feature" not in str(message):
            stack = traceback.extract_stack()[:-1]
            ours = [f for f in stack if any(f"{os.sep}{pkg}{os.sep}" in f.filename for pkg in PACKAGE_DIRS)]
            f = (ours or stack)[-1]
            sites.append(f"{f.filename}:{f.lineno}: {f.line}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            estimate_pattern(q, k, cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not sites, "estimate_pattern synchronised with the host after its first call at:\n" + "\n".join(sites)
