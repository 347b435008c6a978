"""Metrics stay exact when tokens are split over ranks.

Reference: the same quantities computed in ONE process on the full (unsharded) data in float64:
``F.cross_entropy(..., reduction="mean")`` for the loss, its exp and ``torchmetrics.text.Perplexity``
for the perplexity. Distributed runs shard the sequence with the striped layout over 3 processes
(odd world size) with an uneven number of target tokens per rank (ignored labels), so a plain mean
of per-rank means would be visibly wrong (checked too).

Tolerance: the per-rank sums are float32 cross-entropies of float64 logits cast to float32 (what
:func:`token_loss_sum` does in training); float32 has ~6e-8 relative error per term over a few
hundred terms, so 1e-5 relative leaves a wide margin while a wrong weighting (tested below) is off
by more than 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.dist import run_distributed
from lightning_mtraining.core.layouts import shard_sequence
from lightning_mtraining.metrics import (
    AttentionDensity,
    TokenPerplexity,
    TokensPerSecond,
    TokenWeightedLoss,
    token_loss_sum,
)

VOCAB = 11
BLOCK = 4


def _data(step: int, batch: int = 2, seq_len: int = 3 * 2 * BLOCK * 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, S, V] and targets [B, S] with many ignored positions concentrated at the end."""
    g = torch.Generator().manual_seed(100 + step)
    logits = torch.randn(batch, seq_len, VOCAB, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    target[:, -(seq_len // 3 + step) :] = -100  # right padding: the last ranks' shards hold fewer targets
    target[0, 5] = -100
    return logits, target


def _reference(steps: list[int]) -> tuple[float, float]:
    logits = torch.cat([_data(s)[0].reshape(-1, VOCAB) for s in steps])
    target = torch.cat([_data(s)[1].reshape(-1) for s in steps])
    loss = F.cross_entropy(logits, target, ignore_index=-100, reduction="mean").item()
    return loss, math.exp(loss)


def _sharded_worker(rank: int, world_size: int, steps: list[int]) -> dict:
    loss_metric, ppl_metric = TokenWeightedLoss(), TokenPerplexity()
    step_values, local_means = [], []
    for step in steps:
        logits, target = _data(step)
        local_logits = shard_sequence(logits, 1, rank, world_size, layout="striped", block_size=BLOCK)
        local_target = shard_sequence(target, 1, rank, world_size, layout="striped", block_size=BLOCK)
        loss_sum, count = token_loss_sum(local_logits, local_target)
        step_loss = loss_metric(loss_sum, count)  # forward: the synced value for this step
        step_ppl = ppl_metric(loss_sum, count)
        step_values.append((step_loss.item(), step_ppl.item()))
        local_means.append((loss_sum / count).item())
    return {
        "steps": step_values,
        "epoch": (loss_metric.compute().item(), ppl_metric.compute().item()),
        "local_means": local_means,
    }


STEPS = [0, 1, 2]
WORLD = 3


def _worker(rank: int, world_size: int, steps: list[int]) -> dict:
    return {"loss": _sharded_worker(rank, world_size, steps), "throughput": _throughput_worker(rank, world_size)}


@pytest.fixture(scope="module")
def world_results() -> list[dict]:
    """One 3-process run serves both distributed tests (process start-up dominates their cost)."""
    return run_distributed(_worker, WORLD, STEPS)


def test_token_loss_and_perplexity_exact_across_shards(world_results):
    steps = STEPS
    results = [r["loss"] for r in world_results]
    for r in results:  # every rank sees the world value, step by step and for the epoch
        for step, (loss, ppl) in zip(steps, r["steps"]):
            ref_loss, ref_ppl = _reference([step])
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert ppl == pytest.approx(ref_ppl, rel=1e-5)
        ref_loss, ref_ppl = _reference(steps)
        assert r["epoch"][0] == pytest.approx(ref_loss, rel=1e-5)
        assert r["epoch"][1] == pytest.approx(ref_ppl, rel=1e-5)
    # The naive alternative (mean of per-rank means) is wrong here: the test data can tell them apart.
    naive = sum(r["local_means"][0] for r in results) / len(results)
    assert abs(naive - _reference([0])[0]) > 1e-2


def test_single_process_matches_torchmetrics_perplexity():
    from torchmetrics.text import Perplexity

    logits, target = _data(0)
    reference = Perplexity(ignore_index=-100)
    reference.update(logits.float(), target)
    ppl = TokenPerplexity()
    ppl.update(*token_loss_sum(logits, target))
    assert ppl.compute().item() == pytest.approx(reference.compute().item(), rel=1e-5)
    assert ppl.compute().item() == pytest.approx(_reference([0])[1], rel=1e-5)


def _throughput_worker(rank: int, world_size: int) -> dict:
    tps = TokensPerSecond()
    # Uneven tokens and times per rank; step values sum tokens and take the slowest rank's time.
    step1 = tps(100 * (rank + 1), 0.5 + rank).item()
    step2 = tps(10, 2.0 - rank).item()
    density = AttentionDensity(num_layers=3)
    # Layer 1 stays dense on every rank (left out); per-rank pair counts weight the densities.
    density({0: 0.1 * (rank + 1), 2: 0.5}, weights={0: rank + 1, 2: 1.0})
    return {"step1": step1, "step2": step2, "epoch": tps.compute().item(), "density": density.compute().tolist()}


def test_tokens_per_second_and_density_reduce_over_world(world_results):
    world = WORLD
    results = [r["throughput"] for r in world_results]
    tokens1 = sum(100 * (r + 1) for r in range(world))
    assert all(r["step1"] == pytest.approx(tokens1 / (0.5 + world - 1)) for r in results)
    assert all(r["step2"] == pytest.approx(10 * world / 2.0) for r in results)
    # Epoch: all tokens over the slowest rank's TOTAL time (rank r took (0.5 + r) + (2 - r) = 2.5 s).
    assert all(r["epoch"] == pytest.approx((tokens1 + 10 * world) / 2.5) for r in results)
    # Layer 0: sum(d_r * w_r) / sum(w_r) = sum(0.1 (r+1)^2) / sum(r+1) = 1.4 / 6.
    for r in results:
        assert r["density"][0] == pytest.approx(0.1 * (1 + 4 + 9) / 6)
        assert math.isnan(r["density"][1])
        assert r["density"][2] == pytest.approx(0.5)
    logged = AttentionDensity.log_dict(torch.tensor(results[0]["density"]))
    assert set(logged) == {"density/layer_00", "density/layer_02", "density/mean"}
    assert logged["density/mean"].item() == pytest.approx((1.4 / 6 + 0.5) / 2)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="must match"):
        token_loss_sum(torch.zeros(2, 5, 3), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="scalar"):
        TokenWeightedLoss().update(torch.zeros(3), 3)
    with pytest.raises(ValueError, match="expected 2"):
        AttentionDensity(2).update([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        AttentionDensity(2).update([0.1, 1.5])
