"""``SparsityConfig.dense_above``: a layer whose estimated pattern allows more than that share of the causal pairs runs
dense attention in that forward (where the sparse kernels cost more than the dense one), and says so in the metrics.

Both paths are exact: a layer that falls back makes the same ring call as a dense layer (bit-identical), and a layer
below the threshold computes exactly its pattern (bit-identical to ``dense_above=None``).
One process (``apply_context_parallel`` without a mesh), a tiny float64 Qwen2 with random weights.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.models import VOCAB, make_model

SEQ = 512
# top-p 0.9 would keep every pair of so short a sequence; a slash cap makes the pattern cover about 60% of them
CFG = dict(top_p=0.9, last_q=8, sink_tokens=2, local_window=16, tile_size=16, max_vertical=8, max_slash=16)


def _run(sparsity):
    from lightning_mtraining import apply_context_parallel

    model = make_model("qwen2", seed=0).double()
    handle = apply_context_parallel(model, block_size=16, sparsity=sparsity, fused_loss=False)
    if handle.schedule is not None:  # None when every layer is dense
        handle.schedule.log_every_n_steps = 1  # measure the forward
    x = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    logits = model(**handle.shard({"input_ids": x})).logits
    return logits.detach(), handle.attention_metrics(), handle.schedule


def test_a_pattern_covering_most_pairs_runs_dense_exactly():
    from lightning_mtraining import SparsityConfig

    _, measured, _ = _run(SparsityConfig(**CFG, dense_above=None))
    density = measured["attention/density"]
    assert 0.5 < density < 1.0, density  # most pairs, but not all (so the paths differ)

    fallback, metrics, schedule = _run(SparsityConfig(**CFG, dense_above=0.5))
    # layer 0 a dense layer (the ring's dense call), layer 1 falling back as above
    dense, _, _ = _run(SparsityConfig(**CFG, dense_above=0.5, dense_layers=(0,)))
    sparse, _, _ = _run(SparsityConfig(**CFG, dense_above=None))
    assert torch.equal(fallback, dense)  # a layer that falls back makes the dense layer's ring call
    assert (fallback - sparse).abs().max() > 1e-3  # the pattern left pairs out: a real difference
    assert metrics["attention/dense_fallback"] == 2.0
    assert metrics["attention/density"] == 1.0  # what was computed: every causal pair


def test_a_sparse_pattern_keeps_its_pattern():
    from lightning_mtraining import SparsityConfig

    budget = dict(CFG, max_slash=4)  # about 30% of the pairs: below the threshold
    kept, metrics, schedule = _run(SparsityConfig(**budget, dense_above=0.5))
    exact, _, _ = _run(SparsityConfig(**budget, dense_above=None))
    assert torch.equal(kept, exact)
    assert metrics["attention/dense_fallback"] == 0.0
    assert metrics["attention/density"] < 0.5


def test_dense_above_is_checked_and_defaults_on():
    from lightning_mtraining import SparsityConfig
    from lightning_mtraining.sparsity.config import DENSE_ABOVE, PAPER_SPARSITY

    assert SparsityConfig().dense_above == DENSE_ABOVE == PAPER_SPARSITY.dense_above
    assert dataclasses.replace(PAPER_SPARSITY, dense_above=None).dense_above is None
    for bad in (1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="dense_above must be None .* or in \\[0, 1\\]"):
            SparsityConfig(dense_above=bad)


def _qkv(seq: int = 256):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(1, h, seq, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))


@pytest.mark.parametrize("dense_above", [0.5, None])
def test_the_ring_and_its_compiled_op_decide_alike(dense_above):
    """The decision lives in the ring, so ``ring_attention`` (eager) and the sparse ring custom op (what a compiled
    layer runs) take the same path for the same pattern: dense above the threshold, the pattern below it."""
    from lightning_mtraining import VerticalSlashPattern, ring_attention
    from lightning_mtraining.ring.sparse_op import sparse_ring_attention

    q, k, v = _qkv()
    covering = VerticalSlashPattern.full(1, 2, 256, tile_size=16)  # every tile: density 1
    sparse = VerticalSlashPattern(torch.tensor([[[0, 1], [0, 5]]]), torch.tensor([[[0, 16], [0, 48]]]), 16)
    dense = ring_attention(q, k, v, block_size=16)
    for pattern, runs_dense in ((covering, dense_above is not None), (sparse, False)):
        eager = ring_attention(q, k, v, block_size=16, sparsity=pattern, dense_above=dense_above)
        op = sparse_ring_attention(q, k, v, pattern.vertical_idx, pattern.slash_idx, tile_size=16, block_size=16,
                                   dense_above=dense_above)
        exact = ring_attention(q, k, v, block_size=16, sparsity=pattern)  # a given pattern runs as given by default
        torch.testing.assert_close(op, eager, rtol=0, atol=1e-12)  # float64, the same pairs: rounding only
        torch.testing.assert_close(eager, dense if runs_dense else exact, rtol=0, atol=1e-12)
    assert (ring_attention(q, k, v, block_size=16, sparsity=sparse) - dense).abs().max() > 1e-3  # the paths differ
