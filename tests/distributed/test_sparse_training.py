"""Sparse training end to end: ``Trainer(strategy=MTrainingStrategy(sparsity=...))`` and Fabric on 1, 2 and 3 CPU
processes.

Sparse training is exact across world sizes because the pattern is a global object (estimated from the whole
sequence's Q and K, the same on every rank): the same module, data and ``SparsityConfig`` give the same losses and
parameters on 1, 2 and 3 ranks. Tolerances as in ``test_strategy.py`` (2e-5 on losses, 5e-5 on parameters after 3
SGD steps): both sides run the same float32 ops except the attention's summation order (blockwise merge over ring
steps) and DDP's all-reduce. A different pattern on one side (an index set that differs) would move the loss by
~1e-2 (checked by hand: dropping the local window moves the first loss by 0.3).

Also: the per-forward pattern under activation checkpointing (estimated once per layer per forward, the same
gradients as without checkpointing), the dense warm-up, the callback's logged density and imbalance, and the
registered names.
"""

from __future__ import annotations

from typing import Any

import torch

from helpers.dist import run_distributed
from helpers.training import (
    elastic_env,
    lightning_module_class,
    make_samples,
    quiet,
)

# dense_above=None: these tests are about the sparse path (so short a sequence covers most pairs, which would run
# dense by default; tests/unit/test_dense_fallback.py covers that)
CFG = dict(top_p=0.9, max_vertical=6, max_slash=10, last_q=8, sink_tokens=2, local_window=16, tile_size=16,
           dense_above=None)


def fit_sparse(world_size: int, scenario: dict[str, Any]) -> dict[str, Any]:
    import lightning as L

    from lightning_mtraining import SparseAttentionCallback, SparsityConfig
    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    quiet()
    cfg = SparsityConfig(**{**CFG, **scenario.get("cfg", {})})
    strategy = MTrainingStrategy(block_size=16, layout=scenario.get("layout", "striped"), sparsity=cfg)
    module = lightning_module_class()(scenario.get("family", "qwen2"))
    if scenario.get("checkpointing"):
        module.model.gradient_checkpointing_enable()
    loader = torch.utils.data.DataLoader(make_samples(6, scenario.get("seq_len", 100)), batch_size=2)
    callbacks = [SparseAttentionCallback(log_every_n_steps=1, recall_every_n_steps=scenario.get("recall", 0),
                                         recall_rows=8)]
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks if scenario.get("callback", True) else None, log_every_n_steps=1,
                        use_distributed_sampler=False)  # dp = 1: every rank reads the same batches, in order
    trainer.fit(module, loader)
    schedule = strategy.attention_schedule
    return {
        "records": module.records,
        "params": {k: v.detach().clone() for k, v in module.model.named_parameters()},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("attention/")},
        "estimations": schedule.estimations if schedule is not None else None,
        "callbacks": [type(c).__name__ for c in trainer.callbacks],
    }


def _worker(rank, world_size, scenarios):
    elastic_env(rank, world_size, world_size)
    return [fit_sparse(world_size, s) for s in scenarios]


def _close(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    for (ia, la), (ib, lb) in zip(a["records"], b["records"]):
        assert ia == ib and abs(la - lb) < 2e-5, (what, la, lb)
    for name, want in b["params"].items():
        torch.testing.assert_close(a["params"][name], want, rtol=0, atol=5e-5, msg=lambda s: f"{what} {name}: {s}")


SCENARIOS = [{"layout": "striped"}, {"layout": "zigzag", "family": "llama"}]


def test_sparse_training_is_the_same_on_1_2_and_3_ranks():
    one = run_distributed(_worker, 1, SCENARIOS, timeout=600)[0]
    for w in (2, 3):
        per_rank = run_distributed(_worker, w, SCENARIOS, timeout=600)
        for i, scenario in enumerate(SCENARIOS):
            for r in range(w):
                _close(per_rank[r][i], one[i], f"W={w} rank {r} {scenario}")
    for res in one:
        m = res["metrics"]
        # sparse: some causal pairs are left out; W=1: nothing to balance
        assert 0 < m["attention/density"] < 1 and m["attention/imbalance"] == 1.0
        assert "attention/density/layer_0" in m and "attention/density/layer_1" in m


def _checkpoint_worker(rank, world_size):
    elastic_env(rank, world_size, world_size)
    plain = fit_sparse(world_size, {"callback": True})
    ckpt = fit_sparse(world_size, {"checkpointing": True, "recall": 1})
    warm = fit_sparse(world_size, {"cfg": {"dense_warmup_steps": 2}})
    return plain, ckpt, warm


def test_checkpointing_reuses_the_pattern_and_the_warmup_and_logging():
    for plain, ckpt, warm in run_distributed(_checkpoint_worker, 2, timeout=600):
        # 3 steps x 2 layers: one estimate per layer and forward, also when checkpointing recomputes the layers
        assert plain["estimations"] == 6 and ckpt["estimations"] == 6
        _close(ckpt, plain, "checkpointed vs not")
        # the dense warm-up: steps 0 and 1 dense, step 2 sparse (2 layers estimated once)
        assert warm["estimations"] == 2
        assert abs(warm["records"][2][1] - plain["records"][2][1]) > 1e-6  # it trained differently before
        m = plain["metrics"]
        assert 0 < m["attention/density"] < 1 and m["attention/imbalance"] >= 1.0
        r = ckpt["metrics"]
        assert 0 < r["attention/recall"] <= 1 and "attention/recall/layer_1" in r


def test_registered_names_and_default_callback():
    import lightning as L
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_mtraining import MTrainingStrategy, SparsityConfig
    from lightning_mtraining.sparsity.config import PAPER_SPARSITY

    assert StrategyRegistry["mtraining"]["init_params"] == {"sparsity": PAPER_SPARSITY}
    assert StrategyRegistry["mtraining_dense"]["init_params"] == {"sparsity": None}
    assert PAPER_SPARSITY == SparsityConfig(top_p=0.9, max_vertical=4096, max_slash=4096)
    quiet()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="mtraining", logger=False)
    assert isinstance(trainer.strategy, MTrainingStrategy) and trainer.strategy.sparsity == PAPER_SPARSITY
    # a sparse run without a SparseAttentionCallback gets one (it logs density and imbalance)
    res = run_distributed(_worker, 1, [{"callback": False}], timeout=300)[0][0]
    assert "SparseAttentionCallback" in res["callbacks"] and res["estimations"] == 6


def fabric_sparse(world_size: int) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from helpers.models import make_model
    from lightning_mtraining import MTrainingFabricStrategy, SparseAttentionCallback, SparsityConfig

    quiet()
    strategy = MTrainingFabricStrategy(block_size=16, sparsity=SparsityConfig(**{**CFG, "dense_warmup_steps": 1}),
                                       attention=SparseAttentionCallback(log_every_n_steps=1))
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.5)))(make_model("qwen2")))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(make_samples(6, 100), batch_size=2),
                                      use_distributed_sampler=False)
    records, metrics = [], []
    for batch in loader:
        idx = batch.pop("idx")
        loss = model(**batch).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        records.append((idx.tolist(), loss.item()))
        metrics.append(dict(strategy.attention_metrics()))
    hf = model.module if hasattr(model, "module") else model
    return {"records": records, "params": {k: v.detach().clone() for k, v in hf.named_parameters()},
            "metrics": metrics, "steps": strategy.attention_schedule.step,
            "estimations": strategy.attention_schedule.estimations}


def _fabric_worker(rank, world_size):
    elastic_env(rank, world_size, world_size)
    return fabric_sparse(world_size)


def test_fabric_sparse_training_is_the_same_on_1_and_2_ranks_and_reports_the_numbers():
    one = run_distributed(_fabric_worker, 1, timeout=300)[0]
    for r, res in enumerate(run_distributed(_fabric_worker, 2, timeout=300)):
        _close(res, one, f"Fabric rank {r}")
        # Fabric counts optimizer steps itself: step 0 dense (warm-up of 1), steps 1-2 sparse, 2 layers each
        assert res["steps"] == 3 and res["estimations"] == 4
        assert res["metrics"][0] == {} and 0 < res["metrics"][-1]["attention/density"] < 1
        assert res["metrics"][-1]["attention/imbalance"] >= 1.0


def _fit_one_device(strategy: Any, seq_len: int) -> None:
    import lightning as L

    module = lightning_module_class()("llama")
    loader = torch.utils.data.DataLoader(make_samples(6, seq_len), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1)
    trainer.fit(module, loader)


class _Collect(__import__("logging").Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def test_a_sparse_run_at_a_dense_runs_cost_says_so_once():
    """``strategy="mtraining"`` (the paper's top-p 0.9) on 256 tokens keeps every pair of this model (random
    weights, 128-token tiles): the run logs once, on rank 0, the density, the length and what to do instead (measured
    on each of its 3 steps, said once, wrapped to 116 columns). A fixed budget that keeps a small share says nothing."""
    import logging

    from lightning_mtraining import MTrainingStrategy, SparsityConfig
    from lightning_mtraining.sparsity.schedule import DENSE_LIKE_DENSITY

    quiet()
    from lightning_utilities.core import rank_zero

    logger = rank_zero.log  # the logger rank_zero_info writes to (Lightning sets it on import)
    collect, level = _Collect(), logger.level
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    try:
        _fit_one_device("mtraining", 256)
        notes = [m for m in collect.messages if "MTraining sparse attention kept" in m]
        collect.messages.clear()
        small = SparsityConfig(vertical_topk=2, slash_topk=2, last_q=16, sink_tokens=2, local_window=16,
                               tile_size=16)
        strategy = MTrainingStrategy(sparsity=small, block_size=16)
        _fit_one_device(strategy, 256)
    finally:
        logger.removeHandler(collect)
        logger.setLevel(level)
    assert len(notes) == 1, notes
    assert max(len(line) for line in notes[0].splitlines()) <= 116, notes[0]  # wrapped, not one long line
    note = " ".join(notes[0].split())
    assert "kept 100% of the causal pairs at 256 tokens (top_p=0.9, at most 4096 verticals" in note, note
    assert "strategy='mtraining_dense' (sparsity=None)" in note and "SparsityConfig(vertical_topk=V" in note, note
    density = strategy.attention_metrics()["attention/density"]
    assert density < DENSE_LIKE_DENSITY, density  # the budget really is small at this length
    assert not [m for m in collect.messages if "MTraining sparse attention kept" in m]


def _resume_worker(rank, world_size, ckpt_dir):
    """Four steps at once; two steps then a checkpoint, resumed for two more; and the same resume with the schedule's
    state dropped from the checkpoint. Heads above ``dense_above`` (0.5: most of them at so short a sequence) run
    dense from the forward after the one that decided it."""
    import os

    import lightning as L

    from lightning_mtraining import SparseAttentionCallback, SparsityConfig
    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    elastic_env(rank, world_size, world_size)
    quiet()
    data = make_samples(2, 100) * 4  # every batch the same: a resumed epoch that starts its loader over sees it too

    def run(steps, ckpt_in=None, ckpt_out=None, drop_state=False):
        torch.manual_seed(0)
        module = lightning_module_class()("qwen2")
        strategy = MTrainingStrategy(block_size=16, sparsity=SparsityConfig(**{**CFG, "dense_above": 0.5}))
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[SparseAttentionCallback(log_every_n_steps=1)], use_distributed_sampler=False)
        if ckpt_in is not None and drop_state:
            state = torch.load(ckpt_in, weights_only=False)
            state["callbacks"] = {k: v for k, v in state["callbacks"].items() if "SparseAttention" not in k}
            ckpt_in = ckpt_in + ".dropped"
            if rank == 0:
                torch.save(state, ckpt_in)
            torch.distributed.barrier()
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_in)
        if ckpt_out is not None:
            trainer.save_checkpoint(ckpt_out)
        dense = strategy.attention_schedule._dense_heads
        return [loss for _, loss in module.records], dense

    whole, _ = run(4)
    path = os.path.join(ckpt_dir, "two.ckpt")
    _, decided = run(2, ckpt_out=path)
    resumed, _ = run(4, ckpt_in=path)
    forgot, _ = run(4, ckpt_in=path, drop_state=True)
    return whole, resumed, forgot, decided


def test_a_resumed_run_runs_the_dense_heads_the_checkpointed_forward_decided(tmp_path):
    """The checkpoint carries each rank's last dense decisions (SparseAttentionCallback's state), so the resumed run's
    first forward runs what the uninterrupted run's third did: its losses equal that run's third and fourth. Without
    that state the resumed run's first forward runs every head's pattern, and its loss differs."""
    for whole, resumed, forgot, decided in run_distributed(_resume_worker, 2, str(tmp_path), timeout=600):
        assert any(any(any(row) for row in rows) for rows in decided.values()), decided  # some heads went dense
        assert len(resumed) == 2 and all(abs(a - b) < 2e-5 for a, b in zip(resumed, whole[2:])), (resumed, whole)
        assert abs(forgot[0] - whole[2]) > 1e-4, (forgot, whole)
