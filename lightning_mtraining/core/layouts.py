"""Token layouts: how a sequence of N tokens is split over W context-parallel ranks.

Three layouts, all with every rank holding N / W tokens in increasing global order:

``contiguous`` (unit W): rank r holds the r-th of W equal chunks::

    tokens  | 0 1 2 3 | 4 5 6 7 | 8 9 a b |      W = 3, N = 12
    rank    |    0    |    1    |    2    |

  Simple, but under a causal mask the last rank does W times the work of the first.

``zigzag`` (unit 2W): the sequence is cut into 2W chunks; rank r holds chunks r and 2W-1-r, so every rank gets
one early (cheap) and one late (expensive) chunk and dense causal work is balanced::

    chunk   | 0  | 1  | 2  | 3  | 4  | 5  |      W = 3
    rank    | 0  | 1  | 2  | 2  | 1  | 0  |

``striped`` (unit W * block_size): block b of ``block_size`` tokens lives on rank b mod W (MTraining, section
3.2). At ring step t every rank pairs its blocks with the same diagonal offsets modulo W, which balances
vertical-slash sparse work as well as dense work::

    block   | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |  W = 3
    rank    | 0 | 1 | 2 | 0 | 1 | 2 | 0 | 1 | 2 |

A length that is not a multiple of the layout's unit is an error here; the integration layer pads (see
:mod:`lightning_mtraining.distributed.sharding`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch

from lightning_mtraining.core.memo import TensorMemo

Layout = Literal["contiguous", "zigzag", "striped"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "striped")

__all__ = ["LAYOUTS", "Layout", "check_attention_inputs", "check_doc_start", "check_local_length", "document_starts",
           "global_positions", "layout_unit", "shard_sequence", "unshard_sequence"]


def check_attention_inputs(q: Any, k: Any, v: Any = None, what: str = "") -> None:
    """The one check of attention inputs (ring, estimator, sparse attention): ``q [B, H, S, D]``, ``k`` (and ``v``,
    when given) ``[B, Hkv, S, D]`` floating tensors, ``H`` a multiple of ``Hkv``, one dtype (q, k, v given) and one
    device. ``what`` prefixes the message (the caller's name)."""
    pre = f"{what}: " if what else ""
    named = (("q", q), ("k", k)) + ((("v", v),) if v is not None else ())
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{pre}{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{pre}{name} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{pre}{name} must be a floating-point tensor, got {t.dtype}")
    if v is not None and k.shape != v.shape:
        raise ValueError(f"{pre}k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    B, H, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(
            f"{pre}q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on batch, local sequence length and head dim"
        )
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"{pre}query heads ({H}) must be a multiple of key/value heads ({k.shape[1]})")
    tensors = [t for _, t in named]
    if v is not None and len({t.dtype for t in tensors}) > 1:
        raise TypeError(f"{pre}q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"{pre}q, k{', v' if v is not None else ''} must be on one device, got "
                         f"{', '.join(str(t.device) for t in tensors)}")


def check_local_length(local_len: int, cp_size: int, layout: str, block_size: int, what: str = "") -> int:
    """A rank's shard of ``local_len`` tokens must come from a sequence of ``local_len * cp_size`` tokens that is a
    positive multiple of ``layout``'s unit (which is returned); the layout name is checked too."""
    unit = layout_unit(layout, cp_size, block_size)
    if local_len == 0 or (local_len * cp_size) % unit:
        pre = f"{what}: " if what else ""
        raise ValueError(
            f"{pre}local sequence length {local_len} on {cp_size} ranks gives {local_len * cp_size} tokens, not a "
            f"positive multiple of the {layout} layout's unit {unit}; pad the full sequence to a multiple of {unit} "
            f"before sharding (the strategy does this for you)"
        )
    return unit


# check_doc_start's verdicts per doc_start tensor (kept while it lives), by the call's shapes and device and the very
# positions tensor it was checked against (the callers' positions are cached, so every layer of a forward passes the
# same ones): the check's host sync is paid once a batch. A verdict never holds its tensor: "same" stands for it.
_CHECKED = TensorMemo()


def check_doc_start(doc_start: torch.Tensor | None, q: torch.Tensor, q_pos: torch.Tensor,
                    drop_single: bool = True) -> torch.Tensor | None:
    """A valid ``doc_start`` (packed documents: for each of this rank's tokens, the global position of its
    document's first token) for queries ``q [B, H, S, D]`` at global positions ``q_pos [S]``: int64 on q's device, or
    None when every token here lies in a row's first document and ``drop_single`` (nothing to mask locally; a
    decision of this rank alone, so callers whose next step is a collective pass ``drop_single=False``). One host
    sync the first time a tensor is checked against a positions tensor; the verdict is kept while both live and
    neither is modified (every layer of a forward passes the same ones)."""
    if doc_start is None:
        return None
    if not isinstance(doc_start, torch.Tensor):
        return _check_doc_start(doc_start, q, q_pos, drop_single)
    seen = _CHECKED.get_or_make(doc_start, (q.shape[0], q.shape[2], str(q.device), drop_single, q_pos._version),
                                list)  # [(positions' weak reference, verdict)]
    for pos_ref, verdict in seen:
        if pos_ref() is q_pos:
            return doc_start if verdict == "same" else None if verdict == "none" else verdict
    result = _check_doc_start(doc_start, q, q_pos, drop_single)
    seen.append((weakref.ref(q_pos), "same" if result is doc_start else "none" if result is None else result))
    return result


def _check_doc_start(doc_start: Any, q: torch.Tensor, q_pos: torch.Tensor, drop_single: bool) -> torch.Tensor | None:
    B, S = q.shape[0], q.shape[2]
    if not isinstance(doc_start, torch.Tensor) or doc_start.dim() != 2 or doc_start.shape[1] != S \
            or doc_start.shape[0] not in (1, B) or doc_start.is_floating_point():
        got = tuple(doc_start.shape) if isinstance(doc_start, torch.Tensor) else type(doc_start).__name__
        raise ValueError(
            f"doc_start must be an integer tensor [batch or 1, local length] = [{B} or 1, {S}] holding, for each of "
            f"this rank's tokens, the global position of its document's first token; got {got}"
        )
    doc_start = doc_start.to(device=q.device, dtype=torch.int64)
    bad = (doc_start < 0) | (doc_start > q_pos[None, :])
    flags = torch.stack([bad.any(), (doc_start > 0).any()]).tolist()
    if flags[0]:
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"doc_start[{b}, {i}] = {int(doc_start[b, i])} is outside [0, {int(q_pos[i])}] (the token's own global "
            "position): a token's document starts at or before it"
        )
    return doc_start if flags[1] or not drop_single else None


def document_starts(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Packed documents from Hugging Face style ``position_ids [B, S]``: for each token, the index of its document's
    first token (``[B, S]`` int64), or None when no row holds more than one document.

    A document starts wherever a row's position does not continue the previous one (``p[i] != p[i - 1] + 1``): the
    rule of ``transformers.masking_utils.find_packed_sequence_indices``, so a packed batch attends exactly as it
    does on one device with SDPA. Packing pipelines (``DataCollatorWithFlattening``) restart each document at 0.

    Raises:
        ValueError: ``position_ids`` is not an integer ``[batch, seq]`` tensor.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point():
        got = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"position_ids must be an integer [batch, seq] tensor, got {got}")
    p = position_ids.to(torch.int64)
    B, S = p.shape
    restart = p[:, 1:] != p[:, :-1] + 1  # [B, S - 1]: token i + 1 starts a new document
    if not bool(restart.any()):
        return None
    idx = torch.arange(S, device=p.device).expand(B, S)
    first = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=p.device), restart], dim=1)
    return torch.where(first, idx, torch.zeros_like(idx)).cummax(dim=1).values


def _check_layout(layout: str, world_size: int, block_size: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if layout == "striped" and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive int for the striped layout, got {block_size!r}")


def layout_unit(layout: str, world_size: int, block_size: int = 128) -> int:
    """The number of tokens a sequence length must be a multiple of under ``layout``."""
    _check_layout(layout, world_size, block_size)
    if layout == "contiguous":
        return world_size
    if layout == "zigzag":
        return 2 * world_size
    return world_size * block_size


def _check_length(seq_len: int, layout: str, world_size: int, block_size: int) -> int:
    unit = layout_unit(layout, world_size, block_size)
    if seq_len <= 0 or seq_len % unit != 0:
        detail = f"world_size={world_size}" + (f" x block_size={block_size}" if layout == "striped" else "")
        padded = max(unit, -(-seq_len // unit) * unit)
        raise ValueError(
            f"sequence length {seq_len} is not a positive multiple of the {layout} layout's unit {unit} "
            f"({detail}); pad the sequence to {padded} tokens (lightning_mtraining.distributed.sharding pads batches "
            f"for you) or choose another block_size/layout"
        )
    return unit


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")


def global_positions(
    seq_len: int,
    rank: int,
    world_size: int,
    layout: str = "striped",
    block_size: int = 128,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global token positions (int64, increasing) of ``rank``'s shard of a length-``seq_len`` sequence."""
    _check_length(seq_len, layout, world_size, block_size)
    _check_rank(rank, world_size)
    local = seq_len // world_size
    if layout == "contiguous":
        return torch.arange(rank * local, (rank + 1) * local, device=device)
    if layout == "zigzag":
        half = local // 2
        first = torch.arange(rank * half, (rank + 1) * half, device=device)
        second = torch.arange((2 * world_size - 1 - rank) * half, (2 * world_size - rank) * half, device=device)
        return torch.cat([first, second])
    n_local_blocks = local // block_size
    block_starts = (torch.arange(n_local_blocks, device=device) * world_size + rank) * block_size
    return (block_starts[:, None] + torch.arange(block_size, device=device)[None, :]).reshape(-1)


def shard_sequence(
    x: torch.Tensor, dim: int, rank: int, world_size: int, layout: str = "striped", block_size: int = 128
) -> torch.Tensor:
    """``rank``'s shard of ``x`` along ``dim`` under ``layout`` (a new contiguous tensor)."""
    dim = dim % x.dim()
    seq_len = x.shape[dim]
    _check_length(seq_len, layout, world_size, block_size)
    _check_rank(rank, world_size)
    if layout == "contiguous":
        return x.chunk(world_size, dim=dim)[rank].contiguous()
    if layout == "zigzag":
        chunks = x.chunk(2 * world_size, dim=dim)
        return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)
    # striped: [.., N, ..] -> [.., N/(W*bs), W, bs, ..], take rank along W.
    blocks = x.unflatten(dim, (seq_len // (world_size * block_size), world_size, block_size))
    return blocks.select(dim + 1, rank).flatten(dim, dim + 1).contiguous()


def unshard_sequence(
    shards: Sequence[torch.Tensor], dim: int, layout: str = "striped", block_size: int = 128
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from all ranks' shards, in rank order."""
    world_size = len(shards)
    _check_layout(layout, world_size, block_size)
    ref = shards[0]
    dim = dim % ref.dim()
    for r, s in enumerate(shards):
        if s.shape != ref.shape:
            raise ValueError(f"shard {r} has shape {tuple(s.shape)}, shard 0 has {tuple(ref.shape)}; all must match")
    _check_length(ref.shape[dim] * world_size, layout, world_size, block_size)
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    if layout == "zigzag":
        halves = [s.chunk(2, dim=dim) for s in shards]
        order = [halves[r][0] for r in range(world_size)] + [halves[r][1] for r in reversed(range(world_size))]
        return torch.cat(order, dim=dim)
    n_local_blocks = ref.shape[dim] // block_size
    blocks = torch.stack([s.unflatten(dim, (n_local_blocks, block_size)) for s in shards], dim=dim + 1)
    return blocks.flatten(dim, dim + 2)
