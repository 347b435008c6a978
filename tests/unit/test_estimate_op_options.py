"""The estimator as a custom op (what compiled layers call, ``ring.sparse_op.estimate_pattern_op``) estimates with
every option of its ``SparsityConfig``: the probe placement (``probes``, ``probe_blocks``) included, so a compiled
layer's pattern equals the eager one's (compared entry for entry after the op's -1 padding is dropped)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_mtraining import SparsityConfig
from lightning_mtraining.ring.sparse_op import estimate_pattern_op
from lightning_mtraining.sparsity.estimation import estimate_pattern


def _valid(idx: torch.Tensor) -> list[list[list[int]]]:
    return [[sorted(x for x in row.tolist() if x >= 0) for row in head] for head in idx]


@pytest.mark.parametrize("probes", ["last", "spread"])
def test_the_op_estimates_with_the_probe_placement(probes):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 512, 16, generator=g)
    k = torch.randn(1, 2, 512, 16, generator=g)
    cfg = SparsityConfig(top_p=0.5, last_q=16, sink_tokens=2, local_window=16, tile_size=16, max_vertical=24,
                         max_slash=8, probes=probes, probe_blocks=4)
    eager = estimate_pattern(q, k, cfg, block_size=16)
    vert, slash = estimate_pattern_op(q, k, cfg, block_size=16)
    assert _valid(vert) == _valid(eager.vertical_idx) and _valid(slash) == _valid(eager.slash_idx)
    if probes == "spread":  # the placement matters here: the paper's probes choose another pattern
        last = estimate_pattern(q, k, dataclasses.replace(cfg, probes="last"), block_size=16)
        assert _valid(last.vertical_idx) != _valid(eager.vertical_idx) or _valid(last.slash_idx) != _valid(
            eager.slash_idx)
