"""The examples with a real pretrained model: ``examples/train.py --pretrained`` end to end on 2 CPU processes (the
model's own tokenizer builds the corpus, sparse ring attention on the real model's Q and K, the JSON summary), and
``examples/configs/smollm2_cpu.yaml`` parsing into the LightningCLI's typed module, data and strategy."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.real_model import needs_real_model, smollm2_folder
from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_smollm2_config_parses(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    from lightning.pytorch.cli import LightningCLI

    from lightning_mtraining import MTrainingStrategy, SparsityConfig

    cli_mod = load_script("examples/cli.py", "mtraining_example_cli")
    config = ROOT / "examples" / "configs" / "smollm2_cpu.yaml"
    args = ["--config", str(config), f"--trainer.default_root_dir={tmp_path}"]
    cli = LightningCLI(cli_mod.CausalLMModule, cli_mod.StdlibBytesDataModule, run=False, args=args)
    assert cli.model.hparams.pretrained == "smollm2" and cli.model.hparams.rope is None
    assert cli.model.model is None  # loaded in configure_model, on every rank
    assert cli.datamodule.tokenizer == "smollm2" and cli.datamodule.seq_len == 1024
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MTrainingStrategy) and strategy.block_size == 64
    assert strategy.sparsity == SparsityConfig(vertical_topk=32, slash_topk=4, local_window=64, last_q=32,
                                               tile_size=32)


@needs_real_model
def test_train_example_with_the_real_model(tmp_path_factory, tmp_path):
    pytest.importorskip("litdata")
    folder = smollm2_folder(tmp_path_factory)
    cmd = [sys.executable, str(ROOT / "examples" / "train.py"), "--pretrained", str(folder),
           "--devices", "2", "--seq-len", "256", "--block-size", "32", "--tile-size", "16", "--sparsity", "topk:8,2",
           "--max-steps", "2", "--lr", "1e-4", "--warmup-steps", "1", "--packages", "json",
           "--data-dir", str(tmp_path / "corpus"), "--log-dir", str(tmp_path / "logs")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("summary: ")]
    assert len(lines) == 1
    s = json.loads(lines[0][len("summary: "):])
    assert s["pretrained"] == str(folder) and s["model"] == "llama" and s["model_size"] is None
    assert s["parameters"] == 134515008 and (s["world_size"], s["cp_size"]) == (2, 2)
    # a pretrained model on Python source: far below chance (ln 49152 = 10.8), and the metric equals the model's loss
    assert s["steps"] == 2 and all(math.isfinite(x) and x < 4.0 for x in s["losses"])
    for metric, model in zip(s["losses"], s["model_losses"]):
        assert metric == pytest.approx(model, rel=1e-5)
    assert 0.0 < s["attention"]["attention/density"] < 1.0
    manifest = json.loads((tmp_path / "corpus" / "mtraining_corpus.json").read_text())
    assert manifest["vocab_size"] == 49152 and manifest["packages"] == ["json"]
