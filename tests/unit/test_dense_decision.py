"""Which heads run dense (``SparsityConfig.dense_above``) is decided exactly and once per layer and forward.

Under ``precision="bf16-true"`` the forward runs with the default dtype bfloat16 and a checkpointed layer's recompute
(during backward) with float32. A decision ``allowed > dense_above * causal`` computed in the default dtype rounds the
threshold to 8 bits of mantissa in one pass and not in the other, so a head near the threshold took the dense path in
one pass and the sparse one in the other, and non-reentrant checkpointing failed (the recompute saved other tensors).
These tests put a head at the threshold: first on the decision itself at 131072 tokens, then through a checkpointed
bf16 model whose forward and recompute run under different default dtypes.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from helpers.dense_decision import checkpointed_step_at_threshold
from lightning_mtraining.sparsity.pattern import LayerPattern, VerticalSlashPattern, dense_heads, head_pairs

N = 131072


def _pattern_near(share: float, seq: int = N, tile: int = 128) -> VerticalSlashPattern:
    """Two heads: one whose pattern allows about ``share`` of the causal pairs (the first slashes of the diagonal
    band), one sparse (the local window)."""
    n_tiles = seq // tile
    band = int(n_tiles * (1 - (1 - share) ** 0.5))  # slashes 0..band-1 cover about 1 - (1 - band/nt)^2 of the pairs
    slash = torch.full((1, 2, band), -1, dtype=torch.int64)
    slash[0, 0] = torch.arange(band) * tile
    slash[0, 1, :2] = torch.tensor([0, tile])
    vertical = torch.tensor([[[0, 5, 77], [0, -1, -1]]])
    return VerticalSlashPattern(vertical, slash, tile)


def _naive(allowed: torch.Tensor, causal: torch.Tensor, dense_above: float) -> torch.Tensor:
    """The comparison as it was written before: in the default dtype."""
    return allowed > dense_above * causal[:, None]


def test_the_decision_is_exact_at_131072_tokens_under_a_bf16_default_dtype():
    pattern = _pattern_near(0.85)
    allowed, causal = head_pairs(pattern, [N])
    share = Fraction(int(allowed[0, 0]), int(causal[0]))
    assert 0.8 < share < 0.9
    flipped = 0
    # thresholds within a bf16 rounding step (2**-8 relative) of head 0's exact share, on both sides
    for rel in (-3e-3, -1e-3, -1e-6, 1e-6, 1e-3, 3e-3):
        dense_above = float(share) * (1 + rel)
        exact = [Fraction(int(a)) > Fraction(dense_above) * int(causal[0]) for a in allowed[0]]
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            torch.set_default_dtype(dtype)
            try:
                assert dense_heads(pattern, [N], dense_above)[0].tolist() == exact, (rel, dtype)
                assert LayerPattern.decide(pattern, [N], dense_above, N).dense[0].tolist() == exact, (rel, dtype)
                if dtype == torch.bfloat16:
                    flipped += _naive(allowed, causal, dense_above)[0].tolist() != exact
            finally:
                torch.set_default_dtype(torch.float32)
    assert flipped > 0  # the default-dtype comparison does get some of these wrong: the test can fail


def test_the_record_carries_the_decision():
    pattern = _pattern_near(0.5, seq=4096)
    allowed, causal = head_pairs(pattern, [4096])
    layer = LayerPattern.decide(pattern, [4096], 0.3, 4096)
    assert layer.dense.tolist() == [[True, False]]
    assert torch.equal(layer.allowed, allowed) and torch.equal(layer.causal, causal)
    # the dense head runs the full pattern, the other its own
    assert layer.computed is not None and not layer.all_dense
    assert torch.equal(layer.computed.vertical_idx[0, 1], pattern.vertical_idx[0, 1])
    assert (layer.computed.vertical_idx[0, 0] < 0).all()
    assert LayerPattern.decide(pattern, [4096], 0.0, 4096).all_dense
    assert LayerPattern.decide(pattern, [4096], None, 4096).computed is pattern


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("straight", [True, False])
def test_a_checkpointed_bf16_layer_at_the_threshold_takes_one_path(family, straight, monkeypatch):
    checkpointed_step_at_threshold(family, torch.device("cpu"), monkeypatch, straight=straight)
