"""What a user's step may do under context parallelism, outputs that come back whole, and one device = one device.

Compared, on 2 (Llama) and 3 (Qwen2) gloo processes with 301-token sequences (padded to 512 and 384, right
padding in every third sample):
- per-step losses and final parameters of ``Trainer(strategy="mtraining")`` against single-process training of
  the same Hugging Face model on the full sequences (``test_strategy.reference``: float32, eager attention,
  SGD lr 0.5), for a step that returns ``model(**batch).loss``, one that computes ``causal_lm_loss(logits,
  batch)``, and one that mixes both (``out.loss * 0.5 + 0.5 * causal_lm_loss(...)``). Tolerances are
  test_strategy.py's (losses 2e-5, parameters 5e-5: float32 rounding of blockwise against one-softmax
  attention, ~1e-6 per element);
- a step that shifts the logits locally, the idiom of one-device code: it must fail before backward with a
  message that names the logits, the shard and the fix (and, with ``loss_check="warn"``, warn once on rank 0);
- per-token metrics from ``causal_lm_targets``: the CP ranks' (loss sum, count) add up to the single-process
  sum over the full sequence (1e-4 relative: float32 sums of ~600 terms of size ~5, ~1e-6 relative each);
- ``trainer.predict`` and validation outputs: ``[B, 301, V]`` in global order, equal to the single-process logits
  to 5e-5: at this length the float32 eager reference itself is 2.1e-5 away from float64 (measured, logits up
  to 6.7), and the ring's blockwise float32 softmax has an error of the same size, so they may differ by twice
  that. A wrong order or an off-by-one position changes logits by O(1).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch

from helpers.dist import run_distributed
from helpers.training import (
    VOCAB,
    check_against_reference,
    elastic_env,
    fit,
    make_model,
    make_samples,
    quiet,
)

SEQ = 301
LOGIT_TOL = 5e-5  # see the module docstring


def _predict_module():
    import lightning as L

    from lightning_mtraining import causal_lm_targets
    from lightning_mtraining.metrics import token_loss_sum

    class PredictLM(L.LightningModule):
        """predict_step returns the model output (a ModelOutput), a derived tensor and a scalar; validation_step
        returns logits and per-token metric sums."""

        def __init__(self, family: str) -> None:
            super().__init__()
            self.model = make_model(family)
            self.val_outputs: list[dict[str, Any]] = []

        def _inputs(self, batch: dict) -> dict:
            return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

        def predict_step(self, batch, batch_idx):
            out = self.model(**self._inputs(batch))
            return {"output": out, "doubled": out.logits * 2, "scalar": torch.tensor(1.0), "idx": batch["idx"]}

        def validation_step(self, batch, batch_idx):
            logits = self.model(**self._inputs(batch)).logits
            loss_sum, count = token_loss_sum(logits, causal_lm_targets(batch))
            return {"logits": logits, "loss_sum": loss_sum, "count": count}

        def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
            self.val_outputs.append({k: v.detach().clone() for k, v in outputs.items()})

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return PredictLM


def _trainer(world_size: int, **strategy_kwargs: Any):
    import lightning as L

    from lightning_mtraining import MTrainingStrategy

    return L.Trainer(
        accelerator="cpu", devices=world_size, strategy=MTrainingStrategy(**{"sparsity": None, **strategy_kwargs}),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


def _two_rank_worker(rank: int, world_size: int) -> dict[str, Any]:
    elastic_env(rank, world_size, world_size)
    quiet()
    mesh_lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            mesh_lines.append(record.getMessage())

    import lightning.pytorch  # noqa: F401 - names the logger rank_zero_info uses
    import lightning_utilities.core.rank_zero as rank_zero_module

    rank_zero_log = logging.getLogger(rank_zero_module.log.name)
    rank_zero_log.setLevel(logging.INFO)
    rank_zero_log.addHandler(Collect())

    base = dict(family="llama", n_samples=6, seq_len=SEQ, steps=3)
    out: dict[str, Any] = {"fits": [fit(world_size, dict(base, call=call)) for call in ("kwargs", "helper",
                                                                                      "helper_mixed")]}
    out["mesh_lines"] = [line for line in mesh_lines if "world 2 = dp 1 x cp 2" in line]
    try:
        fit(world_size, dict(base, call="manual"))
        out["manual_error"] = None
    except RuntimeError as e:
        out["manual_error"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned = fit(world_size, dict(base, call="manual", strategy=dict(loss_check="warn"), quiet=False))
    out["warn_records"] = len(warned["records"])
    out["warn_first_loss"] = warned["records"][0][1]
    out["warnings"] = [str(w.message) for w in caught if "sharding-aware" in str(w.message)]

    # Outputs of predict and validate on the untrained model (make_model's seed), batch size 1.
    LM = _predict_module()
    loader = torch.utils.data.DataLoader(make_samples(2, SEQ), batch_size=1)
    module = LM("llama")
    trainer = _trainer(world_size)
    out["predictions"] = trainer.predict(module, loader)
    trainer.validate(module, loader, verbose=False)
    out["val_outputs"] = module.val_outputs

    # The exit hook (see strategy._destroy_process_group_at_exit): nothing after an interrupted run, the process
    # groups destroyed after a normal one.
    import torch.distributed as dist

    from lightning_mtraining.strategies.common import _destroy_process_group_at_exit

    _destroy_process_group_at_exit({"interrupted": True})
    out["initialized_after_interrupted"] = dist.is_initialized()
    _destroy_process_group_at_exit({"interrupted": False})
    out["initialized_after_normal"] = dist.is_initialized()
    return out


def _loss_patterns_worker(rank: int, world_size: int, family: str) -> list[dict[str, Any]]:
    elastic_env(rank, world_size, world_size)
    base = dict(family=family, n_samples=6, seq_len=SEQ, steps=3)
    return [fit(world_size, dict(base, call=call)) for call in ("kwargs", "helper", "helper_mixed")]


def _scenario(family: str, call: str) -> dict[str, Any]:
    return dict(family=family, call=call, n_samples=6, seq_len=SEQ, steps=3)


def test_two_ranks_step_patterns_outputs_and_checks():
    results = run_distributed(_two_rank_worker, 2, timeout=420)

    # Right: the model's loss, the helper, and a mix of both give the single-process losses and parameters.
    for i, call in enumerate(("kwargs", "helper", "helper_mixed")):
        check_against_reference([r["fits"][i] for r in results], _scenario("llama", call))

    # Loud: the manual shift fails before backward, naming the logits, the shard and the fix, on every rank.
    for r in results:
        message = r["manual_error"]
        assert message is not None, "a locally shifted loss on a shard must not train silently"
        for words in ("logits", "shard", "causal_lm_loss(logits, batch)", "model(**batch).loss", "loss_check"):
            assert words in message, (words, message)
        assert len(message) < 1000
    # loss_check="warn": trains, warns once, on rank 0 only.
    assert [r["warn_records"] for r in results] == [3, 3]
    # ... and what it trains on is wrong: the first step's local-shift loss differs from the true loss by far
    # more than any tolerance here (so the check above guards a real error, not a formality).
    for r in results:
        assert abs(r["warn_first_loss"] - r["fits"][0]["records"][0][1]) > 0.05, r["warn_first_loss"]
    assert [len(r["warnings"]) for r in results] == [1, 0]
    # The mesh is logged once per strategy, on rank 0 only (three strategies in the first three runs).
    assert len(results[0]["mesh_lines"]) == 3 and results[1]["mesh_lines"] == []

    # Predictions and validation outputs come back whole: [1, 301, V], equal to single-process logits.
    model = make_model("llama")
    samples = make_samples(2, SEQ)
    with torch.no_grad():
        want = [
            model(input_ids=s["input_ids"][None], attention_mask=s["attention_mask"][None]).logits for s in samples
        ]
    for r in results:
        assert len(r["predictions"]) == 2
        for pred in r["predictions"]:
            i = int(pred["idx"])
            real = samples[i]["attention_mask"].bool()  # padded positions see padding differently; no target
            assert tuple(pred["output"].logits.shape) == (1, SEQ, VOCAB)
            assert type(pred["output"]).__name__ == "CausalLMOutputWithPast"
            torch.testing.assert_close(pred["output"].logits[0, real], want[i][0, real], rtol=0, atol=LOGIT_TOL)
            torch.testing.assert_close(pred["doubled"], 2 * pred["output"].logits, rtol=0, atol=0)
            assert pred["scalar"].dim() == 0
        for i, val in enumerate(r["val_outputs"]):
            real = samples[i]["attention_mask"].bool()
            assert tuple(val["logits"].shape) == (1, SEQ, VOCAB)
            torch.testing.assert_close(val["logits"][0, real], want[i][0, real], rtol=0, atol=LOGIT_TOL)
    # Per-token metrics: the CP ranks' sums are the full sequence's sum.
    for i, s in enumerate(samples):
        labels = s["labels"][None]
        ref_sum = torch.nn.functional.cross_entropy(
            want[i][0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum"
        )
        got_sum = sum(float(r["val_outputs"][i]["loss_sum"]) for r in results)
        got_count = sum(int(r["val_outputs"][i]["count"]) for r in results)
        assert got_count == int((labels[0, 1:] != -100).sum())
        assert got_sum == pytest.approx(float(ref_sum), rel=1e-4)

    # Exit hook.
    assert all(r["initialized_after_interrupted"] for r in results)
    assert not any(r["initialized_after_normal"] for r in results)


def test_three_ranks_loss_patterns_match_single_process():
    """Odd world size: 301 tokens padded to 384 (3 x 128), Qwen2."""
    per_rank = run_distributed(_loss_patterns_worker, 3, "qwen2", timeout=420)
    for i, call in enumerate(("kwargs", "helper", "helper_mixed")):
        check_against_reference([r[i] for r in per_rank], _scenario("qwen2", call))


# ---- single process: checks before launch, one device -------------------------------------------------------------

from helpers.training import lightning_module_class  # noqa: E402


def _quiet_trainer(**kwargs: Any):
    import lightning as L

    quiet()
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def test_sizes_and_sparse_settings_fail_at_construction():
    """Sizes fail at Trainer(...)/Fabric(...), in the one process that exists then; a sparsity config that cannot
    tile the layout (striped blocks smaller than the tile) fails at the strategy's construction, with one short
    message."""
    from lightning.fabric import Fabric

    from lightning_mtraining import MTrainingFabricStrategy, MTrainingStrategy, SparsityConfig

    with pytest.raises(ValueError, match="context_parallel_size=3 does not divide the world size 2"):
        _quiet_trainer(devices=2, strategy=MTrainingStrategy(context_parallel_size=3))
    with pytest.raises(ValueError, match="inner_ring_size=3 does not divide context_parallel_size=4"):
        _quiet_trainer(devices=4, strategy=MTrainingStrategy(inner_ring_size=3))
    with pytest.raises(ValueError, match="context_parallel_size=3 does not divide the world size 2"):
        Fabric(accelerator="cpu", devices=2, strategy=MTrainingFabricStrategy(context_parallel_size=3))

    config = SparsityConfig(vertical_topk=16, slash_topk=16)
    assert MTrainingStrategy(sparsity=config).sparsity == config
    for build in (lambda: MTrainingStrategy(block_size=64, sparsity=config),
                  lambda: MTrainingFabricStrategy(block_size=64, sparsity=config)):
        with pytest.raises(ValueError, match="block_size=64 is not a multiple of it") as info:
            build()
        assert len(str(info.value)) < 500 and info.value.__suppress_context__
    with pytest.raises(TypeError,
                       match=r"sparsity=...\) must be a SparsityConfig, a spec string such as .paper., or None"):
        MTrainingStrategy(sparsity={"top_p": 0.9})


def test_model_config_fails_before_any_process_starts(monkeypatch):
    """GPT-2 with attention dropout: the error names the config field, and comes before the launcher would start
    the second process (starting it is made to fail loudly here, so a late check cannot pass)."""
    import lightning as L
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_mtraining import MTrainingStrategy

    def no_children(self):
        raise AssertionError("the launcher started other processes before the model was checked")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", no_children)

    class GPT2Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB,
                                                    bos_token_id=None, eos_token_id=None))

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader([{"input_ids": torch.ones(8, dtype=torch.long)}] * 2, batch_size=1)
    trainer = _quiet_trainer(devices=2, strategy=MTrainingStrategy(sparsity=None), max_steps=1)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel .*attention dropout \(config\.attn_pdrop=0\.1\)") as info:
        trainer.fit(GPT2Module(), loader)
    # reported by this one process, without the other ranks' lines (Note [Failures that speak once])
    from lightning_mtraining.core.errors import SameOnRanks, format_failure

    mark = info.value._mtraining_same_on_ranks
    assert mark == SameOnRanks(0, 0, 1, "this process")
    assert format_failure(info.value, mark).startswith("ValueError: GPT2LMHeadModel cannot be trained")


def test_one_device_matches_strategy_auto():
    """devices=1: the same batches in the same order (shuffled loader) and the same losses and parameters as
    strategy="auto" (dense attention: "mtraining_dense"): no DistributedSampler, models keep their own attention,
    batches pass through unchanged. With ``fused_loss=False`` bit-identical: both runs do the same float32 ops in
    the same order. With the fused loss (the default) the loss sums run by chunks of rows: float32 rounding."""
    import lightning as L

    from lightning_mtraining import MTrainingStrategy

    runs = {}
    for name in ("auto", "mtraining_dense", "plain_loss"):
        L.seed_everything(7)
        module = lightning_module_class()("llama")
        loader = torch.utils.data.DataLoader(make_samples(8, 37), batch_size=2, shuffle=True)
        strategy = MTrainingStrategy(sparsity=None, fused_loss=False) if name == "plain_loss" else name
        trainer = _quiet_trainer(devices=1, strategy=strategy, max_steps=4)
        trainer.fit(module, loader)
        runs[name] = module
        if name != "auto":
            assert trainer.strategy.is_distributed is False
            assert trainer.strategy.distributed_sampler_kwargs is None
            assert module.model.config._attn_implementation == "eager"
    auto = runs["auto"]
    for name in ("mtraining_dense", "plain_loss"):
        ours = runs[name]
        assert [idx for idx, _ in ours.records] == [idx for idx, _ in auto.records]
        # exact without the fused loss; with it, float32 rounding (losses near 5, ulp 5e-7) carried through 4 SGD
        # steps at lr 0.5: the tolerances of the strategy tests against their float32 reference (test_strategy.py)
        exact = name == "plain_loss"
        for (_, a), (_, b) in zip(ours.records, auto.records):
            assert a == b if exact else abs(a - b) < 2e-5, (name, a, b)
        for (pname, a), (_, b) in zip(auto.model.named_parameters(), ours.model.named_parameters()):
            torch.testing.assert_close(b, a, rtol=0, atol=0 if exact else 5e-5, msg=lambda m: f"{name} {pname}: {m}")
