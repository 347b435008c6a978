"""The Triton forward of vertical-slash attention: its jit step, the kernel and the launcher
(:func:`triton_block_forward`; :func:`mtraining_kernels.vertical_slash.block_forward` checks the inputs and
chooses between it and the Gluon forward).

Algorithm (flash-attention 2 style, online softmax in base 2; shape legend in :mod:`mtraining_kernels.vertical_slash`):
one program per (query tile m, batch b, query head h) (or per ``KernelConfig.q_rows``-row slice of one; the last
query tiles are launched first): loops over (1) the key tiles of ``tiles.fwd_idx[b, h, m]`` that need the token
mask ``k_pos <= q_pos`` (and key index < Sk), (2) the key tiles that need no mask, (3) the gathered key columns: the
slots of ``tiles.col_idx[b, h]`` up to the last chunk whose bit word ``tiles.col_bits[b, h, m, j]`` is non-zero,
``KernelConfig.col_step`` (64) slots per step; the K/V rows are gathered and the bits plus the token mask select the
pairs (no branch on the bits, so the loads pipeline). Writes out (q.dtype, or the dtype of a given running ``out``)
and the natural-log ``lse`` (float32). With a running ``(out, lse)`` given, the block result is merged into it by
log-sum-exp inside the kernel (in place), for ring use.

The design choices and the options: :mod:`mtraining_kernels.vertical_slash`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import KernelConfig
from .host import LOG2E, column_args, default_num_warps, query_grid, softcap_log2, tile_list_args
from .indexing import TileLists
from .launch import Launcher
from .triton_common import (
    CHUNK,
    COL_WORDS,
    LIST_ARGS,
    LN2,
    POS_MIN,
    _col_chunk_end,
    _gather_cols,
    _load_rows,
    _query_program,
    _scores,
    _tile_kv,
)

__all__ = ["triton_block_forward"]


@triton.jit
def _fwd_step(acc, m_i, l_i, q, k, v, allowed, qk_scale, cap2, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One online-softmax step of a [BM, D] query tile against [N, D] keys/values (scores in log2 units)."""
    s, _ = _scores(tl.dot(q, tl.trans(k)), qk_scale, cap2, SOFTCAP)
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row so far: avoid -inf - -inf
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=LIST_ARGS)
def _vs_fwd_kernel(
    Q, K, V, Out, Lse, QPos, KPos,
    FIdx, FCnt, FNm, ColIdx, ColBits,
    qk_scale, cap2, Sq, Sk, H, GROUP, J,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, slb, slh, sls,
    sfb, sfh, sfm, scb, sch, scm, snb, snh, snm, sib, sih, sbb, sbh, sbm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    SUB_N: tl.constexpr, HAS_COLS: tl.constexpr, HAS_PREV: tl.constexpr, BLOCK_J: tl.constexpr,
    ROWS: tl.constexpr, HEAVY_FIRST: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid_m, pid_bh, offs_m = _query_program(Sq, ROWS, BLOCK_M, HEAVY_FIRST)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)  # B*H*S*D may pass 2**31
    offs_n = tl.arange(0, SUB_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_rows(Q + b64 * sqb + h64 * sqh, offs_m, sqs, offs_d, Sq)
    q_pos = tl.load(QPos + offs_m, mask=offs_m < Sq, other=POS_MIN)
    k_base = K + b64 * skb + hk64 * skh
    v_base = V + b64 * svb + hk64 * svh
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)

    f_base = FIdx + b * sfb + h * sfh + pid_m * sfm
    cnt = tl.load(FCnt + b * scb + h * sch + pid_m * scm)
    nmask = tl.load(FNm + b * snb + h * snh + pid_m * snm)
    R: tl.constexpr = BLOCK_N // SUB_N  # each key tile is walked SUB_N keys at a time, in one flat loop
    for i in range(0, nmask * R):  # tiles that need the token mask
        k, v, allowed = _tile_kv(f_base, i, k_base, v_base, KPos, q_pos, offs_n, offs_d, sks, svs, Sk, BLOCK_N, SUB_N,
                                 True)
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, allowed, qk_scale, cap2, True, SOFTCAP)
    for i in range(nmask * R, cnt * R):  # tiles fully visible to every query of the tile
        k, v, allowed = _tile_kv(f_base, i, k_base, v_base, KPos, q_pos, offs_n, offs_d, sks, svs, Sk, BLOCK_N, SUB_N,
                                 False)
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, allowed, qk_scale, cap2, False, SOFTCAP)
    if HAS_COLS:
        offs_c = tl.arange(0, BLOCK_C)
        c_base = ColIdx + b * sib + h * sih
        bits_base = ColBits + b * sbb + h * sbh + pid_m * sbm
        NW: tl.constexpr = BLOCK_C // CHUNK  # bit words (64-slot chunks) per step
        for j in range(0, tl.cdiv(_col_chunk_end(bits_base, J, BLOCK_J), NW)):  # no branch on bits: loads pipeline
            k, v, k_pos = _gather_cols(c_base, k_base, v_base, KPos, bits_base, j, J, offs_c, offs_d, sks, svs,
                                       BLOCK_C)
            allowed = k_pos[None, :] <= q_pos[:, None]
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, allowed, qk_scale, cap2, True, SOFTCAP)

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    row_ok = offs_m < Sq
    o_ptrs = Out + b64 * sob + h64 * soh + offs_m[:, None] * sos + offs_d[None, :]
    lse_ptrs = Lse + b * slb + h * slh + offs_m * sls
    if HAS_PREV:  # merge into the running (out, lse) by log-sum-exp, in place
        lse_p = tl.load(lse_ptrs, mask=row_ok, other=float("-inf")).to(tl.float32)
        o_p = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        mx = tl.maximum(lse_p, lse)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w_p = tl.exp(lse_p - mx)
        w_n = tl.exp(lse - mx)
        w = w_p + w_n
        w_safe = tl.where(w > 0.0, w, 1.0)
        o = (o_p * w_p[:, None] + o * w_n[:, None]) / w_safe[:, None]
        lse = tl.where(w > 0.0, mx + tl.log(w_safe), float("-inf"))
    tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptrs, lse.to(Lse.dtype.element_ty), mask=row_ok)


# the JIT's per-call argument binding skipped on repeat launches (mtraining_kernels.launch): host time decides short,
# very sparse calls
_LAUNCH_FWD = Launcher(_vs_fwd_kernel)


def triton_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                         scale: float, tiles: TileLists, out: torch.Tensor | None, lse: torch.Tensor | None,
                         cfg: KernelConfig, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton forward of :func:`mtraining_kernels.vertical_slash.block_forward` on inputs it has checked
    (unit-stride q/k/v, int32 positions on q's device, lists that fit): a new ``(out, lse)``, or the running one
    given, merged into in place."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    has_prev = out is not None
    if out is None:
        out = torch.empty_like(q)
        lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    elif lse is None:
        raise ValueError("triton_block_forward: a running out= needs its lse=")
    BM, BN = tiles.block_m, tiles.block_n
    (fi, fc, fn), fstr = tile_list_args(tiles, "fwd")
    (ci, cb), cstr, J = column_args(tiles, fc)
    rows = min(BM, cfg.q_rows or BM)
    sub_n = min(BN, cfg.sub_n)
    _LAUNCH_FWD(
        query_grid(B * H, Sq, BM, rows),
        (q, k, v, out, lse, q_pos, k_pos, fi, fc, fn, ci, cb, scale * LOG2E, softcap_log2(softcap), Sq, Sk, H,
         H // Hkv, J, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *lse.stride(), *fstr,
         *cstr),
        dict(HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, BLOCK_C=cfg.col_step, SUB_N=sub_n, HAS_COLS=J > 0,
             HAS_PREV=has_prev, BLOCK_J=COL_WORDS, ROWS=rows, HEAVY_FIRST=cfg.heavy_first,
             SOFTCAP=softcap is not None, num_warps=cfg.fwd_warps or default_num_warps(rows, BN, D),
             num_stages=cfg.fwd_stages),
    )
    return out, lse
