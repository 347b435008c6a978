"""The main job, ``examples/train.py``, end to end on CPU: 2 processes, the real strategy, the real corpus.

Runs the script as a user would (a subprocess; Lightning launches the second rank) with tiny flags and
checks what it promises: training makes progress (the loss falls and stays finite), the logged
token-weighted loss (the metric) equals the loss the model returned under the strategy (two
independent routes to the same number: 1e-5 relative covers float32 rounding of a 5-ish value), the
summary is printed and the CSV logger wrote the progress-bar metrics; and a second run, which finds the
corpus built, trains on the same data from the same initialisation (its losses equal the first run's, exactly:
same seed, same float32 ops) without printing the build's progress or the warnings the script silences; a third
with the memory flags (checkpointing, the tiled MLP, offload of one layer) gives the same losses.
(The Llama flag and the
data-parallel path, ``--model llama --context-parallel-size 1``, were run by hand, not here, to keep CI
short; the strategy's own tests cover both families and DP x CP parity.)
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("litdata")

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *flags: str, max_steps: int = 6, warnings: str = "ignore") -> tuple[dict, str]:
    cmd = [
        sys.executable, str(REPO / "examples" / "train.py"),
        "--devices", "2", "--seq-len", "768", "--block-size", "32", "--max-steps", str(max_steps),
        "--lr", "1e-2", "--warmup-steps", "1",
        "--data-dir", str(tmp_path / "corpus"), "--log-dir", str(tmp_path / "logs"), *flags,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": warnings}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "=== summary ===" in proc.stdout
    assert "terminate called" not in proc.stderr  # gloo at exit without destroy_process_group (strategy.py)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("summary: ")]
    assert len(lines) == 1, "exactly one summary (rank 0 only)"
    return json.loads(lines[0][len("summary: ") :]), proc.stdout + proc.stderr


def test_train_example_context_parallel(tmp_path):
    s, output = _run(tmp_path)
    assert "building the byte-level corpus" in output and "corpus built:" in output
    assert output.count("MTrainingStrategy: world 2 = dp 1 x cp 2, flat ring of 2") == 1  # the mesh, rank 0
    assert (s["world_size"], s["dp_size"], s["cp_size"], s["strategy"]) == (2, 1, 2, "mtraining")
    assert s["steps"] == 6 and len(s["losses"]) == 6
    assert all(math.isfinite(v) for v in s["losses"])
    # Random init starts near ln(264) = 5.58; six steps at lr 1e-2 must get clearly below the start.
    assert abs(s["first_loss"] - math.log(264)) < 0.5
    assert s["last_loss"] < s["first_loss"] - 0.2
    for metric, model in zip(s["losses"], s["model_losses"]):
        assert metric == pytest.approx(model, rel=1e-5)
    assert s["final_ppl"] == pytest.approx(math.exp(s["last_loss"]), rel=1e-6)
    assert s["tokens_per_second"] > 0
    rows = list(csv.DictReader(open(s["csv"] if os.path.isabs(s["csv"]) else tmp_path / s["csv"])))
    logged = [float(r["loss"]) for r in rows if r.get("loss")]
    assert len(logged) == 6 and logged == pytest.approx(s["losses"], rel=1e-5)
    assert all(float(r["tok_s"]) > 0 for r in rows if r.get("tok_s"))
    assert all(r.get("ppl") for r in rows if r.get("loss"))
    synced = [float(r["model_loss"]) for r in rows if r.get("model_loss")]
    assert synced == pytest.approx(logged, rel=1e-5)

    # The second run finds the corpus built: same data, same initialisation, same losses; no build output, and
    # none of the warnings the script silences (default warning filters this time).
    again, output = _run(tmp_path, max_steps=2, warnings="default")
    assert again["losses"] == s["losses"][:2]
    assert "building the byte-level corpus" not in output
    assert "LeafSpec" not in output and "`IterableDataset` has `__len__`" not in output

    # The memory flags change where activations live, not the losses: the MLP in chunks of 100 tokens (a rank holds
    # 384) rounds its smaller products differently, within 1e-5 relative in float32
    memory, _ = _run(tmp_path, "--activation-checkpointing", "--tiled-mlp", "100", "--offload", "1", max_steps=2)
    assert memory["losses"] == pytest.approx(s["losses"][:2], rel=1e-5)
