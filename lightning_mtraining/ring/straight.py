"""The straight per-layer path of sparse ring attention: plan once a batch, then per layer estimate -> lists ->
kernels and nothing else.

Note [The straight path]
------------------------
A sparse layer used to check its inputs, look up memos, validate its pattern, pick its block op and read its dense
decision on the host, every layer and pass: hundreds of small ops, so on a GPU the host, not the kernels, set the
step's pace. Here what depends only on the batch is settled once, by :class:`StraightPlan` (built before the first
layer of a forward, the way an attention library plans a batch before running its layers): the topology and the
checks, every rank's positions (int32, as the kernels read them), the ring's source order, the block op, the
estimator's probe rows and buffers (:class:`~lightning_mtraining.sparsity.batch_estimator.BatchEstimator`). Then a
layer's forward is:

    estimate (scores, keys, top-k, finish)  ->  step lists (one builder launch)  ->  attention kernels

and its checkpointed recompute reuses the forward's :class:`LayerRun` (pattern and lists): only the attention runs
again. Nothing in a layer reads a device value on the host, so its launches never wait for the GPU:

- which heads run dense is the *previous* forward's decision of the layer (``dense``: per batch row, the pattern heads
  whose estimated pattern allowed more than ``dense_above`` of their causal pairs in that row; per row, so a batch
  split over data-parallel ranks decides as it would on one device); this forward's decision is made on the device
  and read once, after the forward, for the next one. A head running dense computes every causal pair
  (the pattern with its every tile diagonal, exact); a layer whose every head runs dense takes the dense ring (the
  machine's fused dense kernel at one rank).
- over several ranks every ring step runs (a step whose lists are empty computes nothing in its kernels), and the
  gathered vertical columns (Note [Gathered verticals] in :mod:`.walk`) come in a buffer of a fixed size, padded
  with positions no query sees, instead of the exact union read back to the host.

The same pattern as :func:`~lightning_mtraining.sparsity.estimation.estimate_pattern` and the same attention as
:func:`~lightning_mtraining.ring.attention.ring_attention` with the layer's :class:`~lightning_mtraining.sparsity.
pattern.LayerPattern` (tested), at every world size.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.distributed as dist

from lightning_mtraining.core.layouts import check_attention_inputs, check_local_length
from lightning_mtraining.core.numerics import acc_dtype, default_scale
from lightning_mtraining.core.topology import RingTopology, resolve_topology
from lightning_mtraining.ring.block_ops import BlockAttentionOp, TorchBlockOp
from lightning_mtraining.ring.setup import check_sparse_layout, dense_setup, rank_positions
from lightning_mtraining.ring.steps import StepLists
from lightning_mtraining.ring.walk import (
    RingAttentionFunction,
    gather_vertical_kv,
    gathered_backward,
    ring_backward,
    ring_forward,
)
from lightning_mtraining.sparsity.batch_estimator import BatchEstimator, Estimate
from lightning_mtraining.sparsity.config import SparsityConfig
from mtraining_kernels.indexing import sorted_union, step_tile_lists, step_tile_lists_batched
from mtraining_kernels.lists import TileLists, size_class

__all__ = ["Kernels", "LayerRun", "StraightPlan"]

Kernels = Literal["triton", "torch"]


@dataclasses.dataclass
class LayerRun:
    """What one sparse layer runs in one forward (kept for its checkpointed recompute and its backward).

    ``estimate``: the layer's :class:`~lightning_mtraining.sparsity.batch_estimator.Estimate`; ``steps``: the ring's
    lists (None: every head of the layer runs dense, and the layer takes the dense ring); ``config``: its budgets;
    ``op``: the block op that computes them."""

    estimate: Estimate
    steps: StepLists | None
    config: SparsityConfig
    op: BlockAttentionOp | None = None

    @property
    def all_dense(self) -> bool:
        return self.steps is None


class StraightPlan:
    """What a sparse ring layer runs for one batch, settled once (Note [The straight path]).

    Args:
        q, k: a layer's query ``[B, H, S, D]`` and key ``[B, Hkv, S, D]`` shards (their shapes, dtype and device).
        lengths: the real length of each batch row.
        group, inner_group, outer_group, layout, block_size: the CP group and rings, and the sharding.
        kernels: ``"triton"`` (CUDA) or ``"torch"``: the estimator's route, the list builder and the block op.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, *, lengths: tuple[int, ...],
                 group: dist.ProcessGroup | None, inner_group: dist.ProcessGroup | None,
                 outer_group: dist.ProcessGroup | None, layout: str, block_size: int, kernels: Kernels) -> None:
        check_attention_inputs(q, k)
        topo = resolve_topology(group, inner_group, outer_group)
        B, H, S, D = q.shape
        check_local_length(S, topo.cp_size, layout, block_size)
        if topo.cp_size > 1 and group is None and topo.outer_size > 1:
            raise ValueError("sparse hierarchical ring attention needs group= (the whole CP group, for the pattern "
                             "estimator) besides inner_group and outer_group")
        self.topo: RingTopology = topo
        self.n = S * topo.cp_size
        self.layout, self.block_size, self.kernels = layout, block_size, kernels
        self.est_group = group if group is not None else (topo.inner_group if topo.cp_size > 1 else None)
        self.positions = tuple(p.to(torch.int32) for p in rank_positions(self.n, topo.cp_size, layout, block_size,
                                                                             q.device))
        self.q_pos = self.positions[topo.cp_rank]
        self.sources = topo.sources()
        self.k_pos_steps = torch.stack([self.positions[s] for s in self.sources])
        self.estimator = BatchEstimator(batch=B, heads=H, kv_heads=k.shape[1], local_len=S, head_dim=D,
                                        dtype=q.dtype, device=q.device, lengths=lengths, group=self.est_group,
                                        cp_rank=topo.cp_rank, cp_size=topo.cp_size, layout=layout,
                                        block_size=block_size, route=kernels)
        self._ops: dict[int, BlockAttentionOp] = {}

    def op(self, tile: int) -> BlockAttentionOp:
        """The block op of ``tile`` x ``tile`` lists: the Triton kernels' (one per tile size), or a new torch op (it
        keeps what it derives from a layer's lists for that layer's backward, so it lives as long as they do)."""
        check_sparse_layout(self.n, self.topo.cp_size, self.layout, self.block_size, tile)  # (cached)
        if self.kernels != "triton":
            return TorchBlockOp()
        found = self._ops.get(tile)
        if found is None:
            from mtraining_kernels.vertical_slash import TritonBlockOp

            found = self._ops[tile] = TritonBlockOp(tile, tile)
        return found

    def layer(self, q: torch.Tensor, k: torch.Tensor, config: SparsityConfig, layer_idx: int | None,
              scale: float | None, dense: tuple[tuple[bool, ...], ...] | None) -> LayerRun:
        """A layer's forward work before its attention: the estimate and the ring's lists (no autograd: nothing of
        it is differentiated, and a checkpointed recompute, which reuses it, must save what the forward saved)."""
        scale = default_scale(q.shape[-1], scale)
        with torch.no_grad():
            est = self.estimator.estimate(q, k, config, layer_idx, scale, dense)
            if dense is not None and all(all(row) for row in dense):
                return LayerRun(est, None, config)
            return LayerRun(est, self._steps(est), config, self.op(config.tile_size))

    def _steps(self, est: Estimate) -> StepLists:
        pt = est.tiles
        backend = "triton" if self.kernels == "triton" else "torch"
        W = self.topo.cp_size
        gather = W > 1 and pt.verticals.shape[-1] > 0
        built = step_tile_lists_batched(pt, self.q_pos, self.k_pos_steps, columns=not gather, backend=backend)
        lists: dict[int, TileLists] = dict(zip(self.sources, built))
        skip = {src: False for src in self.sources}  # no host read: a step with empty lists computes nothing
        if not gather:
            return StepLists(lists, skip)
        # the verticals' union over batch rows and heads, in a buffer of a fixed size (Note [The straight path])
        B, G = est.pattern.vertical_idx.shape[:2]
        size = size_class(min(B * G * est.pattern.vertical_idx.shape[-1], self.n), 64, pt.big)
        vert_pos, _ = sorted_union(pt.verticals, pt.big, size=size)
        gathered = step_tile_lists(pt, self.q_pos, vert_pos, tiles=False, backend=backend)
        q_pos = self.q_pos.to(torch.int64)
        local = torch.searchsorted(q_pos, vert_pos).clamp(max=q_pos.numel() - 1)
        owned = (local, q_pos[local] == vert_pos)
        return StepLists(lists, skip, vert_pos, gathered, False, owned)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: LayerRun,
               scale: float | None) -> torch.Tensor:
        """The layer's sparse attention over ``run``'s lists (``[B, H, S, D]``, differentiable in q, k and v)."""
        assert run.steps is not None and run.op is not None  # an all-dense layer takes the dense ring
        scale = default_scale(q.shape[-1], scale)
        op = run.op
        if self.topo.cp_size == 1 and hasattr(op, "differentiable"):
            return op.differentiable(q, k, v, self.q_pos, self.q_pos, scale, tiles=run.steps.lists[self.sources[0]])
        return RingAttentionFunction.apply(q, k, v, self.topo, self.positions, op, scale, run.steps, self.est_group,
                                           {}, None)

    # --- the same as explicit passes, for a custom op (torch.compile: no autograd inside) ----------------------------

    def _ring_args(self, q, k, v, run: LayerRun, scale: float):
        if run.steps is None:  # every head dense: the dense ring (its fused kernel at one rank)
            d = dense_setup(q, k, v, self.topo, self.layout, self.block_size, scale, None, None, None)
            return d.positions, d.op, d.scale, None, d.variant, d.skips
        assert run.op is not None
        return self.positions, run.op, scale, run.steps, {}, None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: LayerRun,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, H, S, D] in q's dtype, lse [B, H, S])`` of the layer's attention under ``run`` (the dense ring
        where every head runs dense), without autograd; :meth:`backward` takes them."""
        positions, op, scale, steps, variant, skips = self._ring_args(q, k, v, run, default_scale(q.shape[-1], scale))
        (out, lse), _ = ring_forward(q, torch.stack([k, v]), self.topo, positions, op, scale, steps, self.est_group,
                                      variant, skips)
        return out.to(q.dtype).contiguous(), lse.to(acc_dtype(q.dtype)).contiguous()

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, run: LayerRun, scale: float | None) -> tuple[torch.Tensor, ...]:
        """``(dq, dk, dv)`` of :meth:`forward`'s attention given the output's gradient."""
        positions, op, scale, steps, variant, skips = self._ring_args(q, k, v, run, default_scale(q.shape[-1], scale))
        kv = torch.stack([k, v])
        dq, dk, dv = ring_backward(dout.contiguous(), q, kv, out, lse, self.topo, positions, op, scale, steps, variant,
                                    skips)
        if steps is not None and steps.vert_pos is not None:  # Note [Gathered verticals] in walk.py: again
            kv_v = gather_vertical_kv(kv, steps, self.est_group, self.topo.cp_size)
            gathered_backward(dq, q, kv_v, out, lse, dout, positions[self.topo.cp_rank], steps, op, scale,
                               self.est_group, self.topo.cp_size, dk, dv, variant)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
