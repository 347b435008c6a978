"""Dense-masked torch references for the vertical-slash kernels (the ``*_ref`` functions).

Shape legend: B batch, H query heads, Hkv key/value heads, Sq / Sk query / key lengths, D head dim.

Two ways to get the boolean mask of computed pairs, both [B', H', rows, Sk]:

- :func:`vertical_slash_mask`: straight from the *definition* in :mod:`mtraining_kernels.indexing` (pattern,
  block size), without building any list; the CPU path of ``sparse_attention`` uses it chunk by chunk.
- :func:`tile_lists_mask`: from a :class:`~mtraining_kernels.indexing.TileLists` and positions, i.e. exactly
  what the kernel is told to compute.

:func:`attention_ref` then runs masked softmax attention in the inputs' dtype (use float64 for references).

The half-precision rule (flash-attention's), shared by the GPU tests and ``benchmarks/kernel_precision.py``: a
kernel's error against a float32 reference must be at most twice the error of the same computation done by torch
at the kernel's precision (:func:`attention_chunked_ref` with ``dtype`` bfloat16 or float16, float32 accumulation
inside matmuls), plus a floor for outputs whose torch error is itself ~0 (1e-3 in bfloat16, scaled by the ratio of
the dtypes' machine epsilons for float16: 1.25e-4). :func:`check_half_precision` applies it to any (out, dq, dk,
dv); :func:`half_precision_case` runs one fwd+bwd of the kernels on a fixed pattern and applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mtraining_kernels.indexing import COL_CHUNK, TileLists

__all__ = [
    "HALF_PRECISION_CASES", "attention_chunked_ref", "attention_ref", "check_half_precision", "half_precision_case",
    "half_precision_floor", "kernel_config", "max_abs_errors", "random_pattern", "tile_lists_mask", "tile_rows_mask",
    "vertical_slash_attention_ref", "vertical_slash_mask",
]


def vertical_slash_mask(
    vertical_idx: torch.Tensor,
    slash_idx: torch.Tensor,
    seq_len: int,
    block_size: int,
    rows: tuple[int, int] | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Mask [B, G, r1 - r0, S] of the pairs computed for pattern ``[B, G, n]`` (see indexing's docstring).

    Tiles are BM x BN = ``block_size`` x ``block_n`` (default square), r = BM / BN. Query i sees key j iff
    j <= i and (the tile offset u = (i // BM) * r - j // BN is computed, or j is a vertical), where offset u is
    computed iff some slash s has u*BN - BN < s < u*BN + BM. Negative entries are padding.
    """
    BM = block_size
    BN = block_size if block_n is None else block_n
    S = seq_len
    r = BM // BN
    r0, r1 = (0, S) if rows is None else rows
    dev = vertical_idx.device
    B, G = vertical_idx.shape[:2]
    Nk = -(-S // BN)
    s = slash_idx.to(torch.int64)
    s_ok = (s >= 0) & (s < S)
    u = torch.arange(-(r - 1), Nk, device=dev)  # [UN]
    hit = (u * BN - BN < s[..., None]) & (s[..., None] < u * BN + BM) & s_ok[..., None]  # [B, G, n, UN]
    comp = hit.any(-2) if s.shape[-1] else torch.zeros(B, G, u.numel(), dtype=torch.bool, device=dev)
    i = torch.arange(r0, r1, device=dev)
    j = torch.arange(S, device=dev)
    uu = (i[:, None] // BM) * r - j[None, :] // BN + (r - 1)  # [rows, S], index into comp
    causal = j[None, :] <= i[:, None]
    tile = torch.gather(comp[:, :, None, :].expand(B, G, r1 - r0, u.numel()), 3,
                        uu.clamp(0, u.numel() - 1)[None, None].expand(B, G, r1 - r0, S))
    v = vertical_idx.to(torch.int64)
    col = torch.zeros(B, G, S + 1, dtype=torch.bool, device=dev)
    col.scatter_(2, torch.where((v >= 0) & (v < S), v, S), torch.ones_like(v, dtype=torch.bool))
    return causal & (tile | col[:, :, None, :S])


def tile_rows_mask(tiles: TileLists, num_keys: int, tiles_range: tuple[int, int] | None = None) -> torch.Tensor:
    """Bool [B', H', tiles, Sk]: for each query tile, the keys its lists name (tiles and gathered columns), before
    the token mask ``k_pos <= q_pos``; ``tiles_range=(m0, m1)`` restricts to query tiles [m0, m1)."""
    Sk, BN = num_keys, tiles.block_n
    Bp, Hp, Mq = tiles.fwd_idx.shape[:3]
    m0, m1 = (0, Mq) if tiles_range is None else tiles_range
    Mr = m1 - m0
    Nk = -(-Sk // BN)
    dev = tiles.fwd_idx.device
    f_idx, f_cnt = tiles.fwd_idx[:, :, m0:m1], tiles.fwd_cnt[:, :, m0:m1]
    slot = torch.arange(f_idx.shape[-1], device=dev)
    live = slot < f_cnt[..., None]
    grid = torch.zeros(Bp, Hp, Mr, Nk + 1, dtype=torch.bool, device=dev)
    grid.scatter_(3, torch.where(live, f_idx.long(), Nk), torch.ones_like(live))
    mask = grid[..., torch.arange(Sk, device=dev) // BN]  # [B', H', Mr, Sk]
    if tiles.col_idx is not None:
        J = tiles.col_bits.shape[-1]
        bit = (tiles.col_bits[:, :, m0:m1, :, None] >> torch.arange(COL_CHUNK, device=dev)) & 1  # [B',H',Mr,J,64]
        bit = bit.reshape(Bp, Hp, Mr, J * COL_CHUNK)
        cols = torch.zeros(Bp, Hp, Mr, Sk, dtype=torch.int64, device=dev)
        # padding slots hold index 0 with bit 0: adding 0 changes nothing
        cols.scatter_add_(3, tiles.col_idx.long()[:, :, None, :].expand(Bp, Hp, Mr, -1).contiguous(), bit)
        mask |= cols > 0
    return mask


def tile_lists_mask(
    tiles: TileLists, q_pos: torch.Tensor, k_pos: torch.Tensor, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """Mask [B', H', Sq, Sk] of the pairs a kernel computes from ``tiles`` (token mask k_pos <= q_pos on all);
    with ``rows=(r0, r1)`` only the query rows [r0, r1): [B', H', r1 - r0, Sk]."""
    Sq = q_pos.shape[0]
    r0, r1 = (0, Sq) if rows is None else rows
    BM = tiles.block_m
    m0, m1 = r0 // BM, -(-r1 // BM)  # the query tiles holding rows [r0, r1)
    per_tile = tile_rows_mask(tiles, k_pos.shape[0], (m0, m1))
    qt = torch.arange(r0, r1, device=q_pos.device) // BM - m0
    return per_tile[:, :, qt] & (k_pos[None, :] <= q_pos[r0:r1, None])


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention in the inputs' dtype: (out [B,H,Sq,D], lse [B,H,Sq]); rows with no key: out 0, lse -inf.

    K/V are repeated over the query heads of their group here only (this is the reference); ``mask`` broadcasts
    to [B, H, Sq, Sk]. ``softcap``: scores ``softcap * tanh(s / softcap)`` before masking.
    """
    H, Hkv = q.shape[1], k.shape[1]
    kr = k.repeat_interleave(H // Hkv, dim=1)
    vr = v.repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(q, kr.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None])
    return torch.matmul(p, vr), lse


def vertical_slash_attention_ref(q, k, v, vertical_idx, slash_idx, block_size: int, scale: float,
                                 block_n: int | None = None):
    """Whole-sequence reference for a pattern (G = H or Hkv): (out, lse) in the inputs' dtype."""
    from mtraining_kernels.indexing import expand_pattern

    H, Hkv, S = q.shape[1], k.shape[1], q.shape[2]
    vi = expand_pattern(vertical_idx, H, Hkv)
    si = expand_pattern(slash_idx, H, Hkv)
    return attention_ref(q, k, v, vertical_slash_mask(vi, si, S, block_size, block_n=block_n), scale)


def attention_chunked_ref(q, k, v, dout, mask_rows, scale: float, dtype: torch.dtype, chunk: int = 1024,
                          softcap: float | None = None):
    """Forward and flash-style backward in torch, chunked over queries, every tensor in ``dtype``.

    ``mask_rows(r0, r1)`` returns the mask [B', H', r1 - r0, Sk] of computed pairs for query rows [r0, r1). Used
    on the GPU at 8K-32K where an S x S float32 tensor would not fit: with ``dtype=float32`` it is the reference,
    with ``dtype=bfloat16`` it is "the same computation in torch at the kernel's precision". Returns
    (out, lse, dq, dk, dv), out/dq/dk/dv in ``dtype``, lse float32; K/V gradients summed over each KV group.
    ``softcap``: scores ``softcap * tanh(s / softcap)`` (computed in float32, the kernels' precision for scores).
    """

    def scores(r0, r1):
        s = torch.matmul(qd[:, :, r0:r1], kr.transpose(-1, -2)) * scale
        if softcap is None:
            return s, None
        t = torch.tanh(s.float() / softcap)
        return (t * softcap).to(s.dtype), 1 - t * t

    B, H, Sq, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qd, kd, vd, dod = (t.to(dtype) for t in (q, k, v, dout))
    kr, vr = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
    out = torch.empty_like(qd)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    for r0 in range(0, Sq, chunk):
        r1 = min(Sq, r0 + chunk)
        s, _ = scores(r0, r1)
        s = s.masked_fill(~mask_rows(r0, r1), float("-inf"))
        lse_c = torch.logsumexp(s.float(), -1)
        safe = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
        p = torch.exp(s.float() - safe[..., None]).to(dtype)
        out[:, :, r0:r1] = torch.matmul(p, vr)
        lse[:, :, r0:r1] = lse_c
    delta = (dod.float() * out.float()).sum(-1)
    dq = torch.empty_like(qd)
    dkr = torch.zeros_like(kr, dtype=torch.float32)  # accumulate over chunks in float32, as one matmul would
    dvr = torch.zeros_like(vr, dtype=torch.float32)
    for r0 in range(0, Sq, chunk):
        r1 = min(Sq, r0 + chunk)
        m = mask_rows(r0, r1)
        s, dcap = scores(r0, r1)
        lse_c = lse[:, :, r0:r1]
        safe = torch.where(torch.isfinite(lse_c), lse_c, torch.full_like(lse_c, float("inf")))
        p = torch.where(m, torch.exp(s.float() - safe[..., None]), 0.0).to(dtype)
        do_c = dod[:, :, r0:r1]
        dvr += torch.matmul(p.transpose(-1, -2), do_c).float()
        dp = torch.matmul(do_c, vr.transpose(-1, -2))
        ds = p.float() * (dp.float() - delta[:, :, r0:r1, None])
        ds = (ds if dcap is None else ds * dcap).to(dtype)
        dq[:, :, r0:r1] = torch.matmul(ds, kr) * scale
        dkr += torch.matmul(ds.transpose(-1, -2), qd[:, :, r0:r1]).float() * scale
    dk = dkr.view(B, Hkv, G, -1, D).sum(2).to(dtype)
    dv = dvr.view(B, Hkv, G, -1, D).sum(2).to(dtype)
    return out, lse, dq, dk, dv


# --- the half-precision rule (module docstring) ----------------------------------------------------------------------

# (S, D, tile size, KernelConfig spec) of the float16 GPU test; benchmarks/kernel_precision.py reports their margins
HALF_PRECISION_CASES = [(8191, 128, 128, ""), (8191, 64, 128, ""), (8191, 128, 64, ""),
                        (32767, 128, 128, "item_order=snake")]


def max_abs_errors(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> list[float]:
    """Max abs difference of each tensor of ``got`` from its partner in ``ref``, in float32."""
    return [(g.float() - r.float()).abs().max().item() for g, r in zip(got, ref)]


def half_precision_floor(dtype: torch.dtype) -> float:
    """The rule's absolute floor at ``dtype``: 1e-3 in bfloat16, scaled by the ratio of machine epsilons."""
    return 1e-3 * torch.finfo(dtype).eps / torch.finfo(torch.bfloat16).eps


def check_half_precision(got, q, k, v, dout, mask_rows, scale: float, dtype: torch.dtype, what: str = "kernel",
                         softcap: float | None = None) -> tuple[list[float], list[float]]:
    """Assert the rule for ``got = (out, dq, dk, dv)`` computed from ``q, k, v, dout`` (in ``dtype``) over the
    pairs ``mask_rows(r0, r1)`` (see :func:`attention_chunked_ref`); returns the max abs errors against float32 of
    ``got`` and of torch at ``dtype``. Raises ``AssertionError`` naming the gradient, both errors and the floor."""
    ref = attention_chunked_ref(q, k, v, dout, mask_rows, scale, torch.float32, softcap=softcap)
    same = attention_chunked_ref(q, k, v, dout, mask_rows, scale, dtype, softcap=softcap)
    names = ("out", "dq", "dk", "dv")
    ref4, same4 = (ref[0], *ref[2:]), (same[0], *same[2:])
    err = max_abs_errors(got, ref4)
    err_torch = max_abs_errors(same4, ref4)
    floor = half_precision_floor(dtype)
    for n, e, et in zip(names, err, err_torch):
        assert e <= 2 * et + floor, f"{n}: {what} error {e:.3e} > 2 x torch {dtype} error {et:.3e} + {floor:.1e}"
    return err, err_torch


def random_pattern(B: int, G: int, S: int, n_vertical: int, slashes: Sequence[int], seed: int,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A test pattern ``(vertical_idx, slash_idx)``, each [B, G, n]: ``n_vertical`` random key positions (the first
    four the sinks 0-3) from a CPU generator seeded ``seed``, and the diagonal offsets ``slashes``, of which heads
    1.. drop the last (per-head budgets), on ``device``."""
    g = torch.Generator().manual_seed(seed)
    vi = torch.randint(0, S, (B, G, n_vertical), generator=g)
    vi[..., :4] = torch.arange(4)  # sinks
    si = torch.tensor(slashes).expand(B, G, -1).clone()
    si[:, 1:, -1] = -1  # per-head different budgets: later heads drop their last slash
    return vi.to(device), si.to(device)


def kernel_config(spec: str):
    """A :class:`~mtraining_kernels.config.KernelConfig` from ``"key=value,..."`` (kernel names and
    ``item_order`` as strings, the other fields as ints), as the GPU tests and the precision report name them."""
    from mtraining_kernels.config import KernelConfig

    items = (i.partition("=") for i in spec.split(","))
    kw = {key: val if key in ("forward", "dq", "dkdv", "dkdv_cols", "item_order") else int(val)
          for key, _, val in items}
    return KernelConfig(**kw)


def half_precision_case(S: int, D: int, block: int | tuple[int, int], config=None, *,
                        dtype: torch.dtype = torch.bfloat16, softcap: float | None = None, q_gain: float = 1.0,
                        attention: Callable | None = None) -> tuple[list[float], list[float]]:
    """One fwd+bwd of the kernels held to the rule on CUDA; returns the max abs errors of (out, dq, dk, dv) against
    float32 for the kernels and for torch at ``dtype``.

    Qwen2.5-3B attention heads (16 query, 2 KV), head dim ``D``, ``S`` tokens (seed 0, q scaled by ``q_gain``),
    300 verticals and six slashes (:func:`random_pattern`, seed ``S``), tiles ``block`` (T or (BM, BN)).
    The kernels run through ``vertical_slash_attention`` with ``config`` and ``softcap``, or, if given,
    ``attention(q, k, v, vertical_idx, slash_idx, block) -> out`` (the tests pass the public ``sparse_attention``).
    """
    from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists
    from mtraining_kernels.vertical_slash import vertical_slash_attention

    torch.manual_seed(0)
    B, H, Hkv = 1, 16, 2
    q, k, v, dout = (torch.randn(B, h, S, D, device="cuda", dtype=dtype) for h in (H, Hkv, Hkv, H))
    q = q * q_gain
    vi, si = random_pattern(B, Hkv, S, 300, [0, 1, 64, 100, 1000, 3333], seed=S, device="cuda")
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    vih, sih = expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv)
    bm, bn = (block, block) if isinstance(block, int) else block
    if attention is not None:
        out = attention(qg, kg, vg, vi, si, block)
    else:
        out = vertical_slash_attention(qg, kg, vg, pattern_tile_lists(vih, sih, S, bm, bn), config=config,
                                       softcap=softcap)
    out.backward(dout)

    def mask_rows(r0, r1):
        return vertical_slash_mask(vih, sih, S, bm, rows=(r0, r1), block_n=bn)

    return check_half_precision((out, qg.grad, kg.grad, vg.grad), q, k, v, dout, mask_rows, D**-0.5, dtype,
                                softcap=softcap)
