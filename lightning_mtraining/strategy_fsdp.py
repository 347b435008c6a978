"""``MTrainingFSDPStrategy``: context parallelism with FSDP2 parameter sharding for the Lightning ``Trainer``.

``Trainer(strategy="mtraining_fsdp")`` (or ``MTrainingFSDPStrategy(...)``) is :class:`MTrainingStrategy` with the
parameters, gradients and optimizer state sharded instead of replicated: built on Lightning's
``ModelParallelStrategy`` (FSDP2, distributed checkpoints), over the same named ``("dp", "cp")`` mesh. In
``setup`` the Hugging Face models are switched to ring attention (:class:`~lightning_mtraining.parallel.
ContextParallel`), then, unless the module's ``configure_model`` already applied ``fully_shard`` (it may, with
``self.device_mesh``), every decoder layer and each model are ``fully_shard``-ed over the flattened ``dp x cp``
mesh (as torchtitan does): every rank holds ``1 / world`` of every parameter, and the gradient reduce-scatter
averages over all ranks, which with the loss scaling of Note [Exact losses and gradients] in
:mod:`lightning_mtraining.hf` is the exact gradient. Batches are sharded as with :class:`MTrainingStrategy`;
losses are checked the same way. Checkpoints: Lightning's distributed checkpoints (a folder, one shard per rank;
``save_distributed_checkpoint=False`` for one file), which load at another world size.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from typing_extensions import override

from lightning_mtraining.hf import find_hf_models
from lightning_mtraining.pattern import PAPER_SPARSITY, SparsityConfig
from lightning_mtraining.options import ContextParallelOptions, document_options
from lightning_mtraining.context_parallel import ContextParallelMixin
from lightning_mtraining.strategy import TrainerStepHooks

__all__ = ["MTrainingFSDPStrategy"]


def _is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


@document_options
class MTrainingFSDPStrategy(TrainerStepHooks, ContextParallelMixin, ModelParallelStrategy):
    """Data parallel x context parallel with FSDP2 parameter sharding (see the module docstring).

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
        sparsity: SparsityConfig | None = None,
        loss_check: Literal["raise", "warn", "off"] = "raise",
        gather_outputs: bool = True,
        fused_loss: bool | str = True,
        activation_checkpointing: bool = False,
        offload_activations: bool = False,
        nonfinite_check: Literal["raise", "warn", "off"] = "raise",
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
        self._gather_outputs = options.gather_outputs
        self.offload_activations = options.offload_activations

    @override
    def _configure_launcher(self) -> None:
        self._check_sizes_before_launch()
        super()._configure_launcher()

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
        from torch.distributed.fsdp import fully_shard

        if self._device_mesh is None:  # one process: nothing to shard
            return
        mesh = self._device_mesh._flatten("dp_cp")
        for model in find_hf_models(module):
            layers = getattr(getattr(model, "model", None), "layers", None)
            for layer in layers if layers is not None else []:
                fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
            fully_shard(model, mesh=mesh)
        if not _is_sharded(module):
            raise RuntimeError(f"{type(self).__name__}: found no parameters to shard in {type(module).__name__}")

    @override
    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup, except that configure_model need not be overridden: the models are switched
        # to ring attention, then sharded here unless configure_model did it.
        from lightning.pytorch.trainer.states import TrainerFn

        from lightning_mtraining.callback import SparseAttentionCallback

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        callbacks = [cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, SparseAttentionCallback)]
        callback = callbacks[0] if callbacks else SparseAttentionCallback()
        every = getattr(trainer, "log_every_n_steps", 50)
        self.prepare_models(self.model, callback.layer_sparsity_fn(self.sparsity), callback.schedule_options(every))
        if not callbacks and self.attention_schedule is not None:
            trainer.callbacks.append(callback)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
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
