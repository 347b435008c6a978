"""Single-device causal vertical-slash sparse attention: the public ``sparse_attention``.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), S sequence length, D head dim,
G pattern heads (G = H: one pattern per query head; G = Hkv: one pattern per KV group, shared by its H // Hkv
query heads), n pattern budget (padded).

Pattern: ``vertical_idx [B, G, n]`` key positions (vertical lines) and ``slash_idx [B, G, n']`` diagonal offsets
q - k (slash lines, 0 = main diagonal), integer tensors. Ragged budgets (heads with fewer entries) are padded
with negative values (-1), which are ignored; duplicates are ignored. Computed pairs (see
:mod:`mtraining_kernels.indexing` for the precise rule): slashes run at tile granularity (tile diagonal d is
computed iff a selected offset s has |s - d*T| < T, T = ``block_size``; rectangular BM x BN tiles generalise
this, see :func:`mtraining_kernels.reference.vertical_slash_mask`), verticals are gathered token by token except
where a computed tile already covers them; always key <= query.

Dispatch: on CUDA the Triton kernels (:mod:`mtraining_kernels.vertical_slash`); elsewhere a torch reference
path, chunked over queries and recomputed in backward (``torch.utils.checkpoint``), so memory stays
O(chunk * S) instead of O(S^2). Validation needs one device sync (the index range checks).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from lightning_mtraining.core.layouts import check_attention_inputs
from lightning_mtraining.core.numerics import default_scale
from mtraining_kernels.indexing import expand_pattern
from mtraining_kernels.reference import attention_ref, vertical_slash_mask

__all__ = ["sparse_attention"]

# the kernels' fastest tile per computed pair (about twice the throughput of 64 x 64 tiles on Hopper)
DEFAULT_BLOCK_SIZE = 128
_MAX_SCORES = 1 << 24  # score elements per chunk on the reference path (64 MiB in float32)


def _blocks(block_size: int | tuple[int, int]) -> tuple[int, int]:
    bm, bn = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    for b in (bm, bn):
        if not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"block sizes must be powers of two >= 16; got block_size={block_size}")
    if bm % bn:
        raise ValueError(f"block_size (BM, BN) needs BM a multiple of BN; got {block_size}")
    return bm, bn


def _validate(q, k, v, vertical_idx, slash_idx) -> None:
    check_attention_inputs(q, k, v, what="sparse_attention")
    B, H, S, D = q.shape
    Hkv = k.shape[1]
    if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the CUDA kernels take float16, bfloat16 or float32; got {q.dtype}")
    for name, idx in (("vertical_idx", vertical_idx), ("slash_idx", slash_idx)):
        if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point or idx.dtype == torch.bool \
                or idx.is_complex():
            raise TypeError(f"{name} must be an integer tensor; got {getattr(idx, 'dtype', type(idx))}")
        if idx.dim() != 3 or idx.shape[0] != B or idx.shape[1] not in (H, Hkv):
            raise ValueError(
                f"{name} must be [B, G, n] with B={B} and G = H={H} (per query head) or H_kv={Hkv} (per KV "
                f"group); got {tuple(idx.shape)}"
            )
        if idx.device != q.device:
            raise ValueError(f"{name} is on {idx.device} but q is on {q.device}")
        if idx.numel() and int(idx.max()) >= S:
            raise ValueError(
                f"{name} holds {int(idx.max())} >= S={S}: key positions and diagonal offsets must be < S "
                "(use negative values for padding)"
            )


def _chunk_attention(q_c, k_c, v_c, mask_c, scale, out_dtype):
    out, _ = attention_ref(q_c, k_c, v_c, mask_c, scale)
    return out.to(out_dtype)


def _reference_path(q, k, v, vertical_idx, slash_idx, bm: int, bn: int, scale: float) -> torch.Tensor:
    """Torch path, chunked over queries: chunk [r0, r1) needs keys [0, r1) only (causal)."""
    B, H, S, D = q.shape
    Hkv = k.shape[1]
    vi = expand_pattern(vertical_idx, H, Hkv)
    si = expand_pattern(slash_idx, H, Hkv)
    cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    chunk = max(bm, (_MAX_SCORES // max(1, B * H * S)) // bm * bm)
    outs = []
    for r0 in range(0, S, chunk):
        r1 = min(S, r0 + chunk)
        mask_c = vertical_slash_mask(vi, si, S, bm, rows=(r0, r1), block_n=bn)[..., :r1]
        args = (q[:, :, r0:r1].to(cdt), k[:, :, :r1].to(cdt), v[:, :, :r1].to(cdt), mask_c, scale, q.dtype)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            outs.append(checkpoint(_chunk_attention, *args, use_reentrant=False))
        else:
            outs.append(_chunk_attention(*args))
    return torch.cat(outs, dim=2)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    vertical_idx: torch.Tensor,
    slash_idx: torch.Tensor,
    *,
    scale: float | None = None,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """Causal vertical-slash sparse attention on one device; differentiable in q, k and v.

    Args:
        q: ``[B, H, S, D]``; k, v: ``[B, H_kv, S, D]`` (GQA: K/V are never repeated on CUDA).
        vertical_idx: ``[B, G, n]`` key positions in [0, S); negative entries are padding.
        slash_idx: ``[B, G, n']`` diagonal offsets q - k in [0, S), 0 = main diagonal; negative entries padding.
            G is H (a pattern per query head) or H_kv (one per KV group, shared by its query heads).
        scale: softmax scale, default ``1 / sqrt(D)``.
        block_size: tile size T at which slashes are executed (see the module docstring), or a pair (BM, BN)
            for BM x BN tiles, BM a multiple of BN. Coarser tiles run faster per computed pair but compute more
            pairs per isolated slash line (an off-grid slash costs about 2T keys per query): 128 (the default)
            is fastest for windows and runs of neighbouring slashes, 64 or (128, 64) can win for many isolated
            slashes.

    Returns:
        ``[B, H, S, D]`` in q's dtype. Rows that see no key (only possible with an empty pattern) are 0.
    """
    bm, bn = _blocks(block_size)
    _validate(q, k, v, vertical_idx, slash_idx)
    scale = default_scale(q.shape[-1], scale)
    if not q.is_cuda:
        return _reference_path(q, k, v, vertical_idx, slash_idx, bm, bn, scale)
    from mtraining_kernels.indexing import pattern_tile_lists
    from mtraining_kernels.vertical_slash import vertical_slash_attention

    H, Hkv, S = q.shape[1], k.shape[1], q.shape[2]
    tiles = pattern_tile_lists(
        expand_pattern(vertical_idx, H, Hkv), expand_pattern(slash_idx, H, Hkv), S, bm, bn
    )
    return vertical_slash_attention(q, k, v, tiles, scale=scale)
