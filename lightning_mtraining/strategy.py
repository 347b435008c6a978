"""``MTrainingStrategy``: data parallel x context parallel training for the Lightning Trainer.

``Trainer(strategy="mtraining", devices=N, num_nodes=M)`` (or ``strategy=MTrainingStrategy(...)``) trains a
LightningModule wrapping a Hugging Face causal LM on sequences split over context-parallel (CP) ranks, with
ring attention (:mod:`lightning_mtraining.ring`) and no change to the module's code.

The world of ``M x N`` ranks is a named device mesh ``("dp", "cp")``; a CP group is ``cp`` consecutive global
ranks, so it stays inside a node whenever it fits (fast links)::

    world 8 = 2 nodes x 4 devices, context_parallel_size=4        context_parallel_size=8, inner_ring_size=4
    node 0: ranks 0 1 2 3  -> dp 0, cp 0..3                       cp group 0..7: inner rings {0..3} {4..7},
    node 1: ranks 4 5 6 7  -> dp 1, cp 0..3                       outer rings {0,4} {1,5} {2,6} {3,7}

What the strategy does, in order (Lightning calls these hooks):

1. ``setup_distributed``: Lightning's DDP process-group setup (launchers, cluster environments: torchrun,
   SLURM, Lightning multi-machine), then the mesh and, for a CP group spanning nodes, the inner (intra-node)
   and outer (inter-node) rings of hierarchical ring attention.
2. ``distributed_sampler_kwargs``: the DP rank and size, so every rank of a CP group reads the same sample.
3. ``setup``: every outermost ``transformers.PreTrainedModel`` in the LightningModule (built in ``__init__``
   or ``configure_model``) is validated and switched to ring attention, with a hook that supplies global
   ``position_ids``, globally shifted labels and the global target count (:mod:`lightning_mtraining.hf`);
   then DDP wraps the module: gradients are averaged over the whole mesh, which keeps every replica identical.
4. ``batch_to_device``: pads each batch to the layout's unit and gives this rank its shard
   (:mod:`lightning_mtraining.sharding`).

Losses: the loss a model returns has the exact full-sequence value on every rank (logged values and the
progress bar show it; ``sync_dist=True`` averages it over DP groups) and its gradient makes DDP's average the
exact gradient; see Note [Exact losses and gradients] in :mod:`lightning_mtraining.hf`.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from typing_extensions import override

from lightning_mtraining.hf import ContextParallelPlan, PreparedModel, find_hf_models, prepare_model
from lightning_mtraining.layouts import LAYOUTS
from lightning_mtraining.pattern import SparsityConfig
from lightning_mtraining.sharding import shard_batch

__all__ = [
    "ContextParallelMixin",
    "MTrainingStrategy",
    "build_context_parallel",
    "check_context_parallel_args",
    "resolve_context_parallel_size",
    "resolve_inner_ring_size",
]

log = logging.getLogger(__name__)


def check_context_parallel_args(
    context_parallel_size: int | str, inner_ring_size: int | None, layout: str, block_size: int
) -> None:
    """Validate the strategy arguments that do not depend on the world size."""
    if context_parallel_size != "auto" and (
        isinstance(context_parallel_size, bool) or not isinstance(context_parallel_size, int)
        or context_parallel_size < 1
    ):
        raise ValueError(f"context_parallel_size must be 'auto' or a positive int, got {context_parallel_size!r}")
    if inner_ring_size is not None and (not isinstance(inner_ring_size, int) or inner_ring_size < 1):
        raise ValueError(f"inner_ring_size must be None or a positive int, got {inner_ring_size!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def resolve_context_parallel_size(context_parallel_size: int | str, world_size: int) -> int:
    """``"auto"`` -> the whole world; an int must divide the world size (the rest is data parallel)."""
    if context_parallel_size == "auto":
        return world_size
    if world_size % context_parallel_size:
        raise ValueError(
            f"context_parallel_size={context_parallel_size} does not divide the world size {world_size} "
            f"(num_nodes x devices); choose a divisor of {world_size} (the data-parallel size is "
            f"world_size / context_parallel_size), or 'auto' for one CP group over all ranks"
        )
    return context_parallel_size


def resolve_inner_ring_size(inner_ring_size: int | None, cp_size: int, ranks_per_node: int) -> int:
    """Ranks per inner (intra-node) ring; equal to ``cp_size`` means a flat ring.

    ``None``: one node's ranks when the CP group spans several whole nodes, else the whole CP group.
    """
    if inner_ring_size is None:
        if cp_size > ranks_per_node and cp_size % ranks_per_node == 0:
            return ranks_per_node
        return cp_size
    if cp_size % inner_ring_size:
        raise ValueError(
            f"inner_ring_size={inner_ring_size} does not divide context_parallel_size={cp_size}; the CP group is "
            "split into equal inner rings (one per node by default: inner_ring_size=None)"
        )
    return inner_ring_size


def build_context_parallel(
    device_type: str,
    world_size: int,
    cp_size: int,
    inner_size: int,
    layout: str,
    block_size: int,
) -> tuple[DeviceMesh | None, ContextParallelPlan]:
    """The ``("dp", "cp")`` device mesh and this rank's :class:`ContextParallelPlan` (collective: all ranks call).

    Without an initialised process group (world size 1) there is no mesh and the plan is a single rank.
    """
    if not dist.is_initialized():
        if world_size != 1:
            raise RuntimeError(f"world size {world_size} but torch.distributed is not initialised")
        return None, ContextParallelPlan(0, 1, layout, block_size)
    dp_size = world_size // cp_size
    mesh = init_device_mesh(device_type, (dp_size, cp_size), mesh_dim_names=("dp", "cp"))
    cp_mesh = mesh["cp"]
    inner_group = outer_group = None
    if 1 < inner_size < cp_size:
        rings = init_device_mesh(
            device_type, (dp_size, cp_size // inner_size, inner_size), mesh_dim_names=("dp", "cp_outer", "cp_inner")
        )
        inner_group, outer_group = rings["cp_inner"].get_group(), rings["cp_outer"].get_group()
    plan = ContextParallelPlan(
        cp_rank=cp_mesh.get_local_rank(),
        cp_size=cp_size,
        layout=layout,
        block_size=block_size,
        group=cp_mesh.get_group(),
        inner_group=inner_group,
        outer_group=outer_group,
    )
    return mesh, plan


def restore_batch_type(original: Any, sharded: dict[str, Any]) -> Any:
    """``sharded`` as the mapping type of ``original`` when it can be rebuilt from a dict (e.g. BatchEncoding)."""
    if type(original) is dict:
        return sharded
    try:
        return type(original)(sharded)
    except Exception:  # noqa: BLE001 - an exotic mapping type: a plain dict is still a valid batch
        return sharded


class ContextParallelMixin:
    """What the Trainer and Fabric strategies share: sizes, the mesh, model preparation and batch sharding.

    Mixed into a DDP strategy (which provides ``world_size``, ``global_rank``, ``num_processes``, ``root_device``).
    """

    def _init_context_parallel(
        self,
        context_parallel_size: int | str,
        inner_ring_size: int | None,
        layout: str,
        block_size: int,
        sparsity: SparsityConfig | None,
    ) -> None:
        check_context_parallel_args(context_parallel_size, inner_ring_size, layout, block_size)
        self._context_parallel_size = context_parallel_size
        self._inner_ring_size = inner_ring_size
        self.layout = layout
        self.block_size = block_size
        self.sparsity = sparsity
        self._device_mesh: DeviceMesh | None = None
        self._plan: ContextParallelPlan | None = None
        self._prepared: list[PreparedModel] = []

    @property
    def is_distributed(self) -> bool:
        # Lightning injects a DistributedSampler and makes sync_dist reduce only for distributed strategies.
        return True

    @property
    def cp_size(self) -> int:
        return resolve_context_parallel_size(self._context_parallel_size, self.world_size)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.global_rank % self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.global_rank // self.cp_size

    @property
    def inner_ring_size(self) -> int:
        return resolve_inner_ring_size(self._inner_ring_size, self.cp_size, max(self.num_processes, 1))

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("dp", "cp")`` mesh; available once the process group is set up."""
        if self._device_mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}.device_mesh is created when the process group is set up (Trainer: at fit/"
                "validate/test/predict; Fabric: at launch) and is not available yet; at world size 1 there is none"
            )
        return self._device_mesh

    @property
    def plan(self) -> ContextParallelPlan:
        """This rank's context-parallel plan (CP rank/size/group, layout) and the batch being processed."""
        if self._plan is None:
            raise RuntimeError(f"{type(self).__name__}.plan is available once the process group is set up")
        return self._plan

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All ranks of one CP group read the same sample; DP groups read different ones.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def _build_context_parallel(self) -> None:
        cp_size, inner = self.cp_size, self.inner_ring_size  # raise on bad sizes before any collective
        self._device_mesh, self._plan = build_context_parallel(
            self.root_device.type, self.world_size, cp_size, inner, self.layout, self.block_size
        )
        log.info(
            f"{type(self).__name__}: world {self.world_size} = dp {self.dp_size} x cp {cp_size} (inner ring {inner}),"
            f" rank {self.global_rank} -> dp {self.dp_rank}, cp {self._plan.cp_rank}"
        )

    def prepare_models(self, module: torch.nn.Module, layer_sparsity: Callable[[int], Any] | None = None) -> None:
        """Switch every outermost Hugging Face model inside ``module`` to ring attention (idempotent)."""
        if self._prepared:
            return
        if layer_sparsity is None:
            layer_sparsity = lambda layer_idx: self.sparsity  # noqa: E731
        models = find_hf_models(module)
        if not models:
            raise ValueError(
                f"{type(module).__name__} contains no transformers PreTrainedModel: {type(self).__name__} switches "
                "Hugging Face causal LMs (attn_implementation) to ring attention. For a custom model, call "
                "lightning_mtraining.ring_attention in its attention and use the sharded batch's position_ids"
            )
        self._prepared = [prepare_model(m, self.plan, layer_sparsity) for m in models]

    def restore_models(self) -> None:
        """Undo :meth:`prepare_models`: hooks removed, previous attention implementation back."""
        for prepared in self._prepared:
            prepared.restore()
        self._prepared = []
        if self._plan is not None:
            self._plan.current = None

    def shard_batch(self, batch: Any) -> Any:
        """Pad and shard ``batch`` (already on this rank's device) for this rank; records it for the model hook."""
        plan = self.plan
        sharded = shard_batch(
            batch, cp_rank=plan.cp_rank, cp_size=plan.cp_size, layout=plan.layout, block_size=plan.block_size
        )
        plan.current = sharded
        return restore_batch_type(batch, sharded.batch)


class MTrainingStrategy(ContextParallelMixin, DDPStrategy):
    """Data parallel x context parallel (ring attention) strategy for the Lightning ``Trainer``.

    Args:
        context_parallel_size: ranks that share one sequence; ``"auto"`` = all ranks. Must divide
            ``num_nodes x devices``; the quotient is the data-parallel size.
        inner_ring_size: ranks of one inner ring of hierarchical ring attention; ``None`` = one node's ranks
            when the CP group spans several nodes (flat ring otherwise).
        layout: token layout of the shards (``"striped"`` balances causal and vertical-slash work).
        block_size: block of the striped layout (sequences are padded to ``cp_size x block_size``).
        sparsity: vertical-slash budgets for sparse ring attention, or ``None`` for dense (exact) attention.
            Per-layer overrides: :class:`~lightning_mtraining.callback.SparseAttentionCallback`.
        process_group_backend: ``None`` picks gloo on CPU, nccl on CUDA.
        timeout: process-group timeout.
        start_method: how Lightning starts processes (as in ``DDPStrategy``).
        **kwargs: passed to ``torch.nn.parallel.DistributedDataParallel``.
    """

    strategy_name = "mtraining"

    def __init__(
        self,
        context_parallel_size: int | Literal["auto"] = "auto",
        inner_ring_size: int | None = None,
        layout: Literal["striped", "zigzag", "contiguous"] = "striped",
        block_size: int = 128,
        sparsity: SparsityConfig | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        check_context_parallel_args(context_parallel_size, inner_ring_size, layout, block_size)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._init_context_parallel(context_parallel_size, inner_ring_size, layout, block_size, sparsity)

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._build_context_parallel()

    def _layer_sparsity(self, trainer: Any) -> Callable[[int], Any]:
        from lightning_mtraining.callback import SparseAttentionCallback

        callbacks = [cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, SparseAttentionCallback)]
        if len(callbacks) > 1:
            raise ValueError(f"found {len(callbacks)} SparseAttentionCallback instances; pass at most one")
        if callbacks:
            return callbacks[0].layer_sparsity_fn(self.sparsity)
        return lambda layer_idx: self.sparsity

    @override
    def setup(self, trainer: Any) -> None:
        # After configure_model, before DDP wraps the module: models built in configure_model are covered.
        assert self.model is not None
        self.prepare_models(self.model, self._layer_sparsity(trainer))
        super().setup(trainer)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.shard_batch(batch)

    @override
    def teardown(self) -> None:
        self.restore_models()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Data parallel x context parallel (MTraining ring attention)"
        )


def _register() -> None:
    if MTrainingStrategy.strategy_name not in StrategyRegistry:
        MTrainingStrategy.register_strategies(StrategyRegistry)


_register()
