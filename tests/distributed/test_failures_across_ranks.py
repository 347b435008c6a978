"""Failures under Lightning's own launcher (``Trainer(devices=2)`` run as a script: the subprocess launcher starts
rank 1 as a child of rank 0), as a user sees them.

- A failure every rank finds alike (left padding: both ranks of the CP group reject the batch) is reported once, by
  rank 0, message first, in at most 3 lines; rank 1 ends with one line naming it; no traceback anywhere (Note
  [Failures that speak once] in lightning_mtraining.core.errors).
- Rank 0 fails while rank 1 stalls in its step: the job ends and rank 1 with it; no process outlives the job (Note
  [No rank outlives a failure] in lightning_mtraining.strategies.launchers). Without it, rank 1 kept running after
  rank 0 had exited.
- Rank 1 raises in ``training_step`` at step 2 while rank 0 waits for it in a collective: rank 0 says in one line that
  rank 1 failed first; rank 1's report (its own frames, the message, its rank and step) comes last, once, in under 30
  lines (Note [The first failure speaks last] in lightning_mtraining.core.errors). Without it: 346 lines, the cause
  mid-log and rank 0's consequential error, which does not name rank 1, last.

The script is written into the test's folder and run with this interpreter; a ~25 s run each on 2 CPU cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import os, sys, time, warnings
warnings.filterwarnings("ignore")
import lightning as L
import torch
from helpers.models import make_model
from lightning_mtraining import MTrainingStrategy

mode, folder = sys.argv[1], sys.argv[2]
world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
steps = 4 if mode == "rank1_at_step2" else 1


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = make_model("llama")

    def training_step(self, batch, batch_idx):
        if mode == "stall":
            if self.global_rank == 1:
                open(os.path.join(folder, "rank1.pid"), "w").write(str(os.getpid()))
                time.sleep(600)  # a rank that hangs in user code
            while not os.path.exists(os.path.join(folder, "rank1.pid")):  # rank 1 is stalling now
                time.sleep(0.1)
            raise RuntimeError("rank 0 fails")
        if mode == "rank1_at_step2" and self.global_rank == 1 and self.global_step == 2:
            raise RuntimeError("rank 1 fails at step 2")
        if mode == "rank1_sleeps" and self.global_rank == 1:
            open(os.path.join(folder, "rank1.pid"), "w").write(str(os.getpid()))
            time.sleep(600)  # stalls in its step, past the process group's timeout: the others wait for it
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


ids = torch.randint(1, 64, (8, 40))
mask = torch.ones_like(ids)
if mode == "left_padding":
    mask[:, :3] = 0
data = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i]} for i in range(8)]
import datetime
timeout = datetime.timedelta(seconds=8 if mode == "rank1_sleeps" else 1800)
trainer = L.Trainer(accelerator="cpu", devices=world,
                    strategy=MTrainingStrategy(sparsity=None, block_size=16, timeout=timeout),
                    max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=1))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has ended
    except FileNotFoundError:
        return False


def _run(tmp_path: Path, mode: str, world: int = 2) -> tuple[int | None, str]:
    """(the job's exit code, or None if it was still running after 300 s; what it printed). Output goes to a file,
    not a pipe: a rank left running would hold a pipe open after the job ended. Ends rank 1 if the job left it."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK",
                                                            "LOCAL_RANK", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    log = tmp_path / "output.txt"
    with open(log, "w") as out:
        job = subprocess.Popen([sys.executable, str(script), mode, str(tmp_path), str(world)], env=env, stdout=out,
                               stderr=subprocess.STDOUT)
        try:
            code = job.wait(timeout=300)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
            code = None
    return code, log.read_text()


def _end_rank1(tmp_path: Path) -> int | None:
    """Rank 1's pid if it wrote one, and whether it was still alive (then ended here, by its pid)."""
    pid_file = tmp_path / "rank1.pid"
    if not pid_file.exists():
        return None
    pid = int(pid_file.read_text())
    if _alive(pid):
        os.kill(pid, 9)  # a process this test started
        return pid
    return None


def test_a_failure_every_rank_finds_is_reported_once(tmp_path):
    code, out = _run(tmp_path, "left_padding")
    assert code == 1, out
    assert "Traceback" not in out, out
    rank0 = [line for line in out.splitlines() if line.startswith("[rank0]:")]
    rank1 = [line for line in out.splitlines() if line.startswith("[rank1]:")]
    assert 2 <= len(rank0) <= 3, out
    assert rank0[0].startswith("[rank0]: ValueError: attention_mask rows [0] have padding before real tokens"), out
    assert len(rank1) == 1 and rank1[0].startswith("[rank1]: ValueError, reported by rank 0"), out
    assert "attention_mask rows [0]" in rank1[0], out  # says what happened even without rank 0's report


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_no_rank_outlives_a_failure_while_another_stalls(tmp_path):
    code, out = _run(tmp_path, "stall")
    left_running = _end_rank1(tmp_path)
    assert (tmp_path / "rank1.pid").exists(), out  # rank 1 did stall
    assert left_running is None, f"rank 1 (pid {left_running}) outlived the job:\n{out}"
    assert code == 1, out
    # rank 1, stalled in its step, was told and said so in one line; rank 0's report comes last
    assert "[rank1]: ending: rank 0 failed first at step 0 (RuntimeError: rank 0 fails)" in out, out
    assert out.rstrip().splitlines()[-2] == "[rank0]: RuntimeError: rank 0 fails", out


def test_the_first_failure_is_printed_last_once_with_its_rank_and_step(tmp_path):
    code, out = _run(tmp_path, "rank1_at_step2")
    assert code == 1, out
    lines = out.rstrip().splitlines()
    rank0 = [line for line in lines if line.startswith("[rank0]:")]
    rank1 = [line for line in lines if line.startswith("[rank1]:")]
    assert rank0 == ["[rank0]: ending: rank 1 failed first at step 2 (RuntimeError: rank 1 fails at step 2)"], out
    assert len(rank1) < 30 and lines[-len(rank1):] == rank1, out  # rank 1's report is the end of the output
    assert rank1[-2] == "[rank1]: RuntimeError: rank 1 fails at step 2", out
    assert rank1[-1].startswith("[rank1]: rank 1 failed first at step 2;"), out
    assert any("train.py" in line and "in training_step" in line for line in rank1), out  # the user's frame
    assert out.count("rank 1 fails at step 2\n") == 1 and "Traceback (most recent call last)" not in out, out
    assert "lightning/pytorch" not in out and "Connection closed" not in out, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_stalled_in_its_step_is_named_by_the_rank_that_waited(tmp_path, world):
    """Rank 1 sleeps in ``training_step`` past the process group's timeout (8 s) while the others wait for it in the
    ring's first transfer: the report names rank 1 as the rank that did not arrive, with where it was (no collective
    of this step yet, step 0) (Note [Who did not arrive] in lightning_mtraining.core.errors); in at most 30 lines of
    the ranks' own output; no process left running."""
    code, out = _run(tmp_path, "rank1_sleeps", world)
    left_running = _end_rank1(tmp_path)
    assert (tmp_path / "rank1.pid").exists(), out
    assert left_running is None, f"rank 1 (pid {left_running}) outlived the job:\n{out}"
    assert code == 1, out
    ranks = [line for line in out.splitlines() if line.startswith("[rank")]
    assert len(ranks) <= 30, out
    named = [line for line in ranks if "did not arrive: rank 1 (" in line]
    assert named, out
    assert "at step 0" in named[0] and "rank 1 (" in named[0].split("did not arrive: ", 1)[1], out
    # the stalled rank says in its one line that it was the one waited for
    assert any(line.startswith("[rank1]: ending: rank ") and "did not arrive: rank 1" in line for line in ranks), out
