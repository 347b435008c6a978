"""The core layer: what every higher layer shares, with torch and torch.distributed only.

- :mod:`.layouts`: token layouts of a sequence over context-parallel ranks (contiguous, zigzag, striped): shard,
  unshard, global positions, packed-document starts, and the input checks of attention calls.
- :mod:`.topology`: the flat or hierarchical ring topology of a rank and its process groups.
- :mod:`.collectives`: collectives across torch versions and backends, and failures that name the operation.
- :mod:`.numerics`: the softmax scale and the accumulation dtype; :mod:`.checks`: argument checks used everywhere;
  :mod:`.errors`: failures every rank finds alike, reported once (Note [Failures that speak once]), and a failure on one
  rank reported once, last (Note [The first failure speaks last]).
- :mod:`.profiling`: profiler ranges (a flag check when no profiler runs); :mod:`.rng`: random generator states
  kept around code that re-seeds them; :mod:`.deprecation`: the warning of a name that moved; :mod:`.memo`: what is
  derived from a tensor, kept while it lives (a batch's packed documents, checked once for every layer).
"""

from lightning_mtraining.core.layouts import LAYOUTS, global_positions, shard_sequence, unshard_sequence
from lightning_mtraining.core.topology import RingTopology, resolve_topology

__all__ = ["LAYOUTS", "RingTopology", "global_positions", "resolve_topology", "shard_sequence", "unshard_sequence"]
