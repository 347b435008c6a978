"""LightningCLI: examples/configs/tiny_cpu.yaml parses into MTrainingStrategy and runs a few steps on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "tiny_cpu.yaml"


def _cli_module():
    return load_script("examples/cli.py", "mtraining_example_cli")


def test_config_parses_into_typed_strategy(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # LightningCLI parses args=..., not pytest's argv
    from lightning.pytorch.cli import LightningCLI

    from lightning_mtraining import MTrainingStrategy, SparsityConfig

    cli_mod = _cli_module()
    args = ["--config", str(CONFIG), f"--trainer.default_root_dir={tmp_path}"]
    cli = LightningCLI(cli_mod.CausalLMModule, cli_mod.StdlibBytesDataModule, run=False, args=args)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MTrainingStrategy)
    assert (strategy.layout, strategy.block_size, strategy.options.context_parallel_size) == ("striped", 64, "auto")
    assert strategy.sparsity == SparsityConfig(vertical_topk=64, slash_topk=16, local_window=32, tile_size=32)
    assert cli.trainer.num_devices == 2 and cli.datamodule.seq_len == 2047

    # Typed init_args: an int CP size and a SparsityConfig dataclass parse from the command line.
    args += ["--trainer.strategy.init_args.context_parallel_size=2", "--trainer.strategy.init_args.layout=zigzag"]
    cli = LightningCLI(cli_mod.CausalLMModule, cli_mod.StdlibBytesDataModule, run=False, args=args)
    strategy = cli.trainer.strategy
    assert strategy.options.context_parallel_size == 2 and strategy.layout == "zigzag"
    sparse_args = [*args, "--trainer.strategy.init_args.sparsity.vertical_topk=256"]
    parsed = cli.parser.parse_args(sparse_args)  # parsed, not yet instantiated
    assert parsed.trainer.strategy.init_args.sparsity.vertical_topk == 256
    cli = LightningCLI(cli_mod.CausalLMModule, cli_mod.StdlibBytesDataModule, run=False, args=sparse_args)
    # the YAML's sparsity block (class_path/init_args) with one field overridden on the command line
    assert cli.trainer.strategy.sparsity == SparsityConfig(vertical_topk=256, slash_topk=16, local_window=32,
                                                           tile_size=32)

    # `sparsity: null` is dense; a config without a sparsity block gets the class's default, the paper's setting
    from lightning_mtraining.sparsity.config import PAPER_SPARSITY

    cli = LightningCLI(cli_mod.CausalLMModule, cli_mod.StdlibBytesDataModule, run=False,
                       args=[*args, "--trainer.strategy.init_args.sparsity=null"])
    assert cli.trainer.strategy.sparsity is None
    plain = tmp_path / "no_sparsity.yaml"
    plain.write_text("\n".join(line for line in CONFIG.read_text().splitlines()
                               if not line.startswith("      sparsity:") and not line.startswith("        ")))
    cli = LightningCLI(cli_mod.CausalLMModule, cli_mod.StdlibBytesDataModule, run=False,
                       args=["--config", str(plain), f"--trainer.default_root_dir={tmp_path}",
                             "--trainer.strategy.init_args.block_size=128"])
    assert cli.trainer.strategy.sparsity == PAPER_SPARSITY

    with pytest.raises(SystemExit):  # jsonargparse rejects a layout outside the Literal
        LightningCLI(cli_mod.CausalLMModule, cli_mod.StdlibBytesDataModule, run=False,
                     args=[*args, "--trainer.strategy.init_args.layout=diagonal"])


def test_cli_fit_runs_two_processes(tmp_path):
    """The documented command, shortened (2 steps, 511 tokens), with its 2 CPU processes."""
    cmd = [sys.executable, str(ROOT / "examples" / "cli.py"), "fit", "--config", str(CONFIG),
           "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--data.seq_len=511",
           f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"]
    launcher_vars = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                     "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in proc.stdout + proc.stderr
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    assert (tmp_path / "config.yaml").exists()
