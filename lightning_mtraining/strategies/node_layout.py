"""The strategies' runtime check of the world a launcher gives them: every process must sit on the node, and be the
local rank, that ``Trainer(devices=..., num_nodes=...)`` makes it, or the rings would straddle nodes.

Note [Launchers and cluster environments]
-----------------------------------------
The strategies never read launcher variables themselves: Lightning picks a cluster environment at ``Trainer(...)``
(or ``Fabric(...)``), the first that detects itself in the order below (LSF and MPI come between SLURM and the
default), and the strategy takes the world size, the global rank and the node rank from it::

    launcher                      detected as (by)                      what Lightning reads
    ----------------------------  ------------------------------------  --------------------------------------------
    torchrun --nnodes N            TorchElasticEnvironment               RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK
      --nproc-per-node G           (TORCHELASTIC_RUN_ID is set)          (the node), MASTER_ADDR, MASTER_PORT
    srun (SLURM), N nodes with     SLURMEnvironment                      SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS,
      --ntasks-per-node G          (SLURM_NTASKS is set, job name not    SLURM_NODEID; MASTER_ADDR is the first host
                                   "bash" or "interactive")              of SLURM_NODELIST, MASTER_PORT from the job id
    Lightning Studio multi-        LightningEnvironment (the default)    NODE_RANK, MASTER_ADDR, MASTER_PORT; Lightning
      machine job, or plain                                              starts the machine's G processes itself (the
      ``python`` on each machine                                         others with LOCAL_RANK set)

``Trainer(devices=G, num_nodes=N)`` says how many processes a node runs and how many nodes there are. Lightning
checks ``G x N`` against torchrun's WORLD_SIZE and, under SLURM, ``G`` against ``--ntasks-per-node`` and ``N``
against ``--nodes``. A CP group is ``cp`` consecutive global ranks and an inner ring ``inner_ring_size`` consecutive
ranks of it, so they stay inside a node only if node ``n`` holds global ranks ``n G .. n G + G - 1``. The strategies
check exactly that at ``Trainer(...)`` / ``Fabric(...)``, before any process group or other work
(:func:`check_launcher_layout`), in both directions:

- ``devices`` below the launcher's processes per node: ``Trainer(devices=1, num_nodes=2)`` under ``torchrun
  --nproc-per-node 2`` on one machine passes Lightning's world check (1 x 2 = 2), and then local rank 1 has no device
  (Lightning's bare ``IndexError`` without this check);
- ``devices`` above them: ``Trainer(devices=2, num_nodes=1)`` under ``torchrun --nnodes 2 --nproc-per-node 1``, or
  ``devices=8, num_nodes=1`` under ``--nnodes 2 --nproc-per-node 4``: global rank 1 runs on node 1, but the strategy
  would take node 0 to hold it;
- ranks numbered round-robin over nodes (``srun --distribution=cyclic``).

Where the launcher says how many processes it started per node and how many nodes (torchrun's ``LOCAL_WORLD_SIZE``
and ``GROUP_WORLD_SIZE``), every rank finds the mismatch alike and it is reported once (Note [Failures that speak
once] in :mod:`lightning_mtraining.core.errors`); otherwise each rank checks its own node and local rank.

With ``num_nodes > 1`` and ``inner_ring_size=None``, a CP group that spans nodes runs the hierarchical ring with its
inner rings inside a node (:func:`~lightning_mtraining.distributed.mesh.resolve_inner_ring_size`), and rank 0's
mesh line says where each ring runs, e.g. ``world 32 (4 nodes x 8) = dp 1 x cp 32, hierarchical ring: 4 outer
(across nodes) x 8 inner (within a node), striped layout (block 128)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightning_mtraining.core.errors import mark_same_on_ranks

__all__ = ["check_launcher_layout", "check_node_layout"]

_FIX = ("Set devices to the processes the launcher starts on each node (torchrun --nproc-per-node, SLURM "
        "--ntasks-per-node) and num_nodes to the number of nodes (torchrun --nnodes, SLURM --nodes); under SLURM keep "
        "the default block distribution of tasks (not --distribution=cyclic)")


def check_node_layout(node_rank: int, global_rank: int, ranks_per_node: int, num_nodes: int, environment: str,
                      owner: str) -> None:
    """Raise ValueError when this rank runs on another node than ``global_rank // ranks_per_node``, the node the
    strategy cuts CP groups and inner rings by (Note [Launchers and cluster environments]).

    ``node_rank``: the node the cluster environment (named ``environment``) reports for this process;
    ``ranks_per_node`` and ``num_nodes``: ``Trainer(devices=..., num_nodes=...)``.
    """
    expected = global_rank // ranks_per_node
    if node_rank == expected:
        return
    raise ValueError(
        f"{owner}: global rank {global_rank} runs on node {node_rank} ({environment}), but with devices="
        f"{ranks_per_node} and num_nodes={num_nodes} the strategy takes node {expected} to hold ranks "
        f"{expected * ranks_per_node}..{expected * ranks_per_node + ranks_per_node - 1}: its context-parallel groups "
        f"and inner rings would straddle nodes. {_FIX}"
    )


def launcher_counts(env: Mapping[str, str] | None = None) -> tuple[int | None, int | None]:
    """``(processes per node, nodes)`` as the launcher states them (torchrun: ``LOCAL_WORLD_SIZE``,
    ``GROUP_WORLD_SIZE``); None for what it does not state."""
    env = os.environ if env is None else env

    def read(name: str) -> int | None:
        value = env.get(name, "")
        return int(value) if value.isdigit() else None

    return read("LOCAL_WORLD_SIZE"), read("GROUP_WORLD_SIZE")


def check_launcher_layout(environment: Any, devices: int, num_nodes: int, owner: str,
                          env: Mapping[str, str] | None = None) -> None:
    """Raise ValueError, before any process group exists, when the processes a launcher started do not sit where
    ``devices`` and ``num_nodes`` put them (Note [Launchers and cluster environments]).

    Checks only processes started by others (torchrun, SLURM, MPI: ``environment.creates_processes_externally``);
    Lightning's own launcher starts ``devices`` processes per node and numbers them as the strategy does.

    Args:
        environment: Lightning's cluster environment for this process.
        devices, num_nodes: the Trainer's (or Fabric's).
        owner: the strategy's name, for the message.
        env: the environment variables (default ``os.environ``).
    """
    if not getattr(environment, "creates_processes_externally", False):
        return
    name = type(environment).__name__
    per_node, nodes = launcher_counts(env)
    if (per_node is not None and per_node != devices) or (nodes is not None and nodes != num_nodes):
        started = f"{per_node} processes on each node" if per_node is not None else "its processes"
        over = f" over {nodes} node{'s' * (nodes != 1)}" if nodes is not None else ""
        error = ValueError(
            f"{owner}: the launcher ({name}) started {started}{over} (LOCAL_WORLD_SIZE={per_node}, GROUP_WORLD_SIZE="
            f"{nodes}), but the Trainer has devices={devices} and num_nodes={num_nodes}; the strategy cuts its "
            f"context-parallel groups and inner rings by node from these, so they would straddle nodes. Use devices="
            f"{per_node if per_node is not None else '<processes per node>'} and num_nodes="
            f"{nodes if nodes is not None else '<nodes>'}"
        )
        # every rank reads the same launcher counts and Trainer arguments: reported once, by rank 0
        raise mark_same_on_ranks(error, environment.global_rank(), 0, max(environment.world_size(), 1), "every rank")
    local_rank, global_rank, node_rank = environment.local_rank(), environment.global_rank(), environment.node_rank()
    if local_rank >= devices:
        raise ValueError(
            f"{owner}: this process is local rank {local_rank} (global rank {global_rank}, node {node_rank}, {name}), "
            f"but with devices={devices} a node runs local ranks 0..{devices - 1} only: the launcher starts more "
            f"processes per node than devices says. {_FIX}"
        )
    check_node_layout(node_rank, global_rank, devices, num_nodes, name, owner)
