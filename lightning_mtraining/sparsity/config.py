"""The budgets of the vertical-slash sparse pattern (``SparsityConfig``) and the paper's training setting.

``SparsityConfig`` holds what the estimator (:func:`~lightning_mtraining.sparsity.estimation.estimate_pattern`) needs
(MTraining section 3.1, MInference's vertical-slash search): a fixed top-k per head, or top-p of the attention mass
with caps; the probe size; the always-kept sinks and local window; which layers stay dense, a dense warm-up, and
per-layer / per-head budgets calibrated offline.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from lightning_mtraining.core.checks import is_int
from lightning_mtraining.sparsity.pattern import check_tile_size

__all__ = ["DENSE_ABOVE", "PAPER_SPARSITY", "SparsityConfig", "parse_sparsity"]

# The share of a head's causal pairs above which its sparse attention is taken to cost more than dense attention on
# one GPU: the vertical-slash kernels run at about FlexAttention dense's rate per computed pair (98-113% at
# 128K-512K on an H200, benchmarks/RESULTS.md "Kernels"), so near full density the sparse path costs dense attention
# plus the estimator, the per-step lists and the gathered columns. Derived from those rates, not yet swept on a GPU
# at high densities (benchmarks/kernel_sparse.py --fractions 0.6 0.8 0.95). The default of SparsityConfig.dense_above.
DENSE_ABOVE = 0.85

PatternHeads = Literal["query", "kv"]
Probes = Literal["last", "documents", "spread"]
PROBES = ("last", "documents", "spread")


def _budget(value: Any, name: str, allow_zero: bool = True) -> int | tuple[int, ...]:
    """An int budget or a per-head tuple of ints, validated (>= 0, or >= 1 when zero is not allowed)."""
    low = 0 if allow_zero else 1
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"SparsityConfig.{name}: a per-head budget list must not be empty")
        out = tuple(_budget(v, f"{name}[{i}]", allow_zero) for i, v in enumerate(value))
        return out  # type: ignore[return-value]
    if not is_int(value, low):
        raise ValueError(f"SparsityConfig.{name} must be an int >= {low} (or one per head), got {value!r}")
    return value


def _load_budgets(budgets: Any) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...] | None:
    """Normalise per-layer budgets to a sorted, hashable ``((layer, ((vertical, slash), ...)), ...)``.

    Accepted: ``{layer: (vertical, slash)}`` (every head of the layer) or ``{layer: [(vertical, slash), ...]}``
    (one pair per pattern head), layer keys as ints or strings of ints, or the path of a JSON file holding such a
    mapping (optionally under a top-level ``"layers"`` key).
    """
    if budgets is None:
        return None
    source = ""
    if isinstance(budgets, (str, os.PathLike)):
        source = f" (from {os.fspath(budgets)})"
        try:
            with open(budgets) as f:
                budgets = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"SparsityConfig.budgets: no such JSON file {os.fspath(budgets)!r}") from None
        if isinstance(budgets, Mapping) and "layers" in budgets:
            budgets = budgets["layers"]
    if isinstance(budgets, tuple) and all(isinstance(e, tuple) and len(e) == 2 for e in budgets):
        budgets = dict(budgets)  # already normalised (dataclasses.replace passes it again)
    if not isinstance(budgets, Mapping):
        raise TypeError(
            f"SparsityConfig.budgets{source} must be a mapping {{layer: (vertical, slash) or [(vertical, slash) per "
            f"head]}} or a JSON file path, got {type(budgets).__name__}"
        )
    out: list[tuple[int, tuple[tuple[Any, Any], ...]]] = []
    for key, value in budgets.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"SparsityConfig.budgets{source}: layer key {key!r} is not an integer") from None
        if layer < 0:
            raise ValueError(f"SparsityConfig.budgets{source}: layer {layer} is negative")
        pairs = value
        if isinstance(value, Sequence) and len(value) == 2 and all(isinstance(x, int) for x in value):
            pairs = [value]
        if not isinstance(pairs, Sequence) or not pairs:
            raise ValueError(
                f"SparsityConfig.budgets{source}[{layer}] must be (vertical, slash) or a non-empty list of such "
                f"pairs, got {value!r}"
            )
        norm: list[tuple[Any, Any]] = []
        for h, pair in enumerate(pairs):
            if not isinstance(pair, Sequence) or len(pair) != 2:
                raise ValueError(f"SparsityConfig.budgets{source}[{layer}][{h}] must be (vertical, slash), "
                                 f"got {pair!r}")
            v, s = (_budget(x, f"budgets[{layer}][{h}]") for x in pair)
            norm.append((v, s))
        out.append((layer, tuple(norm)))
    return tuple(sorted(out, key=lambda item: item[0]))  # layers are unique


@dataclasses.dataclass(frozen=True)
class SparsityConfig:
    """Budgets of the vertical-slash pattern estimated online, every forward, per layer and head.

    Two selection modes (the exact rule is in :func:`~lightning_mtraining.sparsity.estimation.estimate_pattern`):

    - top-k (``top_p=None``): the forced entries plus the ``vertical_topk`` / ``slash_topk`` best others;
    - top-p (``top_p`` in (0, 1]): the forced entries, then others by score until the kept share of the probe
      queries' attention mass reaches ``top_p``, at most ``max_vertical`` / ``max_slash`` others. The MTraining
      reference trains with p = 0.9 (caps 4096); smaller p keeps less.

    Args:
        vertical_topk: key columns kept per head in top-k mode (besides the sinks); an int, or one per pattern head.
        slash_topk: diagonals kept per head in top-k mode (besides the local window); an int, or one per head.
        top_p: ``None`` for top-k mode, or the share of attention mass to keep (top-p mode).
        max_vertical: cap on non-forced key columns per head in top-p mode.
        max_slash: cap on non-forced diagonals per head in top-p mode.
        last_q: probe queries per probe block: a block is ``last_q`` consecutive positions scored against all keys.
        probes: where the probe blocks sit (the exact rule is in
            :func:`~lightning_mtraining.sparsity.estimation.estimate_pattern`):

            - ``"last"``: one block, the last ``last_q`` real positions of each sequence (the MTraining paper's
              probes). On packed documents they lie in the last document(s): the verticals of earlier documents
              are chosen only by what the last document's queries attend to.
            - ``"documents"`` (default): where document boundaries are known (``doc_start``, i.e. ``position_ids``
              restarting, ``documents=True`` data), one more block at the end of each earlier document longer than
              ``local_window`` (a shorter one is covered by the local window alone), the longest first, at most
              ``probe_blocks`` blocks in all, so every document's own columns and diagonals compete for the
              budget; where they are not known, exactly ``"last"``.
            - ``"spread"``: ``probe_blocks`` blocks ending at evenly spaced positions, the last at the end of the
              sequence (for packed data whose boundaries are not known; fewer blocks where the sequence is shorter
              than ``probe_blocks * last_q``).

            The scoring cost grows with the number of blocks (``last_q`` rows each); the budgets are shared by all
            blocks (top-p: the share of the mass of every probe row).
        probe_blocks: most probe blocks per sequence for ``probes="documents"`` and ``"spread"`` (the last block
            included).
        sink_tokens: key positions ``0 .. sink_tokens - 1`` are always kept (attention sinks).
        local_window: diagonal offsets ``0 .. local_window - 1`` are always kept (local window).
        pattern_heads: ``"query"``: one pattern per query head; ``"kv"``: one per KV group (scores summed over its
            query heads), which halves nothing in the kernels but makes the pattern G times smaller.
        tile_size: tile T at which slashes run (a power of two >= 16; 128 is the kernels' fastest). Sharded
            layouts must hold whole, aligned tiles (striped: ``block_size`` a multiple of T).
        dense_layers: layer indices that always run dense (exact) attention.
        dense_warmup_steps: optimizer steps trained dense before sparse attention starts (applied by the
            strategies' schedule; ``estimate_pattern`` itself ignores it).
        dense_above: a pattern head whose estimated pattern allows more than this share of its sequence's causal
            (query, key) pairs computes dense attention instead: there the sparse kernels, the
            estimator's lists and the gathered columns cost more than the dense kernel (diffuse attention: a fresh
            model, early training, short sequences); when every head of a layer does, the layer runs the dense ring.
            ``None``: always run the pattern. Decided per head from the exact pair count of the real (unpadded)
            sequence, so the same on every rank, at every world size and under tensor parallelism. Under the
            strategies' attention (eager and compiled) a forward's decision, made on the device, applies from the
            layer's next forward on (Note [The straight path] in :mod:`lightning_mtraining.ring.straight`: no layer
            waits for a host read); packed documents and soft-capped layers, and
            :func:`~lightning_mtraining.ring.attention.ring_attention` called with a config, decide in the same
            forward (one host read). The logged ``attention/dense_heads`` is the share of heads that ran dense.
        budgets: per-layer (and optionally per-head) budgets calibrated offline: ``{layer: (vertical, slash)}`` or
            ``{layer: [(vertical, slash), ...]}`` (one pair per pattern head), or the path of a JSON file holding
            that mapping. In top-k mode a pair replaces ``(vertical_topk, slash_topk)``; in top-p mode it replaces
            the caps ``(max_vertical, max_slash)``. Layers not listed use the global budgets.
    """

    vertical_topk: int | tuple[int, ...] = 1024
    slash_topk: int | tuple[int, ...] = 1024
    top_p: float | None = None
    max_vertical: int | tuple[int, ...] = 4096
    max_slash: int | tuple[int, ...] = 4096
    last_q: int = 64
    probes: Probes = "documents"
    probe_blocks: int = 16
    sink_tokens: int = 4
    local_window: int = 128
    pattern_heads: PatternHeads = "query"
    tile_size: int = 128
    dense_layers: tuple[int, ...] = ()
    dense_warmup_steps: int = 0
    budgets: Any = None
    dense_above: float | None = DENSE_ABOVE

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        for name in ("vertical_topk", "slash_topk", "max_vertical", "max_slash"):
            set_(name, _budget(getattr(self, name), name))
        for name, low in (("last_q", 1), ("probe_blocks", 1), ("sink_tokens", 0), ("local_window", 0),
                          ("dense_warmup_steps", 0)):
            value = getattr(self, name)
            if not is_int(value, low):
                raise ValueError(f"SparsityConfig.{name} must be an int >= {low}, got {value!r}")
        if self.sink_tokens == 0 and self.local_window == 0:
            raise ValueError(
                "SparsityConfig(sink_tokens=0, local_window=0) could leave a query with no key at all (an empty "
                "attention row: output 0, no gradient); keep sink_tokens >= 1 (key 0 for every query) or "
                "local_window >= 1 (each query's own key); the defaults are 4 and 128"
            )
        if self.top_p is not None:
            if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"SparsityConfig.top_p must be None (top-k mode) or in (0, 1], got {self.top_p!r}")
            set_("top_p", float(self.top_p))
        if self.dense_above is not None:
            above = self.dense_above
            if isinstance(above, bool) or not isinstance(above, (int, float)) or not 0.0 <= above <= 1.0:
                raise ValueError(f"SparsityConfig.dense_above must be None (never dense) or in [0, 1], got {above!r}")
            set_("dense_above", float(above))
        if self.probes not in PROBES:
            raise ValueError(f"SparsityConfig.probes must be one of {PROBES}, got {self.probes!r}")
        if self.pattern_heads not in ("query", "kv"):
            raise ValueError(f"SparsityConfig.pattern_heads must be 'query' or 'kv', got {self.pattern_heads!r}")
        check_tile_size(self.tile_size, "SparsityConfig")
        dense = self.dense_layers
        if isinstance(dense, int) or not isinstance(dense, (list, tuple, set, frozenset)):
            raise ValueError(f"SparsityConfig.dense_layers must be a list of layer indices, got {dense!r}")
        bad = [i for i in dense if not is_int(i, 0)]
        if bad:
            raise ValueError(f"SparsityConfig.dense_layers must hold non-negative ints, got {bad}")
        set_("dense_layers", tuple(sorted(set(dense))))
        set_("budgets", _load_budgets(self.budgets))
        both = sorted(set(self.dense_layers) & {layer for layer, _ in (self.budgets or ())})
        if both:
            raise ValueError(f"SparsityConfig: layers {both} are both in dense_layers and in budgets; choose one")

    @property
    def mode(self) -> Literal["topk", "topp"]:
        return "topk" if self.top_p is None else "topp"

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> SparsityConfig:
        """A config whose fields come from a JSON object (``overrides`` win); ``budgets`` may be inside it."""
        with open(path) as f:
            fields = json.load(f)
        if not isinstance(fields, Mapping):
            raise TypeError(f"{os.fspath(path)} must hold a JSON object of SparsityConfig fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"{os.fspath(path)}: unknown SparsityConfig fields {unknown}; known: {sorted(known)}")
        return cls(**{**fields, **overrides})

    def is_dense_layer(self, layer_idx: int | None) -> bool:
        return layer_idx is not None and layer_idx in self.dense_layers

    def head_budgets(self, num_heads: int, layer_idx: int | None = None) -> tuple[list[int], list[int]]:
        """Per-head (vertical, slash) budgets of ``layer_idx`` for ``num_heads`` pattern heads.

        Top-k mode: the number of non-forced entries kept; top-p mode: the caps. Raises if a per-head list does
        not have ``num_heads`` entries.
        """
        vert: Any
        slash: Any
        if self.mode == "topk":
            vert, slash = self.vertical_topk, self.slash_topk
        else:
            vert, slash = self.max_vertical, self.max_slash
        where = "the global budgets"
        if layer_idx is not None and self.budgets is not None:
            for layer, pairs in self.budgets:
                if layer == layer_idx:
                    where = f"budgets[{layer}]"
                    if len(pairs) == 1:
                        vert, slash = pairs[0]
                    else:
                        vert, slash = [p[0] for p in pairs], [p[1] for p in pairs]
                    break

        def per_head(x: Any) -> list[int]:
            if isinstance(x, int):
                return [x] * num_heads
            flat = list(x)
            if len(flat) != num_heads or not all(isinstance(v, int) for v in flat):
                raise ValueError(
                    f"SparsityConfig: {where} give {len(flat)} per-head budgets, but the pattern has {num_heads} heads "
                    f"(pattern_heads={self.pattern_heads!r}); give one int, or one per head"
                )
            return flat

        return per_head(vert), per_head(slash)


PAPER_SPARSITY = SparsityConfig(top_p=0.9, max_vertical=4096, max_slash=4096)
"""The MTraining paper's training setting: top-p 0.9 of the probes' attention mass, at most 4096 verticals and 4096
slashes per head (besides the forced sinks and local window); what ``strategy="mtraining"`` trains with. Its probes
are the default ``probes="documents"``: the paper's last 64 queries wherever no document boundaries are known, one
block per document where they are (the paper has no packed documents); ``dataclasses.replace(PAPER_SPARSITY,
probes="last")`` keeps the paper's probes there too."""


def parse_sparsity(spec: str, **overrides: Any) -> SparsityConfig | None:
    """A config from a short spec, the same in every entry point (the strategies' ``sparsity=``, LightningCLI configs,
    ``examples/train.py --sparsity``): ``"none"`` (None: dense), ``"paper"`` (:data:`PAPER_SPARSITY`), ``"topp:P"`` or
    ``"topk:V,S"`` (V verticals, S slashes per head), each optionally followed by ``"@T"``, the tile size (default
    128, :class:`SparsityConfig`'s): ``"topk:64,16@32"`` is 64 verticals and 16 slashes per head on 32-token tiles.
    ``overrides`` set other fields (``dense_warmup_steps=...``); a ``tile_size`` among them applies to a spec that
    names no tile, and must agree with one that does."""
    if not isinstance(spec, str):
        raise TypeError(f"a sparsity spec is a string ('none', 'paper', 'topp:P' or 'topk:V,S', each with an optional "
                        f"'@T' tile); got {type(spec).__name__}")
    grammar = ("a sparsity spec is 'none', 'paper', 'topp:P' or 'topk:V,S' (V verticals, S slashes per head: ints), "
               "each optionally followed by '@T' for T-token tiles (default 128), e.g. 'topk:64,16@32'")
    if "tile_size" in overrides and overrides["tile_size"] is None:  # (an option left unset: the spec's tile)
        overrides = {k: v for k, v in overrides.items() if k != "tile_size"}
    if spec == "none":
        return None
    body, at, tile = spec.partition("@")
    kind, _, value = body.partition(":")
    try:
        if kind == "paper" and not value:
            config = PAPER_SPARSITY
        elif kind == "topk":
            vertical, slash = (int(v) for v in value.split(","))
            config = SparsityConfig(vertical_topk=vertical, slash_topk=slash)
        elif kind == "topp":
            config = SparsityConfig(top_p=float(value))
        else:
            raise ValueError
        tile_size = int(tile) if at else None
    except ValueError:
        raise ValueError(f"{grammar}; got {spec!r}") from None
    if tile_size is not None:
        given = overrides.get("tile_size")
        if given is not None and given != tile_size:
            raise ValueError(f"the sparsity spec {spec!r} names {tile_size}-token tiles, but tile_size={given} was "
                             f"also given: drop one of them")
        overrides = {**overrides, "tile_size": tile_size}
    return dataclasses.replace(config, **overrides) if overrides else config
