"""The Triton backward of vertical-slash attention: its jit steps, the kernels and their launchers; which of them
run (each dq / dk/dv part may be the Gluon kernel's instead) is decided by
:func:`mtraining_kernels.vertical_slash.block_backward`.

Algorithm (flash-attention 2 style, base 2; shape legend in :mod:`mtraining_kernels.vertical_slash`), backward from
the FINAL out and lse: a preprocess kernel (``delta = rowsum(dout * out)`` and the base-2 lse), then three kernels,
no atomics, bit-identical across runs.

- dq: one program per query tile, the forward's loops; written in ``grad_dtype`` directly.
- dk/dv of tiles: one program per (key tile, batch, KV head), looping over the query heads of the group and the
  key-tile-major lists ``tiles.bwd_idx``, a query tile taller than ``KernelConfig.sub_m`` = 64 rows walked 64
  rows at a time in one flat loop; it owns its rows of dk/dv, so it writes them once.
- dk/dv of gathered columns: one program per (``KernelConfig.col_block`` = 128 column slots, batch * query head,
  part p): the query tiles from the first to the last with a bit set in those slots, split evenly over the P
  parts; it writes partials [P, G, B, Hkv, NC, D], summed over the parts (one torch sum, fixed order), and one
  epilogue launch (``_dkdv_cols_epilogue_kernel``: one program per 32 key rows of a KV head) adds them into float32
  dk/dv in a fixed order (the query heads of the group; a head's columns are unique, padding slots add exact zeros)
  and casts the result: two launches instead of a dozen torch ops (index arithmetic, one ``index_add_`` per query
  head, a cast), whose host time would show in short calls.

The design choices and the options: :mod:`mtraining_kernels.vertical_slash`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import KernelConfig
from .host import (
    LOG2E,
    batch_strides,
    column_args,
    default_num_warps,
    query_grid,
    softcap_log2,
    tile_list_args,
)
from .indexing import COL_CHUNK, TileLists
from .launch import Launcher
from .triton_common import (
    CHUNK,
    COL_WORDS,
    LIST_ARGS,
    LOG2E_C,
    POS_MAX,
    POS_MIN,
    _col_chunk_end,
    _col_sel,
    _gather_cols,
    _load_rows,
    _query_program,
    _scores,
    _tile_kv,
)

__all__ = ["add_column_grads", "bwd_preprocess", "triton_block_dkdv", "triton_block_dkdv_cols", "triton_block_dq"]


# --------------------------------------------------------------------------------------------------------------
# jit helpers
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k, v, allowed, qk_scale, cap2, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    s, t = _scores(tl.dot(q, tl.trans(k)), qk_scale, cap2, SOFTCAP)
    p = tl.math.exp2(s - lse2[:, None])
    if MASKED:
        p = tl.where(allowed, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    if SOFTCAP:  # d(c tanh(x / c)) / dx = 1 - tanh^2
        ds = ds * (1.0 - t * t)
    return dq + tl.dot(ds.to(k.dtype), k)


@triton.jit
def _dkdv_step(dk, dv, k, v, q, do, lse2, delta, allowed_t, qk_scale, cap2, MASKED: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """Transposed step: [N, D] keys against a [BM, D] query tile; allowed_t is [N, BM]."""
    s_t, t_t = _scores(tl.dot(k, tl.trans(q)), qk_scale, cap2, SOFTCAP)
    p_t = tl.math.exp2(s_t - lse2[None, :])
    if MASKED:
        p_t = tl.where(allowed_t, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do)
    dp_t = tl.dot(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:
        ds_t = ds_t * (1.0 - t_t * t_t)
    dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _bits_range(bits_col, sbm, Mq, n_rows, BLOCK: tl.constexpr):
    """(first, last + 1) query tile whose bits in this column chunk are non-zero, over the first ``n_rows`` tiles
    ((Mq, Mq) if none)."""
    first = Mq
    last = -1
    for m0 in range(0, n_rows, BLOCK):
        offs = m0 + tl.arange(0, BLOCK)
        nz = tl.load(bits_col + offs.to(tl.int64) * sbm, mask=offs < Mq, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(nz, offs, Mq), 0))
        last = tl.maximum(last, tl.max(tl.where(nz, offs, -1), 0))
    return first, tl.maximum(last + 1, first)


@triton.jit
def _load_q_side(q_base, do_base, Lse2, Delta, QPos, row_base, offs_m, offs_d, sqs, sds, Sq):
    """Query-side operands of a dk/dv step; rows past Sq: q = do = 0, lse2 = +inf (p = 0), no position."""
    row_ok = offs_m < Sq
    q = _load_rows(q_base, offs_m, sqs, offs_d, Sq)
    do = _load_rows(do_base, offs_m, sds, offs_d, Sq)
    lse2 = tl.load(Lse2 + row_base + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
    q_pos = tl.load(QPos + offs_m, mask=row_ok, other=POS_MIN)
    return q, do, lse2, delta, q_pos


@triton.jit
def _dkdv_sub_tile(dk, dv, k, v, k_pos, sel, row0, offs_m0, q_base, do_base, Lse2, Delta, QPos, row_base, offs_d,
                   sqs, sds, Sq, qk_scale, cap2, MASKED: tl.constexpr, HAS_SEL: tl.constexpr, SOFTCAP: tl.constexpr):
    """dk/dv contributions of the query rows ``row0 + offs_m0`` (one flat-loop step of the dk/dv kernels)."""
    q, do, lse2, delta, q_pos = _load_q_side(q_base, do_base, Lse2, Delta, QPos, row_base, row0 + offs_m0, offs_d,
                                             sqs, sds, Sq)
    allowed_t = k_pos[:, None] <= q_pos[None, :]
    if HAS_SEL:
        allowed_t = allowed_t & sel[:, None]
    return _dkdv_step(dk, dv, k, v, q, do, lse2, delta, allowed_t, qk_scale, cap2, MASKED, SOFTCAP)


# --------------------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    Out, DO, Lse, Delta, Lse2, Sq, H,
    sob, soh, sos, sdb, sdh, sds, slb, slh, sls,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    """delta = rowsum(dout * out) and lse2 = lse * log2(e) (+inf where lse = -inf: p = 0), both [B, H, Sq] fp32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b64, h64 = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m < Sq
    o = _load_rows(Out + b64 * sob + h64 * soh, offs_m, sos, offs_d, Sq).to(tl.float32)
    do = _load_rows(DO + b64 * sdb + h64 * sdh, offs_m, sds, offs_d, Sq).to(tl.float32)
    lse = tl.load(Lse + b64 * slb + h64 * slh + offs_m * sls, mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * Sq + offs_m, tl.sum(o * do, 1), mask=ok)
    tl.store(Lse2 + pid_bh.to(tl.int64) * Sq + offs_m, tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C),
             mask=ok)


@triton.jit(do_not_specialize=LIST_ARGS)
def _vs_bwd_dq_kernel(
    Q, K, V, DO, Lse2, Delta, DQ, QPos, KPos,
    FIdx, FCnt, FNm, ColIdx, ColBits,
    qk_scale, cap2, sm_scale, Sq, Sk, H, GROUP, J,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sfb, sfh, sfm, scb, sch, scm, snb, snh, snm, sib, sih, sbb, sbh, sbm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    SUB_N: tl.constexpr, HAS_COLS: tl.constexpr, BLOCK_J: tl.constexpr, ROWS: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid_m, pid_bh, offs_m = _query_program(Sq, ROWS, BLOCK_M, HEAVY_FIRST)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)  # B*H*S*D may pass 2**31
    offs_n = tl.arange(0, SUB_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    q = _load_rows(Q + b64 * sqb + h64 * sqh, offs_m, sqs, offs_d, Sq)
    do = _load_rows(DO + b64 * sdb + h64 * sdh, offs_m, sds, offs_d, Sq)
    # Lse2 / Delta are contiguous [B, H, Sq] float32; past-the-end rows: lse2 = +inf makes p = 0
    lse2 = tl.load(Lse2 + pid_bh * Sq + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + pid_bh * Sq + offs_m, mask=row_ok, other=0.0)
    q_pos = tl.load(QPos + offs_m, mask=row_ok, other=POS_MIN)
    k_base = K + b64 * skb + hk64 * skh
    v_base = V + b64 * svb + hk64 * svh
    dq = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)

    f_base = FIdx + b * sfb + h * sfh + pid_m * sfm
    cnt = tl.load(FCnt + b * scb + h * sch + pid_m * scm)
    nmask = tl.load(FNm + b * snb + h * snh + pid_m * snm)
    R: tl.constexpr = BLOCK_N // SUB_N  # as in the forward: SUB_N keys per step, one flat loop
    for i in range(0, nmask * R):
        k, v, allowed = _tile_kv(f_base, i, k_base, v_base, KPos, q_pos, offs_n, offs_d, sks, svs, Sk, BLOCK_N, SUB_N,
                                 True)
        dq = _dq_step(dq, q, do, lse2, delta, k, v, allowed, qk_scale, cap2, True, SOFTCAP)
    for i in range(nmask * R, cnt * R):
        k, v, allowed = _tile_kv(f_base, i, k_base, v_base, KPos, q_pos, offs_n, offs_d, sks, svs, Sk, BLOCK_N, SUB_N,
                                 False)
        dq = _dq_step(dq, q, do, lse2, delta, k, v, allowed, qk_scale, cap2, False, SOFTCAP)
    if HAS_COLS:
        offs_c = tl.arange(0, BLOCK_C)
        c_base = ColIdx + b * sib + h * sih
        bits_base = ColBits + b * sbb + h * sbh + pid_m * sbm
        NW: tl.constexpr = BLOCK_C // CHUNK
        for j in range(0, tl.cdiv(_col_chunk_end(bits_base, J, BLOCK_J), NW)):
            k, v, k_pos = _gather_cols(c_base, k_base, v_base, KPos, bits_base, j, J, offs_c, offs_d, sks, svs,
                                       BLOCK_C)
            allowed = k_pos[None, :] <= q_pos[:, None]
            dq = _dq_step(dq, q, do, lse2, delta, k, v, allowed, qk_scale, cap2, True, SOFTCAP)
    dq_ptrs = DQ + pid_bh.to(tl.int64) * Sq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=LIST_ARGS)
def _vs_bwd_dkdv_kernel(
    Q, K, V, DO, Lse2, Delta, DK, DV, QPos, KPos,
    BIdx, BCnt, BNm,
    qk_scale, cap2, sm_scale, Sq, Sk, H, HKV, GROUP,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sfb, sfh, sfm, scb, sch, scm, snb, snh, snm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = pid_bk // HKV
    hk = pid_bk % HKV
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)  # B*H*S*D may pass 2**31
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, SUB_M)
    R: tl.constexpr = BLOCK_M // SUB_M  # query tiles are walked SUB_M rows at a time, in one flat loop
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_rows(K + b64 * skb + hk64 * skh, offs_n, sks, offs_d, Sk)
    v = _load_rows(V + b64 * svb + hk64 * svh, offs_n, svs, offs_d, Sk)
    k_pos = tl.load(KPos + offs_n, mask=offs_n < Sk, other=POS_MAX)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(0, GROUP):  # every query head reading this KV head: no atomics, one writer per dk row
        h = hk * GROUP + g
        q_base = Q + b64 * sqb + h.to(tl.int64) * sqh
        do_base = DO + b64 * sdb + h.to(tl.int64) * sdh
        row_base = (b * H + h) * Sq
        f_base = BIdx + b * sfb + h * sfh + pid_n * sfm
        cnt = tl.load(BCnt + b * scb + h * sch + pid_n * scm)
        nmask = tl.load(BNm + b * snb + h * snh + pid_n * snm)
        for i in range(0, nmask * R):
            row0 = tl.load(f_base + i // R) * BLOCK_M + (i % R) * SUB_M
            dk, dv = _dkdv_sub_tile(dk, dv, k, v, k_pos, k_pos, row0, offs_m0, q_base, do_base, Lse2, Delta, QPos,
                                    row_base, offs_d, sqs, sds, Sq, qk_scale, cap2, True, False, SOFTCAP)
        for i in range(nmask * R, cnt * R):
            # a ragged last query tile may be "unmasked": its missing rows have p = 0 (see _load_q_side)
            row0 = tl.load(f_base + i // R) * BLOCK_M + (i % R) * SUB_M
            dk, dv = _dkdv_sub_tile(dk, dv, k, v, k_pos, k_pos, row0, offs_m0, q_base, do_base, Lse2, Delta, QPos,
                                    row_base, offs_d, sqs, sds, Sq, qk_scale, cap2, False, False, SOFTCAP)
    out_off = pid_bk.to(tl.int64) * Sk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < Sk)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < Sk)


@triton.jit(do_not_specialize=LIST_ARGS + ["Mq", "NC", "P"])
def _vs_bwd_dkdv_cols_kernel(
    Q, K, V, DO, Lse2, Delta, DKC, DVC, QPos, KPos,
    ColIdx, ColBits,
    qk_scale, cap2, sm_scale, Sq, Sk, H, GROUP, Mq, NC, P, BH,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sib, sih, sbb, sbh, sbm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, SUB_M: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One program per (BLOCK_C column slots = BLOCK_C / 64 chunks, batch * head, part p): the p-th of P equal ranges
    of the query tiles that see those chunks; writes its partial dk/dv of the slots to DKC/DVC [P, GROUP, B, HKV,
    NC, D] (in a [P, GROUP, 2, B, HKV, NC, D] buffer; summed by the launcher in a fixed order)."""
    pid_j = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_p = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)  # B*H*S*D may pass 2**31
    NW: tl.constexpr = BLOCK_C // CHUNK  # bit words (64-slot chunks) per program
    J = NC // CHUNK
    j0 = pid_j * NW
    offs_c = tl.arange(0, BLOCK_C)
    offs_m0 = tl.arange(0, SUB_M)
    offs_d = tl.arange(0, HEAD_DIM)
    slot_ok = j0 * CHUNK + offs_c < NC
    cols = tl.load(ColIdx + b * sib + h * sih + j0 * CHUNK + offs_c, mask=slot_ok, other=0)
    k = tl.load(K + b64 * skb + hk64 * skh + cols[:, None] * sks + offs_d[None, :])  # padding slots hold column 0
    v = tl.load(V + b64 * svb + hk64 * svh + cols[:, None] * svs + offs_d[None, :])
    k_pos = tl.load(KPos + cols)
    q_base = Q + b64 * sqb + h64 * sqh
    do_base = DO + b64 * sdb + h64 * sdh
    row_base = pid_bh * Sq
    bits_base = ColBits + b * sbb + h * sbh
    dk = tl.zeros([BLOCK_C, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_C, HEAD_DIM], dtype=tl.float32)
    R: tl.constexpr = BLOCK_M // SUB_M  # SUB_M query rows per step, one flat loop
    # the query tiles with bits in these chunks, [first, end), split evenly over the P programs of the chunks; the
    # loop has no branch on the bits (so its loads pipeline): a tile with no bit set inside the range is masked
    first = Mq
    end = 0
    for w in tl.static_range(NW):
        f_w, e_w = _bits_range(bits_base + j0 + w, sbm, Mq, tl.where(j0 + w < J, Mq, 0), 1024)
        first = tl.minimum(first, f_w)
        end = tl.maximum(end, tl.where(f_w < Mq, e_w, 0))
    end = tl.maximum(end, first)
    part = tl.cdiv(end - first, P)
    m_lo = first + pid_p * part
    m_hi = tl.minimum(m_lo + part, end)
    for i in range(m_lo * R, m_hi * R):
        sel = _col_sel(bits_base + (i // R) * sbm, j0, J, offs_c, BLOCK_C)
        row0 = (i // R) * BLOCK_M + (i % R) * SUB_M
        dk, dv = _dkdv_sub_tile(dk, dv, k, v, k_pos, sel, row0, offs_m0, q_base, do_base, Lse2, Delta, QPos,
                                row_base, offs_d, sqs, sds, Sq, qk_scale, cap2, True, True, SOFTCAP)
    # partials laid out [P, GROUP, 2, B, HKV, NC, D] (DKC / DVC: the views [:, :, 0] / [:, :, 1]): head g's dk and
    # dv of every KV group are one contiguous slab
    slab = (pid_p * GROUP + h % GROUP) * 2 * (BH // GROUP) + b * (H // GROUP) + hk
    out_off = (slab.to(tl.int64) * NC + j0 * CHUNK + offs_c[:, None]) * HEAD_DIM
    tl.store(DKC + out_off + offs_d[None, :], dk * sm_scale, mask=slot_ok[:, None])
    tl.store(DVC + out_off + offs_d[None, :], dv, mask=slot_ok[:, None])


@triton.jit(do_not_specialize=["ColIdx", "Sk", "NC", "sib", "sih"])
def _dkdv_cols_epilogue_kernel(
    DKV, Part, Out, ColIdx, Sk, NC, G, B, HKV, sib, sih,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, CH: tl.constexpr, CAST: tl.constexpr,
):
    """Adds the gathered columns' dk/dv partials (Part [G, 2, B, HKV, NC, D]: ``_vs_bwd_dkdv_cols_kernel``'s summed
    over its query-range parts) into the key tiles' float32 dk/dv (DKV [2, B, HKV, Sk, D]) and, with CAST, writes
    the result to Out in Out's dtype.

    Deterministic without atomics: one program per (BLOCK_K keys, batch * KV head) owns those rows of dk and dv. For
    each query head g of the group, in order, it finds the slots [lo, hi) of the head's sorted column list that hold
    its keys (by counting; padding slots, column 0 past slot 0, count as past the end) and adds their partials by a
    read-modify-write of the rows. A head's columns are unique, so a chunk of slots has no two writes to one row; a
    barrier separates heads, which may share columns. The busiest program (the sink columns, in every head) does
    G * 2 chunk updates of CH rows, so BLOCK_K stays small."""
    pid_k = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = pid_bk // HKV
    hk = pid_bk % HKV
    k0 = pid_k * BLOCK_K
    offs_d = tl.arange(0, HEAD_DIM)
    row0 = pid_bk.to(tl.int64) * Sk  # row of (b, hk, key 0) in DKV / Out seen as [2 * B * HKV * Sk, D] (dk half)
    w_rows = (B * HKV).to(tl.int64) * Sk  # rows per half (dk, dv)
    for g in range(0, G):
        c_base = ColIdx + b * sib + (hk * G + g) * sih
        lo = k0 * 0
        hi = k0 * 0
        for s0 in range(0, NC, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            c = tl.load(c_base + s, mask=s < NC, other=0)
            val = tl.where((s < NC) & ((s == 0) | (c > 0)), c, POS_MAX)
            lo += tl.sum((val < k0).to(tl.int32), 0)
            hi += tl.sum((val < k0 + BLOCK_K).to(tl.int32), 0)
        for s0 in range(lo, hi, CH):
            s = s0 + tl.arange(0, CH)
            sm = s < hi
            c = tl.load(c_base + s, mask=sm, other=0).to(tl.int64)
            for w in tl.static_range(2):
                slab = (((g * 2 + w) * B + b) * HKV + hk).to(tl.int64)
                part = tl.load(Part + (slab * NC + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=sm[:, None],
                               other=0.0)
                ptrs = DKV + (w * w_rows + row0 + c)[:, None] * HEAD_DIM + offs_d[None, :]
                cur = tl.load(ptrs, mask=sm[:, None], other=0.0)
                tl.store(ptrs, cur + part, mask=sm[:, None])
        tl.debug_barrier()  # head g's row updates visible to every thread before head g + 1 reads those rows
    if CAST:
        rows = k0 + tl.arange(0, BLOCK_K)
        rm = rows < Sk
        for w in tl.static_range(2):
            off = (w * w_rows + row0 + rows)[:, None] * HEAD_DIM + offs_d[None, :]
            x = tl.load(DKV + off, mask=rm[:, None], other=0.0)
            tl.store(Out + off, x.to(Out.dtype.element_ty), mask=rm[:, None])


# --------------------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------------------


# the JIT's per-call argument binding skipped on repeat launches (mtraining_kernels.launch): host time decides short,
# very sparse calls
_LAUNCH_PRE, _LAUNCH_DQ, _LAUNCH_DKDV, _LAUNCH_COLS, _LAUNCH_EPI = (
    Launcher(fn) for fn in (_bwd_preprocess_kernel, _vs_bwd_dq_kernel, _vs_bwd_dkdv_kernel, _vs_bwd_dkdv_cols_kernel,
                            _dkdv_cols_epilogue_kernel))


def _bwd_strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[int]:
    """The (batch, head, row) strides of q, k, v and dout, as the dq and dk/dv kernels take them."""
    return [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3]]


def bwd_preprocess(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(delta, lse2)``: rowsum(dout * out) and the base-2 lse (+inf where lse = -inf), contiguous float32
    [B, H, Sq]: the rows every dq and dk/dv kernel reads, Triton or Gluon (one launch)."""
    B, H, Sq, D = out.shape
    delta = torch.empty(B, H, Sq, dtype=torch.float32, device=out.device)
    lse2 = torch.empty_like(delta)
    _LAUNCH_PRE((triton.cdiv(Sq, 64), B * H),
                (out, dout, lse, delta, lse2, Sq, H, *out.stride()[:3], *dout.stride()[:3], *lse.stride()),
                dict(HEAD_DIM=D, BLOCK=64))
    return delta, lse2


def triton_block_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse2: torch.Tensor,
                    delta: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float, tiles: TileLists,
                    cfg: KernelConfig, grad_dtype: torch.dtype, softcap: float | None) -> torch.Tensor:
    """dq [B, H, Sq, D] in ``grad_dtype`` of :func:`mtraining_kernels.vertical_slash.block_backward` (inputs it has
    checked; ``lse2`` and ``delta`` from :func:`bwd_preprocess`)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    BM, BN = tiles.block_m, tiles.block_n
    sub_n = min(BN, cfg.sub_n)
    rows = min(BM, cfg.q_rows or BM)
    (fi, fc, fn), fstr = tile_list_args(tiles, "fwd")
    (ci, cb), cstr, J = column_args(tiles, fc)
    dq = torch.empty(B, H, Sq, D, dtype=grad_dtype, device=q.device)
    _LAUNCH_DQ(
        query_grid(B * H, Sq, BM, rows),
        (q, k, v, dout, lse2, delta, dq, q_pos, k_pos, fi, fc, fn, ci, cb, scale * LOG2E, softcap_log2(softcap), scale,
         Sq, Sk, H, H // Hkv, J, *_bwd_strides(q, k, v, dout), *fstr, *cstr),
        dict(HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, BLOCK_C=cfg.col_step, SUB_N=sub_n, HAS_COLS=J > 0,
             BLOCK_J=COL_WORDS, ROWS=rows, HEAVY_FIRST=cfg.heavy_first,
             SOFTCAP=softcap is not None, num_warps=cfg.dq_warps or cfg.bwd_warps or default_num_warps(rows, sub_n, D),
             num_stages=cfg.bwd_stages),
    )
    return dq


def triton_block_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse2: torch.Tensor,
                      delta: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float, tiles: TileLists,
                      cfg: KernelConfig, dk: torch.Tensor, dv: torch.Tensor, softcap: float | None) -> None:
    """dk, dv of the key TILES (the gathered columns' share: :func:`triton_block_dkdv_cols`), written into the
    contiguous ``dk`` / ``dv`` shaped like k (their dtype); inputs as :func:`triton_block_dq`'s."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    BM, BN = tiles.block_m, tiles.block_n
    sub_m = min(BM, cfg.sub_m)
    (bi, bc, bn), bstr = tile_list_args(tiles, "bwd")
    _LAUNCH_DKDV(
        (triton.cdiv(Sk, BN), B * Hkv),
        (q, k, v, dout, lse2, delta, dk, dv, q_pos, k_pos, bi, bc, bn, scale * LOG2E, softcap_log2(softcap), scale,
         Sq, Sk, H, Hkv, H // Hkv, *_bwd_strides(q, k, v, dout), *bstr),
        dict(HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, SUB_M=sub_m, SOFTCAP=softcap is not None,
             num_warps=cfg.bwd_warps or default_num_warps(sub_m, BN, D), num_stages=cfg.bwd_stages),
    )


def triton_block_dkdv_cols(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                           lse2: torch.Tensor, delta: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                           scale: float, tiles: TileLists, cfg: KernelConfig, parts: int,
                           softcap: float | None) -> torch.Tensor:
    """The gathered columns' share of dk/dv: the float32 partials [parts, G, 2, B, Hkv, NC, D] (G = H // Hkv;
    [.., 0] dk already scaled, [.., 1] dv), ``parts`` query ranges per column block, for
    :func:`add_column_grads`; inputs as :func:`triton_block_dq`'s (lists with gathered columns)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    BM = tiles.block_m
    (ci, cb), cstr, J = column_args(tiles, tiles.fwd_cnt)
    NC, Mq = J * COL_CHUNK, triton.cdiv(Sq, BM)
    col_sub_m = min(BM, cfg.col_sub_m or cfg.sub_m)
    dkvc = torch.empty(parts, H // Hkv, 2, B, Hkv, NC, D, dtype=torch.float32, device=q.device)
    _LAUNCH_COLS(
        (triton.cdiv(NC, cfg.col_block), B * H, parts),
        (q, k, v, dout, lse2, delta, dkvc[:, :, 0], dkvc[:, :, 1], q_pos, k_pos, ci, cb, scale * LOG2E,
         softcap_log2(softcap), scale, Sq, Sk, H, H // Hkv, Mq, NC, parts, B * H, *_bwd_strides(q, k, v, dout), *cstr),
        dict(HEAD_DIM=D, BLOCK_M=BM, BLOCK_C=cfg.col_block, SUB_M=col_sub_m, SOFTCAP=softcap is not None,
             num_warps=cfg.bwd_warps or default_num_warps(col_sub_m, COL_CHUNK, D), num_stages=cfg.bwd_stages),
    )
    return dkvc


def add_column_grads(dkv: torch.Tensor, dkvc: torch.Tensor, col_idx: torch.Tensor,
                     grad_dtype: torch.dtype) -> torch.Tensor:
    """dk/dv [2, B, Hkv, Sk, D] in ``grad_dtype``: the key tiles' float32 ``dkv`` plus the gathered columns'
    partials ``dkvc`` [P, G, 2, B, Hkv, NC, D] (:func:`triton_block_dkdv_cols` or the Gluon column kernel's) at the
    columns ``col_idx`` of the lists. ``dkv`` is updated in place (and returned when ``grad_dtype`` is float32)."""
    P, G, _, B, Hkv, NC, D = dkvc.shape
    Sk = dkv.shape[3]
    # the parts summed in a fixed order (torch: parallel over the slots; summed inside the epilogue, the program
    # holding the sink columns would be a long tail), then one launch adds the partials into dkv (float32, in place)
    # and writes the result in the grads' dtype
    part = dkvc.sum(0) if P > 1 else dkvc[0]  # [G, 2, B, Hkv, NC, D]
    res = dkv if grad_dtype == torch.float32 else torch.empty(2, B, Hkv, Sk, D, dtype=grad_dtype, device=dkv.device)
    _LAUNCH_EPI((triton.cdiv(Sk, 32), B * Hkv),
                (dkv, part, res, col_idx, Sk, NC, G, B, Hkv, *batch_strides(col_idx, 2)),
                dict(HEAD_DIM=D, BLOCK_K=32, BLOCK_S=256, CH=32, CAST=res is not dkv, num_warps=4))
    return res
