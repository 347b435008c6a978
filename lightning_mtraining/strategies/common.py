"""What every mtraining strategy shares (Trainer with DDP or FSDP2, Fabric): the context-parallel sizes, the
``("dp", "cp")`` mesh and the rings, model preparation, batch sharding, output gathering and the loss checks
(:class:`ContextParallelMixin`). The Lightning-specific hooks live in :mod:`lightning_mtraining.strategies.trainer`
(Trainer), :mod:`lightning_mtraining.strategies.fsdp` and :mod:`lightning_mtraining.strategies.fabric`.
"""

from __future__ import annotations

import atexit
import copy
import gc
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mtraining.core.errors import (
    claim_first_failure,
    group_ranks,
    mark_same_on_ranks,
    note_step,
    same_on_ranks,
    watch_failures,
)
from lightning_mtraining.distributed.mesh import (
    build_context_parallel,
    describe_mesh,
    resolve_context_parallel_size,
    resolve_inner_ring_size,
)
from lightning_mtraining.distributed.plan import ContextParallelPlan
from lightning_mtraining.distributed.sharding import ShardedBatch, gather_sequence, shard_of
from lightning_mtraining.hf.compile import compile_decoder_layers
from lightning_mtraining.hf.losses import is_marked_loss, unmarked_loss_message
from lightning_mtraining.hf.model import PreparedModel, find_hf_models, validate_model
from lightning_mtraining.hf.parallel import ContextParallel, check_sparsity_args
from lightning_mtraining.sparsity.config import PAPER_SPARSITY
from lightning_mtraining.sparsity.schedule import AttentionSchedule
from lightning_mtraining.strategies.node_layout import check_launcher_layout, check_node_layout
from lightning_mtraining.strategies.options import ContextParallelOptions

__all__ = ["ContextParallelMixin", "option_view", "quiet_lightning_pytree_warning"]


def _destroy_process_group_at_exit(state: dict[str, Any]) -> None:
    """Destroy the process groups before the interpreter finalises, after a run that ended normally.

    Lightning never destroys the process group it creates. Left to interpreter finalisation, gloo's worker
    threads outlive Python, and the C++ runtime may abort with ``terminate called without an active exception``
    (pytorch/pytorch#190489; a few gloo all-reduces under torchrun are enough to see it on CPU). Not after an
    exception: a rank that failed may have a ring transfer in flight, and destroying the group would wait on it.

    ``destroy_process_group()`` alone does not stop gloo's threads: it only forgets the groups (gloo's
    ``shutdown()`` does nothing); a group's worker threads are joined when its last reference goes. The strategy's
    device mesh and plan still hold the groups (and a LightningCLI's parser, kept in a context variable, keeps the
    strategy alive until finalisation). A worker thread that finishes the last all-reduce after Python dropped its
    handle destroys the work itself, and releasing a tensor's Python object takes the GIL: if that wait runs into
    finalisation, Python ends the thread inside the work's destructor, which aborts (rarely, e.g. after
    ``examples/cli.py fit`` on 2 CPU ranks). ``state["release"]`` (a weak reference to a callable, optional) drops
    the owner's references, so that the groups are destroyed and their threads joined here, while the
    interpreter is whole.
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


def quiet_lightning_pytree_warning() -> None:
    """Ignore the one deprecation warning Lightning 2.6's data loop raises on every rank under torch 2.13.

    ``lightning.pytorch.utilities._pytree`` builds a ``LeafSpec``, which torch 2.13 deprecates (a ``FutureWarning``
    that names an ``isinstance`` check), each time the Trainer's ``CombinedLoader`` flattens its loaders: nothing a
    user can act on. The filter matches that message from that module only, so every other warning stays.
    """
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")


def option_view(name: str) -> property:
    """A read-only strategy attribute that reads ``self.options`` (:class:`ContextParallelOptions`)."""
    return property(lambda self: getattr(self.options, name), doc=f"``options.{name}`` (read-only).")


class ContextParallelMixin:
    """What the Trainer and Fabric strategies share: sizes, the mesh, model preparation and batch sharding.

    Mixed into a DDP strategy (which provides ``world_size``, ``global_rank``, ``num_processes``, ``root_device``).
    """

    def _init_context_parallel(self, options: ContextParallelOptions) -> None:
        quiet_lightning_pytree_warning()  # every process builds its strategy (Lightning's children re-run the script)
        name = type(self).__name__
        # the default is sparse: say so when it is the default that cannot tile the layout
        owner = f"{name}(sparsity=PAPER_SPARSITY, the default)" if options.sparsity == PAPER_SPARSITY else (
            f"{name}(sparsity=...)")
        check_sparsity_args(owner, [options.sparsity], options.layout, options.block_size)
        self.options = options
        self._cp: ContextParallel | None = None
        self._models_ready = False
        self._warned_nonfinite = False
        self._device_mesh: DeviceMesh | None = None
        self._plan: ContextParallelPlan | None = None
        self._prepared: list[PreparedModel] = []
        self._warned_loss = False
        self._exit_state: dict[str, Any] | None = None
        self._logged_mesh = ""
        self.attention_schedule: AttentionSchedule | None = None

    # the options, read where the strategy needs them (one source: ``self.options``)
    layout = option_view("layout")
    block_size = option_view("block_size")
    sparsity = option_view("sparsity")
    fused_loss = option_view("fused_loss")
    activation_checkpointing = option_view("activation_checkpointing")
    tiled_mlp = option_view("tiled_mlp")
    loss_check = option_view("loss_check")
    nonfinite_check = option_view("nonfinite_check")

    @property
    def is_distributed(self) -> bool:
        # One process is one device: no DistributedSampler (Fabric asks distributed_sampler_kwargs; the Trainer
        # is told in MTrainingStrategy.setup, since it decides by class, not by this property).
        return self.world_size > 1

    @property
    def cp_size(self) -> int:
        return resolve_context_parallel_size(self.options.context_parallel_size, self.world_size)

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
        return resolve_inner_ring_size(self.options.inner_ring_size, self.cp_size, max(self.num_processes, 1))

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
            cp_size = resolve_context_parallel_size(self.options.context_parallel_size, world)
            resolve_inner_ring_size(self.options.inner_ring_size, cp_size, max(devices, 1))

    def _check_world_before_launch(self) -> None:
        """At ``Trainer(...)`` / ``Fabric(...)``, before any process starts or any process group exists: the sizes,
        and the launcher's processes against ``devices`` and ``num_nodes`` in both directions (Note [Launchers and
        cluster environments] in :mod:`lightning_mtraining.strategies.node_layout`)."""
        self._check_sizes_before_launch()
        environment = getattr(self, "cluster_environment", None)
        if environment is not None:
            check_launcher_layout(environment, max(self.num_processes, 1), self.num_nodes, type(self).__name__)

    def _build_context_parallel(self) -> None:
        cp_size, inner = self.cp_size, self.inner_ring_size  # raise on bad sizes before any collective
        self._check_node_layout()
        o = self.options
        self._device_mesh, self._plan = build_context_parallel(
            self.root_device.type, self.world_size, cp_size, inner, o.layout, o.block_size,
            dp_replicate=o.data_parallel_replicate_size, tp=o.tensor_parallel_size)
        if dist.is_initialized() and self._exit_state is None:
            self._exit_state = {"interrupted": False, "release": weakref.WeakMethod(self._release_process_groups)}
            atexit.register(_destroy_process_group_at_exit, self._exit_state)
        if dist.is_initialized():  # a failure on one rank is reported once, last (Note [The first failure speaks last])
            watch_failures(self.global_rank, self.world_size)
        mesh = describe_mesh(type(self).__name__, self.world_size, cp_size, inner, o.layout, o.block_size,
                             o.data_parallel_replicate_size, o.tensor_parallel_size, num_nodes=self.num_nodes)
        if mesh != self._logged_mesh:  # once per strategy, not again for each of fit/validate/test/predict
            self._logged_mesh = mesh
            rank_zero_info(mesh)

    def _check_node_layout(self) -> None:
        """This rank's node, as the cluster environment reports it, must be the one its CP group and inner ring are
        cut for (Note [Launchers and cluster environments] in :mod:`lightning_mtraining.strategies.node_layout`)."""
        environment = getattr(self, "cluster_environment", None)
        if environment is None or self.world_size == 1:
            return
        check_node_layout(environment.node_rank(), self.global_rank, max(self.num_processes, 1), self.num_nodes,
                          type(environment).__name__, type(self).__name__)

    def record_failure(self, exception: BaseException, trainer: Any = None) -> None:
        """``exception`` ends this rank's run: record it as the job's first failure if no other rank failed before,
        with the Trainer's global step and stage (Note [The first failure speaks last] in
        :mod:`lightning_mtraining.core.errors`)."""
        state = getattr(trainer, "state", None)
        stage = getattr(getattr(state, "fn", None), "value", None)
        claim_first_failure(exception, getattr(trainer, "global_step", None), stage)

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

    def same_everywhere(self) -> Any:
        """A context in which a failing check is one every rank finds alike (the models, the options): reported
        once, by global rank 0 (Note [Failures that speak once] in :mod:`lightning_mtraining.core.errors`). Usable
        before the process group exists (the ranks come from the cluster environment)."""
        return same_on_ranks(self.global_rank, 0, max(self.world_size, 1), "every rank")

    def validate_models(self, module: torch.nn.Module) -> None:
        """Raise if a Hugging Face model inside ``module`` has a feature ring attention cannot reproduce. Run it
        inside :meth:`same_everywhere` where every rank runs it (the error is then reported once)."""
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
        may run sparse, an :class:`~lightning_mtraining.sparsity.schedule.AttentionSchedule` (``schedule_options``: its
        logging options) decides per layer and step, and batches are padded to whole tiles on every rank.
        """
        if self._models_ready:
            return
        if layer_sparsity is None:
            layer_sparsity = lambda layer_idx: self.sparsity  # noqa: E731
        cp = ContextParallel(
            module, self.plan, layer_sparsity=layer_sparsity, schedule_options=schedule_options,
            fused_loss=self.fused_loss, activation_checkpointing=self.activation_checkpointing,
            tiled_mlp=self.tiled_mlp, owner=type(self).__name__, watch_nonfinite=self.nonfinite_check != "off",
        )
        if self.options.compile:  # after the hooks and activation checkpointing, as compile_decoder_layers asks
            kwargs = self.options.compile if isinstance(self.options.compile, dict) else {}
            compile_decoder_layers(module, **kwargs)
        self._cp = cp
        self._models_ready = True
        self._prepared = cp.prepared
        self.attention_schedule = cp.schedule

    def attention_metrics(self) -> dict[str, float]:
        """The sparse attention statistics of the last measured step (``attention/density``,
        ``attention/imbalance``, ``attention/recall`` if enabled, per layer too); empty when every layer is dense.
        See :meth:`~lightning_mtraining.sparsity.schedule.AttentionSchedule.metrics`."""
        return self.attention_schedule.metrics() if self.attention_schedule is not None else {}

    def restore_models(self) -> None:
        """Undo :meth:`prepare_models`: hooks removed, previous attention implementation back."""
        if self._cp is not None:
            self._cp.restore()
        self._cp = None
        self._prepared = []
        self._models_ready = False
        if self._plan is not None:
            self._plan.current = None
            self._plan.schedule = None

    def shard_batch(self, batch: Any) -> Any:
        """Pad and shard ``batch`` (already on this rank's device) for this rank; records it for the model hook.

        With one CP rank and no model switched to ring attention, ``batch`` is returned as it is.
        """
        note_step(self._step_now())  # where this rank is, for a failed collective's report (Note [Who did not arrive])
        if self._cp is None:  # no model prepared (yet): nothing is split with one CP rank
            if self.plan.cp_size == 1:
                return batch
            raise RuntimeError(f"{type(self).__name__}.shard_batch was called before the model was set up")
        return self._cp.shard(batch)

    def _step_now(self) -> int | None:
        """The Trainer's global step, or (Fabric) the optimizer steps the attention schedule counted; None unknown."""
        trainer = getattr(getattr(self, "_lightning_module", None), "_trainer", None)
        if trainer is not None:
            return int(trainer.global_step)
        schedule = self._cp.schedule if self._cp is not None else None
        return schedule.step if schedule is not None else None

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

        See Note [Checking the loss] in :mod:`lightning_mtraining.hf.losses`. Checked only while the sequence is
        really split (more than one CP rank).
        """
        if self.loss_check == "off" or not self._prepared or self.plan.cp_size == 1:
            return
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None or is_marked_loss(loss):
            return
        message = unmarked_loss_message(type(self).__name__, self.plan.cp_size, self.plan.layout)
        if self.loss_check == "raise":  # the CP group's ranks ran the same step on the same batch: reported once
            raise mark_same_on_ranks(RuntimeError(message), *group_ranks(self.plan.group),
                                     "every rank of the context-parallel group")
        if not self._warned_loss:
            self._warned_loss = True
            rank_zero_warn(message)

    def check_finite(self, loss: Any) -> None:
        """Raise (``FloatingPointError``) or warn once (``nonfinite_check``) if ``loss`` is NaN or infinite on any
        rank, naming where this rank's forward first stopped being finite: the first attention layer whose input
        hidden states were non-finite, or one that made them non-finite, or "after the last attention layer"
        (:class:`~lightning_mtraining.hf.model.NonFiniteWatch`). Every rank takes the same decision (one all-reduce of a
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
