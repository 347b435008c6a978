"""MTrainingFabricStrategy: a plain Fabric loop on 2 gloo processes equals single-process training.

Same comparison and tolerances as test_strategy.py (losses 2e-5, parameters 5e-5 after SGD steps against a
float32 single-process reference on full sequences; see that file for why).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.dist import run_distributed
from helpers.training import check_against_reference, elastic_env, make_model, make_samples, quiet


def fabric_fit(world_size: int, scenario: dict[str, Any]) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_mtraining.callbacks.sparse_attention import SparseAttentionCallback
    from lightning_mtraining.strategies.fabric import MTrainingFabricStrategy

    quiet()
    attention = SparseAttentionCallback(dense_layers=[0])  # per-layer options reach Fabric through the strategy
    strategy = MTrainingFabricStrategy(**{"sparsity": None, **scenario.get("strategy", {})}, attention=attention)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = make_model(scenario["family"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(make_samples(scenario["n_samples"], scenario["seq_len"]), batch_size=2)
    )
    records = []
    accumulate = scenario.get("accumulate", 1)
    for i, batch in enumerate(loader):
        if i == scenario["steps"] * accumulate:
            break
        idx = batch.pop("idx")
        is_accumulating = (i + 1) % accumulate != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = model(**batch).loss
            fabric.backward(loss / accumulate)
        records.append((idx.tolist(), loss.item()))
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
    # A loss shifted locally on the shard is refused by fabric.backward; gather_sequence makes logits whole.
    batch = next(iter(loader))
    batch.pop("idx")
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    manual = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())
    try:
        fabric.backward(manual)
        manual_error = None
    except RuntimeError as e:
        manual_error = str(e)
    optimizer.zero_grad()
    gathered_shape = tuple(strategy.gather_sequence(logits.detach()).shape)
    hf = model.module if hasattr(model, "module") else model
    plan = strategy.plan
    result = {
        "records": records, "params": {k: v.detach().clone() for k, v in hf.named_parameters()},
        "cp_rank": plan.cp_rank, "cp_size": plan.cp_size, "dp_rank": strategy.dp_rank,
        "manual_error": manual_error, "gathered_shape": gathered_shape,
    }
    strategy.teardown()
    result["attn_after"] = hf.config._attn_implementation
    return result


def _fabric_worker(rank: int, world_size: int, scenario: dict[str, Any]) -> dict[str, Any]:
    elastic_env(rank, world_size, world_size)
    return fabric_fit(world_size, scenario)


def test_registered():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import lightning_mtraining  # noqa: F401 - registers "mtraining"
    from lightning_mtraining.strategies.fabric import MTrainingFabricStrategy

    assert STRATEGY_REGISTRY["mtraining"]["strategy"] is MTrainingFabricStrategy
    with pytest.raises(ValueError, match=r"MTrainingFabricStrategy\(block_size=...\) must be a positive int"):
        MTrainingFabricStrategy(block_size=0)


def test_fabric_loop_two_processes_matches_single_process():
    """CP=2, striped, odd length 15 padded to 16, right padding, gradient accumulation over 2 micro-batches; then
    a locally shifted loss is refused by fabric.backward, and gather_sequence gives whole logits."""
    scenario = dict(family="qwen2", n_samples=8, seq_len=15, steps=2, accumulate=2, strategy=dict(block_size=4))
    results = run_distributed(_fabric_worker, 2, scenario, timeout=300)
    check_against_reference(results, scenario)
    for r in results:
        assert r["manual_error"] is not None and "causal_lm_loss(logits, batch)" in r["manual_error"]
        assert r["gathered_shape"] == (2, 15, 64)  # [B, S, V]: whole, unpadded (16 -> 15)
