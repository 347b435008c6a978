"""The named N-dimensional device mesh: data parallel (replicate and shard) x context parallel x tensor parallel.

One place builds the meshes: :func:`build_mesh` the N-dimensional one, and :func:`build_context_parallel`, which every
strategy calls, the mesh and this rank's :class:`~lightning_mtraining.distributed.plan.ContextParallelPlan` (with the
inner and outer rings of hierarchical ring attention). Sizes are checked against the world
(:func:`resolve_mesh_sizes`, :func:`resolve_context_parallel_size`, :func:`resolve_inner_ring_size`) and against a model
(:func:`check_mesh_fits_model`); the rest of the package reads a mesh through :class:`MeshAxes`.

Note [The mesh axes]
--------------------
Four named axes, outermost first, as torchtitan orders them::

    ("dp_replicate", "dp_shard", "cp", "tp")       every size may be 1; the product is the world size

    world 8 = dp_replicate 1 x dp_shard 2 x cp 2 x tp 2, global rank = ((r * S + s) * C + c) * T + t

    rank:   0   1 | 2   3 | 4   5 | 6   7
    tp:     0   1 | 0   1 | 0   1 | 0   1      tp innermost: the per-layer all-reduces stay on neighbours
    cp:     0   0 | 1   1 | 0   0 | 1   1      a ring links ranks of equal (dp, tp) coordinates
    dp:     0   0 | 0   0 | 1   1 | 1   1      one sample per dp coordinate; its cp x tp ranks share it

- ``tp``: the heads and MLP columns of each decoder layer are split (:mod:`lightning_mtraining.hf.tensor_parallel`);
  every rank of a tp group holds the same tokens and computes the same loss.
- ``cp``: the sequence is split; attention is the ring over this axis (:mod:`lightning_mtraining.ring`).
- ``dp_shard`` x ``cp`` (flattened as ``"dp_shard_cp"``): FSDP2 shards parameters, gradients and optimizer state
  over it; with ``dp_replicate > 1`` the shards are replicated over ``dp_replicate`` (HSDP). The gradient
  reduction averages over every dp x cp rank, which with the loss scaling of Note [Exact losses and gradients] in
  :mod:`lightning_mtraining.hf` is the exact gradient.
- ``dp_replicate`` x ``dp_shard`` (:attr:`MeshAxes.dp`, :attr:`MeshAxes.dp_rank`): which sample a rank reads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_mtraining.core.checks import is_int
from lightning_mtraining.distributed.plan import ContextParallelPlan

__all__ = ["MESH_DIM_NAMES", "MeshAxes", "build_context_parallel", "build_mesh", "check_mesh_fits_model",
           "describe_mesh", "fsdp_mesh", "resolve_context_parallel_size", "resolve_inner_ring_size",
           "resolve_mesh_sizes"]

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


def _positive(owner: str, name: str, value: Any) -> int:
    if not is_int(value):
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value


def resolve_mesh_sizes(
    world_size: int,
    *,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    cp: int = 1,
    tp: int = 1,
    owner: str = "build_mesh",
) -> tuple[int, int, int, int]:
    """``(dp_replicate, dp_shard, cp, tp)`` for ``world_size`` ranks; ``dp_shard=None`` takes what is left.

    Raises ValueError (with the sizes) when the product is not the world size.
    """
    dp_replicate, cp, tp = (_positive(owner, n, v) for n, v in
                            (("dp_replicate", dp_replicate), ("cp", cp), ("tp", tp)))
    others = dp_replicate * cp * tp
    if dp_shard is None:
        if world_size % others:
            raise ValueError(
                f"{owner}: the world of {world_size} ranks is not divisible by dp_replicate {dp_replicate} x cp {cp} "
                f"x tp {tp} = {others}; choose sizes whose product divides the number of processes"
            )
        dp_shard = world_size // others
    dp_shard = _positive(owner, "dp_shard", dp_shard)
    if dp_replicate * dp_shard * cp * tp != world_size:
        raise ValueError(
            f"{owner}: dp_replicate {dp_replicate} x dp_shard {dp_shard} x cp {cp} x tp {tp} = "
            f"{dp_replicate * dp_shard * cp * tp} ranks, but the world has {world_size}; the product of the mesh "
            "sizes must equal the number of processes (leave dp_shard=None to take what is left)"
        )
    return dp_replicate, dp_shard, cp, tp


def build_mesh(
    device_type: str,
    *,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    cp: int = 1,
    tp: int = 1,
) -> DeviceMesh:
    """The ``("dp_replicate", "dp_shard", "cp", "tp")`` mesh over the initialised default process group
    (collective: every rank calls it; Note [The mesh axes]). ``dp_shard=None``: the world size divided by the
    other sizes. :func:`fsdp_mesh` gives FSDP2's part of it."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_mesh needs an initialised process group (torch.distributed.init_process_group)")
    sizes = resolve_mesh_sizes(dist.get_world_size(), dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp)
    return init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIM_NAMES)

def resolve_context_parallel_size(context_parallel_size: int | str, world_size: int) -> int:
    """``"auto"`` -> the whole world; an int must divide the world size (the rest is data parallel)."""
    if isinstance(context_parallel_size, str):
        if context_parallel_size != "auto":
            raise ValueError(f"context_parallel_size must be 'auto' or a positive int, got {context_parallel_size!r}")
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


def describe_mesh(owner: str, world_size: int, cp_size: int, inner_size: int, layout: str, block_size: int,
                  dp_replicate: int = 1, tp: int = 1, num_nodes: int = 1) -> str:
    """One line for the log: ``world 4 = dp 2 x cp 2, flat ring of 2, striped layout (block 128)``; with tensor
    parallel or replicas ``world 8 = dp_replicate 1 x dp_shard 2 x cp 2 x tp 2, ...``.

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
    ring = _ring_phrase(cp_size, inner_size, per_node, tp)
    if tp > 1 or dp_replicate > 1:
        shard = world_size // (dp_replicate * cp_size * tp)
        sizes = f"dp_replicate {dp_replicate} x dp_shard {shard} x cp {cp_size} x tp {tp}"
    else:
        sizes = f"dp {world_size // cp_size} x cp {cp_size}"
    return f"{owner}: {world} = {sizes}, {ring}, {layout} layout{unit}"


def _ring_phrase(cp_size: int, inner_size: int, per_node: int | None, tp: int = 1) -> str:
    """The ring part of :func:`describe_mesh`; with ``per_node`` (ranks per node, several nodes) also where its hops
    run. CP groups are consecutive global ranks (strided by ``tp`` with tensor parallel) and node ``n`` holds ranks
    ``n * per_node ...``, so a CP group (an inner ring) lies inside one node exactly when its span divides
    ``per_node``."""
    if cp_size == 1:
        return "no context parallelism (plain data parallel)"
    if not 1 < inner_size < cp_size:
        if per_node is None:
            return f"flat ring of {cp_size}"
        if per_node % (cp_size * tp) == 0:
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


def build_context_parallel(
    device_type: str,
    world_size: int,
    cp_size: int,
    inner_size: int,
    layout: str,
    block_size: int,
    *,
    dp_replicate: int = 1,
    tp: int = 1,
) -> tuple[DeviceMesh | None, ContextParallelPlan]:
    """The device mesh and this rank's :class:`ContextParallelPlan` (collective: all ranks call): every strategy's
    one mesh builder.

    With ``tp == dp_replicate == 1`` the mesh is ``("dp", "cp")``, plus the inner and outer rings when
    ``1 < inner_size < cp_size`` (hierarchical ring attention); otherwise the N-dimensional :func:`build_mesh` mesh
    (flat rings only). Without an initialised process group (world size 1) there is no mesh and the plan is a single
    rank.
    """
    if not dist.is_initialized():
        if world_size != 1:
            raise RuntimeError(f"world size {world_size} but torch.distributed is not initialised")
        return None, ContextParallelPlan(0, 1, layout, block_size)
    if tp > 1 or dp_replicate > 1:
        if inner_size != cp_size:
            raise ValueError(f"hierarchical rings (inner ring {inner_size} of cp {cp_size}) are not built with "
                             f"tensor parallel ({tp}) or data-parallel replicas ({dp_replicate}); use a flat ring")
        mesh = build_mesh(device_type, dp_replicate=dp_replicate, cp=cp_size, tp=tp)
        cp_mesh = mesh["cp"]
        return mesh, ContextParallelPlan(cp_rank=cp_mesh.get_local_rank(), cp_size=cp_size, layout=layout,
                                         block_size=block_size, group=cp_mesh.get_group())
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


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """This rank's coordinates and the axis sizes of a mesh (missing axes have size 1): reads a
    :func:`build_mesh` mesh or a two-axis ``("dp", "cp")`` one alike."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @classmethod
    def of(cls, mesh: DeviceMesh | None) -> MeshAxes:
        if mesh is None:
            return cls()
        names = mesh.mesh_dim_names or ()
        size = {n: mesh.size(i) for i, n in enumerate(names)}
        coord = dict(zip(names, mesh.get_coordinate() or [0] * len(names)))
        if "dp" in names:  # the ("dp", "cp") mesh of the strategies
            dp_replicate, dp_shard = 1, size["dp"]
            dp_rank = coord["dp"]
        else:
            dp_replicate, dp_shard = size.get("dp_replicate", 1), size.get("dp_shard", 1)
            dp_rank = coord.get("dp_replicate", 0) * dp_shard + coord.get("dp_shard", 0)
        return cls(dp_replicate, dp_shard, size.get("cp", 1), size.get("tp", 1), dp_rank, coord.get("cp", 0),
                   coord.get("tp", 0))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2's ``fully_shard`` takes: ``dp_shard x cp`` flattened as ``"dp_shard_cp"`` (1D), or with
    ``dp_replicate > 1`` the 2D ``("dp_replicate", "dp_shard_cp")`` mesh (HSDP). A ``("dp", "cp")`` mesh flattens
    to ``"dp_cp"``. Flattening again returns the same mesh."""
    names = mesh.mesh_dim_names or ()
    if "dp_shard" not in names:
        return mesh._flatten("dp_cp") if mesh.ndim > 1 else mesh
    missing = [n for n in MESH_DIM_NAMES if n not in names]
    if missing:
        raise ValueError(f"fsdp_mesh: the mesh {names} lacks {missing}; build it with "
                         "lightning_mtraining.distributed.build_mesh")
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if mesh.size(names.index("dp_replicate")) == 1:
        return flat
    # slicing a flattened axis from the root mesh: torch 2.13 warns that it "will be deprecated", and it works there
    return mesh["dp_replicate", "dp_shard_cp"]


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def check_mesh_fits_model(config: Any, tp: int, owner: str = "tensor parallel") -> None:
    """Raise ValueError (the sizes, and what to do) when a Hugging Face ``config`` cannot be split ``tp`` ways:
    query heads, key/value heads and the MLP's intermediate size must be divisible by ``tp`` (each rank holds whole
    heads; a grouped-query model needs at least one KV head per rank)."""
    if tp == 1:
        return
    config = getattr(config, "get_text_config", lambda: config)()
    heads = _config_int(config, "num_attention_heads", "n_head")
    inter = _config_int(config, "intermediate_size", "n_inner")
    name = type(config).__name__
    if heads is None:
        raise ValueError(f"{owner}: {name} has no num_attention_heads; cannot split its attention {tp} ways")
    kv_heads = _config_int(config, "num_key_value_heads") or heads
    if heads % tp:
        raise ValueError(
            f"{owner}: {name}.num_attention_heads={heads} is not divisible by the tensor parallel size {tp}; each "
            f"rank must hold whole heads (use a tp size that divides {heads})"
        )
    if kv_heads < tp:
        raise ValueError(
            f"{owner}: {name}.num_key_value_heads={kv_heads} is fewer than the tensor parallel size {tp}; each rank "
            f"needs its own key/value heads (use tp <= {kv_heads}, and put the other ranks in cp or dp)"
        )
    if kv_heads % tp:
        raise ValueError(
            f"{owner}: {name}.num_key_value_heads={kv_heads} is not divisible by the tensor parallel size {tp} "
            f"(use a tp size that divides {math.gcd(kv_heads, heads)})"
        )
    if inter is not None and inter % tp:
        raise ValueError(
            f"{owner}: {name}.intermediate_size={inter} is not divisible by the tensor parallel size {tp}; the MLP's "
            "columns are split evenly"
        )
