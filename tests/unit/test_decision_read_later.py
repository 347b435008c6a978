"""A layer's dense decision read after its attention is launched (``PendingLayerPattern``).

On a GPU the hook does not wait for the decision before launching the attention: it runs what the layer's last
outcome says (the guess), reads the decision after, and runs the layer again only where the guess was not exact. These
tests run that path on CPU tensors (the read is then immediate, the logic the same): every guess against every
decision gives the attention ``LayerPattern.decide`` gives, the read comes after the step lists are built, and a
checkpointed layer whose guess was wrong recomputes exactly what its forward ran.
"""

from __future__ import annotations

import pytest
import torch

import lightning_mtraining.ring.attention as ring_attention_mod
import lightning_mtraining.sparsity.pattern as pattern_mod
from helpers.dense_decision import checkpointed_step_at_threshold
from lightning_mtraining.ring import ring_attention
from lightning_mtraining.sparsity import LayerPattern, PendingLayerPattern, VerticalSlashPattern
from lightning_mtraining.sparsity.pattern import OUTCOMES
from lightning_mtraining.sparsity.schedule import AttentionSchedule

S, T = 256, 16
DENSE_ABOVE = 0.5


def _pattern(outcome: str) -> VerticalSlashPattern:
    """Two pattern heads: a head is dense (a slash through every tile diagonal: share 1.0 > DENSE_ABOVE) or sparse
    (the local tiles and two columns: share ~0.14); ``outcome`` says which of the two are dense."""
    n_tiles = S // T
    dense_heads = {"sparse": (), "mixed": (0,), "dense": (0, 1)}[outcome]
    slash = torch.full((1, 2, n_tiles), -1, dtype=torch.int64)
    vertical = torch.full((1, 2, 2), -1, dtype=torch.int64)
    for h in range(2):
        if h in dense_heads:
            slash[0, h] = torch.arange(n_tiles) * T
        else:
            slash[0, h, :2] = torch.tensor([0, T])
            vertical[0, h] = torch.tensor([0, 37])
    return VerticalSlashPattern(vertical, slash, T)


def _qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # float64: the two paths are compared at 1e-12 (only the order of the tiles' merges may differ)
    return [torch.randn(1, 2, S, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def _attend(sparsity) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v = _qkv()
    out = ring_attention(q, k, v, sparsity=sparsity, block_size=T)
    (out * torch.linspace(-1, 1, S, dtype=torch.float64)[:, None]).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("truth", OUTCOMES)
@pytest.mark.parametrize("guess", OUTCOMES)
def test_every_guess_gives_the_decided_attention(guess, truth):
    pattern = _pattern(truth)
    decided = LayerPattern.decide(pattern, [S], DENSE_ABOVE, S)
    assert decided.outcome == truth
    seen = []
    pending = PendingLayerPattern(pattern, [S], DENSE_ABOVE, S, guess=guess, on_result=seen.append)
    out, grads = _attend(pending)
    ref, ref_grads = _attend(decided)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)
    assert seen == [truth]  # the schedule hears the decision once
    # the guess ran; the decided pattern ran after it only where the guess was not exact ("mixed" always is)
    assert len(pending.runs) == (1 if guess in (truth, "mixed") else 2)
    result = pending.result()
    assert result.dense.tolist() == decided.dense.tolist() and torch.equal(result.allowed, decided.allowed)
    assert result.computed is pending.runs[-1]


def test_the_read_comes_after_the_step_lists(monkeypatch):
    log = []
    build = ring_attention_mod.build_step_lists
    read = PendingLayerPattern.result

    def building(*args, **kwargs):
        log.append("lists")
        return build(*args, **kwargs)

    def reading(self):
        log.append("read")
        return read(self)

    monkeypatch.setattr(ring_attention_mod, "build_step_lists", building)
    monkeypatch.setattr(PendingLayerPattern, "result", reading)
    _attend(PendingLayerPattern(_pattern("sparse"), [S], DENSE_ABOVE, S, guess="sparse"))
    assert log[:2] == ["lists", "read"]
    assert "lists" not in log[2:]  # a right guess builds the lists once


def test_a_recompute_replays_what_the_forward_ran():
    pending = PendingLayerPattern(_pattern("mixed"), [S], DENSE_ABOVE, S, guess="sparse")
    first, _ = _attend(pending)
    assert [p is None for p in pending.runs] == [False, False] and pending.runs[0] is pending.estimated
    runs = list(pending.runs)
    again, _ = _attend(pending)  # as a checkpointed layer's recompute: the same record again
    assert pending.runs == runs  # unchanged
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_the_schedule_guesses_the_last_outcome():
    schedule = AttentionSchedule(lambda layer: None)
    assert schedule.expected_outcome(3) == "sparse"
    schedule.note_outcome(3, "dense")
    schedule.begin_forward(True)  # a new forward keeps the outcomes (they are the next forward's guesses)
    assert schedule.expected_outcome(3) == "dense" and schedule.expected_outcome(4) == "sparse"


def test_a_wrong_guess_name_is_refused():
    with pytest.raises(ValueError, match="guess must be one of"):
        PendingLayerPattern(_pattern("sparse"), [S], DENSE_ABOVE, S, guess="half")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_checkpointed_layer_with_a_wrong_guess_trains(family, monkeypatch):
    """On the general path (packed documents, soft-capped layers): layer 0 has a head just above ``dense_above``: the
    first forward guesses "no head dense", runs the layer twice, and the non-reentrant checkpoint's recompute (which
    matches saved tensors by order) replays both runs."""
    monkeypatch.setattr(pattern_mod, "READ_LATER_ON", {"cpu", "cuda"})
    record, runs = checkpointed_step_at_threshold(family, torch.device("cpu"), monkeypatch, measure=False,
                                                  straight=False)
    assert runs is not None and len(runs) == 2  # the guess, then the decided pattern
    assert runs[-1] is record.computed and record.outcome == "mixed"


def test_a_measured_step_reads_before_the_launch(monkeypatch):
    """A measured step (statistics) reads the decision before the ring runs: no guess is run at all."""
    monkeypatch.setattr(pattern_mod, "READ_LATER_ON", {"cpu", "cuda"})
    record, runs = checkpointed_step_at_threshold("llama", torch.device("cpu"), monkeypatch, measure=True,
                                                  straight=False)
    assert runs is not None and len(runs) == 1 and runs[0] is record.computed
