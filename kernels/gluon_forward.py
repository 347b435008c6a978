"""An FA3-style forward of the vertical-slash kernel in Gluon (Triton 3.6), Hopper (sm_90) only.

Why: the Triton forward runs each step's two matmuls and its softmax one after the other in every warp (the tensor
pipe is idle much of the time), and each program's load-Q / first-tile / store chain is serial with the next
program's on the SM. This kernel is scheduled by hand:

- one program per SM (persistent), walking the (query tile, batch * head) work items heaviest first;
- a producer partition (the default warpgroup, 24 registers per thread) issues TMA loads of the next work items'
  Q (two buffers), of the key tiles of ``tiles.fwd_idx`` and then of the query tile's gathered-column chunks
  (a K ring of ``K_STAGES`` and a V ring of ``STAGES`` buffers, one "ready" and one "empty" mbarrier per buffer),
  so loads run ahead of the math across work items; for every masked step it also writes the step's key
  positions into shared memory (a gathered column the query tile did not select gets a position no query sees),
  so the consumers mask by one compare. The consumers free a K buffer (and its positions) as soon as the step's
  scores are computed, and a V buffer after P V (with one barrier for both, the next load into a buffer would wait
  for P V and the consumers then wait for K on every step);
- two consumer partitions (warpgroups, 240 registers per thread), each owning 64 of the 128 query rows, share
  the K/V buffers; within a consumer, the QK^T of step j is issued before step j-1's PV has finished
  (``warpgroup_mma`` is asynchronous): the softmax of step j runs while the tensor cores do PV of step j-1.

Computed pairs: exactly those of :func:`mtraining_kernels.vertical_slash.block_forward`: the key tiles of the
lists, with the token mask ``k_pos <= q_pos`` on the first ``fwd_nmask`` tiles, then the gathered columns whose
bit is set for the query tile (``tiles.col_bits``) and with ``k_pos <= q_pos``. The columns are first copied into
dense per-head rows (:func:`mtraining_kernels.gluon_common.gather_columns`) so that TMA can load them like key
tiles. Outputs out (q.dtype) and natural-log lse (float32); rows with no computed pair get out 0 and lse -inf; a
running ``(out, lse)`` is merged into by log-sum-exp, in place.

Constraints: CUDA sm_90, bf16/fp16, q/k/v contiguous ``[B, H(kv), S, D]`` (copied otherwise), D in {64, 128},
128 x 128 tiles. Key rows past Sk of a ragged last tile are read from the next head's rows (or TMA zero fill at
the very end) and masked by position (such tiles are in the masked part of the lists).

The dq and dk/dv kernels built the same way: :mod:`mtraining_kernels.gluon_backward`; what they share with this
one: :mod:`mtraining_kernels.gluon_common`. Chosen by ``KernelConfig(forward="auto" | "gluon")``
(:mod:`mtraining_kernels.vertical_slash`); resources: :func:`mtraining_kernels.testing.gluon.compile_report`
(works offline, after :func:`mtraining_kernels.testing.gluon.install_offline_sm90_target`).
"""

from __future__ import annotations

import torch
import triton

from .gluon_common import (
    HAS_GLUON,
    LIST_ARGS,
    ROWS,
    key_side_args,
    launch_persistent,
    snake_order,
    tma_descriptor,
)
from .host import LOG2E, batch_strides
from .indexing import TileLists, dense_tile_lists
from .launch import Launcher

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from .gluon_common import _apply_mask, _item, _item_meta, _n_items, _producer, _work_item

__all__ = ["gluon_block_forward"]

if HAS_GLUON:

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale):
        """Online softmax of one score tile (raw scores; qk_scale = softmax scale * log2 e folded into exp2)."""
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row fully masked so far
        ms = m_use * qk_scale
        p = gl.exp2(s * qk_scale - gl.expand_dims(ms, 1))
        alpha = gl.exp2(m_i * qk_scale - ms)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha
    @gluon.jit
    def _consumer(q_bufs, k_bufs, v_bufs, kpos_bufs, q_ready, q_empty, k_ready, v_ready, pos_ready, k_empty,
                  v_empty, Out, Lse, QPos, FCnt, FNm, NCS, qk_scale, Sq, H, n_q, total,
                  sob, soh, sos, slb, slh, sls, scb, sch, scm, snb, snh, snm,
                  HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, HAS_PREV: gl.constexpr, HAS_COLS: gl.constexpr, K_STAGES: gl.constexpr,
                  SNAKE: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        BH = total // n_q
        it = 0
        t = 0
        w = gl.program_id(0)
        cnt, nmask, ncs, q_pos = _item_meta(w, total, n_q, H, FCnt, FNm, NCS, QPos, Sq, scb, sch, scm, snb, snh, snm,
                                            HALF, BLOCK_M, row_s, HAS_COLS)
        for i_w in range(_n_items(total, gl.program_id(0), gl.num_programs(0), SNAKE)):
            w = _item(i_w, gl.program_id(0), gl.num_programs(0), SNAKE)
            # the next item's lists and positions, loaded while this one runs
            w_n = _item(i_w + 1, gl.program_id(0), gl.num_programs(0), SNAKE)  # (past the end: zeros)
            cnt_n, nmask_n, ncs_n, q_pos_n = _item_meta(w_n, total, n_q, H, FCnt, FNm, NCS, QPos,
                                                        Sq, scb, sch, scm, snb, snh, snm, HALF, BLOCK_M, row_s,
                                                        HAS_COLS)
            pid_m, pid_bh = _work_item(w, BH, n_q)
            b = pid_bh // H
            h = pid_bh % H
            row0 = pid_m * BLOCK_M + HALF * (BLOCK_M // 2)
            n_steps = cnt + ncs
            qb = t % 2
            q_smem = q_bufs.index(2 * qb + HALF)
            mbarrier.wait(q_ready.index(qb), (t // 2) & 1)

            zero_s = gl.zeros([BLOCK_M // 2, BLOCK_N], gl.float32, s_layout)
            o = gl.zeros([BLOCK_M // 2, HEAD_DIM], gl.float32, o_layout)
            m_i = gl.full([BLOCK_M // 2], float("-inf"), gl.float32, row_s)
            l_i = gl.zeros([BLOCK_M // 2], gl.float32, row_s)
            if n_steps > 0:
                # step 0: S_0 = Q K_0^T, softmax. K (with its positions) and V ride rings of K_STAGES and STAGES
                # buffers: ks / vs index them, kph / vph are the phases
                ks = it % K_STAGES
                kph = (it // K_STAGES) & 1
                mbarrier.wait(k_ready.index(ks), kph)
                s = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), zero_s, use_acc=False)
                if (nmask > 0) | (cnt == 0):
                    mbarrier.wait(pos_ready.index(ks), kph)
                    s = _apply_mask(s, kpos_bufs.index(ks), q_pos, s_layout)
                mbarrier.arrive(k_empty.index(ks), count=1)  # K_0 and its positions read: the producer may refill
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
                for j in range(1, n_steps):
                    prev = it % STAGES
                    prev_ph = (it // STAGES) & 1
                    it += 1
                    ks = it % K_STAGES
                    kph = (it // K_STAGES) & 1
                    mbarrier.wait(k_ready.index(ks), kph)
                    s_tok = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), zero_s, use_acc=False,
                                          is_async=True)
                    mbarrier.wait(v_ready.index(prev), prev_ph)
                    p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
                    o_tok = warpgroup_mma(p_op, v_bufs.index(prev), o, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # S_j done, PV_{j-1} in flight
                    if (j < nmask) | (j >= cnt):
                        mbarrier.wait(pos_ready.index(ks), kph)
                        s = _apply_mask(s, kpos_bufs.index(ks), q_pos, s_layout)
                    mbarrier.arrive(k_empty.index(ks), count=1)  # K_j done with: its buffer refills during softmax
                    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
                    o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                # last PV
                vs = it % STAGES
                mbarrier.wait(v_ready.index(vs), (it // STAGES) & 1)
                p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
                o = warpgroup_mma(p_op, v_bufs.index(vs), o)
                mbarrier.arrive(v_empty.index(vs), count=1)
                it += 1
            mbarrier.arrive(q_empty.index(qb), count=1)

            # epilogue: normalise, lse (natural log), optional merge, store
            l_o = gl.convert_layout(l_i, row_o)
            m_o = gl.convert_layout(m_i, row_o)
            has = l_o > 0.0
            l_safe = gl.where(has, l_o, 1.0)
            out = o / gl.expand_dims(l_safe, 1)
            lse = gl.where(has, (m_o * qk_scale + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
            rows = row0 + gl.arange(0, BLOCK_M // 2, layout=row_o)
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            row_ok = rows < Sq
            b64 = b.to(gl.int64)
            h64 = h.to(gl.int64)
            o_ptrs = Out + b64 * sob + h64 * soh + gl.expand_dims(rows.to(gl.int64) * sos, 1) + gl.expand_dims(cols, 0)
            lse_ptrs = Lse + b64 * slb + h64 * slh + rows * sls
            omask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
            if HAS_PREV:
                lse_p = gl.load(lse_ptrs, mask=row_ok, other=float("-inf")).to(gl.float32)
                o_p = gl.load(o_ptrs, mask=omask, other=0.0).to(gl.float32)
                mx = gl.maximum(lse_p, lse)
                mx = gl.where(mx == float("-inf"), 0.0, mx)
                w_p = gl.exp(lse_p - mx)
                w_n = gl.exp(lse - mx)
                wsum = w_p + w_n
                w_safe = gl.where(wsum > 0.0, wsum, 1.0)
                out = (o_p * gl.expand_dims(w_p, 1) + out * gl.expand_dims(w_n, 1)) / gl.expand_dims(w_safe, 1)
                lse = gl.where(wsum > 0.0, mx + gl.log(w_safe), float("-inf"))
            gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=omask)
            gl.store(lse_ptrs, lse, mask=row_ok)
            t += 1
            cnt, nmask, ncs, q_pos = cnt_n, nmask_n, ncs_n, q_pos_n

    @gluon.jit(do_not_specialize=LIST_ARGS)
    def _gl_fwd_kernel(q_desc, k_desc, v_desc, ck_desc, cv_desc, Out, Lse, QPos, KPos, FIdx, FCnt, FNm, NCS, CPos,
                       ColBits, qk_scale, Sq, Sk, H, GROUP, n_q, total, NCp, J,
                       sob, soh, sos, slb, slh, sls, sfb, sfh, sfm, scb, sch, scm, snb, snh, snm, sbb, sbh, sbm,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, HAS_PREV: gl.constexpr, HAS_COLS: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, K_STAGES: gl.constexpr, SNAKE: gl.constexpr):
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [4] + q_desc.block_type.shape, q_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        pos_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        kpos_bufs = gl.allocate_shared_memory(gl.int32, [K_STAGES, BLOCK_N],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # one arrive per consumer warpgroup
        for i in gl.static_range(K_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(pos_ready.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)
        # (the argument tuples are written out: a tuple built by concatenation loses its constexprs in Gluon 3.6)
        gl.warp_specialize([
            (_producer, (q_desc, q_desc, k_desc, v_desc, ck_desc, cv_desc, q_bufs, q_bufs, k_bufs, v_bufs, kpos_bufs,
                         q_ready, q_empty, k_ready, v_ready, pos_ready, k_empty, v_empty, FIdx, FCnt, FNm, NCS, KPos,
                         CPos, ColBits, Sq, Sk, H, GROUP, n_q, total, NCp, J, sfb, sfh, sfm, scb, sch, scm, snb, snh,
                         snm, sbb, sbh, sbm, BLOCK_M, BLOCK_N, STAGES, HAS_COLS, gl.constexpr(2), gl.constexpr(False),
                         K_STAGES, SNAKE)),
            (_consumer, (q_bufs, k_bufs, v_bufs, kpos_bufs, q_ready, q_empty, k_ready, v_ready, pos_ready, k_empty,
                         v_empty, Out, Lse, QPos, FCnt, FNm, NCS, qk_scale, Sq, H, n_q, total,
                         sob, soh, sos, slb, slh, sls, scb, sch, scm, snb, snh, snm,
                         gl.constexpr(0), HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_PREV, HAS_COLS, K_STAGES, SNAKE)),
            (_consumer, (q_bufs, k_bufs, v_bufs, kpos_bufs, q_ready, q_empty, k_ready, v_ready, pos_ready, k_empty,
                         v_empty, Out, Lse, QPos, FCnt, FNm, NCS, qk_scale, Sq, H, n_q, total,
                         sob, soh, sos, slb, slh, sls, scb, sch, scm, snb, snh, snm,
                         gl.constexpr(1), HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, HAS_PREV, HAS_COLS, K_STAGES, SNAKE)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])

    _LAUNCH_FWD = Launcher(_gl_fwd_kernel)


def gluon_block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tiles: TileLists | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    stages: int = 2,
    k_stages: int = 2,
    consumer_regs: int = 240,
    programs: int | None = None,
    warmup_only: bool = False,
    cache: dict | None = None,
    item_order: str = "strided",
):
    """The forward of :func:`mtraining_kernels.vertical_slash.block_forward` (same arguments and results; 128 x 128
    tiles) by the warp-specialised Gluon kernel. Gathered columns are first copied into dense per-head rows
    (:func:`mtraining_kernels.gluon_common.gather_columns`) so that TMA can load them like key tiles. ``programs``:
    persistent programs (default: one per SM). ``warmup_only`` compiles without launching and returns the compiled
    kernel. ``cache``: a dict shared with the backward of the same call (``gluon_block_dq``, ``gluon_block_dkdv`` of
    :mod:`mtraining_kernels.gluon_backward`), which then reuses the gathered columns and the TMA descriptors built
    here. ``k_stages``: depth of the K ring (2 or 3; V's is ``stages``)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if k.shape != (B, Hkv, Sk, D) or v.shape != k.shape or H % Hkv:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if D not in (64, 128):
        raise ValueError(f"gluon forward: head dim {D} not supported (64 or 128)")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"gluon forward: bf16 or fp16 inputs of one dtype, got {q.dtype}/{k.dtype}/{v.dtype}")
    q_pos = q_pos.to(device=q.device, dtype=torch.int32).contiguous()
    k_pos = k_pos.to(device=q.device, dtype=torch.int32).contiguous()
    if tiles is None:
        tiles = dense_tile_lists(q_pos, k_pos, 128, 128)
    if tiles.block_m != 128 or tiles.block_n != 128:
        raise ValueError(f"gluon forward: needs 128 x 128 tiles, got {tiles.block_m} x {tiles.block_n}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    has_prev = out is not None
    if has_prev != (lse is not None):
        raise ValueError("give both out and lse (a running result) or neither")
    if has_prev:
        if out.shape != q.shape or lse.shape != (B, H, Sq) or not out.is_contiguous() or lse.dtype != torch.float32:
            raise ValueError(f"running out {tuple(out.shape)} / lse {tuple(lse.shape)} {lse.dtype} do not match q "
                             f"{tuple(q.shape)} (contiguous out, float32 lse)")
    else:
        out = torch.empty_like(q)
        lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    n_q = triton.cdiv(Sq, 128)
    total = n_q * B * H
    kd, vd, ckd, cvd, cpos, steps, bits, NCp, J, bstr, has_cols = key_side_args(k, v, k_pos, tiles, H, cache)
    fi, fc, fn = tiles.fwd_idx, tiles.fwd_cnt, tiles.fwd_nmask
    qd = tma_descriptor(q, ROWS, cache, "q")
    args = (qd, kd, vd, ckd, cvd, out, lse, q_pos, k_pos, fi, fc, fn, steps, cpos, bits, scale * LOG2E, Sq, Sk, H,
            H // Hkv, n_q, total, NCp, J, *out.stride()[:3], *lse.stride(), *batch_strides(fi), *batch_strides(fc),
            *batch_strides(fn), *bstr)
    meta = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, STAGES=stages, HAS_PREV=has_prev, HAS_COLS=has_cols,
                CONSUMER_REGS=consumer_regs, K_STAGES=k_stages, SNAKE=snake_order(item_order))
    kernel = launch_persistent(_LAUNCH_FWD, q, total, programs, args, meta, warmup_only)
    return kernel if warmup_only else (out, lse)
