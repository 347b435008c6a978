"""``MTrainingFSDPStrategy``: context parallelism with FSDP2 parameter sharding for the Lightning ``Trainer``.

``Trainer(strategy="mtraining_fsdp")`` (or ``MTrainingFSDPStrategy(...)``) is :class:`MTrainingStrategy` with the
parameters, gradients and optimizer state sharded instead of replicated: built on Lightning's
``ModelParallelStrategy`` (FSDP2, distributed checkpoints), over the same named ``("dp", "cp")`` mesh. In
``setup`` the Hugging Face models are switched to ring attention (:class:`~lightning_mtraining.hf.parallel.
ContextParallel`), then, unless the module's ``configure_model`` already applied ``fully_shard`` (it may, with
``self.device_mesh``), every decoder layer and each model are ``fully_shard``-ed over the flattened ``dp x cp``
mesh (as torchtitan does): every rank holds ``1 / world`` of every parameter, and the gradient reduce-scatter
averages over all ranks, which with the loss scaling of Note [Exact losses and gradients] in
:mod:`lightning_mtraining.hf` is the exact gradient. Batches are sharded as with :class:`MTrainingStrategy`;
losses are checked the same way. Checkpoints: Lightning's distributed checkpoints (a folder, one shard per rank;
``save_distributed_checkpoint=False`` for one file), which load at another world size.

With ``tensor_parallel_size`` or ``data_parallel_replicate_size`` above 1 the mesh is the N-dimensional one of
:mod:`lightning_mtraining.distributed.mesh` (``("dp_replicate", "dp_shard", "cp", "tp")``, Note [The mesh axes]): in
``setup`` the decoder layers are split over ``"tp"`` (:mod:`lightning_mtraining.hf.tensor_parallel`) before FSDP2 shards
over ``dp_shard x cp`` (HSDP over ``dp_replicate``). The CP ring is then flat (no hierarchical rings). Distributed
checkpoints hold DTensors and load at another (dp, cp, tp) layout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from typing_extensions import override

from lightning_mtraining.distributed.mesh import resolve_mesh_sizes
from lightning_mtraining.hf.parallel import apply_fsdp
from lightning_mtraining.hf.tensor_parallel import apply_tensor_parallel, clip_grad_norm_, local_sparsity
from lightning_mtraining.sparsity.config import PAPER_SPARSITY, SparsityConfig
from lightning_mtraining.strategies.common import ContextParallelMixin, option_view
from lightning_mtraining.strategies.launchers import CheckedSubprocessScriptLauncher
from lightning_mtraining.strategies.options import ContextParallelOptions, document_options
from lightning_mtraining.strategies.trainer import TrainerStepHooks

__all__ = ["MTrainingFSDPStrategy"]


def _is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _has_dtensors(module: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


@document_options
class MTrainingFSDPStrategy(TrainerStepHooks, ContextParallelMixin, ModelParallelStrategy):
    """Data parallel x context parallel with FSDP2 parameter sharding (see the module docstring).

    ``MTrainingFSDPStrategy()`` and ``strategy="mtraining_fsdp"`` train sparse in the paper's setting
    (:data:`PAPER_SPARSITY`); ``sparsity=None`` and ``"mtraining_fsdp_dense"`` are exact dense ring attention.

    Args:
        (the ContextParallelOptions fields, rendered here by document_options)
        reshard_after_forward: FSDP2's option for the decoder layers (``True``: parameters are gathered again in
            backward, least memory; ``False``: kept gathered from forward to backward).
        save_distributed_checkpoint, process_group_backend, timeout: as Lightning's ``ModelParallelStrategy``.
    """

    strategy_name = "mtraining_fsdp"

    def __init__(
        self,
        context_parallel_size: int | Literal["auto"] = "auto",
        inner_ring_size: int | None = None,
        layout: Literal["striped", "zigzag", "contiguous"] = "striped",
        block_size: int = 128,
        sparsity: SparsityConfig | str | None = PAPER_SPARSITY,
        loss_check: Literal["raise", "warn", "off"] = "raise",
        gather_outputs: bool = True,
        fused_loss: bool | str = True,
        activation_checkpointing: bool = False,
        tiled_mlp: int | None = None,
        offload_activations: bool | int = False,
        nonfinite_check: Literal["raise", "warn", "off"] = "raise",
        compile: bool | dict[str, Any] = False,
        tensor_parallel_size: int = 1,
        data_parallel_replicate_size: int = 1,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        options = ContextParallelOptions.from_arguments(type(self).__name__, locals())
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._init_context_parallel(options)
        self.reshard_after_forward = reshard_after_forward

    offload_activations = option_view("offload_activations")
    tensor_parallel_size = option_view("tensor_parallel_size")
    data_parallel_replicate_size = option_view("data_parallel_replicate_size")

    # ---- the mesh: ("dp", "cp"), or ("dp_replicate", "dp_shard", "cp", "tp") with tp or dp_replicate > 1 ----

    @property
    def _n_dimensional(self) -> bool:
        return self.tensor_parallel_size > 1 or self.data_parallel_replicate_size > 1

    def _mesh_sizes(self, world: int) -> tuple[int, int, int, int]:
        """``(dp_replicate, dp_shard, cp, tp)`` for ``world`` ranks; ``context_parallel_size="auto"``: every rank
        that is neither a replica nor a tp rank."""
        replicate, tp = self.data_parallel_replicate_size, self.tensor_parallel_size
        cp = self.options.context_parallel_size
        if cp == "auto":
            if world % (replicate * tp):
                raise ValueError(
                    f"{type(self).__name__}: the world of {world} ranks is not divisible by "
                    f"data_parallel_replicate_size {replicate} x tensor_parallel_size {tp}"
                )
            cp = world // (replicate * tp)
        return resolve_mesh_sizes(world, dp_replicate=replicate, cp=cp, tp=tp, owner=type(self).__name__)

    @property
    @override
    def cp_size(self) -> int:
        return self._mesh_sizes(self.world_size)[2]

    @property
    @override
    def dp_size(self) -> int:
        replicate, shard, _, _ = self._mesh_sizes(self.world_size)
        return replicate * shard

    @property
    @override
    def cp_rank(self) -> int:
        return (self.global_rank // self.tensor_parallel_size) % self.cp_size

    @property
    @override
    def dp_rank(self) -> int:
        return self.global_rank // (self.cp_size * self.tensor_parallel_size)

    @property
    @override
    def inner_ring_size(self) -> int:
        if not self._n_dimensional:
            return super().inner_ring_size
        if self.options.inner_ring_size not in (None, self.cp_size):
            raise ValueError(
                f"{type(self).__name__}(inner_ring_size={self.options.inner_ring_size}): hierarchical rings are not "
                "built with tensor_parallel_size or data_parallel_replicate_size above 1; leave inner_ring_size=None"
            )
        return self.cp_size

    @override
    def _check_sizes_before_launch(self) -> None:
        world = self.num_nodes * self.num_processes
        if world > 0 and self._n_dimensional:
            self._mesh_sizes(world)
        else:
            super()._check_sizes_before_launch()

    @override
    def _configure_launcher(self) -> None:
        # ModelParallelStrategy's, with the checks before launch and no local rank outliving a failure
        # (Note [No rank outlives a failure] in lightning_mtraining.strategies.launchers)
        self._check_world_before_launch()
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = CheckedSubprocessScriptLauncher(self, self.cluster_environment, self.num_processes,
                                                             self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # ModelParallelStrategy's, with the ("dp", "cp") mesh instead of its ("data_parallel", "tensor_parallel")
        self._setup_distributed()
        self._build_context_parallel()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        return ContextParallelMixin.distributed_sampler_kwargs.fget(self)  # type: ignore[attr-defined]

    def _shard_parameters(self, module: torch.nn.Module) -> None:
        if not apply_fsdp(module, self._device_mesh, reshard_after_forward=self.reshard_after_forward):
            return  # one process: nothing to shard
        if not _is_sharded(module):
            raise RuntimeError(f"{type(self).__name__}: found no parameters to shard in {type(module).__name__}")

    @override
    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup, except that configure_model need not be overridden: the models are switched
        # to ring attention, then split over tp and sharded here unless configure_model did it.
        from lightning.pytorch.trainer.states import TrainerFn

        from lightning_mtraining.callbacks.sparse_attention import SparseAttentionCallback

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        callbacks = [cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, SparseAttentionCallback)]
        callback = callbacks[0] if callbacks else SparseAttentionCallback()
        every = getattr(trainer, "log_every_n_steps", 50)
        layer_sparsity = callback.layer_sparsity_fn(self.sparsity)
        tp = self.tensor_parallel_size
        if tp > 1:  # each tp rank estimates its own heads (Note [Tensor parallel attention])
            tp_rank, global_sparsity = self.global_rank % tp, layer_sparsity
            layer_sparsity = lambda layer_idx: local_sparsity(global_sparsity(layer_idx), tp_rank, tp)  # noqa: E731
        self.prepare_models(self.model, layer_sparsity, callback.schedule_options(every))
        if not callbacks and self.attention_schedule is not None:
            trainer.callbacks.append(callback)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if tp > 1:
            if not _has_dtensors(self.model):
                apply_tensor_parallel(self.model, self.device_mesh["tp"])
            # Trainer(gradient_clip_val=...): gradients on two meshes, which torch's clip_grad_norm_ refuses
            # (Note [Tensor parallel attention])
            plugin = self.precision_plugin
            plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(  # type: ignore[method-assign, assignment]
                plugin.main_params(optimizer), clip_val)
        if not _is_sharded(self.model):
            self._shard_parameters(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("mtraining_fsdp", cls, description="FSDP2 x context parallel, MTraining sparse "
                                   "ring attention (top-p 0.9)", sparsity=PAPER_SPARSITY)
        strategy_registry.register("mtraining_fsdp_dense", cls,
                                   description="FSDP2 x context parallel, exact dense ring attention", sparsity=None)


if "mtraining_fsdp" not in StrategyRegistry:
    MTrainingFSDPStrategy.register_strategies(StrategyRegistry)
