"""Where a rank sits in context parallelism's ring: the flat or hierarchical (outer x inner) topology and its
process groups.

CP ranks are numbered ``cp_rank = outer_rank * inner_size + inner_rank`` (outer = node, inner = GPU in node); a flat
ring is the case ``outer_size == 1``. The ring (:mod:`lightning_mtraining.ring`) walks it; the work counts
(:mod:`lightning_mtraining.sparsity.balance`) read its step order.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

__all__ = ["RingTopology", "group_rank_size", "resolve_topology"]


@dataclasses.dataclass(frozen=True)
class RingTopology:
    """Where this rank sits in the (outer x inner) ring, and the process groups of each ring."""

    inner_rank: int
    inner_size: int
    outer_rank: int
    outer_size: int
    inner_group: dist.ProcessGroup | None = None
    outer_group: dist.ProcessGroup | None = None

    @property
    def cp_rank(self) -> int:
        return self.outer_rank * self.inner_size + self.inner_rank

    @property
    def cp_size(self) -> int:
        return self.outer_size * self.inner_size

    def source(self, outer_step: int, inner_step: int) -> int:
        """CP rank whose K/V chunk this rank holds at (outer_step, inner_step)."""
        o = (self.outer_rank - outer_step) % self.outer_size
        i = (self.inner_rank - inner_step) % self.inner_size
        return o * self.inner_size + i

    def sources(self) -> list[int]:
        """CP ranks whose chunk is computed at each step, in schedule order (the first is always cp_rank)."""
        return [self.source(so, si) for so in range(self.outer_size) for si in range(self.inner_size)]


def group_rank_size(group: dist.ProcessGroup | None, call: str = "the call") -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (the default group when None); ``(0, 1)`` when
    torch.distributed is not initialised and no group is given. Raises if this process is not a member, saying that
    every rank of the group must take part in ``call``."""
    if group is None and not dist.is_initialized():
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            "this process is not a member of the process group passed as `group`; pass the context-parallel group "
            f"this rank's shard belongs to (every rank of it must take part in {call})"
        )
    return rank, dist.get_world_size(group)


def resolve_topology(
    group: dist.ProcessGroup | None = None,
    inner_group: dist.ProcessGroup | None = None,
    outer_group: dist.ProcessGroup | None = None,
) -> RingTopology:
    """The ring topology from a flat CP group, or from an inner (intra-node) and outer (inter-node) group."""
    if (inner_group is None) != (outer_group is None):
        raise ValueError(
            "hierarchical ring attention needs both inner_group (ranks of one node) and outer_group (same "
            f"local rank across nodes); got inner_group={inner_group!r}, outer_group={outer_group!r}"
        )
    if inner_group is not None:
        inner_rank, inner_size = group_rank_size(inner_group)
        outer_rank, outer_size = group_rank_size(outer_group)
        topo = RingTopology(inner_rank, inner_size, outer_rank, outer_size, inner_group, outer_group)
        if group is not None:
            rank, size = group_rank_size(group)
            if (rank, size) != (topo.cp_rank, topo.cp_size):
                raise ValueError(
                    f"group rank/size ({rank}/{size}) disagree with the hierarchical rings: outer rank "
                    f"{outer_rank}/{outer_size} x inner rank {inner_rank}/{inner_size} gives CP rank "
                    f"{topo.cp_rank}/{topo.cp_size}; CP ranks must be numbered outer_rank * inner_size + inner_rank"
                )
        return topo
    if group is None and not dist.is_initialized():
        return RingTopology(0, 1, 0, 1)
    rank, size = group_rank_size(group)
    return RingTopology(rank, size, 0, 1, inner_group=group if group is not None else dist.group.WORLD)
