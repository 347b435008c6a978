"""``SparsityConfig.dense_above``: a pattern head whose estimated pattern allows more than that share of its causal
pairs computes dense attention (where the sparse kernels cost more than the dense one), a layer whose every head does
runs the dense ring, and the metrics say so. Under the strategies' attention a forward's decision applies from the
layer's next forward (Note [The straight path] in ``lightning_mtraining.ring.straight``); ``ring_attention`` given a
config or ``dense_above`` decides in the same call.

Every path is exact: a layer whose heads all fall back makes the same ring call as a dense layer (bit-identical), a
layer below the threshold computes exactly its pattern (bit-identical to ``dense_above=None``), and in a mixed layer
each head equals its own path. The decision is per head, so a rank holding some of the heads (tensor parallelism)
decides as one device does.
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
    """The second of two forwards of the same batch (the first decided which heads the second runs dense)."""
    from lightning_mtraining import apply_context_parallel

    model = make_model("qwen2", seed=0).double()
    handle = apply_context_parallel(model, block_size=16, sparsity=sparsity, fused_loss=False)
    if handle.schedule is not None:  # None when every layer is dense
        handle.schedule.log_every_n_steps = 1  # measure the forward
    x = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    model(**handle.shard({"input_ids": x}))
    logits = model(**handle.shard({"input_ids": x})).logits
    return logits.detach(), handle.attention_metrics(), handle.schedule


def test_a_forward_decides_the_next_one():
    """The first forward runs every head sparse (no decision yet) and decides; the second runs the decided heads
    dense: its output differs from the first exactly where that changes the attention."""
    from lightning_mtraining import SparsityConfig, apply_context_parallel

    model = make_model("qwen2", seed=0).double()
    handle = apply_context_parallel(model, block_size=16, sparsity=SparsityConfig(**CFG, dense_above=0.5),
                                    fused_loss=False)
    handle.schedule.log_every_n_steps = 1
    x = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    first = model(**handle.shard({"input_ids": x})).logits.detach()
    assert handle.attention_metrics()["attention/dense_heads"] == 0.0  # nothing decided before the first forward
    second = model(**handle.shard({"input_ids": x})).logits.detach()
    assert handle.attention_metrics()["attention/dense_heads"] == 7 / 8
    sparse, _, _ = _run(SparsityConfig(**CFG, dense_above=None))
    assert torch.equal(first, sparse)  # the first forward ran the patterns as estimated
    assert (second - first).abs().max() > 1e-3


def test_a_pattern_covering_most_pairs_runs_dense_exactly():
    from lightning_mtraining import SparsityConfig

    _, measured, _ = _run(SparsityConfig(**CFG, dense_above=None))
    density = measured["attention/density"]
    assert 0.5 < density < 1.0, density  # most pairs, but not all (so the paths differ)

    fallback, metrics, schedule = _run(SparsityConfig(**CFG, dense_above=0.5))
    # every head of layer 0 allows more than half its pairs: the layer makes the dense ring call, bit-identical to a
    # dense layer; layer 1 has a head below the threshold, so it runs mixed, the same way in both runs
    dense, _, _ = _run(SparsityConfig(**CFG, dense_above=0.5, dense_layers=(0,)))
    sparse, _, _ = _run(SparsityConfig(**CFG, dense_above=None))
    assert torch.equal(fallback, dense)
    assert (fallback - sparse).abs().max() > 1e-3  # the patterns left pairs out: a real difference
    assert metrics["attention/density/layer_0"] == 1.0  # what was computed: every causal pair
    assert 0.5 < metrics["attention/density/layer_1"] < 1.0  # one head its pattern, the others every pair
    assert metrics["attention/dense_heads"] == 7 / 8  # 2 layers x 4 pattern heads, one of them below 0.5


def test_a_sparse_pattern_keeps_its_pattern():
    from lightning_mtraining import SparsityConfig

    budget = dict(CFG, max_slash=4)  # about 30% of the pairs: below the threshold
    kept, metrics, schedule = _run(SparsityConfig(**budget, dense_above=0.5))
    exact, _, _ = _run(SparsityConfig(**budget, dense_above=None))
    assert torch.equal(kept, exact)
    assert metrics["attention/dense_heads"] == 0.0
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


def _mixed():
    """Head 0 the ten nearest tile diagonals of 16 (about 85% of the pairs), head 1 two diagonals and two columns
    (under 25%): above and below a threshold of 0.5."""
    from lightning_mtraining import VerticalSlashPattern

    slash = torch.tensor([[list(range(0, 160, 16)), [0, 16] + [-1] * 8]])
    vertical = torch.tensor([[[-1, -1], [0, 5]]])
    return VerticalSlashPattern(vertical, slash, 16)


def test_a_mixed_layer_runs_each_head_on_its_own_path():
    """One head above the threshold, one below: the first equals dense attention, the second its pattern, in the
    eager ring and in the sparse ring op alike (float64: rounding only)."""
    from lightning_mtraining import ring_attention
    from lightning_mtraining.ring.sparse_op import sparse_ring_attention
    from lightning_mtraining.sparsity.pattern import dense_heads

    q, k, v = _qkv()
    pattern = _mixed()
    assert dense_heads(pattern, [256], 0.5).tolist() == [[True, False]]
    dense = ring_attention(q, k, v, block_size=16)
    exact = ring_attention(q, k, v, block_size=16, sparsity=pattern)
    eager = ring_attention(q, k, v, block_size=16, sparsity=pattern, dense_above=0.5)
    op = sparse_ring_attention(q, k, v, pattern.vertical_idx, pattern.slash_idx, tile_size=16, block_size=16,
                               dense_above=0.5)
    # 4 query heads over 2 KV groups: pattern head 0 serves query heads 0-1, head 1 query heads 2-3
    for got in (eager, op):
        torch.testing.assert_close(got[:, :2], dense[:, :2], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[:, 2:], exact[:, 2:], rtol=0, atol=1e-12)
    for heads in (slice(0, 2), slice(2, 4)):  # both patterns leave pairs out: each path is a real choice
        assert (exact[:, heads] - dense[:, heads]).abs().max() > 1e-3


def test_a_rank_holding_some_heads_decides_as_one_device():
    """Tensor parallelism splits the heads across ranks: each KV group's slice computed alone (its pattern head
    alone) equals the same heads of the whole layer, whatever the other heads' patterns."""
    from lightning_mtraining import VerticalSlashPattern, ring_attention

    q, k, v = _qkv()
    pattern = _mixed()
    whole = ring_attention(q, k, v, block_size=16, sparsity=pattern, dense_above=0.5)
    for g in range(2):
        part = VerticalSlashPattern(pattern.vertical_idx[:, g:g + 1], pattern.slash_idx[:, g:g + 1], 16)
        got = ring_attention(q[:, 2 * g:2 * g + 2], k[:, g:g + 1], v[:, g:g + 1], block_size=16, sparsity=part,
                             dense_above=0.5)
        torch.testing.assert_close(got, whole[:, 2 * g:2 * g + 2], rtol=0, atol=1e-12)


def test_the_metrics_count_dense_heads():
    """A measured forward of the mixed pattern: half the heads ran dense, and the density counts their every pair."""
    from lightning_mtraining.sparsity.config import SparsityConfig
    from lightning_mtraining.sparsity.schedule import AttentionSchedule

    pattern = _mixed()
    schedule = AttentionSchedule(lambda layer: SparsityConfig(tile_size=16))
    schedule.record(0, pattern, [256], 256, 1, "contiguous", 16, None, dense_above=0.5)
    metrics = schedule.metrics()
    allowed = pattern.allowed_pairs(256)[0].tolist()
    causal = 256 * 257 // 2
    assert 0.5 * causal < allowed[0] < causal and allowed[1] < causal / 4
    assert metrics["attention/dense_heads"] == 0.5
    assert metrics["attention/density"] == (causal + allowed[1]) / (2 * causal)  # the dense head: every pair
