"""This rank's place in context parallelism and the batch it works on (:class:`ContextParallelPlan`): what the
strategies, :func:`~lightning_mtraining.hf.parallel.apply_context_parallel` and the model hooks share."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from lightning_mtraining.distributed.sharding import ShardedBatch
from lightning_mtraining.ring.sparse_op import new_plan_uid, track_plan

__all__ = ["ContextParallelPlan"]


@dataclasses.dataclass
class ContextParallelPlan:
    """Where this rank sits in context parallelism, and the batch it is currently working on.

    ``current`` is set by the strategy each time it shards a batch; the model hook reads it.
    """

    cp_rank: int = 0
    cp_size: int = 1
    layout: str = "striped"
    block_size: int = 128
    group: dist.ProcessGroup | None = None
    inner_group: dist.ProcessGroup | None = None
    outer_group: dist.ProcessGroup | None = None
    current: ShardedBatch | None = None
    schedule: Any = None  # AttentionSchedule: sparse layers over time, the per-forward patterns, statistics
    # which model forward runs: a CPU tensor, so compiled layers read it as an input (an int would be a constant of
    # their graphs); the estimate op keeps one pattern per layer and forward by it (ring.sparse_op)
    forward_id: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros((), dtype=torch.int64),
                                                 compare=False, repr=False)
    uid: int = dataclasses.field(default_factory=new_plan_uid, compare=False)  # names its patterns in the estimate op
    layer_ids: tuple[int, ...] = ()  # the attention layers of the prepared models
    # each layer's sparsity for this forward (the schedule's decision, made when the forward begins): compiled layers
    # read it here, so their graphs do not hold the step count (a recompile every step)
    layer_configs: dict[int, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # the straight path's plans (lightning_mtraining.ring.straight.StraightPlan), by the batch's shapes and lengths:
    # settled once, reused by every layer and by later batches of the same shape
    straight: dict[tuple, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # whether sparse layers take the straight path where it applies, and its kernels ("auto": Triton on CUDA, torch
    # elsewhere; "triton" also runs them elsewhere, in the Triton interpreter: tests and op counts)
    straight_path: bool = dataclasses.field(default=True, compare=False)
    kernels: str = dataclasses.field(default="auto", compare=False)

    def __post_init__(self) -> None:
        track_plan(self, self.uid)

    def begin_forward(self, training: bool) -> None:
        """A new model forward: new patterns (Note [One pattern per forward]); the model hook calls it."""
        self.forward_id += 1
        if self.schedule is not None:
            self.schedule.begin_forward(training=training)
            for layer_idx in self.layer_ids:  # in place: the dict compiled layers read stays the same object
                self.layer_configs[layer_idx] = self.schedule.config_for(layer_idx)

    def end_forward(self) -> None:
        """The model's forward ended (the model hook calls it)."""
        if self.schedule is not None:
            self.schedule.end_forward()

    @property
    def inner_size(self) -> int:
        """Ranks of one inner ring (``cp_size`` for a flat ring)."""
        return dist.get_world_size(self.inner_group) if self.inner_group is not None else self.cp_size
