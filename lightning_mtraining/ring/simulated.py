"""A single-process simulated ring: every virtual rank's per-step work of a W-rank ring, on one device.

It calls the same per-step functions as the real ring (:func:`~lightning_mtraining.ring.steps.forward_step`,
:func:`~lightning_mtraining.ring.steps.backward_step`) in the same order, and sums each chunk's dK/dV in the order the
real ring does, so its results equal the real ring's. No communication happens: what it measures is each
virtual rank's compute per step (load balance, kernel efficiency), which is what a benchmark on one GPU can
show. Communication cost is modelled separately (``benchmarks/``).

Usage (full-sequence tensors in, per-rank shards out)::

    sim = SimulatedRing(world_size=8, layout="striped", block_size=128, inner_size=4)
    outs = sim.forward(q, k, v)              # list of W tensors [B, H, N/W, D]
    dqs, dks, dvs = sim.backward(douts)      # lists of W shards
    sim.timings                              # {(rank, step, "fwd" | "bwd"): milliseconds}
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from lightning_mtraining.core.layouts import layout_unit, shard_sequence
from lightning_mtraining.core.numerics import default_scale
from lightning_mtraining.core.topology import RingTopology
from lightning_mtraining.ring.block_ops import BlockAttentionOp, default_block_op
from lightning_mtraining.ring.setup import (
    check_sparse_layout,
    rank_positions,
    sparse_block_op,
    variant_op,
    window_for_length,
)
from lightning_mtraining.ring.steps import (
    attention_variant,
    backward_step,
    build_step_lists,
    forward_step,
    window_skips,
)
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern

__all__ = ["SimulatedRing"]


class SimulatedRing:
    """Runs a ring of ``world_size`` virtual ranks (``inner_size`` per node) in this process.

    Args:
        world_size: number of virtual CP ranks W.
        layout, block_size: token layout of the shards.
        inner_size: ranks per node for the hierarchical schedule (default: W, a flat ring).
        op: per-block attention op (default as in :func:`~lightning_mtraining.ring.attention.ring_attention`).
        scale: softmax scale (default ``1/sqrt(D)``).
        time_steps: record each (rank, step) compute time in :attr:`timings` (CUDA events on GPU).
        pattern: a global :class:`~lightning_mtraining.sparsity.pattern.VerticalSlashPattern` for the sparse ring
            (None: dense); each virtual rank builds its step lists as the real ring does (:attr:`step_lists`, per
            rank).
        verticals: ``"gathered"`` or ``"arrival"``, as in :func:`~lightning_mtraining.ring.attention.ring_attention`;
            the gathered vertical step is timed as step W (after the ring's steps). Its columns' dK/dV are summed
            over the virtual ranks in rank order (the real ring's all-reduce may order that sum differently).
        window, softcap: a sliding-window layer and score soft-capping, as in
            :func:`~lightning_mtraining.ring.attention.ring_attention` (a window makes the ring dense, steps outside
            every window skipped).
    """

    def __init__(
        self,
        world_size: int,
        layout: str = "striped",
        block_size: int = 128,
        inner_size: int | None = None,
        op: BlockAttentionOp | None = None,
        scale: float | None = None,
        time_steps: bool = False,
        pattern: VerticalSlashPattern | None = None,
        verticals: str = "gathered",
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        inner_size = world_size if inner_size is None else inner_size
        if world_size < 1 or inner_size < 1 or world_size % inner_size:
            raise ValueError(f"inner_size {inner_size} must be positive and divide world_size {world_size}")
        self.world_size, self.layout, self.block_size = world_size, layout, block_size
        self.inner_size, self.outer_size = inner_size, world_size // inner_size
        self.op, self.scale, self.time_steps, self.pattern = op, scale, time_steps, pattern
        self.verticals = verticals
        self.window, self.softcap = window, softcap
        self.step_lists: list = []
        self.topos = [
            RingTopology(r % inner_size, inner_size, r // inner_size, self.outer_size) for r in range(world_size)
        ]
        self.timings: dict[tuple[int, int, str], float] = {}
        self._events: list[tuple[tuple[int, int, str], torch.cuda.Event, torch.cuda.Event]] = []
        self._saved: tuple | None = None  # what forward keeps for backward

    @contextlib.contextmanager
    def _timed(self, key, device: torch.device):
        if not self.time_steps:
            yield
            return
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((key, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.timings[key] = (time.perf_counter() - t0) * 1e3

    def _collect(self) -> None:
        if self._events:
            torch.cuda.synchronize()
            for key, start, end in self._events:
                self.timings[key] = start.elapsed_time(end)
            self._events.clear()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        """Full-sequence ``q [B,H,N,D]``, ``k, v [B,Hkv,N,D]`` -> each virtual rank's output shard."""
        W, n = self.world_size, q.shape[2]
        layout_unit(self.layout, W, self.block_size)
        shard = lambda x, r: shard_sequence(x, 2, r, W, self.layout, self.block_size)  # noqa: E731
        scale = default_scale(q.shape[-1], self.scale)
        pos = rank_positions(n, W, self.layout, self.block_size, q.device)
        window = window_for_length(self.window, n)
        variant = attention_variant(window, self.softcap)
        skips = [window_skips(pos, r, window) or {} for r in range(W)]
        if self.pattern is None or window is not None:
            op = variant_op(default_block_op(q.device) if self.op is None else self.op, window, self.softcap)
            self.step_lists = [None] * W
        else:
            pattern = self.pattern.to(q.device)
            pattern.validate(n, q.shape[1], k.shape[1], batch_size=q.shape[0])
            check_sparse_layout(n, W, self.layout, self.block_size, pattern.tile_size)
            op = variant_op(sparse_block_op(self.op, q.device, pattern.tile_size), None, self.softcap)
            mode = self.verticals if W > 1 else "arrival"
            self.step_lists = [build_step_lists(pattern, pos, r, topo.sources(), q.shape[1], k.shape[1], n, mode)
                               for r, topo in enumerate(self.topos)]
        qs = [shard(q, r) for r in range(W)]
        kvs = [torch.stack([shard(k, r), shard(v, r)]) for r in range(W)]
        states = []
        for r, topo in enumerate(self.topos):
            state: Any = None  # (out, lse) once a step has run
            plan = self.step_lists[r]
            for step, src in enumerate(topo.sources()):
                tiles, skip = (None, skips[r].get(src, False)) if plan is None else plan.for_source(src)
                with self._timed((r, step, "fwd"), q.device):
                    state = forward_step(state, op, qs[r], kvs[src], pos[r], pos[src], scale, tiles, skip, variant)
            if plan is not None and plan.vert_pos is not None:  # the gathered vertical step
                kv_v = torch.stack([k.index_select(2, plan.vert_pos), v.index_select(2, plan.vert_pos)])
                with self._timed((r, W, "fwd"), q.device):
                    state = forward_step(state, op, qs[r], kv_v, pos[r], plan.vert_pos, scale, plan.gathered,
                                         plan.gathered_skip, variant)
            states.append(state)
        self._collect()
        outs = [s[0].to(q.dtype) for s in states]
        self._saved = (qs, kvs, outs, [s[1] for s in states], pos, op, scale, (k, v), variant, skips)
        return outs

    def backward(self, douts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per-rank output gradients -> per-rank (dq, dk, dv) shards, as the real ring's backward returns them."""
        if self._saved is None:
            raise RuntimeError("call forward() before backward()")
        qs, kvs, outs, lses, pos, op, scale, (k_full, v_full), variant, skips = self._saved
        W, Wi, Wo = self.world_size, self.inner_size, self.outer_size
        dqs, contrib, gathered = [], {}, {}
        for r, topo in enumerate(self.topos):
            dq = torch.zeros(qs[r].shape, dtype=lses[r].dtype, device=qs[r].device)
            plan = self.step_lists[r]
            for step, src in enumerate(topo.sources()):
                tiles, skip = (None, skips[r].get(src, False)) if plan is None else plan.for_source(src)
                with self._timed((r, step, "bwd"), qs[r].device):
                    contrib[(r, step)] = backward_step(
                        dq, op, qs[r], kvs[src], outs[r], lses[r], douts[r].contiguous(), pos[r], pos[src], scale,
                        tiles, skip, variant,
                    )
            if plan is not None and plan.vert_pos is not None:
                kv_v = torch.stack([k_full.index_select(2, plan.vert_pos), v_full.index_select(2, plan.vert_pos)])
                with self._timed((r, W, "bwd"), qs[r].device):
                    gathered[r] = backward_step(dq, op, qs[r], kv_v, outs[r], lses[r], douts[r].contiguous(), pos[r],
                                                plan.vert_pos, scale, plan.gathered, plan.gathered_skip, variant)
            dqs.append(dq.to(qs[r].dtype))
        self._collect()
        dks, dvs = [], []
        for c in range(W):  # sum chunk c's contributions in the real ring's order (see ring.py's Note)
            oc, ic = divmod(c, Wi)
            total: Any = None  # the chunk's dK/dV [2, B, Hkv, S, D], once one node's sum is in
            for so in range(Wo):
                node_sum: Any = None
                for si in range(Wi):
                    r = ((oc + so) % Wo) * Wi + (ic + si) % Wi
                    d = contrib[(r, so * Wi + si)]
                    node_sum = d if node_sum is None else d + node_sum
                total = node_sum if total is None else node_sum + total
            if gathered:  # the columns' dK/dV summed over the ranks, added by their owner
                plan = self.step_lists[c]
                local, mine = plan.owned
                dkv_v = sum(gathered[r] for r in range(W))
                total = total.index_add(3, local, dkv_v * mine.view(1, 1, 1, -1, 1).to(dkv_v.dtype))
            dks.append(total[0].to(kvs[c].dtype))
            dvs.append(total[1].to(kvs[c].dtype))
        return dqs, dks, dvs
