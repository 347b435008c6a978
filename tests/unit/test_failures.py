"""Failures that speak once (Note [Failures that speak once] in lightning_mtraining.core.errors) and no local rank
left running (Note [No rank outlives a failure] in lightning_mtraining.strategies.launchers), in one process.

What is checked: the report a marked failure prints (the reporting rank: the message first, then where it was raised
and the user's frame, in at most a few lines; any other rank: one line naming the reporting rank), that Python
prints it for an uncaught exception and the full traceback when asked, which checks mark what they raise (and which
must not), that a model built in ``configure_model`` is checked before the strategy's ``setup`` runs, and the
launcher's rule for child processes (children of this test: ``sleep`` processes). The multi-process runs under
Lightning's own launcher are in ``tests/distributed/test_failures_across_ranks.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from helpers.models import make_model
from lightning_mtraining.core.errors import FULL_TRACEBACK_ENV, SameOnRanks, format_failure, mark_same_on_ranks


def _raised(message: str) -> ValueError:
    try:
        raise ValueError(message)
    except ValueError as e:
        return e


def test_the_reporting_rank_prints_the_message_first_in_a_few_lines():
    exc = _raised("attention_mask rows [0] have padding before real tokens")
    text = format_failure(exc, SameOnRanks(rank=0, reporter=0, world_size=2, ranks="every rank"))
    lines = text.splitlines()
    assert lines[0] == "[rank0]: ValueError: attention_mask rows [0] have padding before real tokens"
    assert len(lines) == 3 and "raised in" in lines[1] and "test_failures.py" in lines[1]
    assert "every rank found the same" in lines[2] and f"{FULL_TRACEBACK_ENV}=1" in lines[2]
    one = format_failure(_raised("x"), SameOnRanks(0, 0, 1, "every rank"))  # one process: no rank prefix
    assert one.startswith("ValueError: x\n") and "[rank" not in one and "found the same" not in one


def test_another_rank_prints_one_line_naming_the_reporting_rank():
    exc = _raised("a long message " * 20)
    text = format_failure(exc, SameOnRanks(rank=3, reporter=2, world_size=4, ranks="every rank of the group"))
    assert text.count("\n") == 1 and text.startswith("[rank3]: ValueError, reported by rank 2 (found the same here): ")
    assert "a long message a long message" in text and text.rstrip().endswith("...") and len(text) < 200


_SCRIPT = """
from lightning_mtraining.core.errors import mark_same_on_ranks

def check():
    raise ValueError("the batch is wrong: do this")

try:
    check()
except ValueError as e:
    raise mark_same_on_ranks(e, 0, 0, 1, "every rank")
"""


@pytest.mark.parametrize("full", [False, True])
def test_python_prints_the_short_report_of_an_uncaught_marked_failure(full):
    env = {**os.environ, FULL_TRACEBACK_ENV: "1" if full else ""}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    if full:  # the environment variable brings Python's own traceback back
        assert lines[0].startswith("Traceback") and lines[-1] == "ValueError: the batch is wrong: do this"
    else:
        assert lines[0] == "ValueError: the batch is wrong: do this" and len(lines) <= 3, run.stderr
        assert "Traceback" not in run.stderr


def test_marking_keeps_the_exception_and_only_the_first_mark_counts():
    exc = _raised("m")
    assert mark_same_on_ranks(exc, 1, 0, 2, "every rank") is exc
    mark_same_on_ranks(exc, 1, 1, 2, "other")
    assert format_failure(exc, exc._mtraining_same_on_ranks).startswith("[rank1]: ValueError, reported by rank 0")


def _mark(exc: BaseException) -> SameOnRanks | None:
    return getattr(exc, "_mtraining_same_on_ranks", None)


def test_checks_mark_their_failures_and_a_rank_dependent_check_does_not():
    """What every rank of the CP group holds alike (the batch, the forward's inputs, the model) fails marked; the
    position_ids check, whose outcome may differ by rank, is left unmarked (full traceback on every rank)."""
    from lightning_mtraining import SparsityConfig, apply_context_parallel

    model = make_model("llama")
    cp = apply_context_parallel(model, None, sparsity=SparsityConfig(vertical_topk=2, slash_topk=2, last_q=16,
                                                                      tile_size=16), block_size=16)
    ids = torch.randint(1, 64, (1, 32))
    with pytest.raises(ValueError, match="left padding") as info:
        cp.shard({"input_ids": ids, "attention_mask": torch.ones_like(ids).index_fill(1, torch.tensor([0]), 0)})
    assert _mark(info.value) == SameOnRanks(0, 0, 1, "every rank of the context-parallel group")
    batch = cp.shard({"input_ids": ids})
    with pytest.raises(ValueError, match="output_attentions") as info:
        model(**batch, output_attentions=True)
    assert _mark(info.value) is not None
    with pytest.raises(ValueError, match="neither the tokens' global positions") as info:
        model(**batch, position_ids=torch.arange(32)[None] + 1)
    assert _mark(info.value) is None
    with pytest.raises(ValueError, match="attention dropout") as info:
        apply_context_parallel(make_model("llama", attention_dropout=0.1), None)
    assert _mark(info.value) == SameOnRanks(0, 0, 1, "every rank")


def test_a_model_built_in_configure_model_is_checked_before_the_strategys_setup():
    """The model built in configure_model is checked as soon as it exists (when Lightning's model_sharded_context
    closes), before the strategy's setup, where DDP's first collective runs; the failure is marked."""
    import lightning as L

    from lightning_mtraining import MTrainingStrategy

    calls = []

    class Recording(MTrainingStrategy):
        def setup(self, trainer):
            calls.append("setup")
            super().setup(trainer)

    class Late(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None

        def configure_model(self):
            self.model = make_model("llama", attention_dropout=0.1)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Recording(sparsity=None), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader([{"input_ids": torch.ones(8, dtype=torch.long)}] * 2, batch_size=1)
    with pytest.raises(ValueError, match=r"attention dropout \(config\.attention_dropout=0\.1\)") as info:
        trainer.fit(Late(), loader)
    assert calls == [] and _mark(info.value) == SameOnRanks(0, 0, 1, "every rank")


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_failing_launcher_ends_children_that_are_still_running():
    """This process failed: a child that ends on its own within the grace period is left to end; one still running
    after it is killed and reaped."""
    from lightning_mtraining.strategies.launchers import LocalRanks

    quick = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    stalled = _sleeper()
    ranks = LocalRanks([quick, stalled], grace_s=1.0)
    ranks.end_after_failure()
    assert quick.returncode == 1  # ended on its own
    assert stalled.returncode == -signal.SIGKILL  # killed and reaped: no process outlives the job


def test_a_failing_child_ends_this_process_after_the_grace_period(monkeypatch):
    """A child failed: this process gets the grace period, then the other children and this process are killed
    (the kill of this process is recorded here instead of delivered)."""
    from lightning_mtraining.strategies import launchers

    killed_self = []
    real_kill = os.kill

    def kill(pid, sig):
        if pid == os.getpid():
            killed_self.append(sig)
        else:
            real_kill(pid, sig)

    monkeypatch.setattr(launchers.os, "kill", kill)
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    stalled = _sleeper()
    ranks = launchers.LocalRanks([failing, stalled], grace_s=0.5, poll_s=0.05)
    start = time.monotonic()
    ranks.start()
    ranks.join(timeout=60)
    assert not ranks.is_alive()
    assert killed_self == [signal.SIGKILL] and stalled.returncode == -signal.SIGKILL
    assert time.monotonic() - start >= 0.5  # not before the grace period


def test_at_exit_children_are_ended_only_after_an_uncaught_failure(monkeypatch):
    """Fabric's script goes on after fabric.launch(): at exit, children are ended if the script ends with an uncaught
    exception (sys.last_value), and left alone after a clean end."""
    from lightning_mtraining.strategies.launchers import LocalRanks

    child = _sleeper()
    try:
        monkeypatch.delattr(sys, "last_value", raising=False)
        LocalRanks([child], grace_s=0.2).end_if_this_failed()
        assert child.poll() is None  # a clean end: the child is not this process's to end
        monkeypatch.setattr(sys, "last_value", ValueError("uncaught"), raising=False)
        LocalRanks([child], grace_s=0.2).end_if_this_failed()
        assert child.returncode == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# Note [The first failure speaks last]: the store protocol with in-process stores, the report's lines, and a process
# that is told (it prints one line, then nothing). The 2-rank Trainer run:
# tests/distributed/test_failures_across_ranks.py.

def _store():
    from datetime import timedelta

    import torch.distributed as dist

    from helpers.dist import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    return server, lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))


def test_exactly_one_rank_records_the_first_failure_and_the_others_learn_it():
    from lightning_mtraining.core.errors import FailureWatch, FirstFailure

    server, client = _store()
    ranks = [FailureWatch(client(), rank, 3) for rank in range(3)]
    assert ranks[0].first() is None
    first = ranks[2].claim(_raised("rank 2 fails"), step=2, stage="fit")
    assert first == FirstFailure(2, 2, "fit", "ValueError: rank 2 fails")
    assert ranks[1].claim(_raised("connection closed"), step=2) == first  # a consequence: the record stands
    assert ranks[2].claim(_raised("again")) == first and ranks[0].first() == first
    assert not ranks[2].wait_for_the_others(timeout=0.2)  # nobody has said their line yet
    for rank in (0, 1):
        ranks[rank].store.add("lightning_mtraining/first_failure/told", 1)  # what tell() does last
    assert ranks[2].wait_for_the_others(timeout=0.2)
    assert first.where() == " at step 2" and FirstFailure(0, 5, "validate", "x").where() == " at step 5 (validate)"


def test_the_first_failures_report_is_short_names_the_users_frame_its_rank_and_step():
    from lightning_mtraining.core.errors import FULL_TRACEBACK_ENV, FirstFailure, format_first_failure

    def training_step():
        raise RuntimeError("rank 1 fails at step 2\nsecond line")

    try:
        training_step()
    except RuntimeError as e:
        exc = e
    text = format_first_failure(exc, FirstFailure(1, 2, "fit", "RuntimeError: rank 1 fails at step 2"), 2)
    lines = text.splitlines()
    assert all(line.startswith("[rank1]: ") for line in lines) and len(lines) < 30
    assert any("test_failures.py" in line and "in training_step" in line for line in lines), text
    assert lines[-3:-1] == ["[rank1]: RuntimeError: rank 1 fails at step 2", "[rank1]: second line"], text
    assert lines[-1].startswith("[rank1]: rank 1 failed first at step 2; the other ranks stopped with one line each")
    assert f"{FULL_TRACEBACK_ENV}=1" in lines[-1]
    alone = format_first_failure(exc, FirstFailure(1, 2, "fit", "x"), 2, told=False).splitlines()[-1]
    assert "not every other rank answered (ended already, or stuck)" in alone
    deep = _raised("x" * 50 + "\n" * 40)  # a long message is cut
    assert len(format_first_failure(deep, FirstFailure(0, None, None, "x"), 2).splitlines()) < 30


_TOLD = """
import sys
from datetime import timedelta
import torch.distributed as dist
from lightning_mtraining.core.errors import FailureWatch, FirstFailure

watch = FailureWatch(dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=5)), 0, 2)
watch.start()  # its thread finds the record and tells
watch._thread.join(timeout=30)
print("printed after being told", flush=True)
sys.stderr.write("a consequence\\n")
"""


def test_a_told_rank_prints_one_line_then_nothing():
    import json

    server, client = _store()
    server.set("lightning_mtraining/first_failure", json.dumps(
        {"rank": 1, "step": 2, "stage": "fit", "summary": "RuntimeError: rank 1 fails at step 2"}))
    run = subprocess.run([sys.executable, "-c", _TOLD, str(server.port)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "" and run.stderr == (
        "[rank0]: ending: rank 1 failed first at step 2 (RuntimeError: rank 1 fails at step 2)\n"), run
    assert server.add("lightning_mtraining/first_failure/told", 0) == 1  # it acknowledged


def test_a_failed_collective_names_the_ranks_that_did_not_arrive(monkeypatch):
    """Note [Who did not arrive]: each rank's watch publishes the collectives it entered; the rank whose collective
    fails names those with a lower count (with their last collective and step, and how long ago they were heard), the
    furthest behind first, and those at the same count in another operation, at most MAX_NAMED of each kind."""
    import json
    import time

    import lightning_mtraining.core.errors as errors
    from lightning_mtraining.core.errors import MAX_NAMED, FailureWatch, Place, who_did_not_arrive

    server, client = _store()
    store = client()
    now = time.time()
    places = {1: Place(4, "the probe queries' all-reduce (1, 4, 64, 16)", 3, now),  # arrived
              2: Place(3, "the slash partials' reduce-scatter", 3, now - 1),  # behind, heard 1 s ago
              3: Place(0, "", None, now - 60),  # started, silent since: ended?
              4: Place(4, "a stray all-reduce", 3, now)}  # the same count, another op
    for rank, place in places.items():
        store.set(f"lightning_mtraining/place/{rank}", json.dumps(place.__dict__))
    monkeypatch.setattr(errors, "_WATCH", FailureWatch(store, 0, 5, poll_s=0.01))
    text = who_did_not_arrive(4, "the probe queries' all-reduce (1, 4, 64, 16)")
    # the furthest behind first: rank 3 (no collective) before rank 2 (one collective short)
    assert text == ("did not arrive: rank 3 (in no collective yet; silent for 60 s: ended?), rank 2 (last in "
                    "collective 3, the slash partials' reduce-scatter at step 3; last heard 1 s ago); ran different "
                    "work: rank 4 (in a stray all-reduce at step 3; last heard 0 s ago)"), text
    # more ranks behind than are named: the furthest behind are named, the rest counted
    world = MAX_NAMED + 5
    for rank in range(5, world):
        store.set(f"lightning_mtraining/place/{rank}", json.dumps(Place(2, "x", 3, now).__dict__))
    monkeypatch.setattr(errors, "_WATCH", FailureWatch(store, 0, world, poll_s=0.01))
    text = who_did_not_arrive(4, "the probe queries' all-reduce (1, 4, 64, 16)")
    behind, other = text.split("; ran different work: ")
    assert behind.startswith("did not arrive: rank 3 (in no collective yet; silent for 60 s: ended?), rank 5 (last in "
                             "collective 2, x at step 3; last heard 0 s ago), rank 6 ("), behind
    assert "rank 1 " not in behind and "rank 2 " not in behind  # arrived; the least behind, not among the first named
    assert behind.count("rank ") == MAX_NAMED and behind.endswith(f"and {2 + (world - 5) - MAX_NAMED} more")
    assert other == "rank 4 (in a stray all-reduce at step 3; last heard 0 s ago)"
    monkeypatch.setattr(errors, "_WATCH", None)
    assert who_did_not_arrive(4, "x") == ""  # no watch (one process, or no store): nothing to add


def test_entering_a_collective_counts_it_and_the_watch_publishes_the_place():
    import json

    from lightning_mtraining.core.errors import FailureWatch, entering_collective, note_step

    server, client = _store()
    watch = FailureWatch(client(), 1, 2)
    note_step(7)
    count = entering_collective("the ring's first transfer")
    watch.publish()
    got = json.loads(watch.store.get("lightning_mtraining/place/1"))
    assert (got["count"], got["op"], got["step"]) == (count, "the ring's first transfer", 7)
    assert entering_collective("next") == count + 1
