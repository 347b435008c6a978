"""The vertical-slash sparse attention pattern (``VerticalSlashPattern``).

Shape legend: B batch, G pattern heads (G = H: one pattern per query head; G = Hkv: one per KV group, shared by
its H // Hkv query heads), n / n' the (padded) number of verticals / slashes, S the sequence length, T the tile.

A pattern is a *global* object: ``vertical_idx [B, G, n]`` are key positions of the whole sequence and
``slash_idx [B, G, n']`` are diagonal offsets q - k (0 = the main diagonal); negative entries are padding. Its
meaning is exactly ``sparse_attention(q, k, v, vertical_idx, slash_idx, block_size=tile_size)`` on the
unsharded sequence (the computed pairs are defined in :mod:`mtraining_kernels.indexing`): slashes run at tile
granularity (the T x T tiles their diagonal crosses), verticals token by token, always key <= query. Because the
pattern names global positions, the same pattern gives the same attention whatever the layout and the number of
context-parallel ranks; :func:`~lightning_mtraining.sparsity.estimation.estimate_pattern` estimates one online.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import torch

from lightning_mtraining.core.checks import is_int

__all__ = ["OUTCOMES", "LayerPattern", "Outcome", "VerticalSlashPattern", "allowed_share", "check_tile_size",
           "decide_dense_heads", "dense_heads", "head_pairs", "outcome_of", "real_lengths", "sparse_part",
           "with_dense_heads"]

# What a layer's dense decision comes to: no head dense, some heads dense, every head dense.
Outcome = Literal["sparse", "mixed", "dense"]
OUTCOMES: tuple[Outcome, ...] = ("sparse", "mixed", "dense")


def check_tile_size(tile_size: Any, owner: str) -> None:
    if not is_int(tile_size, 16) or tile_size & (tile_size - 1):
        raise ValueError(f"{owner}.tile_size must be a power of two >= 16 (the kernels' tile), got {tile_size!r}")


@dataclasses.dataclass(frozen=True)
class VerticalSlashPattern:
    """A global vertical-slash pattern: the meaning is ``sparse_attention(q, k, v, vertical_idx, slash_idx,
    block_size=tile_size)`` on the unsharded sequence, whatever the layout and world size.

    Args:
        vertical_idx: ``[B, G, n]`` integer key positions (vertical lines); negative entries are padding.
        slash_idx: ``[B, G, n']`` integer diagonal offsets q - k (0 = main diagonal); negative entries are padding.
        tile_size: the tile T at which slashes run (a power of two >= 16).

    Duplicates are allowed and ignored. G is H (a pattern per query head) or H_kv (per KV group).
    """

    vertical_idx: torch.Tensor
    slash_idx: torch.Tensor
    tile_size: int = 128

    def __post_init__(self) -> None:
        for name in ("vertical_idx", "slash_idx"):
            idx = getattr(self, name)
            if not isinstance(idx, torch.Tensor):
                raise TypeError(f"VerticalSlashPattern.{name} must be a torch.Tensor, got {type(idx).__name__}")
            if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.is_complex():
                raise TypeError(f"VerticalSlashPattern.{name} must be an integer tensor, got {idx.dtype}")
            if idx.dim() != 3:
                raise ValueError(f"VerticalSlashPattern.{name} must be [batch, heads, n], got {tuple(idx.shape)}")
        v, s = self.vertical_idx, self.slash_idx
        if v.shape[:2] != s.shape[:2]:
            raise ValueError(
                f"VerticalSlashPattern: vertical_idx {tuple(v.shape)} and slash_idx {tuple(s.shape)} must share "
                "[batch, heads]"
            )
        if v.device != s.device:
            raise ValueError(f"VerticalSlashPattern: vertical_idx on {v.device} but slash_idx on {s.device}")
        check_tile_size(self.tile_size, "VerticalSlashPattern")

    @property
    def batch_size(self) -> int:
        return self.vertical_idx.shape[0]

    @property
    def num_heads(self) -> int:
        """G, the number of pattern heads."""
        return self.vertical_idx.shape[1]

    @property
    def device(self) -> torch.device:
        return self.vertical_idx.device

    def to(self, device: torch.device | str) -> VerticalSlashPattern:
        return VerticalSlashPattern(self.vertical_idx.to(device), self.slash_idx.to(device), self.tile_size)

    def validate(self, seq_len: int, num_heads: int | None = None, num_kv_heads: int | None = None,
                 batch_size: int | None = None) -> None:
        """Raise a clear error unless the pattern fits a sequence of ``seq_len`` tokens (and the given heads).

        Entries must be < ``seq_len`` (negative ones are padding); G must be H or H_kv. One host sync.
        """
        if batch_size is not None and self.batch_size != batch_size:
            raise ValueError(f"the pattern is for batch {self.batch_size}, the inputs have batch {batch_size}")
        if num_heads is not None:
            allowed = {num_heads} | ({num_kv_heads} if num_kv_heads is not None else set())
            if self.num_heads not in allowed:
                raise ValueError(
                    f"the pattern has {self.num_heads} heads; expected H={num_heads} (per query head)"
                    + (f" or H_kv={num_kv_heads} (per KV group)" if num_kv_heads is not None else "")
                )
        for name in ("vertical_idx", "slash_idx"):
            idx = getattr(self, name)
            if idx.numel():
                top = int(idx.max())
                if top >= seq_len:
                    raise ValueError(
                        f"VerticalSlashPattern.{name} holds {top} >= sequence length {seq_len}: key positions and "
                        "diagonal offsets must be < the sequence length (use negative values for padding)"
                    )

    def expand(self, num_heads: int, num_kv_heads: int) -> VerticalSlashPattern:
        """The same pattern with one row per query head (G = H)."""
        from mtraining_kernels.indexing import expand_pattern

        return VerticalSlashPattern(
            expand_pattern(self.vertical_idx, num_heads, num_kv_heads),
            expand_pattern(self.slash_idx, num_heads, num_kv_heads),
            self.tile_size,
        )

    def mask(self, seq_len: int) -> torch.Tensor:
        """Boolean ``[B, G, S, S]`` mask of the allowed (query, key) pairs (a reference for small S)."""
        from mtraining_kernels.reference import vertical_slash_mask

        return vertical_slash_mask(self.vertical_idx, self.slash_idx, seq_len, self.tile_size)

    def allowed_pairs(self, seq_len: int) -> torch.Tensor:
        """Exact number of allowed (query, key) pairs per ``[B, G]`` (int64), counted per tile."""
        from lightning_mtraining.sparsity.balance import allowed_pairs

        return allowed_pairs(self, seq_len)

    def density(self, seq_len: int) -> torch.Tensor:
        """Exact share of the causal pairs the pattern allows, ``[B, G]`` float64 (1.0 = dense)."""
        causal = seq_len * (seq_len + 1) // 2
        return self.allowed_pairs(seq_len).double() / causal

    @classmethod
    def full(cls, batch_size: int, num_heads: int, seq_len: int, tile_size: int = 128,
             device: torch.device | str | None = None) -> VerticalSlashPattern:
        """A pattern that covers every causal pair (a slash through every tile diagonal): dense attention."""
        check_tile_size(tile_size, "VerticalSlashPattern")
        n_tiles = -(-seq_len // tile_size)
        slash = (torch.arange(n_tiles, device=device) * tile_size).expand(batch_size, num_heads, n_tiles)
        vertical = torch.full((batch_size, num_heads, 1), -1, dtype=torch.int64, device=device)
        return cls(vertical, slash.contiguous(), tile_size)


def head_pairs(pattern: VerticalSlashPattern, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(allowed [B, G], causal [B])``: the (query, key) pairs each row's pattern head allows over the row's real
    sequence (``lengths``, one per batch row), and the causal pairs of that sequence (exact, per tile)."""
    allowed = _allowed_per_head(pattern, lengths)
    return allowed, _causal_pairs(lengths).to(allowed.device)


def _allowed_per_head(pattern: VerticalSlashPattern, lengths: list[int]) -> torch.Tensor:
    """``[B, G]`` int64 on the pattern's device, no host sync."""
    if len(set(lengths)) == 1:  # one length: every row at once
        return pattern.allowed_pairs(lengths[0])
    return torch.cat([
        VerticalSlashPattern(pattern.vertical_idx[b:b + 1], pattern.slash_idx[b:b + 1],
                             pattern.tile_size).allowed_pairs(length)
        for b, length in enumerate(lengths)])


@functools.lru_cache(maxsize=64)
def _causal_on(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """:func:`_causal_pairs` on ``device``, made once per lengths and device (the copy to a GPU synchronises)."""
    return _causal_pairs(lengths).to(device)


def _causal_pairs(lengths) -> torch.Tensor:
    """``[B]`` int64 on the host (a tensor built from a list on a GPU would be a synchronising copy)."""
    return torch.tensor([n * (n + 1) // 2 for n in lengths], dtype=torch.int64)


def allowed_share(pattern: VerticalSlashPattern, lengths: list[int]) -> tuple[int, int]:
    """``(allowed, causal)``: the (query, key) pairs ``pattern`` allows over the real sequences (``lengths``, one per
    batch row) and the causal pairs of the same sequences, summed over rows and pattern heads (one host sync)."""
    allowed, causal = head_pairs(pattern, lengths)
    return int(allowed.sum()), int(causal.sum()) * pattern.num_heads


def real_lengths(seq_len: Any, batch: int, padded: int) -> list[int]:
    """One real length per batch row: ``seq_len`` as an int or one per row, or the padded length when None."""
    if seq_len is None:
        return [padded] * batch
    if isinstance(seq_len, int):
        return [seq_len] * batch
    return [int(x) for x in seq_len]


def dense_heads(pattern: VerticalSlashPattern, lengths: list[int], dense_above: float | None) -> torch.Tensor | None:
    """``[B, G]`` bool: the pattern heads (per batch row) that allow more than ``dense_above`` of their real sequence's
    causal pairs, which run dense attention instead (:func:`with_dense_heads`); None when ``dense_above`` is None.
    Decided per head, so the decision is the same on every rank (the pattern is), at every world size (padding does
    not count) and under tensor parallelism (a rank holds whole heads).

    Exact whatever the default dtype: the pair counts are int64 and the comparison runs in float64 (counts up to
    2**53 are exact there, and ``dense_above * causal`` rounds the same way in every pass). A comparison in the
    default dtype would, under ``precision="bf16-true"``, round ``dense_above * causal`` to 8 bits of mantissa in
    the forward and not in a checkpointed layer's float32 recompute, so a head near the threshold would take another
    path in each pass."""
    if dense_above is None:
        return None
    allowed, causal = head_pairs(pattern, lengths)
    return decide_dense_heads(allowed, causal, dense_above)


def decide_dense_heads(allowed: torch.Tensor, causal: torch.Tensor, dense_above: float) -> torch.Tensor:
    """``allowed [B, G] > dense_above * causal [B]`` in float64 (exact for integer counts below 2**53), whatever the
    default dtype: the one place a dense-or-sparse decision is computed."""
    threshold = float(dense_above) * causal.to(torch.float64)
    return allowed.to(torch.float64) > threshold[:, None]


def with_dense_heads(pattern: VerticalSlashPattern, dense: torch.Tensor, seq_len: int) -> VerticalSlashPattern:
    """``pattern`` with the heads marked in ``dense [B, G]`` replaced by the full pattern of a ``seq_len``-token
    sequence (a slash through every tile diagonal, no vertical): those heads compute dense causal attention."""
    T = pattern.tile_size
    n_tiles = -(-seq_len // T)
    dense = dense.to(pattern.vertical_idx.device)
    full = torch.arange(n_tiles, device=dense.device, dtype=pattern.slash_idx.dtype) * T
    width = max(pattern.slash_idx.shape[-1], n_tiles)
    slash = torch.full((*pattern.slash_idx.shape[:2], width), -1, dtype=pattern.slash_idx.dtype, device=dense.device)
    slash[..., :pattern.slash_idx.shape[-1]] = pattern.slash_idx
    # torch.where, not boolean indexing: no host sync on a GPU
    slash = torch.where(dense[..., None], torch.cat([full, full.new_full((width - n_tiles,), -1)]), slash)
    vertical = pattern.vertical_idx.masked_fill(dense[..., None], -1)
    return VerticalSlashPattern(vertical, slash, T)


@dataclasses.dataclass(frozen=True)
class LayerPattern:
    """What one layer's sparse attention runs in one forward, decided once (:meth:`decide`) and handed to the ring as
    one record: the ring neither re-validates the pattern nor re-decides which heads run dense, and a checkpointed
    layer's recompute reuses the record (Note [One pattern per forward] in :mod:`lightning_mtraining.sparsity.schedule`)
    so the forward and the recompute take the same path by construction.

    Attributes:
        estimated: the layer's pattern as estimated or given (validated against the sequence).
        computed: what the sparse kernels compute: ``estimated`` with the dense heads' entries replaced by the full
            pattern (:func:`with_dense_heads`); None when every head runs dense (the ring then runs its dense op).
        dense: ``[B, G]`` bool on the host, the heads that allow more than ``dense_above`` of their real sequence's
            causal pairs; None when ``dense_above`` is None.
        allowed: ``[B, G]`` int64 on the host, each head's allowed pairs over its real sequence (None without
            ``dense_above``; the statistics reuse it).
        causal: ``[B]`` int64 on the host, the causal pairs of each row's real sequence (None without ``dense_above``).
        lengths: the real length of each batch row.
        seq_len: the (padded) sequence length the pattern was validated against.
        dense_above: the threshold the decision used.
    """

    estimated: VerticalSlashPattern
    computed: VerticalSlashPattern | None
    dense: torch.Tensor | None
    allowed: torch.Tensor | None
    causal: torch.Tensor | None
    lengths: tuple[int, ...]
    seq_len: int
    dense_above: float | None

    @classmethod
    def decide(cls, pattern: VerticalSlashPattern, lengths: list[int], dense_above: float | None,
               seq_len: int) -> LayerPattern:
        """Decide, exactly (:func:`decide_dense_heads`), which heads of ``pattern`` run dense under ``dense_above``.
        One host sync when ``dense_above`` is set (the per-head pair counts), none otherwise."""
        lens = tuple(int(x) for x in lengths)
        if dense_above is None:
            return cls(pattern, pattern, None, None, None, lens, seq_len, None)
        allowed_d, dense_d, both = _device_decision(pattern, lens, dense_above)
        allowed, dense = _split(both.cpu(), pattern.num_heads)  # the one host sync: it picks a code path
        return cls(pattern, _computed(pattern, outcome_of(dense), dense_d, seq_len), dense, allowed,
                   _causal_pairs(lens), lens, seq_len, float(dense_above))

    @classmethod
    def ran(cls, pattern: VerticalSlashPattern, dense: torch.Tensor | None, allowed: torch.Tensor,
            lengths: list[int], dense_above: float | None, seq_len: int) -> LayerPattern:
        """The record of what a layer ran when its dense heads were decided beforehand (the straight path of
        :mod:`lightning_mtraining.ring.straight`): ``dense [B, G]`` bool on the host, the heads that ran dense (None:
        none); ``allowed [B, G]`` the pattern's pair counts (on the host)."""
        lens = tuple(int(x) for x in lengths)
        mask = dense if dense is not None else torch.zeros(allowed.shape, dtype=torch.bool)
        outcome = outcome_of(mask)
        computed = None if outcome == "dense" else pattern if outcome == "sparse" else with_dense_heads(
            pattern, mask.to(pattern.device), seq_len)
        return cls(pattern, computed, mask, allowed, _causal_pairs(lens), lens, seq_len,
                   None if dense_above is None else float(dense_above))

    @property
    def outcome(self) -> Outcome:
        """``"sparse"`` (no head runs dense), ``"mixed"`` or ``"dense"`` (every head does)."""
        return outcome_of(self.dense)

    @property
    def all_dense(self) -> bool:
        """Every head runs dense: the ring runs its dense op."""
        return self.computed is None

    @property
    def tile_size(self) -> int:
        return self.estimated.tile_size


def outcome_of(dense: torch.Tensor | None) -> Outcome:
    """What a ``[B, G]`` host decision comes to (None: no decision, nothing runs dense)."""
    if dense is None or not bool(dense.any()):
        return "sparse"
    return "dense" if bool(dense.all()) else "mixed"


def _device_decision(pattern: VerticalSlashPattern, lens: tuple[int, ...],
                     dense_above: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(allowed [B, G], dense [B, G], both [B, 2G])`` on the pattern's device, no host sync: the pair counts, the
    decision, and both side by side as int64 for one read."""
    allowed_d = _allowed_per_head(pattern, list(lens))
    dense_d = decide_dense_heads(allowed_d, _causal_on(lens, allowed_d.device), dense_above)
    return allowed_d, dense_d, torch.cat([allowed_d, dense_d.to(torch.int64)], 1)


def _split(both: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    return both[:, :G], both[:, G:].bool()


def _computed(pattern: VerticalSlashPattern, outcome: Outcome, dense_d: torch.Tensor,
              seq_len: int) -> VerticalSlashPattern | None:
    """What the sparse kernels compute for ``outcome``: None (the ring's dense op), the pattern, or the pattern with
    the dense heads made full (from the device mask ``dense_d``: no copy back)."""
    if outcome == "dense":
        return None
    return pattern if outcome == "sparse" else with_dense_heads(pattern, dense_d, seq_len)


def sparse_part(pattern: VerticalSlashPattern, lengths: list[int], dense_above: float | None,
                seq_len: int) -> VerticalSlashPattern | None:
    """What a ring computes for ``pattern`` under ``dense_above`` (:func:`dense_heads`): None when every head runs
    dense (the ring then runs its dense op, cheaper than the sparse kernels over every tile), else the pattern with
    the dense heads' entries replaced by the full pattern (:func:`with_dense_heads`; the sparse kernels compute
    those heads exactly and densely). One host sync when ``dense_above`` is set (:meth:`LayerPattern.decide`)."""
    return LayerPattern.decide(pattern, lengths, dense_above, seq_len).computed
