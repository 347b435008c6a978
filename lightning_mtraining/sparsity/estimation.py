"""Online estimation of the vertical-slash pattern over a context-parallel group (MTraining section 3.1), and the
recall of a pattern (the share of the true attention mass it keeps).

Shape legend: B batch, H query heads, Hkv key/value heads, G pattern heads (H or Hkv), S local (per-rank)
sequence length, N = S * W the padded global length, W = cp_size, n rows per probe block (``last_q``), r = n x the
number of probe blocks, D head dim, P key pieces of R consecutive positions.

The recall (``attention_recall``) scores its sampled rows with the estimator's own probe machinery (``_Probe``,
``_resolve``, ``_scores``), so both live here.

The contract (``estimate_pattern``), per batch row and pattern head:

- probe rows: blocks of ``last_q`` consecutive positions of the row's *real* sequence (``seq_len``; padding added
  for sharding is never a probe, never selected, never counted), per ``config.probes``:

  - ``"last"``: one block, the last ``last_q`` positions (the paper);
  - ``"spread"``: ``P = min(probe_blocks, L // last_q)`` blocks, block p ending at ``(p + 1) * L // P - 1``;
  - ``"documents"``: without documents, ``"last"``; with documents, the last block plus, for each earlier document
    ``[s, e]`` longer than ``local_window`` with ``s < L - last_q``, the longest first (ties: the later one), at
    most ``probe_blocks - 1`` of them, the rows ``max(s, e - last_q + 1) .. e`` that lie before the last block;

- ``A = softmax(scale * q_probe k^T)`` over the keys with ``k_pos <= q_pos`` (zero elsewhere), and with packed
  documents only the keys of the row's own document; with ``pattern_heads="kv"`` the ``A`` of the query heads of a
  KV group are summed;
- vertical score of key j: the sum of column j of ``A``; slash score of offset o: the sum of ``A[i, q_pos_i - o]``
  over the probe rows;
- forced: verticals ``0 .. sink_tokens - 1`` (packed documents: the first ``sink_tokens`` positions of every
  document) and offsets ``0 .. local_window - 1`` (those < the real length);
- top-k: the forced entries plus the k best others; top-p: the forced entries, then the others by decreasing score
  while the kept mass is below ``top_p`` times the total mass (the sum of all scores), at most the cap; verticals
  and slashes separately; ties: the lower index first. Budgets may differ per head and per layer
  (:meth:`SparsityConfig.head_budgets`).

Note [Distributed estimation]
-----------------------------
No rank ever holds the scores of another rank's keys. Per layer, with W ranks::

    0. documents  (packed documents only; once a batch, the first layer's) one all-gather of this rank's
                  document-start flags [B, S]: every rank knows every document, so every rank places the same
                  probe blocks and the same sinks
    1. probes     every rank writes the probe rows it owns into a zero [B, H, r, D] buffer; all-reduce(sum)
                  gives every rank all probes (exact: each element has one non-zero contributor)
    2. normaliser each rank scores the probes against its own keys (chunked, no grad) and all-gathers its
                  row log-sum-exps [B, H, r]; every rank merges the W of them in the same order
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

Cost per rank: O(r * H * D * S) multiply-adds for the scores (twice: normaliser, then scores; r = n for the
paper's one block, up to ``probe_blocks`` times that with several), O(B*G*(N/W)) for the selection (``topk``); no host
synchronisation except on the first call for a (group, shapes) pair (a cross-rank shape check) and the host-side
key bookkeeping (cached per layout); packed documents add two once a batch (the documents' validation, and the number
of sinks and of probe blocks: both kept per ``doc_start`` tensor, which every layer of a forward shares).

Scorers: on CUDA (half or float32 inputs) the Triton scorer (:mod:`mtraining_kernels.probe_scores`, two launches
per probe block, the scores never leave registers) for probe blocks without padding rows and without documents,
wherever the rank's keys come in blocks of >= 16 consecutive positions holding at
least ``last_q - 1`` keys (striped/zigzag with ``block_size`` >= 16, contiguous, one rank); otherwise the torch
scorer below (chunks of key pieces, ~15 full-size elementwise ops per chunk). Both compute the same sums; the
Triton one in float32 from the input dtype's products. Selection: float32 scores are packed with their index into
unique int64 keys (:func:`_top_packed`, ``topk`` locally and after the all-gather); float64 scores (tests) take
stable sorts. Both give the contract's order exactly (tested equal).

Determinism: every sum is in a fixed order. The slash partials of one probe block are accumulated over pieces
(torch) or blocks (Triton) of >= n - 1 consecutive keys whose offset windows overlap at most pairwise, so even atomic
adds see at most two non-zero terms per element, and a + b is commutative in IEEE arithmetic; the blocks' partials
are kept apart and added in block order.
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
from lightning_mtraining.core.memo import TensorMemo
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
    """The probe rows of one call, every rank's share of them, and the global softmax normaliser.

    ``rows_pos [B, r]``: the rows' global positions, ``blocks`` runs of ``n = r / blocks`` consecutive positions
    (the slash sums shift each block's rows along its diagonals; :func:`attention_recall` passes any rows as one
    block and never asks for slash sums). ``rows_ok [B, r]`` (optional): rows that see no key at all (padding of a
    short block): their probabilities are 0."""

    def __init__(self, q, k, rows_pos: torch.Tensor, group, cp_rank: int, cp_size: int, layout: str,
                 block_size: int, scale: float, doc_start: torch.Tensor | None = None, blocks: int = 1,
                 rows_ok: torch.Tensor | None = None) -> None:
        B, H, S, D = q.shape
        self.B, self.H, self.Hkv, self.D = B, H, k.shape[1], D
        self.r = rows_pos.shape[1]
        self.blocks, self.n = blocks, self.r // blocks
        self.group, self.cp_size, self.scale = group, cp_size, scale
        self.cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.n_total = S * cp_size
        self.pos, self.piece_idx, self.piece_valid, self.piece_start, self.R = _local_keys(
            self.n_total, cp_rank, cp_size, layout, block_size, self.n, q.device
        )
        self.rows_pos = rows_pos  # [B, r] global positions of the probe rows (device, int64)
        self.rows_ok = rows_ok
        self.k = k
        self.q_in = self._gather_rows(q)  # [B, H, r, D] in the input dtype
        self.q_rows = self.q_in.to(self.cdt)
        # packed documents: each probe row sees only keys >= its document's first position (rows_lo [B, r])
        self.rows_lo = None
        if doc_start is not None:
            self.rows_lo = self._gather_rows(doc_start.expand(B, S)[:, None, :, None].contiguous())[:, 0, :, 0]
        plain = doc_start is None and rows_ok is None
        self.block = _triton_block(q, self.n, self.n_total, cp_rank, cp_size, layout, block_size) if plain else 0
        self.lse = self._global_lse()  # [B, H, r]

    @property
    def folds(self) -> bool:
        """One batch row and several blocks: the Triton scorer takes the blocks as a batch of ``blocks`` rows in one
        launch, K broadcast to them with a zero batch stride (no copy)."""
        return self.B == 1 and self.blocks > 1

    def folded(self, t: torch.Tensor) -> torch.Tensor:
        """``[1, H, r, *]`` -> ``[blocks, H, n, *]`` (one batch row per probe block)."""
        return t.view(t.shape[1], self.blocks, self.n, *t.shape[3:]).transpose(0, 1).contiguous()

    def unfold(self, t: torch.Tensor) -> torch.Tensor:
        """``[blocks, H, n]`` -> ``[1, H, r]``."""
        return t.transpose(0, 1).reshape(1, t.shape[1], self.r)

    def block_rows(self, t: torch.Tensor, p: int) -> torch.Tensor:
        """Probe block ``p``'s rows of ``t [..., r, *]`` (dim 2 for ``[B, H, r, D]``, else the last)."""
        sl = slice(p * self.n, (p + 1) * self.n)
        return (t[:, :, sl] if t.dim() == 4 else t[..., sl]).contiguous()

    def _gather_rows(self, q: torch.Tensor) -> torch.Tensor:
        """``q [B, H', S, D']``'s rows at the probe positions, from whichever rank holds each (an all-reduce)."""
        loc = torch.searchsorted(self.pos, self.rows_pos).clamp(max=self.pos.numel() - 1)  # [B, n]
        mine = self.pos[loc] == self.rows_pos
        rows = torch.gather(q, 2, loc[:, None, :, None].expand(self.B, q.shape[1], self.r, q.shape[3]))
        rows = torch.where(mine[:, None, :, None], rows, torch.zeros((), dtype=q.dtype, device=q.device))
        if self.cp_size > 1:
            rows = rows.contiguous()
            with named_failure(f"the probe queries' all-reduce {tuple(rows.shape)}"):
                dist.all_reduce(rows, group=self.group)
        return rows.contiguous()

    def chunks(self):
        """Yield ``(piece slice, key positions [Pc, R], visible [B, 1, r, Pc, R], scores [B, H, r, Pc, R])``."""
        P, R = self.piece_idx.shape
        per = max(1, _MAX_SCORES // max(1, self.B * self.H * self.r * R))
        G = self.H // self.Hkv
        q5 = self.q_rows.view(self.B, self.Hkv, G * self.r, self.D)
        for p0 in range(0, P, per):
            sl = slice(p0, min(P, p0 + per))
            idx, valid = self.piece_idx[sl], self.piece_valid[sl]
            Pc = idx.shape[0]
            kpos = self.pos[idx]  # [Pc, R]
            kc = self.k[:, :, idx.reshape(-1)].to(self.cdt)  # [B, Hkv, Pc*R, D]
            s = torch.matmul(q5, kc.transpose(-1, -2)) * self.scale  # [B, Hkv, G*n, Pc*R]
            s = s.view(self.B, self.H, self.r, Pc, R)
            visible = valid[None, None, None] & (kpos[None, None, None] <= self.rows_pos[:, None, :, None, None])
            if self.rows_lo is not None:
                visible = visible & (kpos[None, None, None] >= self.rows_lo[:, None, :, None, None])
            if self.rows_ok is not None:
                visible = visible & self.rows_ok[:, None, :, None, None]
            yield sl, kpos, visible, s.masked_fill(~visible, float("-inf"))

    def _global_lse(self) -> torch.Tensor:
        if self.block:  # the kernel's rows are one run of consecutive positions: the blocks as a batch, or apart
            from mtraining_kernels.probe_scores import probe_lse

            if self.folds:
                q, rows = self.folded(self.q_in), self.rows_pos.view(self.blocks, self.n)
                lse = self.unfold(probe_lse(q, self.k.expand(self.blocks, -1, -1, -1), self.pos, rows, self.scale,
                                            self.block))
            else:
                lse = torch.cat([probe_lse(self.block_rows(self.q_in, p), self.k, self.pos,
                                           self.block_rows(self.rows_pos, p), self.scale, self.block)
                                 for p in range(self.blocks)], dim=-1)
        else:
            lse = torch.full((self.B, self.H, self.r), float("-inf"), dtype=self.cdt, device=self.q_rows.device)
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


def _top_packed(scores, index, candidate, total, forced_mass, Kl: int, K: int, group,
                cp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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


@functools.lru_cache(maxsize=64)
def _every_rank_positions(n_total: int, cp_size: int, layout: str, block_size: int,
                          device: torch.device) -> torch.Tensor:
    """``[W, S]`` the global positions of every rank's shard."""
    if cp_size == 1:
        return torch.arange(n_total, device=device)[None]
    return torch.stack([global_positions(n_total, r, cp_size, layout, block_size, device=device)
                        for r in range(cp_size)])


class _Documents:
    """The packed documents of every batch row over the whole sequence, the same on every rank: one all-gather of
    this rank's document-start flags (``doc_start [B or 1, S]``, positions ``pos [S]``).

    Attributes (``[B, N]``, N the padded global length; positions >= a row's real length belong to no document):
    ``first`` (a document starts here), ``start_of`` (the first position of each position's document), ``length``
    (at each first position: the document's real length, else 0), ``sinks`` (the first ``sink_tokens`` positions of
    every document, once :meth:`probes_and_sinks` ran)."""

    def __init__(self, doc_start: torch.Tensor, pos: torch.Tensor, lens: list[int], lens_t: torch.Tensor, group,
                 cp_size: int, n_total: int, layout: str, block_size: int) -> None:
        dev = doc_start.device
        mine = (doc_start == pos[None, :]).to(torch.uint8)  # [B', S]
        every = all_gather_stacked(mine, group, cp_size)  # [W, B', S]
        where = _every_rank_positions(n_total, cp_size, layout, block_size, dev).reshape(-1)  # [W * S]
        Bd, N, B = doc_start.shape[0], n_total, lens_t.shape[0]
        first = torch.zeros(Bd, N, dtype=torch.bool, device=dev)
        first.scatter_(1, where[None].expand(Bd, -1), every.permute(1, 0, 2).reshape(Bd, -1).bool())
        self.ar = torch.arange(N, device=dev)
        self.lens = lens_t[:, None]  # [B, 1]
        real = self.ar[None] < self.lens
        self.first = (first.expand(B, N) | (self.ar == 0)[None]) & real
        self.start_of = torch.where(self.first, self.ar, 0).cummax(-1).values
        # the next document's first position (or the real length) after each position
        nxt = torch.where(self.first, self.ar, self.lens).flip(-1).cummin(-1).values.flip(-1)
        after = torch.cat([nxt[:, 1:], self.lens], dim=-1)
        self.length = torch.where(self.first, after - self.ar, 0)
        self.real, self.host_lens = real, lens
        self.sinks: torch.Tensor = torch.zeros(0, dtype=torch.bool, device=dev)  # set by probes_and_sinks

    def probes_and_sinks(self, config: SparsityConfig):
        """``(forced verticals [B, 1, m], rows_pos [B, P*n], rows_ok [B, P*n] or None, P)`` for ``config``: the
        sinks of every document, and the probe rows of ``config.probes`` (one host sync, for m and P)."""
        n, N, B = config.last_q, self.ar.numel(), self.lens.shape[0]
        self.sinks = ((self.ar[None] - self.start_of) < config.sink_tokens) & self.real
        if config.probes == "documents":
            # earlier documents longer than the local window whose end lies before the last block
            last_start = self.start_of.gather(1, self.lens - 1)  # [B, 1]
            cand = self.first & (self.length > config.local_window) & (self.ar[None] != last_start) \
                & (self.ar[None] < self.lens - n)
            m, others = torch.stack([self.sinks.sum(-1).max(), cand.sum(-1).max()]).tolist()
            blocks = min(config.probe_blocks, 1 + others)
        else:
            m, blocks = int(self.sinks.sum(-1).max()), 1
        where = torch.where(self.sinks, self.ar[None], -1)
        forced = _sorted_indices(torch.topk(where, max(1, m), dim=-1).values)[:, None, :]
        last = _last_rows(self.lens[:, 0], n)  # [B, n]
        if config.probes == "spread":
            rows_pos, rows_ok, blocks = _spread_rows(self.host_lens, n, config.probe_blocks, self.ar.device)
            return forced, rows_pos, rows_ok, blocks
        if blocks == 1:
            return forced, last, None, 1
        # the longest documents first (ties: the later one); keys are unique, so the choice is exact
        key = torch.where(cand, self.length * (N + 1) + self.ar[None], -1)
        top = torch.topk(key, blocks - 1, dim=-1).values  # [B, P - 1]
        chosen = top >= 0
        start = torch.where(chosen, top % (N + 1), 0)
        end = start + torch.where(chosen, top // (N + 1), 0) - 1  # the document's last position
        rows = end[..., None] - n + 1 + torch.arange(n, device=self.ar.device)  # [B, P - 1, n]
        ok = chosen[..., None] & (rows >= start[..., None]) & (rows < self.lens[..., None] - n)
        # rows outside the document stay in place (a block is a run of consecutive positions) but see no key
        rows_pos = torch.cat([rows, last[:, None]], dim=1).view(B, blocks * n)
        rows_ok = torch.cat([ok, torch.ones_like(last, dtype=torch.bool)[:, None]], dim=1).view(B, blocks * n)
        return forced, rows_pos, rows_ok, blocks


# The documents' bookkeeping per doc_start tensor (kept while it lives): every layer of a forward estimates with the
# same tensor, so the all-gather of the start flags and the probes' host sync run once a batch (on every rank alike:
# the same layers hit the same entries, so the collectives stay matched).
_DOCUMENTS = TensorMemo()


def _documents(doc_start: torch.Tensor, pos: torch.Tensor, lens: list[int], lens_t: torch.Tensor, group,
               cp_size: int, n_total: int, layout: str, block_size: int, config: SparsityConfig):
    """``(_Documents, its probes_and_sinks(config))``, made once per doc_start tensor, sharding and probe settings."""
    key = (tuple(lens), group, cp_size, n_total, layout, block_size, str(pos.device), config.probes, config.last_q,
           config.probe_blocks, config.local_window, config.sink_tokens)

    def make():
        docs = _Documents(doc_start, pos, lens, lens_t, group, cp_size, n_total, layout, block_size)
        return docs, docs.probes_and_sinks(config)

    return _DOCUMENTS.get_or_make(doc_start, key, make)


def _last_rows(lens_t: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n]`` the last ``n`` real positions of every row: the paper's probes."""
    return lens_t[:, None] - n + torch.arange(n, device=lens_t.device)[None, :]


def _spread_rows(lens: list[int], n: int, max_blocks: int, device) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``probes="spread"``: ``(rows_pos [B, P*n], rows_ok or None, P)``. Row b has ``P_b = min(max_blocks, L_b //
    n)`` blocks, block p ending at ``(p + 1) * L_b // P_b - 1`` (so the last ends at ``L_b - 1`` and no two overlap);
    P is the largest P_b, and rows of blocks p >= P_b are padding (``rows_ok``; None when every row has P blocks).
    Host arithmetic on the real lengths only: no device sync."""
    per_row = [max(1, min(max_blocks, length // n)) for length in lens]
    P = max(per_row)
    starts = [((p + 1) * length // pb - n) if p < pb else 0 for length, pb in zip(lens, per_row) for p in range(P)]
    rows = _device_ints(tuple(starts), device).view(len(lens), P, 1) + torch.arange(n, device=device)
    ok = None
    if min(per_row) < P:
        ok = _device_ints(tuple(int(p < pb) for pb in per_row for p in range(P)), device).bool().view(len(lens), P, 1)
        ok = ok.expand(len(lens), P, n).reshape(len(lens), P * n)
    return rows.reshape(len(lens), P * n), ok, P


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
            with the documents. With ``config.probes="documents"`` every document longer than the local window
            gets its own probe block (up to ``probe_blocks``), so each one's columns and diagonals compete for the
            budget; with ``"last"`` (the paper) the probes lie in the row's last document(s) and the chosen
            verticals mostly serve it. Costs one all-gather of ``B x S`` bytes more once a batch (the documents'
            start flags; kept per ``doc_start`` tensor) and runs the torch scorer.

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
    pos = _local_keys(n_total, cp_rank, cp_size, layout, block_size, n, dev)[0]
    if doc_start is not None:
        # every rank keeps it (even where all its tokens lie in first documents): collectives follow
        doc_start = check_doc_start(doc_start, q, pos, drop_single=False)
    with torch.no_grad():
        docs: _Documents | None = None
        forced_v: torch.Tensor | None = None
        if doc_start is not None:
            docs, (forced_v, rows_pos, rows_ok, blocks) = _documents(doc_start, pos, lens, lens_t, group, cp_size,
                                                                     n_total, layout, block_size, config)
        elif config.probes == "spread":
            rows_pos, rows_ok, blocks = _spread_rows(lens, n, config.probe_blocks, dev)
        else:
            rows_pos, rows_ok, blocks = _last_rows(lens_t, n), None, 1
        probe = _Probe(q, k, rows_pos, group, cp_rank, cp_size, layout, block_size, scale, doc_start, blocks,
                       rows_ok)
        N = n_total
        vert, slash = _scores(probe, G) if not probe.block else _triton_scores(probe, G)
        # rank r receives the exact sums of the offsets [r N/W, (r+1) N/W)
        owned = reduce_scatter_dim0(slash.view(B, G, cp_size, N // cp_size).permute(2, 0, 1, 3), group, cp_size)
        off_idx = torch.arange(N // cp_size, device=dev) + cp_rank * (N // cp_size)
        lens_b = lens_t[:, None, None]
        if docs is None:
            v_forced = probe.pos[None, None, :] < config.sink_tokens
        else:  # every document's first sink_tokens positions
            v_forced = docs.sinks[:, probe.pos][:, None, :]
        v_cand = ~v_forced & (probe.pos[None, None, :] < lens_b)
        s_forced = off_idx[None, None, :] < config.local_window
        s_cand = ~s_forced & (off_idx[None, None, :] < lens_b)
        v_sel = _select(vert, probe.pos[None, :], v_cand, v_forced.expand_as(vert), vert_budget, config.top_p,
                        group, cp_size)
        s_sel = _select(owned, off_idx[None, :], s_cand, s_forced.expand_as(owned), slash_budget, config.top_p,
                        group, cp_size)
        if forced_v is None:
            forced_v = _forced(config.sink_tokens, lens, (B, G), dev)
        vertical_idx = _sorted_indices(forced_v.expand(B, G, -1), v_sel)
        slash_idx = _sorted_indices(_forced(config.local_window, lens, (B, G), dev), s_sel)
    return VerticalSlashPattern(vertical_idx, slash_idx, tile_size=config.tile_size)


def _triton_scores(probe: _Probe, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton scorer: its rows must be one run of positions, so several probe blocks go as a batch (one batch
    row) or one launch pair per block; the blocks' sums are added in block order."""
    from mtraining_kernels.probe_scores import probe_scores

    if probe.folds:  # the blocks' sums land in batch rows, added in block order
        lse = probe.folded(probe.lse[..., None])[..., 0]  # [blocks, H, n]
        vert, slash = probe_scores(probe.folded(probe.q_in), probe.k.expand(probe.blocks, -1, -1, -1), probe.pos,
                                   probe.rows_pos.view(probe.blocks, probe.n), lse, probe.scale, G != probe.H,
                                   probe.n_total, probe.block)
        return vert.sum(0, keepdim=True), slash.sum(0, keepdim=True)
    vert = slash = None
    for p in range(probe.blocks):
        v, s = probe_scores(probe.block_rows(probe.q_in, p), probe.k, probe.pos, probe.block_rows(probe.rows_pos, p),
                            probe.block_rows(probe.lse, p), probe.scale, G != probe.H, probe.n_total, probe.block)
        vert, slash = (v, s) if vert is None else (vert + v, slash + s)
    return vert, slash


def _scores(probe: _Probe, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical scores ``[B, G, S]`` of this rank's keys and slash partial sums ``[B, G, N]`` (torch, chunked).

    Each probe block's diagonals are summed into its own ``[N]`` row (at most two non-zero terms per element, see
    the module docstring), and the blocks' rows are added at the end in block order."""
    B, H, r, n, P, S, N = probe.B, probe.H, probe.r, probe.n, probe.blocks, probe.k.shape[2], probe.n_total
    dev = probe.q_rows.device
    vert = torch.zeros(B, G, S + 1, dtype=probe.cdt, device=dev)  # + 1: a bin for the pieces' unused slots
    slash = torch.zeros(B * G * P * N + 1, dtype=probe.cdt, device=dev)  # + 1: a bin for out-of-range offsets
    R = probe.R
    c = torch.arange(R + n - 1, device=dev)
    row_base = ((torch.arange(B, device=dev)[:, None, None] * G + torch.arange(G, device=dev)[None, :, None]) * P
                + torch.arange(P, device=dev)[None, None, :]) * N  # [B, G, P]
    first = probe.rows_pos.view(B, P, n)[:, :, 0]  # [B, P] each block's first row
    for sl, _kpos, visible, s in probe.chunks():
        a = probe.probabilities(s, visible)  # [B, H, r, Pc, R]
        if G != H:
            a = a.view(B, G, H // G, r, *a.shape[-2:]).sum(2)
        Pc = a.shape[-2]
        # verticals: column sums, written at the pieces' local indices (each local key once)
        col = a.sum(2)  # [B, G, Pc, R]
        idx = torch.where(probe.piece_valid[sl], probe.piece_idx[sl], S)  # invalid slots -> the spare bin S
        vert.scatter_(2, idx.reshape(1, 1, -1).expand(B, G, -1), col.reshape(B, G, -1))
        # slashes: sums along each piece's diagonals per probe block (skew: flip keys, pad, shift row i by i)
        x = a.view(B, G, P, n, Pc, R).permute(0, 1, 2, 4, 3, 5).flip(-1)  # [B, G, P, Pc, n, R]
        x = torch.nn.functional.pad(x, (0, n)).flatten(-2)[..., : n * (R + n) - n]
        diag = x.view(B, G, P, Pc, n, R + n - 1).sum(-2)  # [B, G, P, Pc, R + n - 1]
        # diagonal c of piece p holds offset o = (first row of the block - start_p - R + 1) + c
        off = (first[:, :, None, None] - probe.piece_start[sl][None, None, :, None] - R + 1) + c  # [B, P, Pc, R+n-1]
        ok = (off >= 0) & (off < N)
        flat = torch.where(ok[:, None], row_base[..., None, None] + off[:, None], B * G * P * N)
        slash.index_add_(0, flat.reshape(-1), diag.reshape(-1))
    return vert[..., :S], slash[:-1].view(B, G, P, N).sum(2)


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
        raise ValueError(f"attention_recall: rows must be a count, [r] or [B={B}, r] positions; "
                         f"got {tuple(rows.shape)}")
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
    per_row: bool = False,
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
        per_row: return every sampled row's recall instead of their mean (e.g. to split it by document).

    Returns:
        ``[B, G]`` float64 recall per batch row and pattern head (for a per-KV-group pattern, averaged over the
        group's query heads); with ``per_row``, ``[B, G, r]``.

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
        kept = torch.zeros(B, H, probe.r, dtype=probe.cdt, device=dev)
        qt = (rows_pos // T)[:, None, :, None, None]  # [B, 1, r, 1, 1]
        for _sl, kpos, visible, s in probe.chunks():
            a = probe.probabilities(s, visible)  # [B, H, r, Pc, R]
            u = (qt - (kpos // T)[None, None, None]).clamp(0, NT - 1)  # [B, 1, r, Pc, R]
            tile = comp.gather(-1, u.expand(B, H, *u.shape[2:]).reshape(B, H, -1)).view(a.shape)
            col = is_vert[:, :, kpos.reshape(-1)].view(B, H, 1, *kpos.shape)
            kept += (a * (tile | col)).sum((-1, -2))
        kept = all_gather_stacked(kept, group, cp_size).sum(0).to(torch.float64)  # [B, H, r]
        recall = kept if per_row else kept.mean(-1)  # each row's total mass is 1
        if G != H:
            recall = recall.view(B, G, H // G, *recall.shape[2:]).mean(2)
    return recall
