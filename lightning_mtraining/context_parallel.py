"""What every mtraining strategy shares (Trainer with DDP or FSDP2, Fabric): the context-parallel sizes, the
``("dp", "cp")`` mesh and the rings, model preparation, batch sharding, output gathering and the loss checks
(:class:`ContextParallelMixin`). The Lightning-specific hooks live in :mod:`lightning_mtraining.strategy`
(Trainer), :mod:`lightning_mtraining.strategy_fsdp` and :mod:`lightning_mtraining.fabric`.
"""

from __future__ import annotations

import atexit
import copy
import gc
import math
import sys
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_mtraining.hf import (
    ContextParallelPlan,
    FusedLoss,
    PreparedModel,
    compile_decoder_layers,
    find_hf_models,
    validate_model,
)
from lightning_mtraining.losses import is_marked_loss, unmarked_loss_message
from lightning_mtraining.options import ContextParallelOptions
from lightning_mtraining.parallel import ContextParallel, check_sparsity_args
from lightning_mtraining.schedule import AttentionSchedule
from lightning_mtraining.sharding import ShardedBatch, gather_sequence, shard_of

__all__ = [
    "ContextParallelMixin",
    "build_context_parallel",
    "check_context_parallel_args",
    "describe_mesh",
    "resolve_context_parallel_size",
    "resolve_inner_ring_size",
]


def check_context_parallel_args(
    context_parallel_size: int | str,
    inner_ring_size: int | None,
    layout: str,
    block_size: int,
    loss_check: str = "raise",
) -> None:
    """Validate the strategy arguments that do not depend on the world size (:class:`ContextParallelOptions`)."""
    ContextParallelOptions(context_parallel_size=context_parallel_size, inner_ring_size=inner_ring_size,  # type: ignore[arg-type]
                           layout=layout, block_size=block_size, loss_check=loss_check, owner="mtraining")  # type: ignore[arg-type]


def describe_mesh(owner: str, world_size: int, cp_size: int, inner_size: int, layout: str, block_size: int,
                  num_nodes: int = 1) -> str:
    """One line for the log: ``world 4 = dp 2 x cp 2, flat ring of 2, striped layout (block 128)``.

    On several nodes (``num_nodes`` nodes of ``world_size / num_nodes`` ranks) it also says where the rings run:
    ``world 32 (4 nodes x 8) = dp 1 x cp 32, hierarchical ring: 4 outer (across nodes) x 8 inner (within a node),
    ...``.
    """
    world = f"world {world_size}"
    per_node = None
    if num_nodes > 1 and world_size % num_nodes == 0:
        per_node = world_size // num_nodes
        world += f" ({num_nodes} nodes x {per_node})"
    unit = f" (block {block_size})" if layout == "striped" else ""
    ring = _ring_phrase(cp_size, inner_size, per_node)
    return f"{owner}: {world} = dp {world_size // cp_size} x cp {cp_size}, {ring}, {layout} layout{unit}"


def _ring_phrase(cp_size: int, inner_size: int, per_node: int | None) -> str:
    """The ring part of :func:`describe_mesh`; with ``per_node`` (ranks per node, several nodes) also where its hops
    run. CP groups are consecutive global ranks and node ``n`` holds ranks ``n * per_node ...``, so a CP group (an
    inner ring) lies inside one node exactly when its size divides ``per_node``."""
    if cp_size == 1:
        return "no context parallelism (plain data parallel)"
    if not 1 < inner_size < cp_size:
        if per_node is None:
            return f"flat ring of {cp_size}"
        if per_node % cp_size == 0:
            return f"flat ring of {cp_size} within a node"
        return f"flat ring of {cp_size} across nodes (every ring step waits on the inter-node link)"
    outer = cp_size // inner_size
    if per_node is None:
        return f"hierarchical ring: {outer} outer x {inner_size} inner"
    if per_node % cp_size == 0:
        return f"hierarchical ring: {outer} outer x {inner_size} inner (all within a node)"
    if per_node % inner_size == 0:
        return f"hierarchical ring: {outer} outer (across nodes) x {inner_size} inner (within a node)"
    spans = -(-inner_size // per_node)
    return f"hierarchical ring: {outer} outer x {inner_size} inner (an inner ring spans {spans} nodes)"


def _destroy_process_group_at_exit(state: dict[str, Any]) -> None:
    """Destroy the process groups before the interpreter finalises, after a run that ended normally.

    Lightning never destroys the process group it creates. Left to interpreter finalisation, gloo's worker
    threads outlive Python, and the C++ runtime may abort with ``terminate called without an active exception``
    (see below). Measured on the 2-core CI machine, two ranks under torchrun: a
    script of a few gloo all-reduces, 7 of 12 runs (0 of 12 with ``destroy_process_group()`` first); a Trainer
    fit + validate with this strategy (301 tokens), 2 of 10 runs with this hook disabled, 0 of 10 with it. See
    pytorch/pytorch#190489. Not after an exception: a rank that failed may have a ring transfer in flight, and
    destroying the group would wait on it.

    ``destroy_process_group()`` alone does not stop gloo's threads: it only forgets the groups (gloo's
    ``shutdown()`` does nothing); a group's worker threads are joined when its last reference goes. The strategy's
    device mesh and plan still hold the groups (and a LightningCLI's parser, kept in a context variable, keeps the
    strategy alive until finalisation). A worker thread that finishes the last all-reduce after Python dropped its
    handle destroys the work itself, and releasing a tensor's Python object takes the GIL: if that wait runs into
    finalisation, Python ends the thread inside the work's destructor, which aborts (``examples/cli.py fit``,
    2 CPU ranks: 1 of 40 runs on rank 0). ``state["release"]`` (a weak reference to a callable, optional) drops
    the owner's references, so that the groups are destroyed and their threads joined here, while the
    interpreter is whole (0 of 40 runs).
    """
    if state["interrupted"] or getattr(sys, "last_value", None) is not None:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    release = state.get("release")
    release = release() if release is not None else None
    if release is not None:
        release()
        gc.collect()  # the mesh is freed by the cycle collector


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

    ``None``: a flat ring when every CP group lies inside one node (``cp_size`` divides ``ranks_per_node``); else
    the hierarchical ring with inner rings as large as fit inside a node, ``gcd(cp_size, ranks_per_node)`` ranks
    (one node's ranks when the CP group spans whole nodes), so that only the outer ring crosses nodes. CP groups are
    consecutive global ranks and nodes hold consecutive blocks of ``ranks_per_node`` ranks, so inner rings of that
    size never straddle two nodes. A flat ring when that size is 1.
    """
    if inner_ring_size is None:
        if ranks_per_node % cp_size == 0:
            return cp_size
        inner = math.gcd(cp_size, ranks_per_node)
        return inner if inner > 1 else cp_size
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


class ContextParallelMixin:
    """What the Trainer and Fabric strategies share: sizes, the mesh, model preparation and batch sharding.

    Mixed into a DDP strategy (which provides ``world_size``, ``global_rank``, ``num_processes``, ``root_device``).
    """

    def _init_context_parallel(self, options: ContextParallelOptions) -> None:
        check_sparsity_args(f"{type(self).__name__}(sparsity=...)", [options.sparsity], options.layout,
                            options.block_size)
        self.options = options
        context_parallel_size, inner_ring_size = options.context_parallel_size, options.inner_ring_size
        layout, block_size, sparsity = options.layout, options.block_size, options.sparsity
        loss_check, fused_loss, nonfinite_check = options.loss_check, options.fused_loss, options.nonfinite_check
        activation_checkpointing = options.activation_checkpointing
        self.fused_loss = fused_loss
        self.activation_checkpointing = activation_checkpointing
        self._fused: list[FusedLoss] = []
        self._cp: ContextParallel | None = None
        self._models_ready = False
        self._context_parallel_size = context_parallel_size
        self._inner_ring_size = inner_ring_size
        self.layout = layout
        self.block_size = block_size
        self.sparsity = sparsity
        self.loss_check = loss_check
        self.nonfinite_check = nonfinite_check
        self._warned_nonfinite = False
        self._device_mesh: DeviceMesh | None = None
        self._plan: ContextParallelPlan | None = None
        self._prepared: list[PreparedModel] = []
        self._warned_loss = False
        self._exit_state: dict[str, Any] | None = None
        self._logged_mesh = ""
        self._pad_multiple = 1
        self.attention_schedule: AttentionSchedule | None = None

    @property
    def is_distributed(self) -> bool:
        # One process is one device: no DistributedSampler (Fabric asks distributed_sampler_kwargs; the Trainer
        # is told in MTrainingStrategy.setup, since it decides by class, not by this property).
        return self.world_size > 1

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
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        # All ranks of one CP group read the same sample; DP groups read different ones. None for one process:
        # Fabric then injects no DistributedSampler (which would reshuffle by its own seed).
        if self.world_size == 1:
            return None
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def _check_sizes_before_launch(self) -> None:
        """CP and inner ring sizes against the world the launcher will start (runs before any process starts)."""
        devices = self.num_processes
        world = self.num_nodes * devices
        if world > 0:
            cp_size = resolve_context_parallel_size(self._context_parallel_size, world)
            resolve_inner_ring_size(self._inner_ring_size, cp_size, max(devices, 1))

    def _build_mesh_and_plan(self, cp_size: int, inner: int) -> tuple[DeviceMesh | None, ContextParallelPlan]:
        """The device mesh and this rank's plan (the FSDP2 strategy builds its N-dimensional mesh here)."""
        return build_context_parallel(self.root_device.type, self.world_size, cp_size, inner, self.layout,
                                      self.block_size)

    def _describe_mesh(self, cp_size: int, inner: int) -> str:
        return describe_mesh(type(self).__name__, self.world_size, cp_size, inner, self.layout, self.block_size,
                             num_nodes=self.num_nodes)

    def _build_context_parallel(self) -> None:
        cp_size, inner = self.cp_size, self.inner_ring_size  # raise on bad sizes before any collective
        self._check_node_layout()
        self._device_mesh, self._plan = self._build_mesh_and_plan(cp_size, inner)
        if dist.is_initialized() and self._exit_state is None:
            self._exit_state = {"interrupted": False, "release": weakref.WeakMethod(self._release_process_groups)}
            atexit.register(_destroy_process_group_at_exit, self._exit_state)
        mesh = self._describe_mesh(cp_size, inner)
        if mesh != self._logged_mesh:  # once per strategy, not again for each of fit/validate/test/predict
            self._logged_mesh = mesh
            rank_zero_info(mesh)

    def _check_node_layout(self) -> None:
        """This rank's node, as the cluster environment reports it, must be the one its CP group and inner ring are
        cut for (Note [Launchers and cluster environments] in :mod:`lightning_mtraining.launch`)."""
        from lightning_mtraining.launch import check_node_layout  # launch.py builds on this module

        environment = getattr(self, "cluster_environment", None)
        if environment is None or self.world_size == 1:
            return
        check_node_layout(environment.node_rank(), self.global_rank, max(self.num_processes, 1), self.num_nodes,
                          type(environment).__name__, type(self).__name__)

    def _release_process_groups(self) -> None:
        """Drop the mesh and the plan's groups (at exit, after ``destroy_process_group``: see the exit hook)."""
        self._device_mesh = None
        if self._plan is not None:
            self._plan.group = self._plan.inner_group = self._plan.outer_group = None

    def _mark_interrupted(self) -> None:
        if self._exit_state is not None:
            self._exit_state["interrupted"] = True

    def _layer_sparsity_configs(self, attention: Any) -> list[Any]:
        """Every sparsity config a run may use: the strategy's and a SparseAttentionCallback's."""
        configs = [self.sparsity, *(attention.configs() if attention is not None else [])]
        return [c for c in configs if c is not None]

    def validate_models(self, module: torch.nn.Module) -> None:
        """Raise if a Hugging Face model inside ``module`` has a feature ring attention cannot reproduce."""
        for model in find_hf_models(module):
            validate_model(model)

    def prepare_models(
        self,
        module: torch.nn.Module,
        layer_sparsity: Callable[[int], Any] | None = None,
        schedule_options: dict[str, Any] | None = None,
    ) -> None:
        """Switch every outermost Hugging Face model inside ``module`` to ring attention (idempotent).

        With one CP rank and dense attention on every layer there is nothing to split: the models are validated
        (so a model ring attention cannot run fails on one device too) but keep their own attention. When a layer
        may run sparse, an :class:`~lightning_mtraining.schedule.AttentionSchedule` (``schedule_options``: its
        logging options) decides per layer and step, and batches are padded to whole tiles on every rank.
        """
        if self._models_ready:
            return
        if layer_sparsity is None:
            layer_sparsity = lambda layer_idx: self.sparsity  # noqa: E731
        cp = ContextParallel(
            module, self.plan, layer_sparsity=layer_sparsity, schedule_options=schedule_options,
            fused_loss=self.fused_loss, activation_checkpointing=self.activation_checkpointing,
            owner=type(self).__name__, watch_nonfinite=self.nonfinite_check != "off",
        )
        if self.options.compile:  # after the hooks and activation checkpointing, as compile_decoder_layers asks
            kwargs = self.options.compile if isinstance(self.options.compile, dict) else {}
            compile_decoder_layers(module, **kwargs)
        self._cp = cp
        self._models_ready = True
        self._prepared, self._fused, self._pad_multiple = cp.prepared, cp.fused, cp.pad_multiple
        self.attention_schedule = cp.schedule

    def attention_metrics(self) -> dict[str, float]:
        """The sparse attention statistics of the last measured step (``attention/density``,
        ``attention/imbalance``, ``attention/recall`` if enabled, per layer too); empty when every layer is dense.
        See :meth:`~lightning_mtraining.schedule.AttentionSchedule.metrics`."""
        return self.attention_schedule.metrics() if self.attention_schedule is not None else {}

    def restore_models(self) -> None:
        """Undo :meth:`prepare_models`: hooks removed, previous attention implementation back."""
        if self._cp is not None:
            self._cp.restore()
        self._cp = None
        self._fused = []
        self._prepared = []
        self._models_ready = False
        if self._plan is not None:
            self._plan.current = None
            self._plan.schedule = None

    def shard_batch(self, batch: Any) -> Any:
        """Pad and shard ``batch`` (already on this rank's device) for this rank; records it for the model hook.

        With one CP rank and no model switched to ring attention, ``batch`` is returned as it is.
        """
        if self._cp is None:  # no model prepared (yet): nothing is split with one CP rank
            if self.plan.cp_size == 1:
                return batch
            raise RuntimeError(f"{type(self).__name__}.shard_batch was called before the model was set up")
        return self._cp.shard(batch)

    def gather_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``x`` (this rank's shard of the current sequence along ``dim``) whole, in global order, unpadded.

        ``[B, L, ...] -> [B, S, ...]``: e.g. logits or hidden states for a metric or a prediction. A collective:
        every rank of the CP group must call it. Not differentiable. Returns ``x`` itself when nothing is sharded.
        """
        found = shard_of(x)
        sharded = found[0] if found is not None else (self._plan.current if self._plan is not None else None)
        if sharded is None:
            return x
        return gather_sequence(x, sharded, dim)

    def gather_outputs(self, output: Any) -> Any:
        """``output`` with every tensor that holds this rank's shard of the current sequence made whole.

        A tensor counts as a shard when it is tagged as one (the model's logits) or when its first two dims are
        ``[B or 1, L]`` (B the batch size, L this rank's shard length): e.g. ``logits.argmax(-1)``. Mappings
        (Hugging Face ``ModelOutput`` included), lists and tuples are walked. Unchanged when nothing is sharded.
        """
        current = self._plan.current if self._plan is not None else None
        if current is None:
            return output
        return _map_sequence_tensors(output, current)

    def check_loss(self, loss: Any) -> None:
        """Raise or warn (``loss_check``) if ``loss`` did not come through a sharding-aware path.

        See Note [Checking the loss] in :mod:`lightning_mtraining.losses`. Checked only while the sequence is
        really split (more than one CP rank).
        """
        if self.loss_check == "off" or not self._prepared or self.plan.cp_size == 1:
            return
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None or is_marked_loss(loss):
            return
        message = unmarked_loss_message(type(self).__name__, self.plan.cp_size, self.plan.layout)
        if self.loss_check == "raise":
            raise RuntimeError(message)
        if not self._warned_loss:
            self._warned_loss = True
            rank_zero_warn(message)

    def check_finite(self, loss: Any) -> None:
        """Raise (``FloatingPointError``) or warn once (``nonfinite_check``) if ``loss`` is NaN or infinite on any
        rank, naming where this rank's forward first stopped being finite: the first attention layer whose input
        hidden states were non-finite, or one that made them non-finite, or "after the last attention layer"
        (:class:`~lightning_mtraining.hf.NonFiniteWatch`). Every rank takes the same decision (one all-reduce of a
        flag), so no rank is left waiting in backward's collectives. One host sync per step."""
        if self.nonfinite_check == "off" or self._cp is None or not isinstance(loss, torch.Tensor):
            return
        message = self._cp.nonfinite_message(loss)
        if message is None:
            return
        message += (". The step's gradients would be non-finite; nonfinite_check='warn' trains on (e.g. with a "
                    "float16 grad scaler that skips such steps), 'off' skips this check.")
        if self.nonfinite_check == "raise":
            raise FloatingPointError(message)
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            rank_zero_warn(message)


def _map_sequence_tensors(output: Any, sharded: ShardedBatch) -> Any:
    """``output`` with each shard tensor (see ``gather_outputs``) replaced by the whole sequence."""
    batch_size = sharded.valid.shape[0]

    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tagged = shard_of(x) is not None
            shaped = x.dim() >= 2 and x.shape[1] == sharded.local_len and x.shape[0] in (batch_size, 1)
            return gather_sequence(x, sharded) if tagged or shaped else x
        if isinstance(x, Mapping):
            out = copy.copy(x) if isinstance(x, dict) else dict(x)  # keeps ModelOutput's type
            for key, value in x.items():
                out[key] = visit(value)
            return out
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
            return type(x)(*(visit(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(visit(v) for v in x)
        return x

    return visit(output)
