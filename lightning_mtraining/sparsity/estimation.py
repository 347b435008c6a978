"""Online estimation of the vertical-slash pattern over a context-parallel group (MTraining section 3.1), and the
recall of a pattern (the share of the true attention mass it keeps).

Shape legend: B batch, H query heads, Hkv key/value heads, G pattern heads (H or Hkv), S local (per-rank)
sequence length, N = S * W the padded global length, W = cp_size, n probe rows (``last_q``), D head dim,
P key pieces of R consecutive positions.

The recall (``attention_recall``) scores its sampled rows with the estimator's own probe machinery (``_Probe``,
``_resolve``, ``_scores``), so both live here.

The contract (``estimate_pattern``), per batch row and pattern head:

- probe rows are the last ``last_q`` positions of the row's *real* sequence (``seq_len``; padding added for
  sharding is never a probe, never selected, never counted);
- ``A = softmax(scale * q_probe k^T)`` over the keys with ``k_pos <= q_pos`` (zero elsewhere); with
  ``pattern_heads="kv"`` the ``A`` of the query heads of a KV group are summed;
- vertical score of key j: the sum of column j of ``A``; slash score of offset o: the sum of ``A[i, q_pos_i - o]``
  over the probe rows;
- forced: verticals ``0 .. sink_tokens - 1`` and offsets ``0 .. local_window - 1`` (those < the real length);
- top-k: the forced entries plus the k best others; top-p: the forced entries, then the others by decreasing score
  while the kept mass is below ``top_p`` times the total mass (the sum of all scores), at most the cap; verticals
  and slashes separately; ties: the lower index first. Budgets may differ per head and per layer
  (:meth:`SparsityConfig.head_budgets`).

Note [Distributed estimation]
-----------------------------
No rank ever holds the scores of another rank's keys. Per layer, with W ranks::

    1. probes     every rank writes the probe rows it owns into a zero [B, H, n, D] buffer; all-reduce(sum)
                  gives every rank all probes (exact: each element has one non-zero contributor)
    2. normaliser each rank scores the probes against its own keys (chunked, no grad) and all-gathers its
                  row log-sum-exps [B, H, n]; every rank merges the W of them in the same order
    3. scores     A on the local keys: vertical scores of its own keys, and partial slash sums for every
                  offset its keys touch; the slash partials are reduce-scattered, so rank r owns the exact sums
                  of the offsets [r N/W, (r+1) N/W)
    4. selection  each rank takes the best entries it owns (at most the largest budget), and all-gathers them
                  with its share of the total and of the forced mass; every rank merges the same gathered data
                  in the same order (an exact distributed top-k / top-p: the global best k are among the union
                  of the local best k), so every rank returns the same pattern by construction

Communication per layer (elements): probes B*H*n*D (input dtype, all-reduce), normalisers W*B*H*n (float32),
slash partials B*G*N (float32, reduce-scatter: each rank sends about (W-1)/W of it), candidates
W*B*G*2*(k+2) (int64 keys with the two masses, two all-gathers; k the largest budget; float64
scores send values and indices, 2k+2). For the Qwen2.5-3B attention shape (H=16, Hkv=2,
D=128) this is dominated by the slash partials: 16*N*4 bytes against the ring's K/V traffic per rank of
(W-1)*2*2*(N/W)*128*2 bytes, i.e. about 6% of it for query-head patterns at W=8 and under 1% for
``pattern_heads="kv"``.

Cost per rank: O(n * H * D * S) multiply-adds for the scores (twice: normaliser, then scores), O(B*G*(N/W)) for
the selection (``topk``); no host synchronisation except on the first call for a (group, shapes) pair (a cross-rank
shape check) and the host-side key bookkeeping (cached per layout).

Scorers: on CUDA (half or float32 inputs) the Triton scorer (:mod:`mtraining_kernels.probe_scores`, two launches,
the scores never leave registers) wherever the rank's keys come in blocks of >= 16 consecutive positions holding at
least ``last_q - 1`` keys (striped/zigzag with ``block_size`` >= 16, contiguous, one rank); otherwise the torch
scorer below (chunks of key pieces, ~15 full-size elementwise ops per chunk). Both compute the same sums; the
Triton one in float32 from the input dtype's products. Selection: float32 scores are packed with their index into
unique int64 keys (:func:`_top_packed`, ``topk`` locally and after the all-gather); float64 scores (tests) take
stable sorts. Both give the contract's order exactly (tested equal).

Determinism: every sum is in a fixed order. The slash partials are accumulated over pieces (torch) or blocks
(Triton) of >= n - 1 consecutive keys whose offset windows overlap at most pairwise, so even atomic adds see at
most two non-zero terms per element, and a + b is commutative in IEEE arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_mtraining.core.collectives import all_gather_stacked, named_failure, reduce_scatter_dim0
from lightning_mtraining.core.layouts import (
    check_attention_inputs,
    check_doc_start,
    check_local_length,
    global_positions,
    layout_unit,
)
from lightning_mtraining.core.numerics import default_scale
from lightning_mtraining.core.profiling import ESTIMATE, profiled
from lightning_mtraining.core.topology import group_rank_size
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern

__all__ = ["attention_recall", "estimate_pattern"]

_MAX_SCORES = 1 << 24  # score elements per chunk of keys (64 MiB in float32)
_PIECE = 1024  # longest piece of consecutive keys (pieces are at least last_q - 1 long where runs allow)


# --------------------------------------------------------------------------------------------------------------
# the CP group, the local keys, the probe rows
# --------------------------------------------------------------------------------------------------------------


_CHECKED_GROUPS: set = set()


def _check_group_shapes(q: torch.Tensor, k: torch.Tensor, seq_lens: list[int], group, cp_size: int, what: str):
    """Once per (group, shapes): every rank of ``group`` must hold shards of the same sequences (one all-gather)."""
    if cp_size == 1:
        return
    key = (id(group), tuple(q.shape), tuple(k.shape), tuple(seq_lens))
    if key in _CHECKED_GROUPS:
        return
    mine = torch.tensor([*q.shape, *k.shape, sum(seq_lens), len(seq_lens)], dtype=torch.int64, device=q.device)
    every = all_gather_stacked(mine, group, cp_size)
    if not bool((every == mine).all()):
        rows = every.tolist()
        raise ValueError(
            f"{what}: the ranks of the group hold shards of different shapes (q [B, H, S, D], k [B, Hkv, S, D], "
            f"sum of seq_len, batch): {rows}; `group` must be the context-parallel group whose ranks each hold one "
            "shard of the same sequences"
        )
    _CHECKED_GROUPS.add(key)


@functools.lru_cache(maxsize=64)
def _local_keys(n_total: int, cp_rank: int, cp_size: int, layout: str, block_size: int, last_q: int,
                device: torch.device):
    """This rank's global positions and its keys cut into pieces of R consecutive positions.

    Returns ``(pos [S], piece_idx [P, R] local indices (clamped), piece_valid [P, R], piece_start [P] global
    position of each piece's first slot, R)``. A piece never crosses a gap in the positions; a run shorter than R
    gives a partly valid piece. R = min(longest run, max(_PIECE, last_q - 1)).
    """
    if cp_size == 1:
        pos = torch.arange(n_total)
    else:
        pos = global_positions(n_total, cp_rank, cp_size, layout, block_size)  # CPU, host-side bookkeeping
    S = pos.numel()
    breaks = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, S]
    longest = max(e - s for s, e in zip(starts, ends))
    R = min(longest, max(_PIECE, last_q - 1))
    piece_first = [p for s, e in zip(starts, ends) for p in range(s, e, R)]
    piece_end = [min(p + R, e) for s, e in zip(starts, ends) for p in range(s, e, R)]
    first = torch.tensor(piece_first, dtype=torch.int64)
    slot = torch.arange(R, dtype=torch.int64)
    idx = first[:, None] + slot[None, :]
    valid = idx < torch.tensor(piece_end, dtype=torch.int64)[:, None]
    idx = torch.where(valid, idx, first[:, None])
    start_pos = pos[first]
    return pos.to(device), idx.to(device), valid.to(device), start_pos.to(device), R


@functools.lru_cache(maxsize=256)
def _device_ints(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small int64 device tensor of host values, made once per (values, device): creating it is a blocking copy
    (a host sync on CUDA), so the estimator's hot path reuses it instead."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def _seq_lens(seq_len, batch: int, n_total: int, what: str) -> list[int]:
    """The real length of every batch row as Python ints (host values: validation needs no device sync)."""
    if seq_len is None:
        lens = [n_total] * batch
    elif isinstance(seq_len, int) and not isinstance(seq_len, bool):
        lens = [seq_len] * batch
    elif isinstance(seq_len, (torch.Tensor, Sequence)):
        lens = [int(x) for x in (seq_len.tolist() if isinstance(seq_len, torch.Tensor) else seq_len)]
        if len(lens) != batch:
            raise ValueError(f"{what}: seq_len has {len(lens)} entries for a batch of {batch}; give one per row")
    else:
        raise TypeError(f"{what}: seq_len must be None, an int or one int per batch row, got {type(seq_len).__name__}")
    bad = [n for n in lens if not 1 <= n <= n_total]
    if bad:
        raise ValueError(
            f"{what}: seq_len {bad} must be in [1, {n_total}] (the padded length: {n_total} = local length x ranks)"
        )
    return lens


def _validate_inputs(q, k, layout: str, block_size: int, cp_size: int, what: str) -> None:
    check_attention_inputs(q, k, what=what)
    if cp_size > 1:  # one rank holds the whole sequence in any layout
        check_local_length(q.shape[2], cp_size, layout, block_size, what)
    else:
        layout_unit(layout, cp_size, block_size)  # the layout's name and block size


class _Probe:
    """The probe rows of one call, every rank's share of them, and the global softmax normaliser."""

    def __init__(self, q, k, rows_pos: torch.Tensor, group, cp_rank: int, cp_size: int, layout: str,
                 block_size: int, scale: float, doc_start: torch.Tensor | None = None) -> None:
        B, H, S, D = q.shape
        self.B, self.H, self.Hkv, self.D = B, H, k.shape[1], D
        self.n = rows_pos.shape[1]
        self.group, self.cp_size, self.scale = group, cp_size, scale
        self.cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.n_total = S * cp_size
        self.pos, self.piece_idx, self.piece_valid, self.piece_start, self.R = _local_keys(
            self.n_total, cp_rank, cp_size, layout, block_size, self.n, q.device
        )
        self.rows_pos = rows_pos  # [B, n] global positions of the probe rows (device, int64)
        self.k = k
        self.q_in = self._gather_rows(q)  # [B, H, n, D] in the input dtype
        self.q_rows = self.q_in.to(self.cdt)
        # packed documents: each probe row sees only keys >= its document's first position (rows_lo [B, n])
        self.rows_lo = None
        if doc_start is not None:
            self.rows_lo = self._gather_rows(doc_start.expand(B, S)[:, None, :, None].contiguous())[:, 0, :, 0]
        self.block = 0 if doc_start is not None else _triton_block(q, self.n, self.n_total, cp_rank, cp_size, layout,
                                                                   block_size)
        self.lse = self._global_lse()  # [B, H, n]

    def _gather_rows(self, q: torch.Tensor) -> torch.Tensor:
        """``q [B, H', S, D']``'s rows at the probe positions, from whichever rank holds each (an all-reduce)."""
        loc = torch.searchsorted(self.pos, self.rows_pos).clamp(max=self.pos.numel() - 1)  # [B, n]
        mine = self.pos[loc] == self.rows_pos
        rows = torch.gather(q, 2, loc[:, None, :, None].expand(self.B, q.shape[1], self.n, q.shape[3]))
        rows = torch.where(mine[:, None, :, None], rows, torch.zeros((), dtype=q.dtype, device=q.device))
        if self.cp_size > 1:
            rows = rows.contiguous()
            with named_failure(f"the probe queries' all-reduce {tuple(rows.shape)}"):
                dist.all_reduce(rows, group=self.group)
        return rows.contiguous()

    def chunks(self):
        """Yield ``(piece slice, key positions [Pc, R], visible [B, 1, n, Pc, R], scores [B, H, n, Pc, R])``."""
        P, R = self.piece_idx.shape
        per = max(1, _MAX_SCORES // max(1, self.B * self.H * self.n * R))
        G = self.H // self.Hkv
        q5 = self.q_rows.view(self.B, self.Hkv, G * self.n, self.D)
        for p0 in range(0, P, per):
            sl = slice(p0, min(P, p0 + per))
            idx, valid = self.piece_idx[sl], self.piece_valid[sl]
            Pc = idx.shape[0]
            kpos = self.pos[idx]  # [Pc, R]
            kc = self.k[:, :, idx.reshape(-1)].to(self.cdt)  # [B, Hkv, Pc*R, D]
            s = torch.matmul(q5, kc.transpose(-1, -2)) * self.scale  # [B, Hkv, G*n, Pc*R]
            s = s.view(self.B, self.H, self.n, Pc, R)
            visible = valid[None, None, None] & (kpos[None, None, None] <= self.rows_pos[:, None, :, None, None])
            if self.rows_lo is not None:
                visible = visible & (kpos[None, None, None] >= self.rows_lo[:, None, :, None, None])
            yield sl, kpos, visible, s.masked_fill(~visible, float("-inf"))

    def _global_lse(self) -> torch.Tensor:
        if self.block:
            from mtraining_kernels.probe_scores import probe_lse

            lse = probe_lse(self.q_in, self.k, self.pos, self.rows_pos, self.scale, self.block)
        else:
            lse = torch.full((self.B, self.H, self.n), float("-inf"), dtype=self.cdt, device=self.q_rows.device)
            for _, _, _, s in self.chunks():
                lse = torch.logaddexp(lse, torch.logsumexp(s.flatten(-2), dim=-1))
        if self.cp_size > 1:  # the same W terms merged in the same order on every rank
            lse = torch.logsumexp(all_gather_stacked(lse, self.group, self.cp_size), dim=0)
        return lse

    def probabilities(self, s: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """``A`` of a chunk: ``[B, H, n, Pc, R]``, 0 where not visible."""
        lse = torch.where(torch.isfinite(self.lse), self.lse, torch.zeros_like(self.lse))
        return torch.where(visible, torch.exp(s - lse[..., None, None]), torch.zeros((), dtype=s.dtype,
                                                                                     device=s.device))


_SCORER = "auto"  # "auto": Triton on CUDA where it applies; "torch"; "triton" (tests, in the interpreter on CPU)


@functools.lru_cache(maxsize=64)
def _runs_block(n_total: int, cp_rank: int, cp_size: int, layout: str, block_size: int, n: int) -> int:
    """A key block of consecutive global positions with ``n <= block + 1``, or 0: 64 first (the diagonal
    gather of the slash sums grows with the square of the block, so 64-key blocks beat 128), then 128 (for up to 129
    probe rows), 32 and 16."""
    pos = torch.arange(n_total) if cp_size == 1 else global_positions(n_total, cp_rank, cp_size, layout, block_size)
    from mtraining_kernels.probe_scores import blocks_are_runs

    for blk in (64, 128, 32, 16):
        if n <= blk + 1 and blocks_are_runs(pos, blk):
            return blk
    return 0


def _triton_block(q: torch.Tensor, n: int, n_total: int, cp_rank: int, cp_size: int, layout: str,
                  block_size: int) -> int:
    """The key block of the Triton scorer (:mod:`mtraining_kernels.probe_scores`), or 0 for the torch scorer: the
    Triton one runs on CUDA (or anywhere with ``_SCORER = "triton"``) for half and float32 inputs, head dim <= 256,
    when blocks of consecutive keys exist (see :func:`_runs_block`)."""
    wanted = _SCORER == "triton" or (_SCORER == "auto" and q.is_cuda)
    if not wanted or q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q.shape[-1] > 256:
        return 0
    return _runs_block(n_total, cp_rank, cp_size, layout, block_size, n)


def _resolve(q, k, group, layout, block_size, seq_len, scale, what):
    cp_rank, cp_size = group_rank_size(group, "estimate_pattern")
    if group is None and cp_size > 1:
        group = dist.group.WORLD
    _validate_inputs(q, k, layout, block_size, cp_size, what)
    n_total = q.shape[2] * cp_size
    lens = _seq_lens(seq_len, q.shape[0], n_total, what)
    _check_group_shapes(q, k, lens, group, cp_size, what)
    scale = default_scale(q.shape[-1], scale)
    return group, cp_rank, cp_size, n_total, lens, scale


# --------------------------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------------------------


def _select(
    scores: torch.Tensor,
    index: torch.Tensor,
    candidate: torch.Tensor,
    forced: torch.Tensor,
    budgets: list[int],
    top_p: float | None,
    group,
    cp_size: int,
) -> torch.Tensor:
    """Exact distributed top-k / top-p over entries owned by the ranks of ``group``.

    ``scores [B, G, M]`` this rank's entries (float), ``index [1 or B, M]`` their global indices (unique
    across ranks), ``candidate [B, G, M]`` (or broadcastable) which may be selected, ``forced`` which are forced
    (their mass counts first in top-p mode). Returns ``[B, G, K]`` selected global indices, -1 padding, K = the
    largest budget; identical on every rank.
    """
    B, G, M = scores.shape
    K = max(budgets) if budgets else 0
    dev = scores.device
    f64 = torch.float64
    index = index.expand(B, M)
    total = scores.sum(-1, dtype=f64)  # [B, G] this rank's share of the total mass
    forced_mass = torch.where(forced, scores, torch.zeros((), dtype=scores.dtype, device=dev)).sum(-1, dtype=f64)
    Kl = min(K, M)
    if scores.dtype == torch.float32:
        return _keep(*_top_packed(scores, index, candidate, total, forced_mass, Kl, K, group, cp_size), budgets,
                     top_p)
    cand = torch.where(candidate, scores.to(f64), torch.full((), float("-inf"), dtype=f64, device=dev))
    # (score desc, index asc): this rank's indices ascend along M, so a stable sort keeps ties in index order
    order = torch.sort(cand, dim=-1, descending=True, stable=True).indices[..., :Kl]
    values = torch.gather(cand, -1, order)
    where = torch.gather(index[:, None, :].expand(B, G, M), -1, order).to(f64)
    payload = torch.cat([values, where, total[..., None], forced_mass[..., None]], dim=-1)  # [B, G, 2*Kl + 2]
    every = all_gather_stacked(payload, group, cp_size)
    values = every[..., :Kl].permute(1, 2, 0, 3).reshape(B, G, cp_size * Kl)
    where = every[..., Kl:2 * Kl].permute(1, 2, 0, 3).reshape(B, G, cp_size * Kl)
    total = every[..., 2 * Kl].sum(0)
    forced_mass = every[..., 2 * Kl + 1].sum(0)
    # global order (score desc, index asc): by index first, then a stable sort by score
    by_index = torch.sort(where, dim=-1, stable=True).indices
    values, where = torch.gather(values, -1, by_index), torch.gather(where, -1, by_index)
    by_score = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :K]
    values, where = torch.gather(values, -1, by_score), torch.gather(where, -1, by_score)
    return _keep(values, where.round().to(torch.int64), total, forced_mass, budgets, top_p)


def _keep(values, where, total, forced_mass, budgets: list[int], top_p: float | None) -> torch.Tensor:
    """``values [B, G, K]`` (float64, descending, -inf = no entry) and their indices -> the selected indices, -1
    padding: within each head's budget, and in top-p mode while the mass kept before an entry is below top_p."""
    dev = values.device
    slot = torch.arange(values.shape[-1], device=dev)
    budget = _device_ints(tuple(budgets), dev)[None, :, None]
    keep = (slot < budget) & torch.isfinite(values)
    if top_p is not None:
        v = values.nan_to_num(neginf=0.0)
        keep &= forced_mass[..., None] + torch.cumsum(v, -1) - v < top_p * total[..., None]
    return torch.where(keep, where, torch.full((), -1, dtype=torch.int64, device=dev))


_LOW = 0xFFFFFFFF


def _top_packed(scores, index, candidate, total, forced_mass, Kl: int, K: int, group, cp_size: int):
    """The selection's top entries for float32 scores: one int64 key per entry, ``bits(score) << 32 | (2^32 - 1 -
    index)`` (non-negative float32 bits order like the floats, so the keys order as (score desc, index asc) and are
    unique), ``topk`` on them locally and after the all-gather: no float64 copies, no full stable sorts.
    Returns ``values [B, G, K']`` (float64, -inf for no entry), their indices, the total and the forced mass
    (``[B, G]``, summed over the ranks), as :func:`_keep` takes them."""
    B, G, M = scores.shape
    dev = scores.device
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 -> +0.0; scores are >= 0
    keys = torch.where(candidate, (bits << 32) | (_LOW - index[:, None, :]), torch.full((), -1, dtype=torch.int64,
                                                                                         device=dev))
    keys = torch.topk(keys, Kl, dim=-1).values if Kl < M else keys.sort(-1, descending=True).values
    payload = torch.cat([keys, total[..., None].view(torch.int64), forced_mass[..., None].view(torch.int64)], -1)
    every = all_gather_stacked(payload.contiguous(), group, cp_size)  # [W, B, G, Kl + 2]
    keys = every[..., :Kl].permute(1, 2, 0, 3).reshape(B, G, cp_size * Kl)
    total = every[..., Kl].contiguous().view(torch.float64).sum(0)
    forced_mass = every[..., Kl + 1].contiguous().view(torch.float64).sum(0)
    if cp_size > 1:
        keys = torch.topk(keys, min(K, keys.shape[-1]), dim=-1).values
    ok = keys >= 0
    values = torch.where(ok, (keys >> 32).to(torch.int32).view(torch.float32).to(torch.float64),
                         torch.full((), float("-inf"), dtype=torch.float64, device=dev))
    where = torch.where(ok, _LOW - (keys & _LOW), torch.full((), -1, dtype=torch.int64, device=dev))
    return values, where, total, forced_mass


def _forced(count: int, lens: list[int], shape: tuple[int, int], device) -> torch.Tensor:
    """``[B, G, count]`` indices 0..count-1, -1 where >= the row's real length."""
    B, G = shape
    idx = torch.arange(count, device=device).expand(B, G, count)
    lens_t = _device_ints(tuple(lens), device)[:, None, None]
    return torch.where(idx < lens_t, idx, torch.full((), -1, dtype=torch.int64, device=device))


def _gathered_forced(flags: torch.Tensor, group, cp_size: int, n_total: int, layout: str,
                     block_size: int) -> torch.Tensor:
    """``[B, 1, m]`` global positions of the keys forced on any rank (``flags [B, S]`` this rank's), ascending,
    -1 padding (m: the most of any row). One all-gather of the flags, one host sync for m."""
    every = all_gather_stacked(flags.to(torch.uint8), group, cp_size).bool()  # [W, B, S]
    pos = torch.stack([global_positions(n_total, r, cp_size, layout, block_size, device=flags.device)
                       for r in range(cp_size)]) if cp_size > 1 else torch.arange(n_total, device=flags.device)[None]
    where = torch.where(every, pos[:, None, :], torch.full((), -1, dtype=torch.int64, device=flags.device))
    where = where.permute(1, 0, 2).reshape(flags.shape[0], -1)  # [B, N]
    m = max(1, int(every.sum((0, 2)).max()))
    return _sorted_indices(torch.topk(where, m, dim=-1).values)[:, None, :]


def _sorted_indices(*parts: torch.Tensor) -> torch.Tensor:
    """Concatenate index tensors, sort each row ascending, padding (-1) last."""
    idx = torch.cat(parts, dim=-1)
    big = torch.iinfo(torch.int64).max
    idx = torch.where(idx >= 0, idx, torch.full((), big, dtype=idx.dtype, device=idx.device)).sort(-1).values
    return torch.where(idx == big, torch.full((), -1, dtype=idx.dtype, device=idx.device), idx)


# --------------------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------------------


@profiled(ESTIMATE)
def estimate_pattern(
    q: torch.Tensor,
    k: torch.Tensor,
    config: SparsityConfig,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "striped",
    block_size: int = 128,
    seq_len: int | Sequence[int] | torch.Tensor | None = None,
    scale: float | None = None,
    layer_idx: int | None = None,
    doc_start: torch.Tensor | None = None,
) -> VerticalSlashPattern:
    """Estimate the vertical-slash pattern of this layer from the current Q and K of the whole (sharded) sequence.

    Args:
        q: ``[B, H, S, D]`` this rank's query shard in ``layout``.
        k: ``[B, Hkv, S, D]`` this rank's key shard (H a multiple of Hkv).
        config: the budgets (:class:`SparsityConfig`).
        group: the context-parallel group (default: the default group; none initialised means one rank).
        layout, block_size: how the sequence was sharded (:mod:`lightning_mtraining.core.layouts`).
        seq_len: the real length before padding: an int for every row, or one per batch row (ragged batches);
            default: no padding (the full ``S * cp_size``).
        scale: softmax scale, default ``1 / sqrt(D)``.
        layer_idx: which layer this is, for per-layer budgets (``config.budgets``).
        doc_start: packed documents (``[B or 1, S]``, for each of this rank's tokens the global position of its
            document's first token; :func:`~lightning_mtraining.core.layouts.document_starts`): the scores ``A`` of a
            probe row cover only the keys of its own document, and the forced verticals are the first
            ``sink_tokens`` positions of *every* document (each document's attention sinks), so their number grows
            with the documents. The probes stay the last ``last_q`` real positions, which lie in the row's last
            document(s): the slashes (offsets, the same in every document) are estimated there and apply to all
            documents, masked at their boundaries; the chosen verticals mostly serve the probes' document. Costs one
            all-gather of ``B x S`` bytes more (the forced flags) and runs the torch scorer.

    Returns:
        The same global :class:`VerticalSlashPattern` on every rank of ``group``: ``[B, G, sink + k]`` verticals and
        ``[B, G, window + k']`` slashes, each row sorted ascending, -1 padding; G = H (``pattern_heads="query"``)
        or Hkv (``"kv"``). Computed without gradients; see the module docstring for the exact rule and the
        communication (Note [Distributed estimation]).
    """
    what = "estimate_pattern"
    if not isinstance(config, SparsityConfig):
        raise TypeError(f"{what}: config must be a SparsityConfig, got {type(config).__name__}")
    group, cp_rank, cp_size, n_total, lens, scale = _resolve(q, k, group, layout, block_size, seq_len, scale,
                                                              what)
    n = config.last_q
    if n > min(lens):
        raise ValueError(
            f"{what}: last_q={n} probe queries but a sequence has only {min(lens)} real tokens; lower "
            "SparsityConfig.last_q or train on longer sequences"
        )
    B, H = q.shape[:2]
    Hkv = k.shape[1]
    G = H if config.pattern_heads == "query" else Hkv
    vert_budget, slash_budget = config.head_budgets(G, layer_idx)
    dev = q.device
    lens_t = _device_ints(tuple(lens), dev)
    if doc_start is not None:
        # every rank keeps it (even where all its tokens lie in first documents): collectives follow
        doc_start = check_doc_start(doc_start, q, _local_keys(n_total, cp_rank, cp_size, layout, block_size, n,
                                                              dev)[0], drop_single=False)
    with torch.no_grad():
        rows_pos = lens_t[:, None] - n + torch.arange(n, device=dev)[None, :]  # [B, n]
        probe = _Probe(q, k, rows_pos, group, cp_rank, cp_size, layout, block_size, scale, doc_start)
        N = n_total
        vert, slash = _scores(probe, G) if not probe.block else _triton_scores(probe, G)
        # rank r receives the exact sums of the offsets [r N/W, (r+1) N/W)
        owned = reduce_scatter_dim0(slash.view(B, G, cp_size, N // cp_size).permute(2, 0, 1, 3), group, cp_size)
        off_idx = torch.arange(N // cp_size, device=dev) + cp_rank * (N // cp_size)
        lens_b = lens_t[:, None, None]
        if doc_start is None:
            v_forced = probe.pos[None, None, :] < config.sink_tokens
        else:  # every document's first sink_tokens positions
            v_forced = ((probe.pos[None, :] - doc_start) < config.sink_tokens)[:, None, :] & (probe.pos < lens_b)
        v_cand = ~v_forced & (probe.pos[None, None, :] < lens_b)
        s_forced = off_idx[None, None, :] < config.local_window
        s_cand = ~s_forced & (off_idx[None, None, :] < lens_b)
        v_sel = _select(vert, probe.pos[None, :], v_cand, v_forced.expand_as(vert), vert_budget, config.top_p,
                        group, cp_size)
        s_sel = _select(owned, off_idx[None, :], s_cand, s_forced.expand_as(owned), slash_budget, config.top_p,
                        group, cp_size)
        if doc_start is None:
            forced_v = _forced(config.sink_tokens, lens, (B, G), dev)
        else:
            forced_v = _gathered_forced(v_forced[:, 0], group, cp_size, n_total, layout, block_size).expand(B, G, -1)
        vertical_idx = _sorted_indices(forced_v, v_sel)
        slash_idx = _sorted_indices(_forced(config.local_window, lens, (B, G), dev), s_sel)
    return VerticalSlashPattern(vertical_idx, slash_idx, tile_size=config.tile_size)


def _triton_scores(probe: _Probe, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    from mtraining_kernels.probe_scores import probe_scores

    return probe_scores(probe.q_in, probe.k, probe.pos, probe.rows_pos, probe.lse, probe.scale, G != probe.H,
                        probe.n_total, probe.block)


def _scores(probe: _Probe, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical scores ``[B, G, S]`` of this rank's keys and slash partial sums ``[B, G, N]`` (torch, chunked)."""
    B, H, n, S, N = probe.B, probe.H, probe.n, probe.k.shape[2], probe.n_total
    dev = probe.q_rows.device
    vert = torch.zeros(B, G, S + 1, dtype=probe.cdt, device=dev)  # + 1: a bin for the pieces' unused slots
    slash = torch.zeros(B * G * N + 1, dtype=probe.cdt, device=dev)  # + 1: a bin for out-of-range offsets
    R = probe.R
    c = torch.arange(R + n - 1, device=dev)
    row_base = (torch.arange(B, device=dev)[:, None] * G + torch.arange(G, device=dev)[None, :]) * N  # [B, G]
    for sl, kpos, visible, s in probe.chunks():
        a = probe.probabilities(s, visible)  # [B, H, n, Pc, R]
        if G != H:
            a = a.view(B, G, H // G, n, *a.shape[-2:]).sum(2)
        Pc = a.shape[-2]
        # verticals: column sums, written at the pieces' local indices (each local key once)
        col = a.sum(2)  # [B, G, Pc, R]
        idx = torch.where(probe.piece_valid[sl], probe.piece_idx[sl], S)  # invalid slots -> the spare bin S
        vert.scatter_(2, idx.reshape(1, 1, -1).expand(B, G, -1), col.reshape(B, G, -1))
        # slashes: sums along each piece's diagonals (skew: flip keys, pad, shift row i by i), then offsets
        x = a.permute(0, 1, 3, 2, 4).flip(-1)  # [B, G, Pc, n, R]
        x = torch.nn.functional.pad(x, (0, n)).flatten(-2)[..., : n * (R + n) - n]
        diag = x.view(B, G, Pc, n, R + n - 1).sum(-2)  # [B, G, Pc, R + n - 1]
        # diagonal c of piece p holds offset o = (p0_b - start_p - R + 1) + c  (p0_b: row b's first probe)
        off = (probe.rows_pos[:, 0, None, None] - probe.piece_start[sl][None, :, None] - R + 1) + c  # [B, Pc, R+n-1]
        ok = (off >= 0) & (off < N)
        flat = torch.where(ok[:, None], row_base[:, :, None, None] + off[:, None], B * G * N)
        slash.index_add_(0, flat.reshape(-1), diag.reshape(-1))
    return vert[..., :S], slash[:-1].view(B, G, N)


def _recall_rows(rows, lens: list[int], device) -> torch.Tensor:
    """``[B, r]`` global positions of the query rows to measure (default: 64 evenly spaced real rows)."""
    B = len(lens)
    if rows is None or (isinstance(rows, int) and not isinstance(rows, bool)):
        count = 64 if rows is None else rows
        if count < 1:
            raise ValueError(f"attention_recall: rows={rows} must be >= 1")
        i = torch.arange(count, dtype=torch.int64)
        # row i at floor((i + 1) * L / count) - 1: evenly spaced, the last real position included
        pos = torch.stack([torch.clamp((i + 1) * n // count - 1, min=0) for n in lens])
        return pos.to(device)
    rows = torch.as_tensor(rows, dtype=torch.int64, device=device)
    if rows.dim() == 1:
        rows = rows.expand(B, rows.numel())
    if rows.dim() != 2 or rows.shape[0] != B:
        raise ValueError(f"attention_recall: rows must be a count, [r] or [B={B}, r] positions; got {tuple(rows.shape)}")
    return rows


def attention_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    pattern: VerticalSlashPattern,
    *,
    rows: int | torch.Tensor | Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "striped",
    block_size: int = 128,
    seq_len: int | Sequence[int] | torch.Tensor | None = None,
    scale: float | None = None,
    doc_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Share of the true attention mass that ``pattern`` keeps, averaged over a sample of query rows.

    For each sampled row i (any rows, not only the estimator's probes): ``sum_j A[i, j] * allowed(i, j)`` where
    ``A`` is the dense causal softmax of the row over the whole sequence and ``allowed`` is the pattern's mask (the
    pairs ``sparse_attention`` computes). 1.0 means nothing is lost. Same arguments and sharding as
    :func:`estimate_pattern`; every rank of ``group`` calls it and gets the same value.

    Args:
        rows: a count (default 64, evenly spaced over each row's real sequence, the last position included), or
            global positions ``[r]`` / ``[B, r]``.
        doc_start: packed documents, as in :func:`estimate_pattern`: each row's true attention covers its own
            document only.

    Returns:
        ``[B, G]`` float64 recall per batch row and pattern head (for a per-KV-group pattern, averaged over the
        group's query heads).

    Cost: like one estimation with ``r`` probe rows (the scores of r rows against all keys, split over the ranks:
    O(r * H * D * N / W) per rank), plus the pattern's tile mask gathered per score; meant for logging every few
    hundred steps, not every step.
    """
    what = "attention_recall"
    if not isinstance(pattern, VerticalSlashPattern):
        raise TypeError(f"{what}: pattern must be a VerticalSlashPattern, got {type(pattern).__name__}")
    group, cp_rank, cp_size, n_total, lens, scale = _resolve(q, k, group, layout, block_size, seq_len, scale,
                                                              what)
    B, H = q.shape[:2]
    Hkv = k.shape[1]
    pattern.validate(n_total, H, Hkv, batch_size=B)
    G = pattern.num_heads
    full = pattern.expand(H, Hkv)
    T = pattern.tile_size
    from mtraining_kernels.indexing import computed_tile_offsets

    with torch.no_grad():
        dev = q.device
        rows_pos = _recall_rows(rows, lens, dev)
        if bool((rows_pos < 0).any()) or bool((rows_pos >= _device_ints(tuple(lens), dev)[:, None]).any()):
            raise ValueError(f"{what}: rows must be real positions of each sequence (0 <= row < seq_len {lens})")
        if doc_start is not None:
            doc_start = check_doc_start(doc_start, q, _local_keys(n_total, cp_rank, cp_size, layout, block_size,
                                                                  rows_pos.shape[1], dev)[0], drop_single=False)
        probe = _Probe(q, k, rows_pos, group, cp_rank, cp_size, layout, block_size, scale, doc_start)
        comp = computed_tile_offsets(full.slash_idx.to(dev), n_total, T, T)  # [B, H, NT]
        NT = comp.shape[-1]
        v = full.vertical_idx.to(dev)
        is_vert = torch.zeros(B, H, n_total + 1, dtype=torch.bool, device=dev)
        is_vert.scatter_(2, torch.where((v >= 0) & (v < n_total), v, n_total), True)
        kept = torch.zeros(B, H, probe.n, dtype=probe.cdt, device=dev)
        qt = (rows_pos // T)[:, None, :, None, None]  # [B, 1, r, 1, 1]
        for sl, kpos, visible, s in probe.chunks():
            a = probe.probabilities(s, visible)  # [B, H, r, Pc, R]
            u = (qt - (kpos // T)[None, None, None]).clamp(0, NT - 1)  # [B, 1, r, Pc, R]
            tile = comp.gather(-1, u.expand(B, H, *u.shape[2:]).reshape(B, H, -1)).view(a.shape)
            col = is_vert[:, :, kpos.reshape(-1)].view(B, H, 1, *kpos.shape)
            kept += (a * (tile | col)).sum((-1, -2))
        kept = all_gather_stacked(kept, group, cp_size).sum(0)
        recall = kept.to(torch.float64).mean(-1)  # [B, H]: each row's total mass is 1
        if G != H:
            recall = recall.view(B, G, H // G).mean(-1)
    return recall
