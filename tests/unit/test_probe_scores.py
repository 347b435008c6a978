"""The Triton scorer of the pattern estimator (:mod:`mtraining_kernels.probe_scores`) against a float64 torch
implementation of the same sums, and ``estimate_pattern`` with the Triton scorer against the torch scorer.

What is compared: for one rank's keys (global positions of striped / zigzag / contiguous layouts, W 1, 3, 4, stripe
blocks 16 and 32), probe rows at the end of ragged sequences (n = 5, 16, 17 rows, B = 2, 4 query heads on 2 KV
heads, head dim 24 padded to 32 in the kernel): the row log-sum-exp over the rank's visible keys, the column sums
(vertical scores) and the diagonal sums at every global offset (slash partials) of ``A = exp(scale q k^T - lse)``,
per query head and summed per KV group. Inputs are float32 (the kernel's dot runs in IEEE float32); tolerance
2e-5 relative to each sum's scale: float32 accumulation over <= ~400 terms of size <= 1 (about 400 * 6e-8 = 2.4e-5
worst case; typical error is far smaller).

Then ``estimate_pattern`` itself (the last probe block, and four blocks spread over each row: the Triton scorer
runs per block with two batch rows, on the blocks as its batch with one), distributed over 3 gloo processes (W = 3
striped) and on one process, with the
Triton scorer forced on CPU (``estimation._SCORER = "triton"``) against the torch scorer on the same float32
inputs: identical index sets (both sum in float32 in different orders; with these seeded inputs no selection
boundary is within that noise, which the exact equality checks).

The checks run in ONE subprocess with ``TRITON_INTERPRET=1`` (``run_interpreter_checks``); run this file directly
to see them: ``TRITON_INTERPRET=1 python tests/unit/test_probe_scores.py``. The GPU test compares the scorers at 32K.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from helpers.interpreter import run_interpreter_checks

pytestmark = pytest.mark.slow  # a Triton-interpreter subprocess: minutes on 2 cores

CASES = [("striped", 1, 16), ("striped", 3, 16), ("striped", 4, 32), ("zigzag", 3, 16), ("contiguous", 3, 16)]
CHECKS = [f"scores_{lay}_w{w}_b{blk}" for lay, w, blk in CASES] + [
    "estimate_pattern_triton_equals_torch_w1",
    "estimate_pattern_triton_equals_torch_w3_gloo",
    "layouts_without_runs_fall_back_to_torch",
]


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_checks(__file__, timeout=900)


@pytest.mark.parametrize("name", CHECKS)
def test_interpreter(interpreter_results, name):
    assert interpreter_results.get(name) == "ok", interpreter_results.get(name, "missing")


def reference_sums(q_rows, k, pos, rows_pos, lse_global, scale, kv_sum, n_total):
    """float64: (local lse [B, H, n], vertical [B, G, S], slash partials [B, G, N])."""
    q, kk = q_rows.double(), k.double()
    B, H, n, _ = q.shape
    Hkv = kk.shape[1]
    kk = kk.repeat_interleave(H // Hkv, 1)
    s = torch.einsum("bhnd,bhsd->bhns", q, kk) * scale
    vis = pos[None, None, None, :] <= rows_pos[:, None, :, None]
    lse_local = torch.logsumexp(s.masked_fill(~vis, float("-inf")), -1)
    a = torch.where(vis, torch.exp(s - lse_global.double()[..., None]), torch.zeros((), dtype=torch.float64))
    if kv_sum:
        a = a.view(B, Hkv, H // Hkv, n, -1).sum(2)
    G = a.shape[1]
    vert = a.sum(2)
    off = (rows_pos[:, :, None] - pos[None, None, :])  # [B, n, S]
    slash = torch.zeros(B, G, n_total + 1, dtype=torch.float64)
    idx = torch.where(off >= 0, off, n_total)  # invisible pairs have a = 0; park them in a spare bin
    slash.scatter_add_(2, idx.reshape(B, 1, -1).expand(B, G, -1), a.reshape(B, G, -1))
    return lse_local, vert, slash[..., :n_total]


def _close(got, ref, what):
    scale = max(float(ref.abs().max()), 1e-30)
    err = float((got.double() - ref).abs().max())
    assert err <= 2e-5 * scale, f"{what}: max error {err:.3g} against scale {scale:.3g}"


def _estimate_worker(rank, w, interpret_shim):
    import torch.distributed as dist

    if interpret_shim:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from helpers.interpreter import shim_interpreter

        shim_interpreter()
    import lightning_mtraining.sparsity.estimation as est
    from lightning_mtraining import SparsityConfig, estimate_pattern
    from lightning_mtraining.core.layouts import shard_sequence

    N = 3 * 96
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, N, 24, generator=g)
    k = torch.randn(2, 2, N, 24, generator=g)
    group = dist.group.WORLD if w > 1 else None
    ql, kl = (shard_sequence(t, 2, rank, w, "striped", 16) for t in (q, k))
    out = {}
    for name, cfg in {
        "topp": SparsityConfig(top_p=0.9, max_vertical=40, max_slash=50, last_q=16, sink_tokens=2, local_window=3,
                               tile_size=16),
        "topk-kv": SparsityConfig(vertical_topk=(5, 9), slash_topk=6, last_q=17, sink_tokens=1, local_window=2,
                                  tile_size=16, pattern_heads="kv"),
        # four probe blocks spread over each row: the Triton scorer runs once per block
        "spread-topp": SparsityConfig(top_p=0.9, max_vertical=40, max_slash=50, last_q=16, probes="spread",
                                      probe_blocks=4, sink_tokens=2, local_window=3, tile_size=16),
    }.items():
        for scorer in ("torch", "triton"):
            est._SCORER = scorer
            p = estimate_pattern(ql, kl, cfg, group=group, layout="striped", block_size=16, seq_len=[N, N - 37])
            out[(name, scorer)] = (p.vertical_idx, p.slash_idx)
            if cfg.probes == "spread":  # one batch row: the Triton scorer takes the blocks as its batch
                p = estimate_pattern(ql[:1], kl[:1], cfg, group=group, layout="striped", block_size=16, seq_len=N - 5)
                out[(name + "-b1", scorer)] = (p.vertical_idx, p.slash_idx)
    est._SCORER = "auto"
    return out


def _run_checks() -> dict[str, str]:

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from helpers.interpreter import shim_interpreter

    shim_interpreter()
    from lightning_mtraining.core.layouts import global_positions
    from mtraining_kernels.probe_scores import blocks_are_runs, probe_lse, probe_scores

    def scores_check(layout, w, blk):
        def check():
            N = {"striped": 384, "zigzag": 288, "contiguous": 288}[layout]
            g = torch.Generator().manual_seed(N + w + blk)
            compared = 0
            for n in (5, 16, 17):
                rows_pos = torch.stack([N - n + torch.arange(n), N - 41 - n + torch.arange(n)])  # ragged row 1
                q_rows = torch.randn(2, 4, n, 24, generator=g)
                for r in range(w):
                    pos = global_positions(N, r, w, layout, blk)
                    k = torch.randn(2, 2, pos.numel(), 24, generator=g)
                    block = 16
                    assert blocks_are_runs(pos, block)
                    lse = probe_lse(q_rows, k, pos, rows_pos, 0.3, block, blocks_per_program=3)
                    lse_global = torch.logaddexp(lse, torch.randn(lse.shape, generator=g))  # other ranks' share
                    for kv_sum in (False, True):
                        ref_lse, ref_v, ref_s = reference_sums(q_rows, k, pos, rows_pos, lse_global, 0.3, kv_sum, N)
                        fin = torch.isfinite(ref_lse)
                        assert torch.equal(fin, torch.isfinite(lse)), f"rank {r} n {n}: -inf rows differ"
                        _close(lse[fin], ref_lse[fin], f"lse rank {r} n {n}")
                        vert, slash = probe_scores(q_rows, k, pos, rows_pos, lse_global, 0.3, kv_sum, N, block)
                        _close(vert, ref_v, f"vertical rank {r} n {n} kv {kv_sum}")
                        _close(slash, ref_s, f"slash rank {r} n {n} kv {kv_sum}")
                        compared += int((ref_s > 0).sum())
            assert compared > 0
        return check

    checks = {f"scores_{lay}_w{w}_b{blk}": scores_check(lay, w, blk) for lay, w, blk in CASES}

    def same_patterns(out):
        for name in ("topp", "topk-kv", "spread-topp", "spread-topp-b1"):
            for a, b in zip(out[(name, "torch")], out[(name, "triton")]):
                assert torch.equal(a, b), f"{name}: triton scorer {b.tolist()} != torch scorer {a.tolist()}"

    def w1():
        same_patterns(_estimate_worker(0, 1, False))

    def w3():
        from helpers.dist import run_distributed

        per_rank = run_distributed(_estimate_worker, 3, True, timeout=600)
        for out in per_rank:
            same_patterns(out)
            for key, val in out.items():
                for a, b in zip(val, per_rank[0][key]):
                    assert torch.equal(a, b), f"{key}: ranks differ"

    def no_runs():
        import lightning_mtraining.sparsity.estimation as est

        # striped stripes of 8 keys: no block of 16 consecutive positions, so the torch scorer runs (block 0)
        assert est._runs_block(96 * 3, 1, 3, "striped", 8, 16) == 0
        assert est._runs_block(96 * 3, 1, 3, "striped", 16, 16) == 16
        assert est._runs_block(96 * 3, 1, 3, "striped", 16, 18) == 0  # 18 probe rows need blocks of >= 17
        assert not blocks_are_runs(global_positions(96 * 3, 1, 3, "striped", 8), 16)

    checks.update({
        "estimate_pattern_triton_equals_torch_w1": w1,
        "estimate_pattern_triton_equals_torch_w3_gloo": w3,
        "layouts_without_runs_fall_back_to_torch": no_runs,
    })
    from helpers.interpreter import collect

    return collect(checks)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern_heads", ["query", "kv"])
def test_gpu_triton_scorer_matches_torch_scorer_at_32k(pattern_heads):
    """32K tokens, bf16, 16 query heads on 2 KV heads, head dim 128, 64 probes: the Triton scorer's vertical and
    slash scores against the torch scorer's (both float32 sums of the same bf16 products, different orders), and
    the patterns' index sets within a few boundary swaps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import lightning_mtraining.sparsity.estimation as est
    from lightning_mtraining import SparsityConfig, estimate_pattern

    N = 32768
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 2, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k[:, :, :8] += 2.0  # sinks, as trained models have
    cfg = SparsityConfig(top_p=0.9, max_vertical=1024, max_slash=1024, pattern_heads=pattern_heads)
    rows_pos = (N - 64 + torch.arange(64, device="cuda"))[None]
    pats, sums = {}, {}
    for scorer in ("torch", "triton"):
        est._SCORER = scorer
        probe = est._Probe(q, k, rows_pos, None, 0, 1, "striped", 128, 128 ** -0.5)
        G = 16 if pattern_heads == "query" else 2
        sums[scorer] = est._triton_scores(probe, G) if probe.block else est._scores(probe, G)
        pats[scorer] = estimate_pattern(q, k, cfg)
    est._SCORER = "auto"
    for ref, got, what in zip(sums["torch"], sums["triton"], ("vertical", "slash")):
        err = float((ref - got).abs().max())
        # float32 sums of up to 64 * 8 terms in different orders, relative to the largest score
        assert err <= 1e-4 * float(ref.abs().max()), f"{what}: {err}"
    for a, b in zip((pats["torch"].vertical_idx, pats["torch"].slash_idx),
                    (pats["triton"].vertical_idx, pats["triton"].slash_idx)):
        for row_a, row_b in zip(a.flatten(0, 1), b.flatten(0, 1)):
            sa, sb = set(row_a.tolist()) - {-1}, set(row_b.tolist()) - {-1}
            # random scores are nearly uniform: neighbours at the cap's boundary are ~3e-6 apart (relative), the
            # float32 summation orders differ by ~1e-6, so a few boundary entries may swap; not more than 1%
            assert len(sa ^ sb) <= max(4, len(sa) // 100), (len(sa), len(sb), len(sa ^ sb))


if __name__ == "__main__":
    from helpers.interpreter import script_main

    script_main(_run_checks)
