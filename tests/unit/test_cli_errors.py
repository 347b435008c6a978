"""CLI errors first and short (``lightning_mtraining.strategies.cli``): the messages jsonargparse and the strategy
give, reduced to the error, the nearest valid key and the expected type, at most 15 lines; and ``examples/cli.py``
exiting with status 2 and such a message for a misspelled key, a wrong type and a bad ``sparsity`` string."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.scripts import ROOT

KEYS = ["config", "trainer.max_steps", "trainer.max_time", "trainer.min_steps", "data.seq_len", "data.batch_size",
        "trainer.strategy.init_args.block_size", "trainer.strategy.init_args.sparsity"]


def test_an_unknown_key_comes_with_the_nearest_ones():
    from lightning_mtraining.strategies.cli import compact_cli_error

    lines = compact_cli_error("Subcommand 'fit' does not accept option 'trainer.max_step'", KEYS, "cli.py fit")
    assert lines[0] == "error: Subcommand 'fit' does not accept option 'trainer.max_step'"
    assert "'trainer.max_steps'" in lines[1] and lines[1].startswith("  did you mean")
    lines = compact_cli_error("unrecognized arguments: --trainer.strategy.init_args.block_sise 64", KEYS, "cli.py fit")
    assert "'trainer.strategy.init_args.block_size'" in lines[1]
    lines = compact_cli_error("Subcommand 'fit' does not accept option 'data.zzz'", KEYS, "cli.py fit")
    assert lines[1] == "  keys under 'data': data.batch_size, data.seq_len"


def test_a_strategy_message_is_kept_and_the_value_dump_dropped():
    from lightning_mtraining.strategies.cli import MAX_LINES, compact_cli_error

    message = ("Does not validate against any of the Union subtypes\nSubtypes: [<class 'str'>, <class 'Strategy'>]\n"
               "Errors:\n  - Expected a <class 'str'>\n  - MTrainingStrategy(sparsity=...): a sparsity spec is 'none', "
               "...; got 'fast'\nGiven value type: <class 'Namespace'>\nGiven value: Namespace(" + "x=1, " * 500 + ")")
    lines = compact_cli_error(message, KEYS, "cli.py fit")
    assert lines[0] == "error: MTrainingStrategy(sparsity=...): a sparsity spec is 'none', ...; got 'fast'"
    assert len(lines) <= MAX_LINES and not any("Given value" in ln for ln in lines)
    lines = compact_cli_error('Parser key "data.seq_len":\n  Expected a <class \'int\'>. Got value: sixty-four', KEYS,
                              "cli.py fit")
    assert lines[:2] == ['error: Parser key "data.seq_len":', "  Expected a <class 'int'>. Got value: sixty-four"]


@pytest.mark.slow  # three CLI processes (Lightning's import each)
@pytest.mark.parametrize("args, first, second", [
    (["--trainer.strategy.init_args.sparsity", "fast"], "error: MTrainingStrategy(sparsity=...): a sparsity spec is",
     None),
    (["--data.seq_len", "sixty-four"], 'error: Parser key "data.seq_len":', "Got value: sixty-four"),
    (["--data.seq_lenn", "64"], "error: unrecognized arguments: --data.seq_lenn 64", "'data.seq_len'"),
])
def test_the_example_cli_exits_2_with_the_error_first(args, first, second):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "cli.py"), "fit", "--config",
                           str(ROOT / "examples" / "configs" / "tiny_cpu.yaml"), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # (Lightning logs the seed before the classes are built)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("Seed set to")]
    assert lines[0].startswith(first), lines
    assert len(lines) <= 15 and "Traceback" not in proc.stderr
    if second is not None:
        assert second in lines[1]


def test_the_cli_trainer_counts_steps_in_its_progress_bar(monkeypatch):
    """Where the config names no progress bar the Trainer gets the one that reads ``Epoch 0`` for a run bounded by
    ``max_steps`` (Lightning's own reads ``Epoch 0/-2``); one the config names stays."""
    from helpers.scripts import load_script
    from lightning_mtraining.callbacks.progress import StepBoundRichProgressBar
    from lightning_mtraining.strategies.cli import MTrainingCLI

    monkeypatch.setattr(sys, "argv", ["cli.py"])  # (the arguments come from args=)
    example = load_script("examples/cli.py", "cli_example")
    base = ["--config", str(ROOT / "examples" / "configs" / "tiny_cpu.yaml"), "--trainer.devices", "1",
            "--trainer.strategy", "auto"]
    cli = MTrainingCLI(example.CausalLMModule, example.StdlibBytesDataModule, run=False, args=base,
                       save_config_callback=None)
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, StepBoundRichProgressBar)
    bar._trainer = cli.trainer
    assert bar._get_train_description(0).strip() == "Epoch 0"
    cli = MTrainingCLI(example.CausalLMModule, example.StdlibBytesDataModule, run=False, save_config_callback=None,
                       args=[*base, "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"])
    assert type(cli.trainer.progress_bar_callback).__name__ == "TQDMProgressBar"
