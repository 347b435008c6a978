"""MTrainingStrategy: Trainer runs on 1, 2 and 4 gloo processes against single-process training.

What is compared: per-micro-batch losses seen in ``training_step`` and every parameter after a few optimizer
steps, against a single-process float32 reference that runs the same Hugging Face model (eager attention) on
the *full* sequences and averages DP groups the way DDP does (mean of per-group losses, sum over accumulated
micro-batches / accumulate_grad_batches). Sequences have odd lengths, right padding (attention_mask), batch
size 2, gradient accumulation, two model families (Qwen2, Llama) and all three layouts.

Tolerances: both sides run the same float32 ops except attention (ring: blockwise online softmax merged by
log-sum-exp; reference: one softmax) and the DDP gradient all-reduce; per-element attention differences are
~1e-7 relative, so losses agree to ~1e-6 and parameters after 3 SGD steps (lr 0.5) to ~1e-6. We assert 2e-5
on losses and 5e-5 on parameters: an order of magnitude of headroom. The models are initialised with
initializer_range=0.3 (sharp attention) so that real bugs are far outside it; checked by breaking the code on
purpose: shard-local RoPE positions move the first loss by 0.3, a per-rank (not global) target count by 2.9,
returning the partial per-rank loss value by 1.4.

The data, the LightningModule and the reference trainer are in ``helpers/training.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.dist import run_distributed
from helpers.models import make_model
from helpers.training import (
    check_against_reference,
    elastic_env,
    fit,
    fit_worker,
    lightning_module_class,
    make_samples,
    quiet,
    run_scenarios,
)

# ---- tests -------------------------------------------------------------------------------------------------------


def test_registered_and_typed():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_mtraining  # noqa: F401 - registers "mtraining"
    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    assert StrategyRegistry["mtraining"]["strategy"] is MTrainingStrategy
    with pytest.raises(ValueError, match=r"layout=...\) must be one of"):
        MTrainingStrategy(layout="diagonal")
    with pytest.raises(ValueError, match="context_parallel_size"):
        MTrainingStrategy(context_parallel_size=0)


def test_sizes_must_fit_world():
    from lightning_mtraining.distributed.mesh import resolve_context_parallel_size, resolve_inner_ring_size

    assert resolve_context_parallel_size("auto", 6) == 6
    assert resolve_context_parallel_size(3, 6) == 3
    with pytest.raises(ValueError, match="context_parallel_size=4 does not divide the world size 6"):
        resolve_context_parallel_size(4, 6)
    assert resolve_inner_ring_size(None, 8, 4) == 4  # spans two nodes: one inner ring per node
    assert resolve_inner_ring_size(None, 4, 8) == 4  # fits in a node: flat ring
    assert resolve_inner_ring_size(None, 6, 4) == 2  # spans nodes unevenly: inner rings of gcd(6, 4) in a node
    assert resolve_inner_ring_size(None, 3, 2) == 3  # gcd 1: no inner ring fits a node, flat ring
    with pytest.raises(ValueError, match="inner_ring_size=4 does not divide context_parallel_size=6"):
        resolve_inner_ring_size(4, 6, 8)

    # The strategy itself, in a world of 6 (3 devices x 2 nodes): CP size 4 is refused before any collective.
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    strategy = MTrainingStrategy(context_parallel_size=4, cluster_environment=LightningEnvironment(),
                                 parallel_devices=[torch.device("cpu")] * 3)
    strategy.cluster_environment.set_world_size(6)
    with pytest.raises(ValueError, match="context_parallel_size=4 does not divide the world size 6"):
        _ = strategy.distributed_sampler_kwargs
    strategy = MTrainingStrategy(context_parallel_size=3, cluster_environment=LightningEnvironment(),
                                 parallel_devices=[torch.device("cpu")] * 3)
    strategy.cluster_environment.set_world_size(6)
    strategy.cluster_environment.set_global_rank(4)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}  # DP rank of global rank 4
    assert (strategy.cp_rank, strategy.inner_ring_size) == (1, 3)


def test_single_process_matches_reference():
    """World size 1 (no process group): padding to the unit and the model hook change nothing."""
    scenario = dict(family="qwen2", n_samples=6, seq_len=13, steps=3, strategy=dict(block_size=4))
    result = fit(1, scenario)
    check_against_reference([result], scenario)


@pytest.mark.parametrize("options", [
    dict(fused_loss=False),
    dict(fused_loss=True, activation_checkpointing=True, offload_activations=True, tiled_mlp=5),
    dict(activation_checkpointing=True, offload_activations=1),
])
def test_single_process_memory_options_match_reference(options):
    """The fused loss, activation checkpointing, offload and the sequence-tiled MLP (13 tokens in chunks of 5, 5, 3)
    change no loss or parameter (same reference and tolerances as above); one process trains the bare module, not a
    DDP wrapper (nothing to average)."""
    scenario = dict(family="llama", n_samples=6, seq_len=13, steps=3, strategy=dict(block_size=4, **options))
    result = fit(1, scenario)
    check_against_reference([result], scenario)
    assert result["wrapper"] != "DistributedDataParallel"
    assert result["checkpointing"] == options.get("activation_checkpointing", False)


def test_memory_options_are_checked():
    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    with pytest.raises(TypeError, match=r"fused_loss=...\) must be True, False or a backend name .*got 'yes'"):
        MTrainingStrategy(fused_loss="yes")
    for bad in (0, -1, 1.5, "yes"):
        with pytest.raises(TypeError, match=r"offload_activations=...\) must be True, False or a number of decoder "
                                            r"layers >= 1, got"):
            MTrainingStrategy(offload_activations=bad)
    for bad in (0, -8, 2.5, True, "64"):
        with pytest.raises(ValueError, match=r"tiled_mlp=...\) must be None or a positive int \(tokens per chunk\)"):
            MTrainingStrategy(tiled_mlp=bad)


def test_bad_batch_and_model_errors():
    import lightning as L

    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    quiet()

    class NoHF(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def training_step(self, batch, i):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MTrainingStrategy(sparsity=None), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="contains no transformers PreTrainedModel"):
        trainer.fit(NoHF(), torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2))

    # One device, dense: nothing is split, so the batch reaches training_step as it is (the sharding errors for
    # batches without input_ids are tested in test_sharding.py, where the sequence is split).
    from lightning_mtraining.distributed.plan import ContextParallelPlan

    strategy = MTrainingStrategy(block_size=4, sparsity=None)
    strategy._plan = ContextParallelPlan(block_size=4)  # what setup_distributed builds at world size 1
    odd = {"tokens": torch.ones(2, 5, dtype=torch.long)}
    assert strategy.shard_batch(odd) is odd


def test_two_processes_match_single_process():
    """CP=2: Qwen2 striped (odd length 13 -> 16, padding, grad accumulation, model(**batch)) and Llama zigzag
    with only input_ids/labels passed, the model built in configure_model and its MLPs tiled (a rank's shard in
    chunks of 4 tokens)."""
    run_scenarios(2, [
        dict(family="qwen2", n_samples=8, seq_len=13, steps=2, accumulate=2, strategy=dict(block_size=4)),
        dict(family="llama", call="explicit", build_in_configure=True, n_samples=6, seq_len=11, steps=3,
             strategy=dict(layout="zigzag", tiled_mlp=4)),
    ])


def test_four_processes_and_dp2_cp2_match_single_process():
    """CP=4 (Llama, striped, clipping) and DP=2 x CP=2 (Qwen2, contiguous, grad accumulation, labels built in
    training_step from input_ids)."""
    run_scenarios(4, [
        dict(family="llama", n_samples=6, seq_len=29, steps=3, clip=0.05, strategy=dict(block_size=4)),
        dict(family="qwen2", call="clone", n_samples=16, seq_len=9, steps=2, accumulate=2,
             strategy=dict(context_parallel_size=2, layout="contiguous")),
    ])


@pytest.mark.parametrize("world_size,cp", [(3, 3), (4, 2)])  # 8 ranks, HSDP x CP x TP: test_tensor_parallel.py
def test_fsdp_strategy_matches_single_process(world_size, cp):
    """MTrainingFSDPStrategy: FSDP2 over the flattened dp x cp mesh gives the reference's losses and parameters."""
    scenario = dict(family="qwen2", n_samples=8, seq_len=13, steps=2, fsdp=True,
                    strategy=dict(block_size=4, context_parallel_size=cp, sparsity=None))
    per_rank = run_distributed(fit_worker, world_size, [scenario], timeout=300)
    results = [r[0] for r in per_rank]
    check_against_reference(results, scenario)
    assert all(r["sharded"] for r in results)  # every parameter a DTensor: FSDP2 applied
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_mtraining  # noqa: F401 - registers the names

    assert StrategyRegistry["mtraining_fsdp_dense"]["init_params"] == {"sparsity": None}


def _shuffled_fit(rank: int, world_size: int, use_distributed_sampler: bool,
                  shuffle: bool = True) -> list[tuple[list[int], float]]:
    """The (sample indices, loss) of each step of a Trainer on a shuffled loader with a seeded generator (or, with
    ``shuffle=False``, an unshuffled one)."""
    import lightning as L

    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    if world_size > 1:
        elastic_env(rank, world_size, world_size)
    quiet()
    module = lightning_module_class()("qwen2")
    loader = torch.utils.data.DataLoader(make_samples(8, 13), batch_size=2, shuffle=shuffle,
                                         generator=torch.Generator().manual_seed(7))
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=MTrainingStrategy(block_size=4, sparsity=None),
                        max_steps=4, use_distributed_sampler=use_distributed_sampler, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    return module.records


def _shuffled_worker(rank: int, world_size: int) -> dict:
    runs: dict = {flag: _shuffled_fit(rank, world_size, flag) for flag in (False, True)}
    runs["unshuffled"] = _shuffled_fit(rank, world_size, True, shuffle=False)
    return runs


def test_a_shuffled_loader_gives_one_devices_losses_as_the_docs_say():
    """The recipe ``docs/guarantees.md`` gives for comparing with one device: data-parallel size 1,
    ``use_distributed_sampler=False`` and a DataLoader with a seeded generator. Then the 2 CP ranks read the one-device
    run's samples in its order and see its losses (2e-5, see the module docstring). Lightning's default injects a
    DistributedSampler with its own shuffle, so the default run reads another order: the recipe is needed, not
    decoration. And an unshuffled loader does not keep its order under the default: Lightning's training sampler
    shuffles whatever the loader's own ``shuffle`` (the docs say so)."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "guarantees.md").read_text()
    promise = next(line for line in docs.splitlines() if "gives one device's losses and parameters" in line)
    for recipe_part in ("data-parallel size 1", "use_distributed_sampler=False", "generator=torch.Generator()",
                        "even an unshuffled loader"):
        assert recipe_part in promise, recipe_part  # the guarantee says how to see it: this recipe

    one_device = _shuffled_fit(0, 1, True)
    for rank, runs in enumerate(run_distributed(_shuffled_worker, 2, timeout=300)):
        recipe, default = runs[False], runs[True]
        assert [idx for idx, _ in recipe] == [idx for idx, _ in one_device], (rank, recipe, one_device)
        for (_, got), (_, want) in zip(recipe, one_device):
            assert abs(got - want) < 2e-5, (rank, got, want)
        assert [idx for idx, _ in default] != [idx for idx, _ in one_device], rank
        in_order = [list(range(2 * i, 2 * i + 2)) for i in range(4)]  # what one device reads unshuffled
        assert [idx for idx, _ in runs["unshuffled"]] != in_order, (rank, runs["unshuffled"])


def _features_worker(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    """Validation with sync_dist, checkpoint save/resume, bf16-mixed and bf16-true on CP=2."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    elastic_env(rank, world_size, world_size)
    quiet()
    LM = lightning_module_class()
    train = torch.utils.data.DataLoader(make_samples(4, 13), batch_size=2)  # 2 steps per epoch
    val = torch.utils.data.DataLoader(make_samples(4, 10, seed=5), batch_size=2)

    def trainer(steps, **kw):
        kw.setdefault("enable_checkpointing", False)
        return L.Trainer(accelerator="cpu", devices=world_size, strategy=MTrainingStrategy(block_size=4, sparsity=None),
                         max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, **kw)

    first = LM("qwen2")
    # No validation here: a checkpoint saved at validation end resumes mid-epoch (Lightning semantics, not ours).
    trainer(2, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], enable_checkpointing=True).fit(
        first, train)
    resumed = LM("qwen2")
    trainer(4).fit(resumed, train, ckpt_path=f"{ckpt_dir}/last.ckpt")
    straight = LM("qwen2")
    t = trainer(4)
    t.fit(straight, train)
    val_loss = float(t.validate(straight, val, verbose=False)[0]["val_loss"])
    with torch.no_grad():  # reference: the trained model on full sequences, one process
        ref_val = sum(straight.model(**{k: v for k, v in b.items() if k != "idx"}).loss.item() for b in val) / 2
    bf16 = {}
    for precision in ("bf16-mixed", "bf16-true"):
        m = LM("qwen2")
        trainer(1, precision=precision).fit(m, train)
        bf16[precision] = m.records[0][1]
    return {
        "resumed_first": resumed.records[0], "straight_third": straight.records[2],
        "val_loss": val_loss, "ref_val": ref_val, "fp32_first": straight.records[0][1], "bf16": bf16,
        "n_resumed_steps": len(resumed.records)
    }


def test_validation_checkpoint_resume_and_bf16_two_processes(tmp_path):
    results = run_distributed(_features_worker, 2, str(tmp_path), timeout=300)
    for r in results:
        # Resumed from the step-2 checkpoint, step 3 sees the same batch with the same parameters as an
        # uninterrupted run, so the same loss (identical float32 math: 1e-6). (Which batch comes at step 4
        # after a resume is Lightning's business: plain "ddp" does the same.)
        assert r["n_resumed_steps"] == 2
        assert r["resumed_first"][0] == r["straight_third"][0]
        assert abs(r["resumed_first"][1] - r["straight_third"][1]) < 1e-6
        # The validation loss logged with sync_dist equals the full-sequence loss (same tolerance as above).
        assert abs(r["val_loss"] - r["ref_val"]) < 2e-5
        # bf16: same first-step loss as float32 to bf16 precision (8 mantissa bits, ~4e-3 relative per op).
        for precision, loss in r["bf16"].items():
            assert abs(loss - r["fp32_first"]) < 0.05, (precision, loss, r["fp32_first"])


def test_attention_callback_per_layer_options_with_configure_model():
    """Per-layer sparsity reaches each attention module (model built in configure_model): layer 0 dense, layer 1
    sparse, and only layer 1's pattern is estimated and measured."""
    import lightning as L

    from lightning_mtraining import SparseAttentionCallback, SparsityConfig
    from lightning_mtraining.distributed.plan import ContextParallelPlan
    from lightning_mtraining.hf.model import prepare_model
    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    quiet()
    budgets = SparsityConfig(vertical_topk=4, slash_topk=4, last_q=8, tile_size=16, local_window=16)
    callback = SparseAttentionCallback(dense_layers=[0], layer_sparsity={1: budgets}, log_every_n_steps=1)
    model = make_model("qwen2")
    prepare_model(model, ContextParallelPlan(block_size=4), callback.layer_sparsity_fn(default=None))
    assert [layer.self_attn._mtraining_ring.sparsity for layer in model.model.layers] == [None, budgets]

    def trainer(cb):
        return L.Trainer(accelerator="cpu", devices=1, strategy=MTrainingStrategy(block_size=16, sparsity=None),
                         max_steps=1, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)

    loader = torch.utils.data.DataLoader(make_samples(2, 40), batch_size=2)
    t = trainer(callback)
    t.fit(lightning_module_class()("qwen2", build_in_configure=True), loader)
    assert t.strategy.attention_schedule.estimations == 1
    metrics = t.strategy.attention_metrics()
    assert "attention/density/layer_1" in metrics and "attention/density/layer_0" not in metrics
    with pytest.raises(ValueError, match=r"lists layers \[5\], but Qwen2ForCausalLM has 2 layers"):
        trainer(SparseAttentionCallback(dense_layers=[5])).fit(lightning_module_class()("qwen2"), loader)
    with pytest.raises(ValueError, match="both in dense_layers and layer_sparsity"):
        SparseAttentionCallback(dense_layers=[1], layer_sparsity={1: budgets})


def _resume_worker(rank: int, world_size: int, ckpt_dir: str, phase: str, fsdp: bool = False) -> dict[str, Any]:
    """``phase="save"``: 2 steps with a checkpoint, then (a fresh run) 4 steps straight; ``"resume"``: from the
    checkpoint to step 4. SGD with momentum, so the optimizer state must come back too."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    if world_size > 1:
        elastic_env(rank, world_size, world_size, port=29500 + 7 * world_size)
    quiet()

    class Momentum(lightning_module_class()):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    # one sequence four times: which samples follow a resume depends on Lightning's sampler and the world size,
    # so every batch is the same and the losses follow the parameters and the optimizer state alone
    one = make_samples(1, 23)[0]
    train = torch.utils.data.DataLoader([{**one, "idx": torch.tensor(i)} for i in range(4)], batch_size=2)

    def trainer(steps, **kw):
        from lightning_mtraining.strategies.fsdp import MTrainingFSDPStrategy

        kw.setdefault("enable_checkpointing", False)
        cls = MTrainingFSDPStrategy if fsdp else MTrainingStrategy
        return L.Trainer(accelerator="cpu", devices=world_size, strategy=cls(block_size=4, sparsity=None),
                         max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, **kw)

    if phase == "save":
        trainer(2, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], enable_checkpointing=True).fit(
            Momentum("qwen2"), train)
        straight = Momentum("qwen2")
        trainer(4).fit(straight, train)
        return {"records": straight.records}
    resumed = Momentum("qwen2")
    trainer(4).fit(resumed, train, ckpt_path=f"{ckpt_dir}/last.ckpt")
    return {"records": resumed.records}


@pytest.mark.parametrize("fsdp", [False, True])
def test_checkpoint_resumes_at_another_cp_size(tmp_path, fsdp):
    """A checkpoint written on a CP group of 2 resumes on a CP group of 3 (and, DDP, on one process) with the same
    next losses as the uninterrupted run: MTrainingStrategy's checkpoint holds full parameters and optimizer state;
    MTrainingFSDPStrategy's is a distributed checkpoint (one shard per rank), resharded when loaded."""
    saved = run_distributed(_resume_worker, 2, str(tmp_path), "save", fsdp, timeout=300)[0]["records"]
    on3 = run_distributed(_resume_worker, 3, str(tmp_path), "resume", fsdp, timeout=300)[0]["records"]
    on1 = on3 if fsdp else _resume_worker(0, 1, str(tmp_path), "resume")["records"]
    assert len(saved) == 4 and saved[2][1] < saved[0][1]  # it trained
    for resumed in (on1, on3):
        assert len(resumed) == 2
        for (_, got), (_, want) in zip(resumed, saved[2:]):
            # other CP sizes split the float32 sums differently: the tolerance of the CP-vs-one-device tests
            assert abs(got - want) < 2e-5, (resumed, saved)
