"""causal_lm_loss / causal_lm_targets in one process, and the loss mark the strategies check.

Reference: Hugging Face's own causal-LM loss of the same model on the same batch (``model(**batch).loss``),
float32; both compute the same cross-entropies and differ only in summation order, so 1e-6 relative. The
distributed cases (2 and 3 ranks against single-process training) are in test_user_steps.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

from helpers.models import make_model
from helpers.training import make_samples
from lightning_mtraining import causal_lm_loss, causal_lm_targets
from lightning_mtraining.distributed.sharding import shard_batch
from lightning_mtraining.hf.losses import is_marked_loss, mark_loss


def _batch(n: int = 3, seq_len: int = 29) -> dict:
    samples = make_samples(n, seq_len)
    return {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "attention_mask", "labels")}


def test_whole_sequence_matches_hugging_face():
    model = make_model("qwen2")
    batch = _batch()
    out = model(**batch)
    assert causal_lm_loss(out.logits, batch).item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert causal_lm_loss(out.logits, batch["labels"]).item() == pytest.approx(out.loss.item(), rel=1e-6)
    # Already-shifted targets (nanoGPT-style data): the same loss when they are the shifted labels.
    targets = causal_lm_targets(batch)
    assert torch.equal(targets[:, :-1], batch["labels"][:, 1:]) and (targets[:, -1] == -100).all()
    assert causal_lm_loss(out.logits, targets, shifted=True).item() == pytest.approx(out.loss.item(), rel=1e-6)
    # The gradient is HF's too.
    g_ours = torch.autograd.grad(causal_lm_loss(out.logits, batch), out.logits, retain_graph=True)[0]
    g_hf = torch.autograd.grad(out.loss, out.logits)[0]
    torch.testing.assert_close(g_ours, g_hf, rtol=1e-5, atol=1e-9)


def test_single_rank_shard_matches_and_errors_are_clear():
    """A batch sharded for one rank (padded 29 -> 32): the helper finds the shard's targets through the tags."""
    model = make_model("llama")
    batch = _batch()
    want = model(**batch).loss.item()
    sharded = shard_batch(batch, cp_rank=0, cp_size=1, layout="striped", block_size=8)
    inputs = sharded.batch
    logits = model(input_ids=inputs["input_ids"]).logits  # [3, 32, V]; the padding has no target
    assert causal_lm_loss(logits, inputs).item() == pytest.approx(want, rel=1e-6)
    # Labels built in the step (untagged): with the logits tagged by a prepared model they are shifted over the CP
    # group (test_user_steps.py); here the logits are untagged, so a whole padded sequence, -100 at the padding.
    assert causal_lm_loss(logits, inputs["labels"].clone()).item() == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="logits .* do not line up with the targets .* unshifted"):
        causal_lm_loss(logits[:, :-1], inputs)
    # A shard whose record is gone (kept from an earlier step) is refused, not treated as a whole sequence.
    stale = inputs["labels"]
    del sharded, inputs
    gc.collect()
    with pytest.raises(RuntimeError, match="shard of an earlier batch"):
        causal_lm_loss(logits, stale)


def test_mark_is_found_through_arithmetic_and_missing_otherwise():
    x = torch.randn(4, requires_grad=True)
    marked = mark_loss((x * 2).sum())
    assert is_marked_loss(marked)
    assert is_marked_loss(marked * 0.5 + x.pow(2).sum() / 4)  # `out.loss * 0.5 + aux`, then / accumulate
    assert not is_marked_loss((x * 3).sum())
    assert not is_marked_loss(torch.tensor(1.0))  # no graph
    deep = (x * 2).sum()
    for _ in range(2000):  # a graph larger than the search bound with no mark: bounded, and False
        deep = deep + 0.0
    assert not is_marked_loss(deep)
