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

0. Before any process starts (in the launching process, once): the sizes against the world (at ``Trainer(...)``),
   sparse mode against what the core implements (at construction), and the Hugging Face models that already
   exist in the LightningModule against what ring attention reproduces (``trainer.fit``, before launch).
1. ``setup_distributed``: Lightning's DDP process-group setup (launchers, cluster environments: torchrun,
   SLURM, Lightning multi-machine), then the mesh and, for a CP group spanning nodes, the inner (intra-node)
   and outer (inter-node) rings of hierarchical ring attention; rank 0 logs the mesh once.
2. ``distributed_sampler_kwargs``: the DP rank and size, so every rank of a CP group reads the same sample.
3. ``setup``: every outermost ``transformers.PreTrainedModel`` in the LightningModule (built in ``__init__``
   or ``configure_model``) is validated and switched to ring attention, with a hook that supplies global
   ``position_ids``, globally shifted labels and the global target count (:mod:`lightning_mtraining.hf`);
   then DDP wraps the module: gradients are averaged over the whole mesh, which keeps every replica identical.
4. ``batch_to_device``: pads each batch to the layout's unit and gives this rank its shard
   (:mod:`lightning_mtraining.distributed.sharding`).
5. ``backward``: checks that the loss came through a sharding-aware path (Note [Checking the loss] in
   :mod:`lightning_mtraining.hf.losses`).
6. ``validation_step`` / ``test_step`` / ``predict_step``: outputs that hold this rank's shard of the sequence
   come back whole, in global order and without padding (:meth:`ContextParallelMixin.gather_outputs`).

With ``context_parallel_size=1`` and dense attention (one device, or data parallel only) there is nothing to
split: models keep their own attention, batches pass through unchanged, and the strategy is plain DDP; with one
device, no DistributedSampler is injected either, so batches come in the same order as ``strategy="auto"``.

Losses: the loss a model returns has the exact full-sequence value on every rank (logged values and the
progress bar show it; ``sync_dist=True`` averages it over DP groups) and its gradient makes DDP's average the
exact gradient; see Note [Exact losses and gradients] in :mod:`lightning_mtraining.hf.model`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from typing_extensions import override

from lightning_mtraining.core.errors import same_on_ranks
from lightning_mtraining.core.rng import preserved_rng_states
from lightning_mtraining.hf.offload import ActivationOffload
from lightning_mtraining.hf.parallel import check_sparsity_args
from lightning_mtraining.sparsity.config import PAPER_SPARSITY, SparsityConfig
from lightning_mtraining.strategies.common import ContextParallelMixin, option_view
from lightning_mtraining.strategies.launchers import CheckedMultiProcessingLauncher, CheckedSubprocessScriptLauncher
from lightning_mtraining.strategies.options import FSDP_ONLY, ContextParallelOptions, document_options

__all__ = ["MTrainingStrategy", "TrainerStepHooks", "register_names"]


class TrainerStepHooks:
    """The Trainer hooks both Trainer strategies (:class:`MTrainingStrategy`, DDP, and
    :class:`~lightning_mtraining.strategies.fsdp.MTrainingFSDPStrategy`, FSDP2) add to their Lightning base: shard
    each batch, check the loss before backward, offload saved activations, give step outputs back whole, restore the
    models at teardown; the checks before launch (:meth:`check_before_launch`, called by the launchers of
    :mod:`lightning_mtraining.strategies.launchers`). Placed before the Lightning strategy in the bases; needs
    :class:`ContextParallelMixin` and ``options.gather_outputs`` and ``options.offload_activations``."""

    _offload: ActivationOffload | None = None  # offload_activations=N: built at the first training step

    def check_before_launch(self, trainer: Any, alone: bool = False) -> None:
        """The checks that need the Trainer or the module: sparse callbacks, models that already exist.

        Runs in the launching process before other processes start (``alone``: no other rank exists yet; the
        launcher knows), or on every rank when they were started by others (torchrun, SLURM): a failure is then
        reported once (Note [Failures that speak once] in :mod:`lightning_mtraining.core.errors`). Models built in
        ``configure_model`` are checked when it returns (``model_sharded_context``), and every model again in
        ``setup``.
        """
        with same_on_ranks(0, 0, 1, "this process") if alone else self.same_everywhere():
            check_sparsity_args(
                f"{type(self).__name__} with SparseAttentionCallback",
                self._layer_sparsity_configs(self._attention_callback(trainer)), self.layout, self.block_size,
            )
            if self.lightning_module is not None:
                self.validate_models(self.lightning_module)

    @staticmethod
    def _attention_callback(trainer: Any) -> Any:
        from lightning_mtraining.callbacks.sparse_attention import SparseAttentionCallback

        callbacks = [cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, SparseAttentionCallback)]
        if len(callbacks) > 1:
            raise ValueError(f"found {len(callbacks)} SparseAttentionCallback instances; pass at most one")
        return callbacks[0] if callbacks else None

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.shard_batch(batch)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.check_loss(closure_loss)
        self.check_finite(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        offload = self.offload_activations
        if offload is False:
            return super().training_step(*args, **kwargs)
        if offload is True:  # everything: torch's own hooks
            with torch.autograd.graph.save_on_cpu(pin_memory=self.root_device.type == "cuda"):
                return super().training_step(*args, **kwargs)
        if getattr(self, "_offload", None) is None:  # the models exist by now (configure_model has run)
            with self.same_everywhere():
                self._offload = ActivationOffload(self.lightning_module, offload,
                                                  pin_memory=self.root_device.type == "cuda", owner=type(self).__name__)
        with self._offload():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        return self.gather_outputs(output) if self.options.gather_outputs else output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        return self.gather_outputs(output) if self.options.gather_outputs else output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        return self.gather_outputs(output) if self.options.gather_outputs else output

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with super().model_sharded_context():
            yield
        # configure_model has just built the models: check them now, before anything else runs (a checkpoint's
        # restore, DDP's broadcast), so that every rank fails at once and the failure is reported once
        if self.lightning_module is not None:
            with self.same_everywhere():
                self.validate_models(self.lightning_module)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._mark_interrupted()
        self.record_failure(exception, getattr(self.lightning_module, "_trainer", None))
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if getattr(self, "_offload", None) is not None:
            self._offload.remove()
            self._offload = None
        self.restore_models()
        super().teardown()


@document_options(exclude=FSDP_ONLY)
class MTrainingStrategy(TrainerStepHooks, ContextParallelMixin, DDPStrategy):
    """Data parallel x context parallel (ring attention) strategy for the Lightning ``Trainer``.

    ``MTrainingStrategy()`` and ``strategy="mtraining"`` are the same thing: sparse ring attention in the paper's
    training setting (:data:`PAPER_SPARSITY`: top-p 0.9, caps 4096). ``MTrainingStrategy(sparsity=None)`` and
    ``strategy="mtraining_dense"`` are exact dense ring attention.

    Args:
        (the ContextParallelOptions fields, rendered here by document_options)
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
        sparsity: SparsityConfig | str | None = PAPER_SPARSITY,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        loss_check: Literal["raise", "warn", "off"] = "raise",
        gather_outputs: bool = True,
        fused_loss: bool | str = True,
        activation_checkpointing: bool = False,
        tiled_mlp: int | None = None,
        offload_activations: bool | int = False,
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
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._init_context_parallel(options)

    offload_activations = option_view("offload_activations")

    @override
    def _configure_launcher(self) -> None:
        # Called by the Trainer's connector once devices and nodes are known: the sizes fail at Trainer(...).
        self._check_world_before_launch()
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = CheckedSubprocessScriptLauncher(
                self, self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = CheckedMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_distributed(self) -> None:
        if self.num_nodes * self.num_processes == 1:
            # DDPStrategy re-seeds every generator here (reset_seed, for spawned ranks to agree); one process has
            # nothing to agree with, and the re-seed would make its first shuffle differ from strategy="auto".
            with preserved_rng_states():
                super().setup_distributed()
        else:
            super().setup_distributed()
        self._build_context_parallel()

    @override
    def setup(self, trainer: Any) -> None:
        # After configure_model, before DDP wraps the module: models built in configure_model are covered.
        assert self.model is not None
        from lightning_mtraining.callbacks.sparse_attention import SparseAttentionCallback

        callback = self._attention_callback(trainer)
        added = callback is None
        if added:
            callback = SparseAttentionCallback()
        every = getattr(trainer, "log_every_n_steps", 50)
        self.prepare_models(self.model, callback.layer_sparsity_fn(self.sparsity), callback.schedule_options(every))
        if added and self.attention_schedule is not None:
            # a sparse run logs its density and imbalance even when the user added no callback
            trainer.callbacks.append(callback)
        if self.world_size == 1:
            # The Trainer injects a DistributedSampler for every DDPStrategy subclass whatever is_distributed says
            # (lightning 2.6 _AcceleratorConnector.is_distributed); on one device it would reorder the batches
            # against strategy="auto" (its own shuffle seed), so tell the Trainer's connector not to.
            connector = getattr(trainer, "_accelerator_connector", None)
            if connector is not None and hasattr(connector, "use_distributed_sampler"):
                connector.use_distributed_sampler = False
        super().setup(trainer)

    @override
    def configure_ddp(self) -> None:
        if self.world_size == 1:
            # One process has nothing to average: DDP would only add its reducer, which copies every gradient
            # into communication buckets (as much memory again as the gradients) and all-reduces over one rank.
            return
        super().configure_ddp()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)


def register_names(registry: Any, cls: type) -> None:
    """``"mtraining"``: ``cls()``, sparse ring attention in the paper's training setting (the class's default,
    named here too so that the registry says it); ``"mtraining_dense"``: ``cls(sparsity=None)``, exact dense."""
    registry.register(
        "mtraining", cls, description="Data parallel x context parallel, MTraining sparse ring attention (top-p 0.9)",
        sparsity=PAPER_SPARSITY,
    )
    registry.register(
        "mtraining_dense", cls, description="Data parallel x context parallel, exact dense ring attention",
        sparsity=None,
    )


def _register() -> None:
    if "mtraining" not in StrategyRegistry:
        MTrainingStrategy.register_strategies(StrategyRegistry)


_register()
