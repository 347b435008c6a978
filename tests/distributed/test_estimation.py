"""Online pattern estimation (``estimate_pattern``) and pattern recall (``attention_recall``) against an independent
float64 single-device implementation of the contract (``tests/helpers/pattern_ref.py``, plain loops).

The estimator runs on W gloo processes (W in 1, 2, 3, 4, 8), each holding its shard of the same random q/k in one of
the three layouts; every rank must return the same pattern, and it must equal the reference's index sets exactly
(top-k and top-p, per query head and per KV group, GQA, batch 2, a ragged batch whose second row has 37 padding
tokens). Inputs are float64, so the distributed sums and the reference's differ only by summation order (~1e-16),
far below the gaps between random scores: any mismatch is a real difference in what is selected.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from helpers.dist import run_distributed
from helpers.pattern_ref import pattern_lists, reference_pattern
from lightning_mtraining import shard_sequence
from lightning_mtraining.core.layouts import LAYOUTS, layout_unit
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.estimation import attention_recall, estimate_pattern
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern

B, H, HKV, D, BS = 2, 6, 2, 8, 16
CONFIGS = {
    "topk-query": SparsityConfig(vertical_topk=5, slash_topk=4, last_q=8, sink_tokens=2, local_window=3, tile_size=16),
    "topp-query": SparsityConfig(top_p=0.6, max_vertical=9, max_slash=7, last_q=8, sink_tokens=2, local_window=3,
                                 tile_size=16),
    "topk-kv": SparsityConfig(vertical_topk=(3, 6), slash_topk=4, last_q=5, sink_tokens=0, local_window=1,
                              tile_size=16, pattern_heads="kv"),
    "topp-kv": SparsityConfig(top_p=0.9, max_vertical=20, max_slash=30, last_q=12, sink_tokens=1, local_window=0,
                              tile_size=16, pattern_heads="kv"),
    # probe blocks spread over the sequence: 5 blocks of 30 rows in full rows (150-256 tokens), 3 to 5 in the
    # ragged row (n - 37 tokens), whose missing blocks are padding rows
    "spread-topp-query": SparsityConfig(top_p=0.8, max_vertical=12, max_slash=9, last_q=30, probes="spread",
                                        probe_blocks=5, sink_tokens=2, local_window=3, tile_size=16),
    "spread-topk-kv": SparsityConfig(vertical_topk=(4, 7), slash_topk=5, last_q=7, probes="spread", probe_blocks=3,
                                     sink_tokens=1, local_window=2, tile_size=16, pattern_heads="kv"),
}


def seq_len_for(layout: str, w: int) -> int:
    unit = layout_unit(layout, w, BS)
    return unit * max(1, math.ceil(150 / unit))


def inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64)
    return q, k


def lens_for(n: int) -> list[list[int]]:
    return [[n, n], [n, n - 37]]


def estimate_worker(rank, w):
    results = {}
    for li, layout in enumerate(LAYOUTS):
        n = seq_len_for(layout, w)
        q, k = inputs(n, seed=100 + li)
        ql, kl = (shard_sequence(t, 2, rank, w, layout, BS) for t in (q, k))
        for name, cfg in CONFIGS.items():
            for lens in lens_for(n):
                p = estimate_pattern(ql, kl, cfg, group=dist.group.WORLD, layout=layout, block_size=BS, seq_len=lens)
                results[(layout, name, tuple(lens))] = (p.vertical_idx, p.slash_idx)
    return results


@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
def test_estimator_matches_float64_reference_on_every_rank(w):
    per_rank = run_distributed(estimate_worker, w, timeout=600)
    for key, (v0, s0) in per_rank[0].items():
        for r in range(1, w):  # the same global pattern on every rank, bit for bit
            assert torch.equal(per_rank[r][key][0], v0) and torch.equal(per_rank[r][key][1], s0), (key, r)
    for li, layout in enumerate(LAYOUTS):
        n = seq_len_for(layout, w)
        q, k = inputs(n, seed=100 + li)
        for name, cfg in CONFIGS.items():
            for lens in lens_for(n):
                v, s = per_rank[0][(layout, name, tuple(lens))]
                got = pattern_lists(VerticalSlashPattern(v, s, cfg.tile_size))
                assert got == reference_pattern(q, k, cfg, lens), (layout, name, lens)
                # padding (positions and offsets >= the real length) is never selected
                for b, length in enumerate(lens):
                    assert int(v[b].max()) < length and int(s[b].max()) < length


def test_single_process_without_group_and_layouts_agree():
    """W = 1 needs no process group; the layout is irrelevant there (one shard holds everything)."""
    n = 96
    q, k = inputs(n, seed=7)
    cfg = CONFIGS["topp-query"]
    ref = reference_pattern(q, k, cfg, [n, n])
    for layout in LAYOUTS:
        assert pattern_lists(estimate_pattern(q, k, cfg, layout=layout, block_size=BS)) == ref


def test_per_layer_and_per_head_budgets():
    n = 128
    q, k = inputs(n, seed=3)
    budgets = {2: [(1, 2), (3, 0), (0, 5), (2, 2), (4, 4), (6, 1)], 5: (0, 0)}
    cfg = SparsityConfig(vertical_topk=4, slash_topk=4, last_q=8, sink_tokens=1, local_window=2, tile_size=16,
                         budgets=budgets)
    for layer in (None, 2, 5):
        got = pattern_lists(estimate_pattern(q, k, cfg, layer_idx=layer))
        assert got == reference_pattern(q, k, cfg, [n, n], layer_idx=layer), layer
    # layer 5 keeps nothing but the forced entries
    p5 = pattern_lists(estimate_pattern(q, k, cfg, layer_idx=5))
    assert all(heads == ([0], [0, 1]) for row in p5 for heads in row)


def test_budgets_load_from_json(tmp_path):
    path = tmp_path / "budgets.json"
    path.write_text('{"layers": {"0": [7, 9], "3": [[1, 2], [3, 4]]}}')
    cfg = SparsityConfig(budgets=str(path))
    assert cfg.head_budgets(2, 0) == ([7, 7], [9, 9])
    assert cfg.head_budgets(2, 3) == ([1, 3], [2, 4])
    assert cfg.head_budgets(2, 1) == ([1024, 1024], [1024, 1024])
    full = tmp_path / "config.json"
    full.write_text('{"top_p": 0.9, "max_vertical": 100, "budgets": {"1": [5, 6]}}')
    cfg2 = SparsityConfig.from_json(full, last_q=32)
    assert cfg2.top_p == 0.9 and cfg2.last_q == 32 and cfg2.head_budgets(1, 1) == ([5], [6])
    with pytest.raises(ValueError, match="per-head budgets"):
        cfg.head_budgets(3, 3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vertical_topk=-1), "vertical_topk must be an int >= 0"),
        (dict(max_slash=[1, -2]), r"max_slash\[1\] must be an int >= 0"),
        (dict(top_p=1.5), "top_p must be None"),
        (dict(last_q=0), "last_q must be an int >= 1"),
        (dict(tile_size=100), "power of two"),
        (dict(pattern_heads="group"), "pattern_heads"),
        (dict(probes="first"), "probes must be one of"),
        (dict(probe_blocks=0), "probe_blocks must be an int >= 1"),
        (dict(dense_layers=[1], budgets={1: (1, 1)}), "both in dense_layers and in budgets"),
        (dict(budgets={"x": (1, 1)}), "not an integer"),
    ],
)
def test_bad_configs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparsityConfig(**kwargs)


def test_bad_inputs_are_clear_errors():
    q, k = inputs(64, seed=1)
    cfg = SparsityConfig(last_q=8, tile_size=16)
    with pytest.raises(ValueError, match="last_q=80 probe queries but a sequence has only 64"):
        estimate_pattern(q, k, SparsityConfig(last_q=80))
    with pytest.raises(ValueError, match="last_q=8 probe queries but a sequence has only 5"):
        estimate_pattern(q, k, cfg, seq_len=[64, 5])
    with pytest.raises(ValueError, match="estimate_pattern: q \\(2, 6, 64, 8\\) and k/v \\(2, 2, 32, 8\\) must agree "
                                         "on batch, local sequence length"):
        estimate_pattern(q, k[:, :, :32], cfg)
    with pytest.raises(ValueError,
                       match="estimate_pattern: query heads \\(\\d+\\) must be a multiple of key/value heads"):
        estimate_pattern(q[:, :5], k, cfg)
    with pytest.raises(ValueError, match="seq_len \\[65, 65\\] must be in \\[1, 64\\]"):
        estimate_pattern(q, k, cfg, seq_len=65)
    with pytest.raises(ValueError, match="seq_len has 3 entries for a batch of 2"):
        estimate_pattern(q, k, cfg, seq_len=[64, 64, 64])
    with pytest.raises(TypeError, match="config must be a SparsityConfig"):
        estimate_pattern(q, k, {"top_p": 0.9})
    with pytest.raises(ValueError, match="unknown layout"):
        estimate_pattern(q, k, cfg, layout="ring")


def _bad_group_worker(rank, w):
    q, k = inputs(96, seed=2)
    cfg = SparsityConfig(last_q=8, tile_size=16)
    errors = []
    solo = dist.new_group([0])  # every rank must call new_group; rank 1 is not a member
    if rank == 1:
        try:
            estimate_pattern(q[:, :, :48], k[:, :, :48], cfg, group=solo, layout="contiguous")
        except ValueError as e:
            errors.append(str(e))
    # shards of different lengths on the two ranks: not one CP group's shards of one sequence
    s = 48 if rank == 0 else 32
    try:
        estimate_pattern(q[:, :, :s], k[:, :, :s], cfg, group=dist.group.WORLD, layout="contiguous")
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_a_group_that_is_not_the_cp_group_is_a_clear_error():
    errs = run_distributed(_bad_group_worker, 2)
    assert len(errs[0]) == 1 and "different shapes" in errs[0][0]
    assert len(errs[1]) == 2 and "not a member" in errs[1][0] and "different shapes" in errs[1][1]


# --- recall ---------------------------------------------------------------------------------------------------


def reference_recall(q, k, pattern, rows, seq_len):
    """float64: dense causal softmax of the given rows over the whole sequence, mass inside the pattern's mask."""
    Bq, Hq, n, Dq = q.shape
    Hk = k.shape[1]
    mask = pattern.expand(Hq, Hk).mask(n)  # [B, H, n, n]
    kr = k.double().repeat_interleave(Hq // Hk, 1)
    s = q.double() @ kr.transpose(-1, -2) / math.sqrt(Dq)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.softmax(s, -1)
    kept = (a * mask).sum(-1)  # [B, H, n]
    per_row = torch.stack([kept[b][:, rows[b]] for b in range(Bq)])  # [B, H, r]
    recall = per_row.mean(-1)
    G = pattern.num_heads
    return recall.view(Bq, G, Hq // G).mean(-1) if G != Hq else recall


def recall_worker(rank, w):
    out = {}
    for li, layout in enumerate(LAYOUTS):
        n = seq_len_for(layout, w)
        q, k = inputs(n, seed=200 + li)
        ql, kl = (shard_sequence(t, 2, rank, w, layout, BS) for t in (q, k))
        for name in ("topk-query", "topp-kv"):
            cfg = CONFIGS[name]
            p = estimate_pattern(ql, kl, cfg, group=dist.group.WORLD, layout=layout, block_size=BS, seq_len=[n, n - 37])
            r = attention_recall(ql, kl, p, rows=9, group=dist.group.WORLD, layout=layout, block_size=BS,
                                 seq_len=[n, n - 37])
            full = VerticalSlashPattern.full(B, H, n, tile_size=16)
            rf = attention_recall(ql, kl, full, group=dist.group.WORLD, layout=layout, block_size=BS)
            out[(layout, name)] = (p.vertical_idx, p.slash_idx, r, rf)
    return out


def test_attention_recall_matches_reference_distributed():
    w = 3
    per_rank = run_distributed(recall_worker, w)
    for li, layout in enumerate(LAYOUTS):
        n = seq_len_for(layout, w)
        q, k = inputs(n, seed=200 + li)
        rows = [[(i + 1) * length // 9 - 1 for i in range(9)] for length in (n, n - 37)]
        for name in ("topk-query", "topp-kv"):
            v, s, r, rf = per_rank[0][(layout, name)]
            for other in per_rank[1:]:
                assert torch.equal(other[(layout, name)][2], r)  # identical on every rank
            p = VerticalSlashPattern(v, s, 16)
            ref = reference_recall(q, k, p, rows, n)
            # float64 sums in different orders: 1e-12
            torch.testing.assert_close(r, ref, rtol=0, atol=1e-12)
            assert bool((r > 0).all()) and bool((r <= 1 + 1e-12).all())
            if name == "topk-query":  # 4 slashes of ~10 tile diagonals: some mass is lost
                assert float(r.mean()) < 0.95
            torch.testing.assert_close(rf, torch.ones_like(rf), rtol=0, atol=1e-12)  # full pattern: nothing lost


def _select_cases():
    """float32 scores with many exact ties (values on a coarse grid), some entries not candidates, some forced."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 6, (2, 3, 60), generator=g).float() / 8
    cand = torch.rand(2, 3, 60, generator=g) > 0.2
    forced = ~cand & (torch.rand(2, 3, 60, generator=g) > 0.5)
    index = torch.arange(60)[None] * 3 + 1  # global indices, ascending
    return scores, index, cand, forced


def select_worker(rank, w):
    from lightning_mtraining.sparsity.estimation import _select

    scores, index, cand, forced = _select_cases()
    mine = slice(rank * 60 // w, (rank + 1) * 60 // w)  # each rank owns a slice of the entries
    out = {}
    for top_p in (None, 0.7):
        for budgets in ([5, 0, 70], [12, 12, 12]):
            args = (index[:, mine], cand[..., mine], forced[..., mine], budgets, top_p, dist.group.WORLD, w)
            out[(top_p, tuple(budgets))] = (_select(scores[..., mine], *args),
                                            _select(scores[..., mine].double(), *args))
    return out


@pytest.mark.parametrize("w", [1, 3])
def test_packed_float32_selection_equals_the_float64_sort(w):
    """The float32 selection (int64 keys, ``topk``) against the float64 one (stable sorts) on the same values: ties
    broken by the lower index, budgets 0 and above the entry count, top-p with forced mass, over 1 and 3 ranks each
    owning a slice. The float32 -> float64 conversion is exact, so the results must be identical."""
    per_rank = run_distributed(select_worker, w)
    for key, (packed, sorted_) in per_rank[0].items():
        assert torch.equal(packed, sorted_), (key, packed.tolist(), sorted_.tolist())
        assert bool((packed >= 0).any())
        for other in per_rank[1:]:
            assert torch.equal(other[key][0], packed)
