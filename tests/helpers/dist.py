"""Run a function on N CPU processes joined by a gloo process group, and collect what each returns.

Shared by every multi-process test. ``fn(rank, world_size, *args)`` must be a module-level
function (it is pickled by reference). Results come back as a list indexed by rank; an
exception in any rank is re-raised here with that rank's traceback, and a rank that does not
finish within ``timeout`` seconds fails the test instead of hanging it.

Ranks start from a fork server (:func:`context`): one process, started once a test session, imports torch, Lightning,
transformers and this package, and every rank is forked from it, so a rank starts in a fraction of a second instead
of the ~4 s of CPU those imports take, while still starting from a process no test has run in (the server runs no
test code, and starts no thread). Each rank then takes the environment, working directory and ``sys.path`` of the
test that started it, as a spawned process would. ``MTRAINING_TEST_START_METHOD=spawn`` starts every rank as a fresh
interpreter instead.
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


# What the fork server imports once: what every rank's test code imports anyway (the tiny models' two most used
# families included, whose modules transformers imports on first use).
_PRELOAD = [
    "torch", "torch.distributed", "lightning", "lightning.pytorch", "lightning.fabric", "transformers",
    "transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama", "lightning_mtraining",
    "pytest", "helpers.training",
]


def context():
    """The multiprocessing context ranks start from: the fork server (see the module's docstring) where the platform
    has one, else spawn."""
    method = os.environ.get("MTRAINING_TEST_START_METHOD", "forkserver")
    if method == "forkserver" and method in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def start_ranks(ctx, fn: Callable[..., Any], world_size: int, port: int, timeout: float, queue, args: tuple = (),
                kwargs: dict[str, Any] | None = None) -> list:
    """Start ``world_size`` daemon processes running ``fn`` as ranks of one gloo group on ``port``; each puts
    ``(rank, ok, payload)`` on ``queue``."""
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, timeout, queue, args, kwargs or {}, env),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def _worker(fn, rank, world_size, port, timeout, queue, args, kwargs, env):
    # A forked rank holds the fork server's environment: take the starting test's, as a spawned process would.
    os.environ.clear()
    os.environ.update(env)
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
    ctx = context()
    queue = ctx.Queue()
    procs = start_ranks(ctx, fn, world_size, free_port(), timeout, queue, args, kwargs)
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
