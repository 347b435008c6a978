"""The pattern estimator settled once a batch (:class:`BatchEstimator`): what depends only on the batch (lengths,
positions, probe rows, the scorer's key block, buffers at fixed addresses, budgets as device tensors) is worked out
before the first layer, so that a layer's estimate is a few launches and nothing else.

A layer's :meth:`BatchEstimator.estimate` returns an :class:`Estimate`: the global pattern (exactly
:func:`~lightning_mtraining.sparsity.estimation.estimate_pattern`'s, -1 padded to the static widths ``sink_tokens +
the largest vertical budget`` and ``local_window + the largest slash budget``), the prepared tiles the ring's list
builder reads (:class:`~mtraining_kernels.lists.PatternTiles`, bounded widths), and on the device each head's exact
allowed pairs over its real sequence and whether they exceed ``dense_above`` of its causal pairs. No host read.

Two routes, chosen once per batch:

- ``"triton"`` (CUDA; in tests also the Triton interpreter): the Triton scorer in two launches (the first also zeroes
  the slash buffer, the second merges the normaliser's partials itself), the candidate keys in one
  (:func:`mtraining_kernels.pattern_select.select_keys`), ``torch.topk``, and the selection, pattern, tiles, counts and
  decision in one (:func:`mtraining_kernels.pattern_select.finish_pattern`). Over W ranks the collectives of Note
  [Distributed estimation] sit between them: the probe rows' all-reduce, an all-gather of the normaliser's partials,
  the slash sums' reduce-scatter and an all-gather of the top keys with the masses' partials (then one more
  ``topk``). It applies to half and float32 inputs without packed documents, with the ``"last"`` probes (also
  ``"documents"`` where no documents are known) or ``"spread"`` ones on one batch row, wherever the rank's keys come in
  blocks of consecutive positions the scorer takes.
- ``"torch"`` (everywhere else, the CPU among them): :func:`~lightning_mtraining.sparsity.estimation.estimate_pattern`
  itself, then the tiles, counts and decision with the torch functions the Triton kernels are tested against.

Both give the same pattern, tiles (valid entries), counts and decisions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch
import torch.distributed as dist

from lightning_mtraining.core.collectives import all_gather_stacked, named_failure, reduce_scatter_dim0
from lightning_mtraining.core.layouts import global_positions
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.estimation import estimate_pattern
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern, decide_dense_heads, head_pairs, with_dense_heads
from mtraining_kernels.indexing import prepare_pattern_tiles
from mtraining_kernels.lists import PatternTiles, list_width_bounds

__all__ = ["BatchEstimator", "Estimate", "dense_mask_tensor"]

Route = Literal["triton", "torch"]


@dataclasses.dataclass
class Estimate:
    """One layer's estimate in one forward.

    Attributes:
        pattern: the estimated global pattern ``[B, G, *]`` (-1 padded).
        tiles: what the list builder reads for the layer's query heads ``[B, H, *]``: the pattern's computed tile
            diagonals and unique verticals, with the heads of ``dense`` given every diagonal and no vertical.
        allowed: ``[B, G]`` int64 on the device, each head's allowed pairs over its row's real sequence.
        decided: ``[B, G]`` on the device (bool, or int8 0 / 1), the heads whose pattern allows more than
            ``dense_above`` of their causal pairs (None without ``dense_above``).
        dense: the pattern heads that ran dense (every tile) in this forward, per batch row, as given (None: none).
    """

    pattern: VerticalSlashPattern
    tiles: PatternTiles
    allowed: torch.Tensor
    decided: torch.Tensor | None
    dense: tuple[tuple[bool, ...], ...] | None


@functools.lru_cache(maxsize=256)
def _device_tensor(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small device tensor of host values, made once per (values, device): the copy would be a host sync."""
    return torch.tensor(values, dtype=dtype, device=device)


def dense_mask_tensor(dense: tuple[tuple[bool, ...], ...], device: torch.device) -> torch.Tensor:
    """``[B, G]`` int8 on ``device`` (made once per value: no copy per layer)."""
    return _device_tensor(tuple(tuple(int(x) for x in row) for row in dense), torch.int8, device)


def _scorer_block(n_total: int, cp_rank: int, cp_size: int, layout: str, block_size: int, n: int) -> int:
    """The Triton scorer's key block for ``n`` probe rows (its blocks of consecutive keys must hold ``n - 1``), or 0."""
    from mtraining_kernels.probe_scores import blocks_are_runs

    pos = torch.arange(n_total) if cp_size == 1 else global_positions(n_total, cp_rank, cp_size, layout, block_size)
    for blk in (64, 128, 32, 16):  # 64 first: the slash sums' gather grows with the square of the block
        if n <= blk + 1 and blocks_are_runs(pos, blk):
            return blk
    return 0


class BatchEstimator:
    """The online estimator for one batch: the shapes of this rank's q ``[B, H, S, D]`` and k ``[B, Hkv, S, D]``, the
    real lengths, the sharding and the route (see the module docstring). Build it once before the first layer of a
    forward (the batch's), then call :meth:`estimate` per layer."""

    def __init__(self, *, batch: int, heads: int, kv_heads: int, local_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, lengths: tuple[int, ...], group: dist.ProcessGroup | None, cp_rank: int,
                 cp_size: int, layout: str, block_size: int, route: Route) -> None:
        self.B, self.H, self.Hkv, self.S, self.D = batch, heads, kv_heads, local_len, head_dim
        self.dtype, self.device, self.lengths = dtype, device, tuple(int(x) for x in lengths)
        self.group, self.cp_rank, self.cp_size = group, cp_rank, cp_size
        self.layout, self.block_size = layout, block_size
        self.N = local_len * cp_size
        self.route: Route = route
        self.pos = (torch.arange(self.N, device=device) if cp_size == 1
                    else global_positions(self.N, cp_rank, cp_size, layout, block_size, device=device))
        self.lens_t = _device_tensor(self.lengths, torch.int64, device)
        self._probes: dict[tuple, _Probes | None] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}

    # --- what a config needs, once per batch ---------------------------------------------------------------------

    def applies(self, config: SparsityConfig) -> bool:
        """Whether the Triton route runs ``config`` on this batch (else the torch route does)."""
        return self.route == "triton" and self._probes_for(config) is not None

    def _probes_for(self, config: SparsityConfig) -> _Probes | None:
        key = (config.last_q, config.probes, config.probe_blocks)
        if key not in self._probes:
            self._probes[key] = _Probes.make(self, config)
        return self._probes[key]

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        """A buffer of this batch, allocated once (at a fixed address, shared by the layers that use it in turn)."""
        key = (name, shape, dtype)
        found = self._buffers.get(key)
        if found is None:
            make = torch.zeros if zero else torch.empty
            found = self._buffers[key] = make(shape, dtype=dtype, device=self.device)
        return found

    def widths(self, config: SparsityConfig, layer_idx: int | None, any_dense: bool) -> tuple[int, int, int, int]:
        """``(nv, ns, L, NV)``: the pattern's static widths and the tiles' (bounded, a few size classes; every tile
        diagonal where a head runs dense)."""
        G = self.H if config.pattern_heads == "query" else self.Hkv
        vert, slash = config.head_budgets(G, layer_idx)
        nv, ns = config.sink_tokens + max(vert), config.local_window + max(slash)
        T = config.tile_size
        L, NV = list_width_bounds(ns, nv, self.N, T, T)
        return nv, ns, (self.N // T if any_dense else L), NV

    # --- one layer ------------------------------------------------------------------------------------------------

    def estimate(self, q: torch.Tensor, k: torch.Tensor, config: SparsityConfig, layer_idx: int | None,
                 scale: float, dense: tuple[tuple[bool, ...], ...] | None = None) -> Estimate:
        """This layer's :class:`Estimate` from its q and k (this rank's shards, the shapes given at construction);
        ``dense``: per batch row, the pattern heads to give every tile (the previous forward's decision)."""
        if dense is not None and not any(any(row) for row in dense):
            dense = None
        if self.applies(config):
            return self._triton(q, k, config, layer_idx, scale, dense)
        return self._torch(q, k, config, layer_idx, scale, dense)

    def _torch(self, q, k, config, layer_idx, scale, dense) -> Estimate:
        pattern = estimate_pattern(q, k, config, group=self.group if self.cp_size > 1 else None, layout=self.layout,
                                   block_size=self.block_size, seq_len=list(self.lengths), scale=scale,
                                   layer_idx=layer_idx)
        allowed, causal = head_pairs(pattern, list(self.lengths))
        decided = None if config.dense_above is None else decide_dense_heads(allowed, causal, config.dense_above)
        full = pattern.expand(self.H, self.Hkv)
        if dense is not None:
            mask = dense_mask_tensor(dense, q.device).bool()
            mask = mask.repeat_interleave(self.H // mask.shape[1], dim=1)
            full = with_dense_heads(full, mask, self.N)
        tiles = prepare_pattern_tiles(full.vertical_idx, full.slash_idx, self.N, config.tile_size, widths="bounded")
        return Estimate(pattern, tiles, allowed, decided, dense)

    def _triton(self, q, k, config, layer_idx, scale, dense) -> Estimate:
        from mtraining_kernels.pattern_select import SELECT_CHUNK, finish_pattern, select_keys
        from mtraining_kernels.probe_scores import lse_parts_shape, probe_lse_parts, probe_scores

        probes = self._probes_for(config)
        assert probes is not None
        B, H, Hkv, S, N, W = self.B, self.H, self.Hkv, self.S, self.N, self.cp_size
        G = H if config.pattern_heads == "query" else Hkv
        T = config.tile_size
        q_in = probes.rows(q, self)  # [B', H, n, D]: the probe queries (B' = probe blocks folded as rows)
        Bp = q_in.shape[0]
        k_in = k if Bp == B else k.expand(Bp, -1, -1, -1)
        slash = self.buffer("slash", (Bp, G, N), torch.float32)
        parts = tuple(self.buffer(f"lse{i}", lse_parts_shape(q_in.shape, S, probes.block), torch.float32)
                      for i in range(2))
        mx, sm = probe_lse_parts(q_in, k_in, self.pos, probes.rows_pos, scale, probes.block, zero=slash, parts=parts)
        if W > 1:  # every rank's partials: the kernel merges them in rank order
            every = all_gather_stacked(torch.stack([mx, sm]), self.group, W)
            mx, sm = every[:, 0], every[:, 1]
        vert = self.buffer("vert", (Bp, G, S), torch.float32)
        vert, slash = probe_scores(q_in, k_in, self.pos, probes.rows_pos, (mx, sm), scale, G != H, N, probes.block,
                                   vert=vert, slash=slash)
        if Bp != B:  # probe blocks folded as rows: their sums added in block order
            vert, slash = vert.sum(0, keepdim=True), slash.sum(0, keepdim=True)
        # rank r receives the exact sums of the offsets [r N/W, (r+1) N/W)
        owned = slash if W == 1 else reduce_scatter_dim0(slash.view(B, G, W, N // W).permute(2, 0, 1, 3),
                                                         self.group, W)
        M = N // W
        C = -(-M // SELECT_CHUNK)
        keys, mass = select_keys(vert, owned, self.pos, self.cp_rank * M, self.lens_t, config.sink_tokens,
                                 config.local_window, keys=self.buffer("keys", (2, B, G, M), torch.int64),
                                 mass=self.buffer("mass", (2, B, G, C, 2), torch.float64))
        vert_b, slash_b = config.head_budgets(G, layer_idx)
        K = max(max(vert_b), max(slash_b))
        top = torch.topk(keys, min(K, M), dim=-1).values
        if W > 1:  # the best of every rank's best: an exact distributed top-k (Note [Distributed estimation])
            Kl, nk = top.shape[-1], top.numel()
            every = all_gather_stacked(torch.cat([top.reshape(-1), mass.view(torch.int64).reshape(-1)]), self.group, W)
            top = every[:, :nk].view(W, 2, B, G, Kl).permute(1, 2, 3, 0, 4).reshape(2, B, G, W * Kl)
            top = torch.topk(top, min(K, W * Kl), dim=-1).values
            mass = every[:, nk:].view(torch.float64).view(W, 2, B, G, C, 2)
        nv, ns, L, NV = self.widths(config, layer_idx, dense is not None)
        out = (torch.empty(B, G, nv, dtype=torch.int64, device=q.device),
               torch.empty(B, G, ns, dtype=torch.int64, device=q.device),
               torch.empty(B, H, L, dtype=torch.int64, device=q.device),
               torch.empty(B, H, NV, dtype=torch.int64, device=q.device),
               torch.empty(2, B * H, dtype=torch.int32, device=q.device),
               torch.empty(B, G, dtype=torch.int64, device=q.device),
               torch.empty(B, G, dtype=torch.int8, device=q.device))
        NT = N // T
        scratch = (self.buffer("vmark", (B * H, N), torch.int8, zero=True),
                   self.buffer("smark", (B * H, N), torch.int8, zero=True),
                   self.buffer(f"cmark{T}", (B * H, NT + 1), torch.int8, zero=True),
                   self.buffer(f"prefix{T}", (B * H, NT), torch.int32))
        budgets = _device_tensor((tuple(vert_b), tuple(slash_b)), torch.int32, q.device)
        da = config.dense_above
        params = _device_tensor((config.top_p or 0.0, da if da is not None else 0.0), torch.float64, q.device)
        finish_pattern(top, mass, budgets, params, self.lens_t, num_heads=H, seq_len=N, tile=T,
                       sink_tokens=config.sink_tokens, local_window=config.local_window,
                       top_p=config.top_p is not None, decide=da is not None,
                       dense=dense_mask_tensor(dense, q.device) if dense is not None else None, scratch=scratch,
                       out=out)
        pattern = VerticalSlashPattern(out[0], out[1], T)
        tiles = PatternTiles(T, out[2], out[3], max(N, NT) + 1, out[4])
        return Estimate(pattern, tiles, out[5], out[6] if da is not None else None, dense)


@dataclasses.dataclass
class _Probes:
    """Where a config's probe rows are, for one batch: ``rows_pos [B', n]`` (B' = B, or the probe blocks folded as
    batch rows of one sequence), the scorer's key block, and how this rank gets the rows' queries."""

    rows_pos: torch.Tensor
    block: int
    slice_at: int | None  # one rank, one run of rows shared by every batch row: a view of q
    index: torch.Tensor | None  # [B', n] local indices of the rows (this rank's where it owns them)
    mine: torch.Tensor | None  # [B', n] whether this rank owns each row (several ranks: the others add zeros)
    fold: int  # probe blocks folded as batch rows (1: none)

    @staticmethod
    def make(est: BatchEstimator, config: SparsityConfig) -> _Probes | None:
        """The probe rows of ``config`` on ``est``'s batch, or None where the Triton route does not apply."""
        if est.dtype not in (torch.float16, torch.bfloat16, torch.float32) or est.D > 256:
            return None
        n, lens, B = config.last_q, est.lengths, est.B
        if min(lens) < n:
            return None
        if config.probes in ("last", "documents"):  # "documents" without documents: the last block
            starts = [[length - n] for length in lens]
        elif B == 1:  # spread: P blocks ending at (p + 1) * L // P - 1, folded as batch rows
            P = max(1, min(config.probe_blocks, lens[0] // n))
            starts = [[(p + 1) * lens[0] // P - n] for p in range(P)]
        else:
            return None
        block = _scorer_block(est.N, est.cp_rank, est.cp_size, est.layout, est.block_size, n)
        if not block:
            return None
        ar = torch.arange(n)
        rows = torch.tensor([s[0] for s in starts], dtype=torch.int64)[:, None] + ar  # [B', n] global positions
        fold = len(starts) if len(starts) != B else 1
        slice_at = starts[0][0] if est.cp_size == 1 and len({s[0] for s in starts}) == 1 and fold == 1 else None
        index = mine = None
        if slice_at is None:
            pos = est.pos.cpu()
            loc = torch.searchsorted(pos, rows).clamp(max=pos.numel() - 1)
            index, mine = loc.to(est.device), (pos[loc] == rows).to(est.device)
        return _Probes(rows.to(est.device), block, slice_at, index, mine, fold)

    def rows(self, q: torch.Tensor, est: BatchEstimator) -> torch.Tensor:
        """``[B', H, n, D]`` the probe rows' queries (every rank gets all of them: an all-reduce over several)."""
        if self.slice_at is not None:
            return q[:, :, self.slice_at:self.slice_at + self.rows_pos.shape[1]]
        assert self.index is not None and self.mine is not None
        Bq, H, _, D = q.shape
        Bp, n = self.index.shape
        src = q if Bq == Bp else q.expand(Bp, -1, -1, -1)
        rows = torch.gather(src, 2, self.index[:, None, :, None].expand(Bp, H, n, D))
        if est.cp_size > 1:
            rows = rows * self.mine[:, None, :, None].to(rows.dtype)
            with named_failure(f"the probe queries' all-reduce {tuple(rows.shape)}"):
                dist.all_reduce(rows, group=est.group)
        return rows
