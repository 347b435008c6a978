"""Context parallelism over a model and a mesh, without Lightning: what the Trainer strategy, the Fabric strategy
and a plain torch loop share.

:func:`apply_context_parallel` switches every outermost Hugging Face model inside a module to ring attention over
the ``"cp"`` dimension of a :class:`~torch.distributed.device_mesh.DeviceMesh` (dense or sparse, per layer), with
the fused loss and activation checkpointing as options, and returns a :class:`ContextParallel` handle whose
:meth:`~ContextParallel.shard` gives this rank its shard of each batch. Parameters are the caller's to shard or
replicate: with FSDP2, ``fully_shard`` the layers and the model over the flattened ``("dp", "cp")`` mesh (every
rank holds a slice of every parameter; gradients are averaged over all ranks, which with the loss scaling of Note
[Exact losses and gradients] in :mod:`lightning_mtraining.hf` is the exact gradient), as torchtitan does::

    mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_model = apply_context_parallel(model, mesh, sparsity=SparsityConfig(top_p=0.9))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh._flatten("dp_cp"))
    fully_shard(model, mesh=mesh._flatten("dp_cp"))
    for batch in loader:                           # every rank of a CP group reads the same sample
        loss = model(**cp_model.shard(batch)).loss  # the exact loss of the whole sequence, on every rank
        loss.backward()
        optimizer.step(); optimizer.zero_grad()

With tensor parallelism the mesh has more axes (Note [The mesh axes] in :mod:`lightning_mtraining.distributed.mesh`):
:func:`apply_context_parallel` also splits the decoder layers over ``mesh["tp"]`` (Note [Tensor parallel
attention] in :mod:`lightning_mtraining.hf.tensor_parallel`), and :func:`apply_fsdp` shards over dp x cp::

    mesh = build_mesh("cuda", dp_replicate=1, cp=2, tp=2)    # dp_shard: what is left of the world
    cp_model = apply_context_parallel(model, mesh)            # tp first, then ring attention over "cp"
    apply_fsdp(model, mesh)                                   # FSDP2 over dp_shard x cp (HSDP with dp_replicate)
    sample = loader[step * axes.dp + axes.dp_rank]            # axes = MeshAxes.of(mesh); tp and cp ranks share it

The per-batch state (the current shard) is kept in the handle's plan, which the model hooks read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mtraining.core.errors import same_on_ranks_of
from lightning_mtraining.core.layouts import document_starts
from lightning_mtraining.distributed.mesh import fsdp_mesh
from lightning_mtraining.distributed.plan import ContextParallelPlan
from lightning_mtraining.distributed.sharding import IGNORE_INDEX, shard_batch, sparse_padding_multiple
from lightning_mtraining.hf.fused_loss import FusedLoss, prepare_fused_loss
from lightning_mtraining.hf.model import (
    NonFiniteWatch,
    PreparedModel,
    attention_modules,
    find_hf_models,
    packed_documents_cache_error,
    prepare_model,
    validate_model,
)
from lightning_mtraining.hf.tensor_parallel import apply_tensor_parallel, local_sparsity
from lightning_mtraining.hf.tiled_mlp import tile_mlps
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.schedule import AttentionSchedule

__all__ = ["ContextParallel", "apply_context_parallel", "apply_fsdp", "check_sparsity_args", "restore_batch_type"]


def check_sparsity_args(owner: str, configs: Iterable[Any], layout: str, block_size: int) -> None:
    """Raise, once and short, if a sparsity config is of the wrong type or cannot tile the layout."""
    for config in configs:
        if config is None:
            continue
        if not isinstance(config, SparsityConfig):
            raise TypeError(f"{owner}: sparsity must be a SparsityConfig or None, got {type(config).__name__}")
        try:
            sparse_padding_multiple(layout, 1, block_size, config.tile_size)
        except ValueError as e:
            raise ValueError(f"{owner}: {e}; or sparsity=None for exact dense attention") from None


def restore_batch_type(original: Any, sharded: dict[str, Any]) -> Any:
    """``sharded`` as the mapping type of ``original`` when it can be rebuilt from a dict (e.g. BatchEncoding)."""
    if type(original) is dict:
        return sharded
    try:
        return type(original)(sharded)
    except Exception:  # noqa: BLE001 - an exotic mapping type: a plain dict is still a valid batch
        return sharded


class ContextParallel:
    """Models switched to context parallelism (see :func:`apply_context_parallel`); :meth:`restore` undoes it.

    Attributes: ``plan`` (this rank's place and the current batch), ``models`` (the Hugging Face models found),
    ``prepared`` (those switched to ring attention: none with one CP rank and dense attention, where models keep
    their own), ``packed`` (with those, the hooks that make their attention honour packed documents,
    :class:`PackedDocuments`), ``fused`` (fused-loss hooks), ``schedule`` (the sparse attention schedule, None when
    every layer is dense), ``pad_multiple`` (sequence padding asked by sparse tiles), ``tiled`` (the
    sequence-tiled MLPs, :class:`~lightning_mtraining.hf.tiled_mlp.TiledMLPs`, or None).
    """

    def __init__(
        self,
        module: nn.Module,
        plan: ContextParallelPlan,
        *,
        layer_sparsity: Callable[[int], Any],
        schedule_options: dict[str, Any] | None = None,
        fused_loss: bool | str = True,
        activation_checkpointing: bool = False,
        tiled_mlp: int | None = None,
        owner: str = "apply_context_parallel",
        watch_nonfinite: bool = True,
    ) -> None:
        models = find_hf_models(module)
        if not models:
            raise ValueError(
                f"{type(module).__name__} contains no transformers PreTrainedModel: {owner} switches Hugging Face "
                "causal LMs (attn_implementation) to ring attention. For a custom model, call "
                "lightning_mtraining.ring_attention in its attention and use the sharded batch's position_ids"
            )
        with same_on_ranks_of(None, "every rank"):  # the models are the same on every rank
            for model in models:
                validate_model(model)
        self.plan = plan
        self.models = models
        self.prepared: list[PreparedModel] = []
        self.fused: list[FusedLoss] = []
        self.packed: list[PackedDocuments] = []
        self.schedule: AttentionSchedule | None = None
        self.pad_multiple = 1
        layers = sorted({m.layer_idx for model in models for m in attention_modules(model)})
        schedule = AttentionSchedule(layer_sparsity, **(schedule_options or {}))
        configs = schedule.sparse_configs(layers)
        if activation_checkpointing:
            for model in models:
                # non-reentrant: the recomputed forward reuses the layer's pattern (Note [One pattern per forward])
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if plan.cp_size > 1 or configs:
            check_sparsity_args(owner, configs, plan.layout, plan.block_size)
            for cfg in configs:
                self.pad_multiple = math.lcm(self.pad_multiple, sparse_padding_multiple(
                    plan.layout, plan.cp_size, plan.block_size, cfg.tile_size))
            self.schedule = schedule if configs else None
            plan.schedule = self.schedule
            self.prepared = [prepare_model(m, plan, layer_sparsity) for m in models]
        else:  # the models keep their own attention: make it honour packed documents (before the fused loss hook)
            self.packed = [PackedDocuments(m) for m in models]
        self.tiled = tile_mlps(module, tiled_mlp, owner) if tiled_mlp is not None else None
        self.watch = NonFiniteWatch(models) if watch_nonfinite else None
        if fused_loss:  # after the ring hook: its pre-hook supplies the labels this one takes
            backend = "auto" if fused_loss is True else fused_loss
            self.fused = [f for f in (prepare_fused_loss(m, backend) for m in models) if f is not None]

    def shard(self, batch: Any) -> Any:
        """Pad and shard ``batch`` (on this rank's device) for this rank, and record it for the model hooks.

        With one CP rank and no model switched to ring attention, ``batch`` is returned as it is.
        """
        plan = self.plan
        if plan.cp_size == 1 and not self.prepared:
            return batch
        with same_on_ranks_of(plan.group):  # the CP group shares the batch: its checks fail alike on every rank
            sharded = shard_batch(
                batch, cp_rank=plan.cp_rank, cp_size=plan.cp_size, layout=plan.layout, block_size=plan.block_size,
                group=plan.group, multiple_of=self.pad_multiple,
            )
        plan.current = sharded
        return restore_batch_type(batch, sharded.batch)

    def attention_metrics(self) -> dict[str, float]:
        """The sparse attention statistics of the last measured step (empty when every layer is dense)."""
        return self.schedule.metrics() if self.schedule is not None else {}

    def nonfinite_message(self, loss: torch.Tensor, group: dist.ProcessGroup | None = None) -> str | None:
        """None if ``loss`` is finite on every rank of ``group`` (the default group when initialised; a collective
        then: every rank calls it); else a message naming where this rank's last forward first stopped being finite
        (:class:`~lightning_mtraining.hf.model.NonFiniteWatch`). One host sync, and one all-reduce of a flag."""
        finite = torch.isfinite(loss.detach()).all().to(torch.int32).reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=group)
        if bool(finite.item()):
            return None
        here = torch.isfinite(loss.detach()).all().item()
        rank = f"rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else "this process"
        where = self.watch.report() if self.watch is not None else "(no layer watch installed)"
        what = f"the loss is {loss.detach().float().reshape(-1)[0].item()}" if not here else "the loss is finite here"
        return f"non-finite loss: on {rank} {what}; {where}"

    def restore(self) -> None:
        """Remove every hook and restore each model's previous attention implementation."""
        if self.watch is not None:
            self.watch.restore()
            self.watch = None
        if self.tiled is not None:
            self.tiled.restore()
            self.tiled = None
        for fused in self.fused:
            fused.restore()
        for prepared in self.prepared:
            prepared.restore()
        for packed in self.packed:
            packed.restore()
        self.fused, self.prepared, self.packed = [], [], []
        self.plan.current = None
        self.plan.schedule = None


class PackedDocuments:
    """Packed documents on one device with the model's own attention (no ring attention installed).

    ``transformers`` reads packed documents from ``position_ids`` only when no ``attention_mask`` and no cache is passed
    (``masking_utils.find_packed_sequence_indices`` in ``_preprocess_mask_arguments``), and a training forward of a
    model whose config has ``use_cache=True`` (the default) creates a cache: the documents would silently attend to each
    other. For a forward whose ``position_ids`` restart (:func:`~lightning_mtraining.core.layouts.document_starts`) this
    pre-hook passes ``use_cache=False``, drops an all-ones ``attention_mask``, and sets ``labels`` to -100 at each
    document's first token (no target crosses a boundary, as under context parallelism). :meth:`restore` removes it.
    """

    def __init__(self, model: nn.Module) -> None:
        self._handle = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def restore(self) -> None:
        self._handle.remove()

    @staticmethod
    def _pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        pid = kwargs.get("position_ids")
        if not isinstance(pid, torch.Tensor) or pid.dim() != 2 or pid.is_floating_point() \
                or kwargs.get("past_key_values") is not None:
            return None
        doc = document_starts(pid)
        if doc is None:
            return None
        name = type(module).__name__
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all())):
                raise ValueError(
                    f"{name} received packed documents (position_ids that restart) together with an attention_mask "
                    "that is not all ones: transformers then ignores the document boundaries. Pack without padding "
                    "(or pad at the end of the last document, continuing its positions) and pass no attention_mask"
                )
            kwargs["attention_mask"] = None
        if kwargs.get("use_cache"):
            raise packed_documents_cache_error(name)
        kwargs["use_cache"] = False
        labels = kwargs.get("labels")
        if isinstance(labels, torch.Tensor) and labels.shape[-1] == doc.shape[-1]:
            first = doc == torch.arange(doc.shape[-1], device=doc.device)
            kwargs["labels"] = labels.masked_fill(first.to(labels.device).expand_as(labels), IGNORE_INDEX)
        return args, kwargs


def apply_context_parallel(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    cp_dim: str = "cp",
    tp_dim: str = "tp",
    layout: str = "striped",
    block_size: int = 128,
    sparsity: SparsityConfig | Callable[[int], SparsityConfig | None] | None = None,
    fused_loss: bool | str = True,
    activation_checkpointing: bool = False,
    tiled_mlp: int | None = None,
) -> ContextParallel:
    """Switch the Hugging Face causal LMs inside ``model`` to context parallelism over ``mesh[cp_dim]``, after
    splitting their decoder layers over ``mesh[tp_dim]`` when the mesh has that axis with more than one rank.

    Args:
        model: a ``transformers`` causal LM, or a module holding some. mesh: a device mesh with a ``cp_dim`` dimension
        (``("dp", "cp")``, or :func:`~lightning_mtraining.distributed.mesh.
            build_mesh`'s four axes); ``None``: one process, no split.
        tp_dim: the tensor parallel axis; absent or of size 1: no tensor parallelism. The split stays when
            :meth:`ContextParallel.restore` undoes the rest.
        layout, block_size: the token layout of the shards (see :mod:`lightning_mtraining.core.layouts`).
        sparsity: a :class:`SparsityConfig` for every layer, a function of the layer index, or None (dense).
            With tensor parallelism, per-head budgets are those of the global heads (each rank takes its own).
        fused_loss, activation_checkpointing, tiled_mlp: as the strategies' options (Note [Fused loss] in
            :mod:`lightning_mtraining.hf.fused_loss`, Note [Tiled MLP] in :mod:`lightning_mtraining.hf.tiled_mlp`).

    Returns the :class:`ContextParallel` handle: ``shard(batch)`` before each forward, ``restore()`` to undo. A flat
    ring; the strategies build the hierarchical (intra-/inter-node) rings from their own mesh.
    """
    from lightning_mtraining.core.layouts import LAYOUTS

    if layout not in LAYOUTS:
        raise ValueError(f"apply_context_parallel: layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"apply_context_parallel: block_size must be a positive int, got {block_size!r}")
    if mesh is None:
        if sparsity is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # group=None means the default group to the ring and the estimator: they would treat this process's
            # sequence as one shard of a world-sized ring
            raise ValueError(
                f"apply_context_parallel: mesh=None means one process, but torch.distributed is initialised with "
                f"{dist.get_world_size()} ranks and sparse attention needs its CP group; pass a mesh with a 'cp' "
                "axis (build_mesh(..., cp=1) for no context parallelism)"
            )
        plan = ContextParallelPlan(0, 1, layout, block_size)
    else:
        if mesh.mesh_dim_names is None or cp_dim not in mesh.mesh_dim_names:
            raise ValueError(
                f"apply_context_parallel: the mesh has dimensions {mesh.mesh_dim_names}, none named {cp_dim!r}; "
                "build it with init_device_mesh(..., mesh_dim_names=('dp', 'cp')) or pass cp_dim="
            )
        cp_mesh = mesh[cp_dim]
        plan = ContextParallelPlan(cp_rank=cp_mesh.get_local_rank(), cp_size=cp_mesh.size(), layout=layout,
                                   block_size=block_size, group=cp_mesh.get_group())  # size 1 too: not WORLD
    layer_sparsity = sparsity if callable(sparsity) else (lambda layer_idx: sparsity)
    check_sparsity_args("apply_context_parallel", [sparsity] if not callable(sparsity) else [], layout, block_size)
    if mesh is not None and tp_dim in (mesh.mesh_dim_names or ()) and mesh[tp_dim].size() > 1:
        tp_mesh = mesh[tp_dim]
        apply_tensor_parallel(model, tp_mesh)
        tp_rank, tp_size, global_sparsity = tp_mesh.get_local_rank(), tp_mesh.size(), layer_sparsity
        layer_sparsity = lambda layer_idx: local_sparsity(global_sparsity(layer_idx), tp_rank, tp_size)  # noqa: E731
    return ContextParallel(model, plan, layer_sparsity=layer_sparsity, fused_loss=fused_loss,
                           activation_checkpointing=activation_checkpointing, tiled_mlp=tiled_mlp)


def apply_fsdp(module: nn.Module, mesh: DeviceMesh | None, *, reshard_after_forward: bool = True) -> bool:
    """FSDP2 ``fully_shard`` every decoder layer, then each Hugging Face model inside ``module``, over the dp x cp
    part of ``mesh`` (:func:`~lightning_mtraining.distributed.mesh.fsdp_mesh`: HSDP when the mesh has ``dp_replicate >
    1``).
    Apply after tensor parallelism. Returns False (and does nothing) without a mesh."""
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        return False
    shard_mesh = fsdp_mesh(mesh)
    for model in find_hf_models(module):
        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers if layers is not None else []:
            fully_shard(layer, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=shard_mesh)
    return True
