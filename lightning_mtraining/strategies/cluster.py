"""Job tooling, from "N machines of G GPUs" to a running job: a plan written as a LightningCLI config, a dry run that
builds every rank's strategy and mesh for a cluster shape in one CPU process (:func:`simulate_cluster`), the launch
commands of each launcher, and an optional Lightning Studio job submission. Nothing here runs inside a training job;
the check a running strategy makes of its launcher's world is :mod:`lightning_mtraining.strategies.node_layout`
(Note [Launchers and cluster environments] there: which world each launcher gives the strategy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_mtraining.core.checks import is_int
from lightning_mtraining.distributed.mesh import resolve_context_parallel_size, resolve_inner_ring_size
from lightning_mtraining.hf.parallel import check_sparsity_args
from lightning_mtraining.sparsity.config import PAPER_SPARSITY, SparsityConfig
from lightning_mtraining.strategies.node_layout import check_node_layout  # its home before the split; still here
from lightning_mtraining.strategies.options import ContextParallelOptions

__all__ = [
    "SimulatedRank",
    "check_node_layout",
    "cli_command",
    "describe_simulation",
    "launch_commands",
    "machine_gpus",
    "simulate_cluster",
    "sparsity_init",
    "studio_job_request",
    "submit_studio_job",
    "to_yaml",
    "trainer_config",
]


def sparsity_init(sparsity: SparsityConfig | None) -> dict[str, Any] | None:
    """``sparsity`` as LightningCLI writes a class: ``{"class_path": ..., "init_args": {...}}`` (``None``: dense).

    ``init_args`` holds the selection mode's own budgets (``top_p`` and the caps, or the two top-k budgets) and every
    other field that differs from its default, so the config reads as what it trains with.
    """
    if sparsity is None:
        return None
    if not isinstance(sparsity, SparsityConfig):
        raise TypeError(f"sparsity must be a SparsityConfig or None, got {type(sparsity).__name__}")
    mode = ("top_p", "max_vertical", "max_slash") if sparsity.top_p is not None else ("vertical_topk", "slash_topk")
    args: dict[str, Any] = {}
    for field in dataclasses.fields(SparsityConfig):
        value = getattr(sparsity, field.name)
        if field.name == "budgets" and value is not None:  # normalised to ((layer, ((v, s), ...)), ...)
            value = {layer: pairs for layer, pairs in value}
        if field.name in mode or value != field.default:
            args[field.name] = _plain(value)
    return {"class_path": "lightning_mtraining.SparsityConfig", "init_args": args}


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists, all the way down (YAML writes lists; the config classes take either)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def trainer_config(
    *,
    nodes: int,
    devices: int,
    context_parallel_size: int,
    inner_ring_size: int | None = None,
    layout: str = "striped",
    block_size: int = 128,
    sparsity: SparsityConfig | None = PAPER_SPARSITY,
    activation_checkpointing: bool = True,
    offload_activations: bool | int = False,
    tiled_mlp: int | None = None,
    fsdp: bool = False,
    accelerator: str = "gpu",
    precision: str = "bf16-mixed",
    **trainer_args: Any,
) -> dict[str, Any]:
    """The ``trainer:`` section of a LightningCLI config that runs the mtraining strategy on ``nodes`` machines of
    ``devices`` processes each.

    Args:
        nodes: machines (``Trainer(num_nodes=...)``).
        devices: processes per machine, one per GPU (``Trainer(devices=...)``).
        context_parallel_size: ranks sharing one sequence; must divide ``nodes x devices`` (the rest is data
            parallel).
        inner_ring_size: ranks of an inner ring of the hierarchical ring (written out, so the config says which
            ring runs); ``None``: the strategy's default for this world (inner rings inside a node).
        layout, block_size, sparsity, activation_checkpointing, offload_activations, tiled_mlp: the strategy's
            options (``tiled_mlp`` written only when set).
        fsdp: ``MTrainingFSDPStrategy`` (parameters, gradients and optimizer state sharded over all ranks) instead
            of ``MTrainingStrategy`` (replicated, DDP).
        accelerator, precision: the Trainer's.
        **trainer_args: further Trainer arguments (``max_steps=...``), written after the others.

    Raises ValueError (with the values) when the CP size does not divide the world, the inner ring the CP size, or
    an option is one the strategy would refuse.
    """
    for name, value in (("nodes", nodes), ("devices", devices), ("context_parallel_size", context_parallel_size)):
        if not is_int(value):
            raise ValueError(f"trainer_config: {name} must be a positive int, got {value!r}")
    world = nodes * devices
    cp = resolve_context_parallel_size(context_parallel_size, world)
    inner = resolve_inner_ring_size(inner_ring_size, cp, devices)
    owner = "trainer_config"
    ContextParallelOptions(context_parallel_size=cp, inner_ring_size=inner, layout=layout, block_size=block_size,  # type: ignore[arg-type]
                           sparsity=sparsity, activation_checkpointing=activation_checkpointing,
                           offload_activations=offload_activations, tiled_mlp=tiled_mlp, owner=owner)
    check_sparsity_args(owner, [sparsity], layout, block_size)
    strategy = "MTrainingFSDPStrategy" if fsdp else "MTrainingStrategy"
    init_args: dict[str, Any] = {
        "context_parallel_size": cp,
        "inner_ring_size": inner,
        "layout": layout,
        "block_size": block_size,
        "sparsity": sparsity_init(sparsity),
        "activation_checkpointing": activation_checkpointing,
        "offload_activations": offload_activations,
    }
    if tiled_mlp is not None:
        init_args["tiled_mlp"] = tiled_mlp
    return {
        "accelerator": accelerator,
        "devices": devices,
        "num_nodes": nodes,
        "precision": precision,
        "strategy": {"class_path": f"lightning_mtraining.{strategy}", "init_args": init_args},
        **trainer_args,
    }


def to_yaml(config: Mapping[str, Any], comments: str | Sequence[str] = ()) -> str:
    """``config`` as YAML in its own key order, under ``comments`` (each line written as a ``#`` comment)."""
    import yaml  # a dependency of Lightning (LightningCLI reads YAML with it)

    lines = comments.splitlines() if isinstance(comments, str) else list(comments)
    header = "".join(f"# {line}".rstrip() + "\n" for line in lines)
    return header + yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False, width=110)


def cli_command(config_path: str | Path, script: str = "examples/cli.py", python: str = "python") -> str:
    """``python examples/cli.py fit --config PATH``: the command every launcher below runs on each machine."""
    return f"{python} {shlex.quote(str(script))} fit --config {shlex.quote(str(config_path))}"


def launch_commands(
    script_args: str,
    *,
    nodes: int,
    devices: int,
    master_port: int = 29500,
    machine: str = "H100_X_8",
    studio: str = "MY_STUDIO",
    name: str = "mtraining",
) -> dict[str, str]:
    """How to start ``script_args`` (a script and its arguments, e.g. ``examples/cli.py fit --config plan.yaml``) on
    ``nodes`` machines of ``devices`` processes, keyed by launcher:

    - ``"python"``: one machine; Lightning starts the ``devices`` processes itself;
    - ``"studio"``: a Lightning Studio multi-machine job (the ``lightning`` command of the Lightning SDK; the platform
      runs the command once per machine, Lightning starts the processes there);
    - ``"torchrun"``: run on every node, with ``NODE_RANK`` (0 .. nodes - 1) and ``MASTER_ADDR`` (node 0's address)
      set in the shell;
    - ``"slurm"``: run inside an allocation of ``nodes`` nodes (``sbatch`` / ``salloc``), one task per GPU.
    """
    python = f"python {script_args}"
    commands = {"python": python}
    commands["studio"] = (f"lightning job run --name {name} --num-machines {nodes} --machine {machine} "
                          f"--studio {studio} --command {shlex.quote(python)}")
    if nodes == 1:
        commands["torchrun"] = f"torchrun --nproc-per-node {devices} {script_args}"
    else:
        commands["torchrun"] = (f"torchrun --nnodes {nodes} --nproc-per-node {devices} --node-rank $NODE_RANK "
                                f"--master-addr $MASTER_ADDR --master-port {master_port} {script_args}")
    commands["slurm"] = f"srun --nodes {nodes} --ntasks-per-node {devices} {python}"
    return commands


def machine_gpus(machine: Any) -> int | None:
    """GPUs of a Lightning Studio machine: its ``accelerator_count`` (a ``lightning_sdk.Machine``), or from a name
    such as ``"H100_X_8"`` (8) or ``"H100"`` (1); ``None`` for a CPU machine (whose ``accelerator_count`` counts
    CPUs) or a name that says nothing."""
    name = str(getattr(machine, "name", machine)).upper()
    family = str(getattr(machine, "family", "") or "").upper()
    if name.startswith(("CPU", "DATA")) or family in ("CPU", "DATA-PREP"):
        return None
    count = getattr(machine, "accelerator_count", None)
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    found = re.search(r"_X_(\d+)$", name)
    if found:
        return int(found.group(1))
    return 1 if re.match(r"^[A-Z]+\d+", name) else None


def studio_job_request(
    command: str,
    *,
    name: str,
    machine: Any,
    num_machines: int,
    devices: int | None = None,
    studio: Any = None,
    teamspace: Any = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    **job_args: Any,
) -> dict[str, Any]:
    """The keyword arguments of ``lightning_sdk.Job.run`` for a job that runs ``command`` on ``num_machines``
    machines of type ``machine`` in the environment of ``studio`` (:func:`submit_studio_job` submits it).

    The platform starts ``command`` once on every machine; under Lightning's default cluster environment the Trainer
    reads the machine's rank and the main address from the variables the platform sets (Note [Launchers and cluster
    environments]) and starts one process per GPU. ``command`` must therefore be a plain ``python`` command whose
    Trainer has ``devices`` equal to the machine's GPUs and ``num_nodes`` equal to ``num_machines``.

    Args:
        command: the shell command, e.g. :func:`cli_command` ``("plan.yaml")``.
        name: the job's name (unique in the teamspace).
        machine: a ``lightning_sdk.Machine`` or its name, e.g. ``"H100_X_8"``.
        num_machines: machines (``num_nodes`` of the Trainer).
        devices: the Trainer's ``devices``; checked against the machine's GPUs when both are known.
        studio: the Studio (or its name) whose environment and files the job runs with; ``None`` lets the SDK pick
            the Studio this code runs in.
        teamspace: the teamspace (name or object); ``None``: the SDK's default.
        env: environment variables for the job.
        cwd: a folder to ``cd`` into first (the paths in ``command`` are relative to it).
        **job_args: other ``Job.run`` arguments (``interruptible=True``, ``max_runtime=...``), passed as they are.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"studio_job_request: name must be a non-empty string (the job's name), got {name!r}")
    if not isinstance(command, str) or not command.strip():
        raise ValueError(f"studio_job_request: command must be a non-empty shell command, got {command!r}")
    if not is_int(num_machines):
        raise ValueError(f"studio_job_request: num_machines must be a positive int, got {num_machines!r}")
    gpus = machine_gpus(machine)
    if devices is not None and gpus is not None and devices != gpus:
        raise ValueError(
            f"studio_job_request: the Trainer runs devices={devices} processes per machine but machine "
            f"{getattr(machine, 'name', machine)!r} has {gpus} GPUs; pick a machine with {devices} GPUs (e.g. "
            f"'H100_X_{devices}') or plan for {gpus} GPUs per node"
        )
    if cwd is not None:
        command = f"cd {shlex.quote(cwd)} && {command}"
    request: dict[str, Any] = {"name": name, "machine": machine, "command": command, "num_machines": num_machines}
    if studio is not None:
        request["studio"] = studio
    if teamspace is not None:
        request["teamspace"] = teamspace
    if env:
        request["env"] = dict(env)
    request.update(job_args)
    return request


def _lightning_sdk() -> Any:
    try:
        import lightning_sdk
    except ImportError as error:
        raise ImportError(
            "submit_studio_job needs the Lightning SDK, which is not installed: pip install lightning-sdk (or "
            "pip install 'lightning-mtraining[studio]'), then log in with `lightning login` or set "
            "LIGHTNING_USER_ID and LIGHTNING_API_KEY (inside a Studio they are set)"
        ) from error
    return lightning_sdk


def submit_studio_job(command: str, **request: Any) -> Any:
    """Submit a Lightning Studio (multi-machine) job that runs ``command``: ``lightning_sdk.Job.run(**``
    :func:`studio_job_request` ``(command, **request))``; returns the SDK's ``Job``. Needs ``lightning-sdk``
    (imported here, not at package import) and a Lightning AI login."""
    job_request = studio_job_request(command, **request)
    return _lightning_sdk().Job.run(**job_request)


# ---------------------------------------------------------------------------------------------------------------
# a dry run: every rank's strategy and mesh for a cluster shape, in one CPU process
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SimulatedRank:
    """What one rank of a simulated cluster built: its place (``rank``, ``node``, ``local_rank``), the global ranks
    of each of its mesh axes' groups (``groups``: axis name -> ranks, e.g. ``{"dp": (1, 9), "cp": (8, ..., 15)}``),
    its inner and outer rings (None for a flat ring), and the mesh line rank 0 logs (``mesh_line``)."""

    rank: int
    node: int
    local_rank: int
    groups: dict[str, tuple[int, ...]]
    inner: tuple[int, ...] | None
    outer: tuple[int, ...] | None
    mesh_line: str


_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                  "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def _as_torchrun_rank(rank: int, nodes: int, devices: int) -> Iterator[None]:
    """This process's environment as torchrun sets it for ``rank`` of ``nodes x devices`` (no main address: nothing
    connects), restored after."""
    world = nodes * devices
    values = dict(RANK=rank, LOCAL_RANK=rank % devices, GROUP_RANK=rank // devices, ROLE_RANK=rank, WORLD_SIZE=world,
                  LOCAL_WORLD_SIZE=devices, GROUP_WORLD_SIZE=nodes, ROLE_WORLD_SIZE=world,
                  TORCHELASTIC_RUN_ID="mtraining-dry-run")
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning_utilities.core import rank_zero as utilities_rank_zero

    saved = {name: os.environ.get(name) for name in _TORCHRUN_VARS}
    quiet = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in quiet]
    # the strategy sets the rank rank_zero_info prints on: this process's own once the simulated rank is done
    zero: list[tuple[Any, Any]] = [(module.rank_zero_only, getattr(module.rank_zero_only, "rank", None))
            for module in (fabric_rank_zero, utilities_rank_zero)]
    try:
        for name in _TORCHRUN_VARS:
            os.environ.pop(name, None)
        os.environ.update({name: str(value) for name, value in values.items()})
        for logger in quiet:  # the Trainer's device banner, once per simulated rank otherwise
            logger.setLevel(logging.WARNING)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
        for function, rank in zero:
            if rank is not None:
                function.rank = rank


def _fake_process_group(rank: int, world: int) -> None:
    """A process group of ``world`` ranks in which this process is ``rank`` and no collective communicates (torch's
    fake backend, registered by the module that defines it)."""
    import torch.distributed as dist

    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    except ImportError as error:
        raise RuntimeError(f"simulate_cluster needs torch's fake process group, which this torch lacks "
                           f"({error})") from error
    dist.init_process_group("fake", rank=rank, world_size=world, store=dist.HashStore())


def simulate_cluster(build_strategy: Callable[[], Any], nodes: int, devices: int) -> list[SimulatedRank]:
    """Build, in this process and on CPU, what each rank of a ``nodes x devices`` cluster builds: for every global
    rank, ``build_strategy()`` runs with that rank's torchrun environment (it constructs the Trainer or Fabric of the
    job, whose strategy then makes its checks before launch: sizes, sparsity, node layout), and the strategy builds
    its mesh and rings over a fake process group of the whole world (no communication, no GPU, nothing started).

    Args:
        build_strategy: returns the strategy of a Trainer (or Fabric) built as the job builds it, with a CPU
            accelerator.
        nodes, devices: the cluster shape (``Trainer(num_nodes=..., devices=...)``).

    Returns:
        each rank's :class:`SimulatedRank`, in rank order. Raises what the strategy raises on the first rank that
        fails.
    """
    import torch.distributed as dist

    from lightning_mtraining.distributed.mesh import describe_mesh

    if dist.is_initialized():
        raise RuntimeError("simulate_cluster builds its own process groups: call it where none is initialised")
    world, ranks = nodes * devices, []
    for rank in range(world):
        with _as_torchrun_rank(rank, nodes, devices):
            strategy = build_strategy()
            _fake_process_group(rank, world)
            try:
                strategy._build_context_parallel()
                mesh, plan = strategy.device_mesh, strategy.plan
                names = mesh.mesh_dim_names or ()
                groups = {name: tuple(dist.get_process_group_ranks(mesh.get_group(name))) for name in names}
                inner = tuple(dist.get_process_group_ranks(plan.inner_group)) if plan.inner_group else None
                outer = tuple(dist.get_process_group_ranks(plan.outer_group)) if plan.outer_group else None
                o = strategy.options
                line = describe_mesh(type(strategy).__name__, world, strategy.cp_size, strategy.inner_ring_size,
                                     o.layout, o.block_size, o.data_parallel_replicate_size, o.tensor_parallel_size,
                                     num_nodes=nodes)
            finally:
                strategy._release_process_groups()
                dist.destroy_process_group()
        ranks.append(SimulatedRank(rank, rank // devices, rank % devices, groups, inner, outer, line))
    return ranks


def _ranges(ranks: tuple[int, ...]) -> str:
    """``(8, 9, 10, 11)`` -> ``"8..11"``; ``(1, 9, 17)`` -> ``"1, 9, 17"``."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}..{ranks[-1]}"
    return ", ".join(map(str, ranks))


def describe_simulation(ranks: list[SimulatedRank], devices: int) -> list[str]:
    """What :func:`simulate_cluster` found, as lines: rank 0's mesh line, one line per rank (its groups and rings),
    and whether every CP group, or else every inner ring, stays inside a node (the slow link only between nodes)."""
    lines = [ranks[0].mesh_line]
    for r in ranks:
        groups = "; ".join(f"{name} [{_ranges(g)}]" for name, g in r.groups.items())
        rings = f"; inner ring [{_ranges(r.inner)}], outer ring [{_ranges(r.outer)}]" if r.inner and r.outer else ""
        lines.append(f"  rank {r.rank} (node {r.node}, local rank {r.local_rank}): {groups}{rings}")

    def inside_a_node(group: tuple[int, ...]) -> bool:
        return len({rank // devices for rank in group}) == 1

    if all(inside_a_node(r.groups.get("cp", (r.rank,))) for r in ranks):
        lines.append("every context-parallel group lies inside one node: its ring never crosses nodes")
    elif all(r.inner is not None and inside_a_node(r.inner) for r in ranks):
        lines.append("every inner ring lies inside one node: only the outer rings cross nodes")
    else:
        lines.append("WARNING: some rings cross nodes in every step (inner rings straddle nodes): set inner_ring_size "
                     "to the processes of one node, or leave it None")
    return lines
