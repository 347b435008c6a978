"""The distributed layer: where each rank sits and what it holds.

- :mod:`.mesh`: the named device mesh (``dp_replicate x dp_shard x cp x tp``), the strategies' one mesh builder
  (:func:`build_context_parallel`, with the rings of hierarchical ring attention) and the size checks.
- :mod:`.plan`: :class:`ContextParallelPlan`, this rank's place in context parallelism and its current batch.
- :mod:`.sharding`: a batch padded, its labels shifted over the whole sequence, and this rank's shard of it
  (:func:`shard_batch`); outputs gathered back whole.
"""

from lightning_mtraining.distributed.mesh import MeshAxes, build_context_parallel, build_mesh, fsdp_mesh
from lightning_mtraining.distributed.plan import ContextParallelPlan
from lightning_mtraining.distributed.sharding import ShardedBatch, gather_sequence, shard_batch

__all__ = ["ContextParallelPlan", "MeshAxes", "ShardedBatch", "build_context_parallel", "build_mesh", "fsdp_mesh",
           "gather_sequence", "shard_batch"]
