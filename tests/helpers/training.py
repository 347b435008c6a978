"""Trainer runs against single-process training: the data, the LightningModule, the reference trainer and the
comparison shared by the strategy, Fabric, sparse-training, multinode and user-step tests.

What is compared: per-micro-batch losses seen in ``training_step`` and every parameter after a few optimizer steps,
against a single-process float32 reference that runs the same Hugging Face model (eager attention) on the *full*
sequences and averages DP groups the way DDP does (mean of per-group losses, sum over accumulated micro-batches /
accumulate_grad_batches). Tolerances: see ``distributed/test_strategy.py``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from helpers.dist import run_distributed
from helpers.models import VOCAB, make_model


def make_samples(n: int, seq_len: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` samples of ``seq_len`` tokens; every third is right-padded by 3 (attention_mask 0, labels -100)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (seq_len,), generator=g)
        mask = torch.ones(seq_len, dtype=torch.long)
        if i % 3 == 1:
            mask[-3:] = 0
            ids[-3:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        samples.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "idx": torch.tensor(i)})
    return samples


def lightning_module_class():
    import lightning as L

    from lightning_mtraining import causal_lm_loss

    class _CausalLM(L.LightningModule):
        """A user's module: wraps an HF causal LM, unaware of context parallelism."""

        def __init__(self, family: str, call: str = "kwargs", lr: float = 0.5, build_in_configure: bool = False):
            super().__init__()
            self.family, self.call, self.lr = family, call, lr
            self.model = None if build_in_configure else make_model(family)
            self.records: list[tuple[list[int], float]] = []

        def configure_model(self):
            if self.model is None:
                self.model = make_model(self.family)

        def forward_loss(self, batch):
            if self.call == "kwargs":
                out = self.model(**{k: v for k, v in batch.items() if k != "idx"})
            elif self.call == "clone":  # labels built here, not a tensor of the batch: shifted over the CP group
                # (padding gets -100: labels at padded positions are refused, see test_padding_labels.py)
                labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
                out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
            elif self.call in ("helper", "manual"):  # the step computes its own loss from the logits
                logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                if self.call == "manual":  # the single-device idiom: a local shift (wrong on a shard)
                    ids = batch["input_ids"]
                    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
                return causal_lm_loss(logits, batch)
            elif self.call == "helper_mixed":  # `outputs.loss * 0.5 + aux` style, aux through the helper
                out = self.model(**{k: v for k, v in batch.items() if k != "idx"})
                # Labels built in the step (equal to the batch's): found through the logits' tag, shifted over
                # the CP group.
                labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
                return out.loss * 0.5 + 0.5 * causal_lm_loss(out.logits, labels)
            else:  # only input_ids and labels, no attention_mask / position_ids
                out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
            return out.loss

        def training_step(self, batch, batch_idx):
            loss = self.forward_loss(batch)
            self.wrapper = type(self.trainer.strategy.model).__name__
            self.records.append((batch["idx"].tolist(), loss.item()))
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.forward_loss(batch), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    return _CausalLM


def elastic_env(rank: int, world_size: int, local_world_size: int, port: int = 29500) -> None:
    """Environment torchrun would set, so Lightning uses the processes that already exist."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank % local_world_size), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size), GROUP_RANK=str(rank // local_world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="test",
    )


def quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def fit(world_size: int, scenario: dict[str, Any], devices: int | None = None, num_nodes: int = 1) -> dict[str, Any]:
    """Run ``Trainer.fit`` in this (already distributed) process; returns records and final parameters."""
    import lightning as L

    from lightning_mtraining.strategies.trainer import MTrainingStrategy

    if scenario.get("quiet", True):
        quiet()
    strategy_kwargs = {"sparsity": None, **scenario.get("strategy", {})}  # dense unless the scenario says otherwise
    if scenario.get("fsdp"):
        from lightning_mtraining.strategies.fsdp import MTrainingFSDPStrategy

        strategy = MTrainingFSDPStrategy(**strategy_kwargs)
    else:
        strategy = MTrainingStrategy(**strategy_kwargs)
    module = lightning_module_class()(scenario["family"], scenario.get("call", "kwargs"),
                                 build_in_configure=scenario.get("build_in_configure", False))
    data = make_samples(scenario["n_samples"], scenario["seq_len"])
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices or world_size, num_nodes=num_nodes, strategy=strategy,
        max_steps=scenario["steps"], accumulate_grad_batches=scenario.get("accumulate", 1),
        gradient_clip_val=scenario.get("clip"), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, loader)
    plan = strategy.plan
    mesh = strategy.device_mesh if world_size > 1 else None
    return {
        "records": module.records,
        "params": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in module.model.named_parameters()},
        "cp_rank": plan.cp_rank, "cp_size": plan.cp_size, "dp_rank": strategy.dp_rank,
        "mesh": None if mesh is None else (tuple(mesh.mesh_dim_names), mesh.mesh.tolist()),
        "attn_after": module.model.config._attn_implementation,
        "logged": float(trainer.callback_metrics["train_loss"]),
        "wrapper": module.wrapper,
        "sharded": all(hasattr(v, "full_tensor") for v in module.model.parameters()),
        "checkpointing": module.model.is_gradient_checkpointing,
    }


def reference(scenario: dict[str, Any], micro_batches: list[list[list[int]]]) -> dict[str, Any]:
    """Single-process training on full sequences. ``micro_batches[m][g]``: sample indices of DP group g."""
    model = make_model(scenario["family"])
    model.set_attn_implementation("eager")
    data = make_samples(scenario["n_samples"], scenario["seq_len"])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    accumulate = scenario.get("accumulate", 1)
    losses = []
    for m, groups in enumerate(micro_batches):
        step_losses = []
        for idx in groups:
            batch = {k: torch.stack([data[i][k] for i in idx]) for k in ("input_ids", "attention_mask", "labels")}
            if scenario.get("call") == "explicit":
                batch.pop("attention_mask")
            step_losses.append(model(**batch).loss)
        losses.append([x.item() for x in step_losses])
        (torch.stack(step_losses).mean() / accumulate).backward()
        if (m + 1) % accumulate == 0:
            if scenario.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), scenario["clip"])
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "params": dict(model.named_parameters())}


def check_against_reference(results: list[dict[str, Any]], scenario: dict[str, Any]) -> None:
    """Same samples per CP group, disjoint across DP groups; losses and parameters equal to the reference."""
    cp = results[0]["cp_size"]
    dp = len(results) // cp
    n_micro = len(results[0]["records"])
    assert n_micro == scenario["steps"] * scenario.get("accumulate", 1)
    micro_batches = []
    for m in range(n_micro):
        groups = []
        for g in range(dp):
            ranks = [r for r in results if r["dp_rank"] == g]
            assert len(ranks) == cp
            idx = ranks[0]["records"][m][0]
            assert all(r["records"][m][0] == idx for r in ranks), "CP ranks of one group got different samples"
            groups.append(idx)
        flat = [i for idx in groups for i in idx]
        assert len(set(flat)) == len(flat), f"DP groups share samples: {groups}"
        micro_batches.append(groups)
    ref = reference(scenario, micro_batches)
    for m in range(n_micro):
        for r in results:
            got = r["records"][m][1]
            want = ref["losses"][m][r["dp_rank"]]
            assert abs(got - want) < 2e-5, f"micro-batch {m}, rank cp{r['cp_rank']}/dp{r['dp_rank']}: {got} vs {want}"
    for r in results:
        for name, want in ref["params"].items():
            torch.testing.assert_close(r["params"][name], want.detach(), rtol=0, atol=5e-5,
                                       msg=lambda s: f"{name}: {s}")
        assert r["attn_after"] == "eager", "teardown must restore the attention implementation"


def fit_worker(rank: int, world_size: int, scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    elastic_env(rank, world_size, world_size)
    return [fit(world_size, s) for s in scenarios]


def run_scenarios(world_size: int, scenarios: list[dict[str, Any]]) -> None:
    per_rank = run_distributed(fit_worker, world_size, scenarios, timeout=300)
    for i, scenario in enumerate(scenarios):
        check_against_reference([per_rank[r][i] for r in range(world_size)], scenario)
