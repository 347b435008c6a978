"""Vertical-slash sparse attention in Triton: forward and backward over generic tile and column lists.

Shape legend: B batch, H query heads, Hkv key/value heads (GQA: query head h reads KV head h // (H // Hkv); K/V
are never repeated), Sq / Sk query / key lengths (may differ), D head dim (16..256, power of two; 64 and 128
tested), BM / BN query / key tile sizes, gathered key columns in chunks of 64 slots (one int64 bit word each).

This module is the public entry point and the dispatch: the input checks, which kernel runs each part of a call
(Triton, or on Hopper the Gluon kernel: ``_use_gluon``, from ``KernelConfig.forward`` / ``dq`` / ``dkdv`` /
``dkdv_cols``), :func:`block_forward` / :func:`block_backward` (the ring's block ops), the autograd Function behind
:func:`vertical_slash_attention`, and :class:`TritonBlockOp`. The kernels and their launchers:

- :mod:`mtraining_kernels.triton_forward`, :mod:`mtraining_kernels.triton_backward`: the Triton kernels (their
  algorithm is in those modules' docstrings); :mod:`mtraining_kernels.triton_common`: what the two share.
- :mod:`mtraining_kernels.gluon_forward`, :mod:`mtraining_kernels.gluon_backward`: the warp-specialised Gluon
  kernels for sm_90, the same pairs.
- :mod:`mtraining_kernels.config`: :class:`KernelConfig` (re-exported here).

Design choices of the Triton kernels: dq has a kernel of its own (no atomic or reduce-add accumulation inside the
dk/dv kernels, which also keeps the backward deterministic); the forward and dq walk the key tiles and the gathered
columns in two loops (only the first ``fwd_nmask`` tiles are masked); the heaviest query tiles are launched first
(``KernelConfig.heavy_first``). Smaller programs (``KernelConfig.q_rows``, ``dq_warps``) are options for short, very
sparse calls.

Computed pairs: exactly those described by the lists (see :mod:`mtraining_kernels.indexing`), intersected with
``k_pos <= q_pos`` - the lists promise that the unmasked tiles hold only allowed pairs. Rows with no computed
pair get out 0 and lse -inf; their gradients are 0.

Constraints: q, k, v, dout with unit stride in the last dim (other strides are free; batch/head offsets are
int64); positions int64/int32, increasing, |pos| < 2**31; tiles BM x BN with BM, BN >= 16 powers of two;
fp16/bf16 (GPU) or fp32/fp16 (the Triton interpreter: tl.dot is wrong for bf16 there). float32 inputs use the
tensor cores' tf32 on the GPU (Triton's default), about 3e-4 relative error.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton

from .config import DEFAULT_CONFIG, KernelConfig
from .host import column_split, softcap_log2
from .indexing import COL_CHUNK, TileLists, dense_tile_lists
from .triton_backward import (
    add_column_grads,
    bwd_preprocess,
    triton_block_dkdv,
    triton_block_dkdv_cols,
    triton_block_dq,
)
from .triton_forward import triton_block_forward

__all__ = [
    "DEFAULT_CONFIG",
    "KernelConfig",
    "TritonBlockOp",
    "block_backward",
    "block_forward",
    "vertical_slash_attention",
]


# --------------------------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------------------------


def _check_lists(tiles: TileLists, B: int, H: int, Sq: int, Sk: int) -> None:
    Mq, Nk = -(-Sq // tiles.block_m), -(-Sk // tiles.block_n)
    ok = tiles.fwd_idx.shape[2] == Mq and tiles.bwd_idx.shape[2] == Nk
    for t in (tiles.fwd_idx, tiles.bwd_idx):
        ok = ok and t.shape[0] in (1, B) and t.shape[1] in (1, H) and t.dtype == torch.int32 and t.stride(-1) == 1
    if tiles.col_idx is not None:
        ok = ok and tiles.col_bits.shape[2] == Mq and tiles.col_idx.shape[-1] == tiles.col_bits.shape[-1] * COL_CHUNK
        ok = ok and tiles.col_idx.stride(-1) == 1 and tiles.col_bits.stride(-1) == 1
    if not ok:
        raise ValueError(
            f"tile lists (fwd {tuple(tiles.fwd_idx.shape)}, bwd {tuple(tiles.bwd_idx.shape)}, blocks "
            f"{tiles.block_m}x{tiles.block_n}) do not fit B={B}, H={H}, Sq={Sq}, Sk={Sk}"
        )


def _prep(q, k, v, q_pos, k_pos, tiles, block_m, block_n):
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if k.shape != (B, Hkv, Sk, D) or v.shape != k.shape or H % Hkv:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"head dim {D} not supported (power of two in 16..256)")
    if q_pos.shape != (Sq,) or k_pos.shape != (Sk,):
        raise ValueError(f"positions {tuple(q_pos.shape)}/{tuple(k_pos.shape)} do not match lengths {Sq}/{Sk}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    q_pos = q_pos.to(device=q.device, dtype=torch.int32).contiguous()
    k_pos = k_pos.to(device=q.device, dtype=torch.int32).contiguous()
    if tiles is None:
        tiles = dense_tile_lists(q_pos, k_pos, block_m, block_n)
    _check_lists(tiles, B, H, Sq, Sk)
    return q, k, v, q_pos, k_pos, tiles


# --------------------------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------------------------


def _use_gluon(choice: str, which: str, q: torch.Tensor, tiles: TileLists, extra_ok: bool,
               softcap: float | None = None) -> bool:
    """Whether KernelConfig.<which> = ``choice`` runs the Gluon kernel here; 'gluon' where it cannot: an error."""
    if choice == "triton":
        return False
    if softcap is not None:  # the Gluon kernels apply no soft-cap: the Triton kernels do
        if choice == "gluon":
            raise ValueError(f"KernelConfig({which}='gluon') cannot run with softcap={softcap}: the Gluon kernels "
                             f"apply no soft-cap; use {which}='auto' (the Triton kernel) or 'triton'")
        return False
    from .gluon_common import gluon_supported

    if gluon_supported(q, tiles) and extra_ok:
        return True
    if choice == "gluon":
        raise ValueError(
            f"KernelConfig({which}='gluon') cannot run here: device {q.device}, dtype {q.dtype}, head dim "
            f"{q.shape[-1]}, tiles {tiles.block_m} x {tiles.block_n}"
            + ("" if extra_ok else ", running (out, lse) not contiguous / float32")
            + f". It needs an sm_90 GPU, bf16/fp16, head dim 64/128 and 128 x 128 tiles; use {which}='auto' to fall "
            "back to the Triton kernel.")
    return False


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tiles: TileLists | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    config: KernelConfig | None = None,
    cache: dict | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B,H,Sq,D] against k/v [B,Hkv,Sk,D] over ``tiles`` (None: dense causal by positions).

    ``softcap``: scores become ``softcap * tanh(scale * q.k / softcap)`` before the softmax (Gemma 2's
    ``attn_logit_softcapping``); the Triton kernels apply it (the Gluon ones do not, so ``"auto"`` picks Triton).

    Returns ``(out [B,H,Sq,D], lse [B,H,Sq] float32, natural log)``. If ``out`` and ``lse`` are given (a running
    result, any float dtype for out), the block is merged into them by log-sum-exp in place and they are returned.
    ``cache``: an empty dict to pass again to :func:`block_backward` of the same call (same q, k, v, positions and
    lists): the Gluon path keeps there what the backward can reuse (the gathered columns, TMA descriptors).
    """
    cfg = config or DEFAULT_CONFIG
    q, k, v, q_pos, k_pos, tiles = _prep(q, k, v, q_pos, k_pos, tiles, block_m, block_n)
    B, H, Sq, D = q.shape
    has_prev = out is not None
    if has_prev != (lse is not None):
        raise ValueError("give both out and lse (a running result) or neither")
    if has_prev and (out.shape != q.shape or lse.shape != (B, H, Sq) or out.stride(-1) != 1):
        raise ValueError(f"running out {tuple(out.shape)} / lse {tuple(lse.shape)} do not match q {tuple(q.shape)}")
    prev_ok = not has_prev or (out.is_contiguous() and lse.dtype == torch.float32)
    if _use_gluon(cfg.forward, "forward", q, tiles, prev_ok, softcap):
        from .gluon_forward import gluon_block_forward

        return gluon_block_forward(q, k, v, q_pos, k_pos, scale, tiles, out, lse, k_stages=cfg.k_stages,
                                   cache=cache, item_order=cfg.order_of("forward"))
    return triton_block_forward(q, k, v, q_pos, k_pos, scale, tiles, out, lse, cfg, softcap)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tiles: TileLists | None = None,
    block_m: int = 64,
    block_n: int = 64,
    config: KernelConfig | None = None,
    grad_dtype: torch.dtype | None = None,
    cache: dict | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of this block's pairs, given the FINAL ``out`` and ``lse`` (flash-attention backward).

    ``grad_dtype``: dtype of the returned (dq, dk, dv); None gives float32 (what a ring accumulates across steps).
    The kernels accumulate in float32 and write dq (and dk/dv when there are no gathered columns) in that dtype
    directly; gathered-column partials are added to float32 dk/dv first, then cast. ``cache``: the dict given to
    :func:`block_forward` of the same call, if any. ``softcap``: as the forward's (the same value).

    Deterministic (bit-identical across runs): every element is written by one program, plus (gathered columns
    only) a fixed-order sum over query-range parts and one epilogue program per block of key rows that adds the
    columns' partials in a fixed order (the query heads of the KV group), see ``_dkdv_cols_epilogue_kernel``
    (:mod:`mtraining_kernels.triton_backward`).
    """
    cfg = config or DEFAULT_CONFIG
    q, k, v, q_pos, k_pos, tiles = _prep(q, k, v, q_pos, k_pos, tiles, block_m, block_n)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    out = out if out.stride(-1) == 1 else out.contiguous()
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != (B, H, Sq):
        raise ValueError(f"out {tuple(out.shape)}, dout {tuple(dout.shape)}, lse {tuple(lse.shape)} do not match q "
                         f"{tuple(q.shape)}")
    gdt = grad_dtype or torch.float32
    gluon_dq = _use_gluon(cfg.dq, "dq", q, tiles, True, softcap)  # (an error for dq='gluon' here, before any launch)
    gluon_dkdv = _use_gluon(cfg.dkdv, "dkdv", q, tiles, True, softcap)
    gluon_cols = tiles.col_idx is not None and _use_gluon(cfg.dkdv_cols, "dkdv_cols", q, tiles, True, softcap)
    softcap_log2(softcap)  # (an error for a bad softcap here, before any launch)
    delta, lse2 = bwd_preprocess(out, dout, lse)
    has_cols = tiles.col_idx is not None
    dkv = torch.empty(2, B, Hkv, Sk, D, dtype=torch.float32 if has_cols else gdt, device=q.device)
    dk, dv = dkv[0], dkv[1]  # one buffer: the column epilogue reads and writes both in one launch
    if gluon_dq:
        from .gluon_backward import gluon_block_dq

        dq = gluon_block_dq(q, k, v, dout, lse2, delta, q_pos, k_pos, scale, tiles, dq_dtype=gdt,
                            k_stages=cfg.k_stages, cache=cache, item_order=cfg.order_of("dq"))
    else:
        dq = triton_block_dq(q, k, v, dout, lse2, delta, q_pos, k_pos, scale, tiles, cfg, gdt, softcap)
    if gluon_dkdv:
        from .gluon_backward import gluon_block_dkdv

        gluon_block_dkdv(q, k, v, dout, lse2, delta, q_pos, k_pos, scale, tiles, dk=dk, dv=dv, cache=cache,
                         item_order=cfg.order_of("dkdv"))
    else:
        triton_block_dkdv(q, k, v, dout, lse2, delta, q_pos, k_pos, scale, tiles, cfg, dk, dv, softcap)
    J = tiles.col_bits.shape[-1] if has_cols else 0  # bit words (64-slot column chunks) per query tile
    if J > 0 and tiles.col_idx is not None:  # (J > 0: the lists have columns)
        NC, Mq = J * COL_CHUNK, triton.cdiv(Sq, tiles.block_m)
        if gluon_cols:
            from .gluon_backward import gluon_block_dkdv_cols

            P = min(cfg.col_split or column_split(triton.cdiv(NC, 128) * B * H, Mq, q.device), Mq)
            dkvc = gluon_block_dkdv_cols(q, k, v, dout, lse2, delta, q_pos, k_pos, scale, tiles, P, cache=cache,
                                         item_order=cfg.order_of("dkdv_cols"))
        else:
            P = min(cfg.col_split or column_split(triton.cdiv(NC, cfg.col_block) * B * H, Mq, q.device), Mq)
            dkvc = triton_block_dkdv_cols(q, k, v, dout, lse2, delta, q_pos, k_pos, scale, tiles, cfg, P, softcap)
        dkv = add_column_grads(dkv, dkvc, tiles.col_idx, gdt)
    if dkv.dtype != gdt:  # (lists with an empty column list)
        dkv = dkv.to(gdt)
    return dq, dkv[0], dkv[1]


# --------------------------------------------------------------------------------------------------------------
# autograd Function and block op
# --------------------------------------------------------------------------------------------------------------


def _attention_range():
    """``mtraining::attention`` (``lightning_mtraining.core.profiling``) while a profiler runs, else nothing."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function("mtraining::attention")
    return contextlib.nullcontext()


class _VerticalSlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, tiles, scale, config, softcap):
        # positions as the kernels take them, once for both passes; ``cache`` carries what the backward reuses
        q_pos, k_pos = (p.to(device=q.device, dtype=torch.int32).contiguous() for p in (q_pos, k_pos))
        cache: dict = {}
        with _attention_range():
            out, lse = block_forward(q, k, v, q_pos, k_pos, scale, tiles=tiles, config=config, cache=cache,
                                     softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos)
        # The forward's cache is not kept for the backward: its TMA descriptors hold views of q, k and v (and it
        # holds the gathered columns), and a node's attributes live until its backward. Under activation
        # checkpointing, whose saved-tensor hooks drop q, k, v and out, the cache alone would keep every layer's
        # q, k and v alive through the forward (0.31 GiB a layer at 64K tokens for the Qwen2.5-3B shape, 11 GiB over
        # 36 layers), so the sparse step's peak memory would exceed the dense one's. The
        # recomputed tensors have other addresses, so the descriptors would not be reused
        # anyway; the backward rebuilds them (host microseconds) and gathers the columns again (one small kernel).
        ctx.tiles, ctx.scale, ctx.config, ctx.cache, ctx.softcap = tiles, scale, config, {}, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_pos, k_pos = ctx.saved_tensors
        with _attention_range():
            dq, dk, dv = block_backward(q, k, v, out, lse, dout, q_pos, k_pos, ctx.scale, tiles=ctx.tiles,
                                        config=ctx.config, grad_dtype=q.dtype, cache=ctx.cache, softcap=ctx.softcap)
        ctx.cache = None  # the gathered columns are not needed any more
        return dq, dk, dv, None, None, None, None, None, None


def vertical_slash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tiles: TileLists,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    scale: float | None = None,
    config: KernelConfig | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Differentiable attention over ``tiles`` (positions default to 0..S-1); returns [B, H, Sq, D].

    ``config``: launch settings and the dq mode (:class:`KernelConfig`; None: :data:`DEFAULT_CONFIG`). ``softcap``:
    scores ``softcap * tanh(s / softcap)`` (Triton kernels; see :func:`block_forward`)."""
    if q_pos is None and k_pos is None and q.shape[2] == k.shape[2]:
        q_pos = k_pos = torch.arange(q.shape[2], device=q.device, dtype=torch.int32)
    if q_pos is None:
        q_pos = torch.arange(q.shape[2], device=q.device, dtype=torch.int32)
    if k_pos is None:
        k_pos = torch.arange(k.shape[2], device=q.device, dtype=torch.int32)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _VerticalSlashAttention.apply(q, k, v, q_pos, k_pos, tiles, scale, config, softcap)


class TritonBlockOp:
    """The ring's per-block op protocol (``lightning_mtraining.ring.block_ops``) on the Triton kernels.

    ``forward`` returns (out in q.dtype, lse float32), or with a running ``out`` / ``lse`` (any float out, float32
    lse) merges the block into them in place and returns them; ``backward`` takes the FINAL merged (out, lse) and
    returns float32 (dq, dk, dv). With ``tiles=`` (a sparse ring step's lists, T x T tiles) the kernels compute
    exactly those pairs; without, the tile lists come from :func:`dense_tile_lists` on every call (O((Sq/BM) *
    (Sk/BN)) torch work on the device).
    """

    supports_tiles = True
    supports_softcap = True  # ``softcap=`` on forward / backward / differentiable (the Triton kernels apply it)
    supports_running = True  # ``forward(..., out=, lse=)`` merges the block into a running result inside the kernel

    def __init__(self, block_m: int = 64, block_n: int = 64, config: KernelConfig | None = None) -> None:
        self.block_m, self.block_n, self.config = block_m, block_n, config

    def forward(self, q, k, v, q_pos, k_pos, scale, tiles=None, softcap=None, out=None, lse=None):
        return block_forward(q, k, v, q_pos, k_pos, scale, tiles=tiles, out=out, lse=lse, block_m=self.block_m,
                             block_n=self.block_n, config=self.config, softcap=softcap)

    def backward(self, q, k, v, out, lse, dout, q_pos, k_pos, scale, tiles=None, softcap=None):
        return block_backward(q, k, v, out, lse, dout, q_pos, k_pos, scale, tiles=tiles, block_m=self.block_m,
                              block_n=self.block_n, config=self.config, softcap=softcap)

    def differentiable(self, q, k, v, q_pos, k_pos, scale, tiles=None, softcap=None):
        """The block's output with its own autograd (a ring of one step needs no merge)."""
        if tiles is None:
            tiles = dense_tile_lists(q_pos.to(q.device), k_pos.to(q.device), self.block_m, self.block_n)
        return vertical_slash_attention(q, k, v, tiles, q_pos, k_pos, scale, config=self.config, softcap=softcap)

    def __repr__(self) -> str:
        return f"TritonBlockOp(block_m={self.block_m}, block_n={self.block_n})"
