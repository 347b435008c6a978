"""Run a function on N CPU processes joined by a gloo process group, and collect what each returns.

Shared by every multi-process test. ``fn(rank, world_size, *args)`` must be a module-level
function (spawn pickles it by reference). Results come back as a list indexed by rank; an
exception in any rank is re-raised here with that rank's traceback, and a rank that does not
finish within ``timeout`` seconds fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_lib
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, timeout, queue, args, kwargs):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world_size, *args, **kwargs)
        # Tensors are serialised to bytes: torch's shared-memory handoff through a Queue breaks when the
        # worker exits before the parent has read the result.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, timeout, queue, args, kwargs), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except queue_lib.Empty as e:
                raise TimeoutError(
                    f"distributed test did not finish within {timeout}s; got results from ranks {sorted(results)}"
                ) from e
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def hierarchical_groups(rank: int, world_size: int, inner_size: int):
    """``(inner_group, outer_group)`` of this rank for rings of ``inner_size`` ranks (CP rank = outer * inner_size +
    inner). Every rank must call it: it creates all the groups."""
    outer_size = world_size // inner_size
    inner = [dist.new_group([o * inner_size + i for i in range(inner_size)]) for o in range(outer_size)]
    outer = [dist.new_group([o * inner_size + i for o in range(outer_size)]) for i in range(inner_size)]
    o, i = divmod(rank, inner_size)
    return inner[o], outer[i]
