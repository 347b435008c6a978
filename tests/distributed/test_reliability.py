"""No silent hangs: a rank that stalls makes the others fail within the process group's timeout, and a rank that is
killed makes them fail at once, with an error that names the waiting rank and the operation (and, for a ring
transfer, its peer), and, where the job's failure watch runs, the rank that did not arrive with the collective it
was in (Note [Who did not arrive] in lightning_mtraining.core.errors). Gloo, CPU, 3 ranks."""

from __future__ import annotations

import datetime
import io
import time

import pytest
import torch
import torch.distributed as dist

from helpers.dist import run_distributed

TIMEOUT_S, STALL_S = 3, 8


def _ring_until_failure(rank: int, world_size: int, sparse: bool, timeout_s: float, misbehave) -> object:
    """Every rank runs one ring attention over a group with ``timeout_s``; rank 1 calls ``misbehave()`` instead
    (returning what it returns). The others return (seconds until the ring failed, the error) or "no error"."""
    from lightning_mtraining import SparsityConfig, ring_attention
    from lightning_mtraining.core.errors import watch_failures

    watch_failures(rank, world_size, store=dist.distributed_c10d._get_default_store())  # as the strategies do
    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=timeout_s))
    g = torch.Generator().manual_seed(rank)
    q, k = torch.randn(1, 2, 64, 8, generator=g), torch.randn(1, 2, 64, 8, generator=g)
    if rank == 1:
        return misbehave()
    sparsity = SparsityConfig(vertical_topk=2, slash_topk=2, last_q=8, tile_size=16) if sparse else None
    start = time.monotonic()
    try:
        ring_attention(q, k, k, group=group, block_size=16, sparsity=sparsity)
    except RuntimeError as err:
        return time.monotonic() - start, str(err)
    return "no error"


def _stall() -> str:
    time.sleep(STALL_S)  # never joins: a rank that hangs (a dead rank fails its peers at once instead)
    return "stalled"


def _stalled_worker(rank: int, world_size: int, sparse: bool):
    return _ring_until_failure(rank, world_size, sparse, TIMEOUT_S, _stall)


@pytest.mark.parametrize("sparse", [True])  # the dense ring's transfers: the killed-rank test below
def test_a_stalled_rank_fails_the_others_within_the_timeout_naming_the_op(sparse):
    results = run_distributed(_stalled_worker, 3, sparse, timeout=60)
    assert results[1] == "stalled"
    for rank in (0, 2):
        waited, message = results[rank]
        assert waited < TIMEOUT_S + 2, waited  # the group's timeout, not the stall (or forever)
        assert message.startswith(f"rank {rank}: "), message
        assert "timeout" in message, message
        if sparse:  # the pattern estimator's collective is the first to wait: it names the op and the group
            assert "all-gather" in message and "over a group of 3" in message, message
        else:  # a ring transfer names its peer: rank 0 sends to the stalled rank 1, rank 2 receives from it
            assert "ring attention's" in message and "rank 1" in message, message
        assert "(did not arrive: rank 1 (in no collective yet; last heard " in message, message


def _stray() -> str:
    from lightning_mtraining.core.collectives import named_failure

    try:  # a collective the others never join: this rank "ran different work"
        with named_failure("a stray all-reduce"):
            dist.all_reduce(torch.zeros(1))
    except RuntimeError:
        pass
    return "strayed"


def _stray_worker(rank: int, world_size: int, sparse: bool):
    return _ring_until_failure(rank, world_size, sparse, TIMEOUT_S, _stray)


def test_a_rank_in_another_collective_is_named_with_it():
    """Rank 1 enters a collective of its own while the others enter the estimator's first: at the same count, in
    another operation, it is named as having run different work, with that operation."""
    results = run_distributed(_stray_worker, 3, True, timeout=60)
    assert results[1] == "strayed"
    for rank in (0, 2):
        _, message = results[rank]
        assert "(ran different work: rank 1 (in a stray all-reduce; last heard " in message, message


KILL_AFTER_S = 1.0


def _die() -> None:
    import os
    import signal

    time.sleep(KILL_AFTER_S)  # the others are waiting on it by now
    os.kill(os.getpid(), signal.SIGKILL)  # dies as an OOM-killed or crashed rank does: no cleanup, no message


def _killed_worker(rank: int, world_size: int, sparse: bool):
    return _ring_until_failure(rank, world_size, sparse, 60, _die)


@pytest.mark.parametrize("sparse", [False, True])
def test_a_killed_rank_fails_the_others_at_once_naming_the_op(sparse):
    """A rank killed mid-step (SIGKILL) makes the others fail at once (its sockets close), well before the group's
    60 s timeout, with an error naming the waiting rank and the operation."""
    import queue as queue_lib

    from helpers.dist import context, free_port, start_ranks

    ctx = context()
    results = ctx.Queue()
    procs = start_ranks(ctx, _killed_worker, 3, free_port(), 60, results, (sparse,))
    got = {}
    try:
        for _ in range(2):
            rank, ok, payload = results.get(timeout=90)
            assert ok, payload
            got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    except queue_lib.Empty:
        pytest.fail(f"the surviving ranks did not finish within 90 s (got {sorted(got)}): a hang")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -9, procs[1].exitcode
    for rank in (0, 2):
        waited, message = got[rank]
        assert waited < 30, waited  # at once, not the group's 60 s timeout
        assert message.startswith(f"rank {rank}: "), message
        assert "A rank it waits on died, stalled or ran different work" in message, message
        if sparse:
            assert "over a group of 3" in message, message
        else:
            assert "ring attention's" in message, message
        # (in the dense ring the other survivor may be named too: it waits at an earlier transfer, for rank 1 as well)
        assert "did not arrive: " in message and "rank 1 (in no collective yet; " in message, message
