"""``MTrainingFabricStrategy``: data parallel x context parallel for Lightning Fabric.

The same arguments and behaviour as :class:`~lightning_mtraining.strategies.trainer.MTrainingStrategy` (the shared
logic lives in :class:`~lightning_mtraining.strategies.common.ContextParallelMixin`). Fabric never calls
``batch_to_device``, so sharding happens in the dataloader: ``fabric.setup_dataloaders(loader)`` returns a
loader whose batches are already on the device and sharded for this rank (and the DistributedSampler Fabric
injects uses the data-parallel rank/size). Batches from elsewhere: ``fabric.strategy.shard_batch(batch)``.
``fabric.backward(loss)`` checks that the loss came through a sharding-aware path (``model(**batch).loss`` or
:func:`~lightning_mtraining.hf.losses.causal_lm_loss`), and ``fabric.strategy.gather_sequence(logits)`` puts a
shard's outputs back in global order, unpadded.

    fabric = Fabric(strategy=MTrainingFabricStrategy(block_size=128), devices=4)   # or strategy="mtraining"
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)       # HF models switched to ring attention here
    loader = fabric.setup_dataloaders(loader)               # batches sharded along the sequence
    for batch in loader:
        loss = model(**batch).loss                          # exact full-sequence loss value on every rank
        fabric.backward(loss)
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.nn import Module
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_mtraining.callbacks.sparse_attention import SparseAttentionCallback, say_dense_cost_note
from lightning_mtraining.hf.parallel import check_sparsity_args
from lightning_mtraining.sparsity.config import PAPER_SPARSITY, SparsityConfig
from lightning_mtraining.strategies.common import ContextParallelMixin
from lightning_mtraining.strategies.launchers import FabricSubprocessScriptLauncher
from lightning_mtraining.strategies.options import FSDP_ONLY, TRAINER_ONLY, ContextParallelOptions, document_options
from lightning_mtraining.strategies.trainer import register_names

__all__ = ["MTrainingFabricStrategy"]


class _ShardingDataLoader:
    """Iterates a DataLoader, moving each batch to the device and sharding it for this rank.

    Looks like the wrapped loader to Fabric (its attributes are copied, as Fabric's own wrapper does), so
    sampler epochs and ``len()`` keep working.
    """

    def __init__(self, dataloader: DataLoader, strategy: MTrainingFabricStrategy) -> None:
        self.__dict__.update(dataloader.__dict__)
        self._dataloader = dataloader
        self._strategy = strategy

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self._dataloader:
            yield self._strategy.shard_batch(move_data_to_device(batch, self._strategy.root_device))


@document_options(exclude=TRAINER_ONLY + FSDP_ONLY)
class MTrainingFabricStrategy(ContextParallelMixin, DDPStrategy):
    """Data parallel x context parallel (ring attention) strategy for Lightning Fabric.

    ``MTrainingFabricStrategy()`` and ``Fabric(strategy="mtraining")`` use the paper's setting (:data:`PAPER_SPARSITY`:
    top-p 0.9, caps 4096); ``sparsity=None`` and ``"mtraining_dense"`` are exact dense attention; the numbers:
    :meth:`attention_metrics`. ``loss_check`` and ``nonfinite_check`` act in ``fabric.backward``.

    Args:
        (the ContextParallelOptions fields, rendered here by document_options)
        attention: per-layer options and measuring cadence (a ``SparseAttentionCallback``; Fabric has no callbacks
            the strategy can see, so pass it here). Fabric has no global step: the strategy counts optimizer steps
            for the dense warm-up and the measurements.
        process_group_backend: ``None`` picks gloo on CPU, nccl on CUDA.
        timeout: process-group timeout.
        start_method: how Fabric starts processes (as in Fabric's ``DDPStrategy``).
        **kwargs: passed to ``torch.nn.parallel.DistributedDataParallel``.
    """

    strategy_name = "mtraining"

    def __init__(
        self,
        context_parallel_size: int | Literal["auto"] = "auto",
        inner_ring_size: int | None = None,
        layout: Literal["striped", "zigzag", "contiguous"] = "striped",
        block_size: int = 128,
        sparsity: SparsityConfig | str | None = PAPER_SPARSITY,
        attention: SparseAttentionCallback | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        loss_check: Literal["raise", "warn", "off"] = "raise",
        fused_loss: bool | str = True,
        activation_checkpointing: bool = False,
        tiled_mlp: int | None = None,
        nonfinite_check: Literal["raise", "warn", "off"] = "raise",
        compile: bool | dict[str, Any] = False,
        **kwargs: Any,
    ) -> None:
        options = ContextParallelOptions.from_arguments(type(self).__name__, locals())
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._init_context_parallel(options)
        self.attention = attention
        check_sparsity_args(f"{type(self).__name__}(attention=...)", self._layer_sparsity_configs(attention), layout,
                            block_size)

    @override
    def _configure_launcher(self) -> None:
        # Called by Fabric's connector once devices and nodes are known: bad sizes fail at Fabric(...).
        self._check_world_before_launch()
        super()._configure_launcher()
        if self._start_method == "popen":  # no local rank outlives a failure (Note [No rank outlives a failure])
            self._launcher = FabricSubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                            self.num_nodes)

    @override
    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        self._build_context_parallel()

    @override
    def setup_module(self, module: Module) -> Module:
        attention = self.attention if self.attention is not None else SparseAttentionCallback()
        self.prepare_models(module, attention.layer_sparsity_fn(self.sparsity), attention.schedule_options())
        if self.attention is not None:
            self.attention.check_layers(module)
        return super().setup_module(module)

    @override
    def backward(self, tensor: torch.Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        self.check_loss(tensor)
        self.check_finite(tensor)
        super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        if self.attention_schedule is not None:  # Fabric has no global step: count optimizer steps for the warm-up
            self.attention_schedule.set_step(self.attention_schedule.step + 1)
            say_dense_cost_note(self.attention_schedule)  # once: a sparse run at a dense run's cost
        return output

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        return _ShardingDataLoader(super().process_dataloader(dataloader), self)  # type: ignore[return-value]

    @override
    def teardown(self) -> None:
        self.restore_models()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)


def _register() -> None:
    if "mtraining" not in STRATEGY_REGISTRY:
        MTrainingFabricStrategy.register_strategies(STRATEGY_REGISTRY)


_register()
