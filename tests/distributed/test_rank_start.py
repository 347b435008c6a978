"""The ranks of :func:`helpers.dist.run_distributed` start from the test that starts them, as spawned processes would:
its environment, working directory and ``sys.path``, and not the fork server's (which holds the environment of the
test that started it, once a session)."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from helpers.dist import run_distributed


def _where(rank: int, world_size: int) -> dict:
    return {"probe": os.environ.get("MTRAINING_RANK_START_PROBE"), "cwd": os.getcwd(), "path": list(sys.path),
            "pid": os.getpid(), "world": dist.get_world_size()}


def test_ranks_take_the_starting_tests_environment(monkeypatch, tmp_path):
    for value in ("first", "second"):  # the second start comes from the same fork server
        monkeypatch.setenv("MTRAINING_RANK_START_PROBE", value)
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path / value))
        got = run_distributed(_where, 2)
        assert [g["probe"] for g in got] == [value, value]
        assert [g["cwd"] for g in got] == [str(tmp_path)] * 2
        assert all(g["path"][0] == str(tmp_path / value) for g in got), [g["path"][:2] for g in got]
        assert [g["world"] for g in got] == [2, 2]
        assert len({g["pid"] for g in got} | {os.getpid()}) == 3
    monkeypatch.delenv("MTRAINING_RANK_START_PROBE")
    assert [g["probe"] for g in run_distributed(_where, 2)] == [None, None]
