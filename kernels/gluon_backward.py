"""The Gluon (warp-specialised Hopper, sm_90) backward kernels of vertical-slash attention, built like the forward
(:mod:`mtraining_kernels.gluon_forward`: persistent programs, a producer partition issuing TMA loads, two consumer
warpgroups of 64 rows each), and their launchers: dq (:func:`gluon_block_dq`), the dk/dv of the key tiles
(:func:`gluon_block_dkdv`) and the gathered columns' dk/dv by the same dk/dv kernel (:func:`gluon_block_dkdv_cols`).
They compute the pairs of :func:`mtraining_kernels.vertical_slash.block_backward`, which chooses them
(``KernelConfig(dq= / dkdv= / dkdv_cols="auto" | "gluon")``) and runs the preprocess (``lse2``, ``delta``) and the
column epilogue in Triton (:mod:`mtraining_kernels.triton_backward`). Shared pieces:
:mod:`mtraining_kernels.gluon_common`; resources: :func:`mtraining_kernels.testing.gluon.compile_report`.
"""

from __future__ import annotations

import torch
import triton

from .gluon_common import (
    HAS_GLUON,
    LIST_ARGS,
    POS_MAX,
    POS_MIN,
    ROWS,
    gather_columns,
    key_side_args,
    launch_persistent,
    snake_order,
    tma_descriptor,
)
from .host import LOG2E, batch_strides
from .indexing import TileLists
from .launch import Launcher

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    from .gluon_common import _apply_mask, _item, _item_meta, _n_items, _producer, _work_item

__all__ = ["column_query_lists", "gluon_block_dkdv", "gluon_block_dkdv_cols", "gluon_block_dq"]

if HAS_GLUON:

    @gluon.jit
    def _dq_item_meta(w, total, n_q, H, FCnt, FNm, NCS, QPos, Lse2, Delta, Sq, scb, sch, scm, snb, snh, snm,
                      HALF: gl.constexpr, BLOCK_M: gl.constexpr, row_s: gl.constexpr, HAS_COLS: gl.constexpr):
        """:func:`_item_meta` plus the rows' base-2 lse (+inf past the end: p = 0) and delta."""
        cnt, nmask, ncs, q_pos = _item_meta(w, total, n_q, H, FCnt, FNm, NCS, QPos, Sq, scb, sch, scm, snb, snh, snm,
                                            HALF, BLOCK_M, row_s, HAS_COLS)
        ok = w < total
        pid_m, pid_bh = _work_item(w, total // n_q, n_q)
        offs_m = pid_m * BLOCK_M + HALF * (BLOCK_M // 2) + gl.arange(0, BLOCK_M // 2, layout=row_s)
        rm = (offs_m < Sq) & ok
        base = pid_bh.to(gl.int64) * Sq
        lse2 = gl.load(Lse2 + base + offs_m, mask=rm, other=float("inf"))
        delta = gl.load(Delta + base + offs_m, mask=rm, other=0.0)
        return cnt, nmask, ncs, q_pos, lse2, delta

    @gluon.jit
    def _dq_scores(q_smem, do_smem, k_bufs, v_bufs, kpos_bufs, k_ready, v_ready, pos_ready, v_empty, ks, kph, vs,
                   vph, masked, q_pos, lse2_b, delta_b, zero_s, qk_scale, s_layout: gl.constexpr,
                   a_layout: gl.constexpr):
        """dS of one step, synchronously (the first step of a work item): P (dP - delta) as the A operand; frees
        the step's V (K stays: dq += dS K reads it next)."""
        mbarrier.wait(k_ready.index(ks), kph)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(vs), vph)
        dp_tok = warpgroup_mma(do_smem, v_bufs.index(vs).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        if masked:
            mbarrier.wait(pos_ready.index(ks), kph)
            s = _apply_mask(s, kpos_bufs.index(ks), q_pos, s_layout)
        p = gl.exp2(s * qk_scale - lse2_b)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
        mbarrier.arrive(v_empty.index(vs), count=1)
        return gl.convert_layout((p * (dp - delta_b)).to(k_bufs.dtype), a_layout)

    @gluon.jit
    def _dq_consumer(q_bufs, do_bufs, k_bufs, v_bufs, kpos_bufs, q_ready, q_empty, k_ready, v_ready, pos_ready,
                     k_empty, v_empty, DQ, Lse2, Delta, QPos, FCnt, FNm, NCS, qk_scale, sm_scale, Sq, H, n_q, total,
                     scb, sch, scm, snb, snh, snm,
                     HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, HAS_COLS: gl.constexpr, QBUF: gl.constexpr, K_STAGES: gl.constexpr,
                     SNAKE: gl.constexpr):
        """dq of 64 query rows: per step S = Q K^T and dP = dO V^T, dS = P (dP - delta), dq += dS K, the last one
        issued at the start of the next step, ahead of that step's S; the step's dP is issued once it has retired
        (with all four in registers ptxas serialises every wgmma at D=128)."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        it = 0
        t = 0
        w = gl.program_id(0)
        cnt, nmask, ncs, q_pos, lse2, delta = _dq_item_meta(w, total, n_q, H, FCnt, FNm, NCS, QPos, Lse2, Delta, Sq,
                                                            scb, sch, scm, snb, snh, snm, HALF, BLOCK_M, row_s,
                                                            HAS_COLS)
        for i_w in range(_n_items(total, gl.program_id(0), gl.num_programs(0), SNAKE)):
            w = _item(i_w, gl.program_id(0), gl.num_programs(0), SNAKE)
            w_n = _item(i_w + 1, gl.program_id(0), gl.num_programs(0), SNAKE)  # (past the end: zeros)
            nxt = _dq_item_meta(w_n, total, n_q, H, FCnt, FNm, NCS, QPos, Lse2, Delta, Sq,
                                scb, sch, scm, snb, snh, snm, HALF, BLOCK_M, row_s, HAS_COLS)
            pid_m, pid_bh = _work_item(w, total // n_q, n_q)
            row0 = pid_m * BLOCK_M + HALF * (BLOCK_M // 2)
            n_steps = cnt + ncs
            qb = t % QBUF
            q_smem = q_bufs.index(2 * qb + HALF)
            do_smem = do_bufs.index(2 * qb + HALF)
            mbarrier.wait(q_ready.index(qb), (t // QBUF) & 1)
            zero_s = gl.zeros([BLOCK_M // 2, BLOCK_N], gl.float32, s_layout)
            dq = gl.zeros([BLOCK_M // 2, HEAD_DIM], gl.float32, o_layout)
            lse2_b = gl.expand_dims(lse2, 1)
            delta_b = gl.expand_dims(delta, 1)
            if n_steps > 0:
                ks = it % K_STAGES  # K (with its positions) and V rings, as in the forward
                ds_op = _dq_scores(q_smem, do_smem, k_bufs, v_bufs, kpos_bufs, k_ready, v_ready, pos_ready, v_empty,
                                   ks, (it // K_STAGES) & 1, it % STAGES, (it // STAGES) & 1,
                                   (nmask > 0) | (cnt == 0), q_pos, lse2_b, delta_b, zero_s, qk_scale, s_layout,
                                   a_layout)
                for j in range(1, n_steps):
                    prev = ks
                    it += 1
                    ks = it % K_STAGES
                    kph = (it // K_STAGES) & 1
                    vs = it % STAGES
                    # dq += dS_{j-1} K_{j-1} runs on the tensor cores while S_j and dP_j are issued behind it
                    dq_tok = warpgroup_mma(ds_op, k_bufs.index(prev), dq, is_async=True)
                    mbarrier.wait(k_ready.index(ks), kph)
                    s_tok = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), zero_s, use_acc=False,
                                          is_async=True)
                    # wgmma groups retire in order: dq += dS_{j-1} K_{j-1} first, so K_{j-1} is freed (and the load
                    # of K_{j+1} can start) while S_j runs; dP_j is issued only then: with dq, dS_{j-1}, S_j and
                    # dP_j all in registers at once ptxas runs out and serialises every wgmma (D=128)
                    dq, ds_op = warpgroup_mma_wait(num_outstanding=1, deps=(dq_tok, ds_op))
                    mbarrier.arrive(k_empty.index(prev), count=1)  # K_{j-1}: its last reader, dq += dS K, is done
                    mbarrier.wait(v_ready.index(vs), (it // STAGES) & 1)
                    dp_tok = warpgroup_mma(do_smem, v_bufs.index(vs).permute((1, 0)), zero_s, use_acc=False,
                                           is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
                    if (j < nmask) | (j >= cnt):
                        mbarrier.wait(pos_ready.index(ks), kph)
                        s = _apply_mask(s, kpos_bufs.index(ks), q_pos, s_layout)
                    p = gl.exp2(s * qk_scale - lse2_b)
                    dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
                    mbarrier.arrive(v_empty.index(vs), count=1)  # V_j: dP_j was its only reader
                    ds_op = gl.convert_layout((p * (dp - delta_b)).to(k_bufs.dtype), a_layout)
                mbarrier.arrive(q_empty.index(qb), count=1)  # Q and dO no longer read
                dq = warpgroup_mma(ds_op, k_bufs.index(ks), dq)
                mbarrier.arrive(k_empty.index(ks), count=1)
                it += 1
            else:
                mbarrier.arrive(q_empty.index(qb), count=1)
            rows = row0 + gl.arange(0, BLOCK_M // 2, layout=row_o)
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            ptrs = DQ + pid_bh.to(gl.int64) * Sq * HEAD_DIM + gl.expand_dims(rows.to(gl.int64) * HEAD_DIM, 1) \
                + gl.expand_dims(cols, 0)
            dmask = gl.expand_dims(rows < Sq, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
            gl.store(ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=dmask)
            t += 1
            cnt, nmask, ncs, q_pos, lse2, delta = nxt

    @gluon.jit(do_not_specialize=LIST_ARGS)
    def _gl_dq_kernel(q_desc, do_desc, k_desc, v_desc, ck_desc, cv_desc, DQ, Lse2, Delta, QPos, KPos, FIdx, FCnt,
                      FNm, NCS, CPos, ColBits, qk_scale, sm_scale, Sq, Sk, H, GROUP, n_q, total, NCp, J,
                      sfb, sfh, sfm, scb, sch, scm, snb, snh, snm, sbb, sbh, sbm,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, HAS_COLS: gl.constexpr, QBUF: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, K_STAGES: gl.constexpr, SNAKE: gl.constexpr):
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2 * QBUF] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2 * QBUF] + do_desc.block_type.shape, do_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        pos_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        kpos_bufs = gl.allocate_shared_memory(gl.int32, [K_STAGES, BLOCK_N],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        for i in gl.static_range(QBUF):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
        for i in gl.static_range(K_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(pos_ready.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)
        gl.warp_specialize([
            (_producer, (q_desc, do_desc, k_desc, v_desc, ck_desc, cv_desc, q_bufs, do_bufs, k_bufs, v_bufs,
                         kpos_bufs, q_ready, q_empty, k_ready, v_ready, pos_ready, k_empty, v_empty, FIdx, FCnt, FNm,
                         NCS, KPos, CPos, ColBits, Sq, Sk, H, GROUP, n_q, total, NCp, J, sfb, sfh, sfm, scb, sch, scm,
                         snb, snh, snm, sbb, sbh, sbm, BLOCK_M, BLOCK_N, STAGES, HAS_COLS, QBUF, gl.constexpr(True),
                         K_STAGES, SNAKE)),
            (_dq_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, kpos_bufs, q_ready, q_empty, k_ready, v_ready, pos_ready,
                            k_empty, v_empty, DQ, Lse2, Delta, QPos, FCnt, FNm, NCS, qk_scale, sm_scale, Sq, H, n_q,
                            total, scb, sch, scm, snb, snh, snm, gl.constexpr(0), HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                            HAS_COLS, QBUF, K_STAGES, SNAKE)),
            (_dq_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, kpos_bufs, q_ready, q_empty, k_ready, v_ready, pos_ready,
                            k_empty, v_empty, DQ, Lse2, Delta, QPos, FCnt, FNm, NCS, qk_scale, sm_scale, Sq, H, n_q,
                            total, scb, sch, scm, snb, snh, snm, gl.constexpr(1), HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                            HAS_COLS, QBUF, K_STAGES, SNAKE)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])

    @gluon.jit
    def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, qpos_bufs, lse2_bufs,
                       delta_bufs, kv_ready, kv_empty, q_ready, q_empty, row_ready, BIdx, BCnt, QPos, Lse2, Delta,
                       Sq, Sk, H, HKV, GROUP, n_k, total, sib, sih, sin, scb, sch, scn, NPART,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SNAKE: gl.constexpr):
        """Per work item (key tile, batch, KV head, part): the key tile's K/V halves once, then for every query
        head of the group and every query tile of its share of the list (part ``p`` of ``NPART`` equal shares), two
        64-row steps: TMA loads of Q and dO rows, and the rows' positions, base-2 lse and delta written to shared
        memory. Key tiles or, for the gathered columns, 128-slot chunks of a head's gathered rows (``COLS`` in
        :func:`_dkdv_consumer`)."""
        RQ: gl.constexpr = q_desc.block_type.shape[0]  # query rows per step
        row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        offs_r = gl.arange(0, RQ, layout=row_layout)
        BHK = total // (n_k * NPART)
        it = 0
        t = 0
        for i_w in range(_n_items(total, gl.program_id(0), gl.num_programs(0), SNAKE)):
            w = _item(i_w, gl.program_id(0), gl.num_programs(0), SNAKE)
            part = w % NPART
            pid_n = (w // NPART) // BHK  # the first key tiles first: under causality they see the most query tiles
            pid_bk = (w // NPART) % BHK
            b = pid_bk // HKV
            hk = pid_bk % HKV
            mbarrier.wait(kv_empty, (t & 1) ^ 1)
            mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
            row_k = pid_bk * Sk + pid_n * BLOCK_N
            for half in gl.static_range(2):
                tma.async_copy_global_to_shared(k_desc, [row_k + half * (BLOCK_N // 2), 0], kv_ready,
                                                k_bufs.index(half))
                tma.async_copy_global_to_shared(v_desc, [row_k + half * (BLOCK_N // 2), 0], kv_ready,
                                                v_bufs.index(half))
            for g in range(GROUP):
                h = hk * GROUP + g
                base = BIdx + b * sib + h * sih + pid_n * sin
                cnt = gl.load(BCnt + b * scb + h * sch + pid_n * scn)
                lo = cnt * part // NPART
                row_bh = (b * H + h) * Sq
                for i in range(lo * (BLOCK_M // RQ), cnt * (part + 1) // NPART * (BLOCK_M // RQ)):
                    st = it % STAGES
                    mbarrier.wait(q_empty.index(st), ((it // STAGES) & 1) ^ 1)
                    mbarrier.expect(q_ready.index(st), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                    r0 = gl.load(base + i // (BLOCK_M // RQ)) * BLOCK_M + (i % (BLOCK_M // RQ)) * RQ
                    tma.async_copy_global_to_shared(q_desc, [row_bh + r0, 0], q_ready.index(st), q_bufs.index(st))
                    tma.async_copy_global_to_shared(do_desc, [row_bh + r0, 0], q_ready.index(st), do_bufs.index(st))
                    offs = r0 + offs_r
                    ok = offs < Sq
                    qpos_bufs.index(st).store(gl.load(QPos + offs, mask=ok, other=POS_MIN))
                    lse2_bufs.index(st).store(gl.load(Lse2 + row_bh.to(gl.int64) + offs, mask=ok,
                                                      other=float("inf")))
                    delta_bufs.index(st).store(gl.load(Delta + row_bh.to(gl.int64) + offs, mask=ok, other=0.0))
                    mbarrier.arrive(row_ready.index(st), count=1)
                    it += 1
            t += 1

    @gluon.jit
    def _dkdv_consumer(q_bufs, do_bufs, k_bufs, v_bufs, qpos_bufs, lse2_bufs, delta_bufs, kv_ready, kv_empty,
                       q_ready, q_empty, row_ready, DK, DV, KPos, BCnt, BNm, qk_scale, sm_scale, Sk, HKV, GROUP,
                       n_k, total, scb, sch, scn, snb, snh, snn, NPART, BIdx, sib, sih, sin, Bits, sbb, sbh, sbm, J,
                       NC, GQ, HKVQ, BQ,
                       HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, COLS: gl.constexpr, SNAKE: gl.constexpr):
        """dk, dv of 64 keys (half ``HALF`` of the key tile): per 64-row query step S^T = K Q^T and dP^T = V dO^T
        (issued together), P^T = exp2(S^T - lse2), dv += P^T dO, dS^T = P^T (dP^T - delta), dk += dS^T Q.

        ``COLS``: the keys are 64 gathered-column slots of query head h (chunk 2 * tile + HALF of its bit words;
        ``HKV`` = heads, ``GROUP`` = 1, ``KPos`` the heads' slot positions [B * H, Sk]), every step masked by the
        query tile's bit word and ``k_pos <= q_pos``; the partial dk/dv of part ``p`` go to the float32 buffer
        ``DK`` laid out [NPART, GQ, 2, BQ, HKVQ, NC, D] (slots < NC only), summed by the caller."""
        RQ: gl.constexpr = q_bufs.type.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, RQ, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        BHK = total // (n_k * NPART)
        k_smem = k_bufs.index(HALF)
        v_smem = v_bufs.index(HALF)
        slot = gl.arange(0, BLOCK_N // 2, layout=row_s).to(gl.int64)
        it = 0
        t = 0
        for i_w in range(_n_items(total, gl.program_id(0), gl.num_programs(0), SNAKE)):
            w = _item(i_w, gl.program_id(0), gl.num_programs(0), SNAKE)
            part = w % NPART
            pid_n = (w // NPART) // BHK
            pid_bk = (w // NPART) % BHK
            b = pid_bk // HKV
            hk = pid_bk % HKV
            key0 = pid_n * BLOCK_N + HALF * (BLOCK_N // 2)
            offs_k = key0 + gl.arange(0, BLOCK_N // 2, layout=row_s)
            if COLS:
                k_pos = gl.load(KPos + pid_bk.to(gl.int64) * Sk + offs_k)
            else:
                k_pos = gl.load(KPos + offs_k, mask=offs_k < Sk, other=POS_MAX)
            zero_s = gl.zeros([BLOCK_N // 2, RQ], gl.float32, s_layout)
            dk = gl.zeros([BLOCK_N // 2, HEAD_DIM], gl.float32, o_layout)
            dv = gl.zeros([BLOCK_N // 2, HEAD_DIM], gl.float32, o_layout)
            mbarrier.wait(kv_ready, t & 1)
            for g in range(GROUP):
                h = hk * GROUP + g
                cnt = gl.load(BCnt + b * scb + h * sch + pid_n * scn)
                nmask = gl.load(BNm + b * snb + h * snh + pid_n * snn)
                lo = cnt * part // NPART
                for i in range(cnt * (part + 1) // NPART * (BLOCK_M // RQ) - lo * (BLOCK_M // RQ)):
                    st = it % STAGES
                    ph = (it // STAGES) & 1
                    if COLS:  # the step's query tile and its bit word of this half's 64 slots (loaded early)
                        m = gl.load(BIdx + b * sib + h * sih + pid_n * sin + lo + i // (BLOCK_M // RQ))
                        jw = 2 * pid_n + HALF
                        word = gl.load(Bits + b * sbb + h * sbh + m * sbm + jw, mask=jw < J, other=0)
                    mbarrier.wait(q_ready.index(st), ph)
                    q_smem = q_bufs.index(st)
                    do_smem = do_bufs.index(st)
                    st_tok = warpgroup_mma(k_smem, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    dpt_tok = warpgroup_mma(v_smem, do_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    s_t = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))
                    mbarrier.wait(row_ready.index(st), ph)
                    if COLS:
                        q_pos = qpos_bufs.index(st).load(col_s)
                        sel = ((word >> slot) & 1) != 0
                        s_t = gl.where(gl.expand_dims(sel, 1) & (gl.expand_dims(k_pos, 1) <= gl.expand_dims(q_pos, 0)),
                                       s_t, float("-inf"))
                    elif i < nmask * (BLOCK_M // RQ):
                        q_pos = qpos_bufs.index(st).load(col_s)
                        s_t = gl.where(gl.expand_dims(k_pos, 1) <= gl.expand_dims(q_pos, 0), s_t, float("-inf"))
                    lse2 = lse2_bufs.index(st).load(col_s)
                    p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
                    pt_op = gl.convert_layout(p_t.to(q_bufs.dtype), a_layout)
                    dv_tok = warpgroup_mma(pt_op, do_smem, dv, is_async=True)
                    dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok,))  # dP^T done, dv may run on
                    delta = delta_bufs.index(st).load(col_s)
                    ds_op = gl.convert_layout((p_t * (dp_t - gl.expand_dims(delta, 0))).to(q_bufs.dtype), a_layout)
                    dk_tok = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
                    dv, dk, pt_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, pt_op, ds_op))
                    mbarrier.arrive(q_empty.index(st), count=1)
                    it += 1
            mbarrier.arrive(kv_empty, count=1)
            rows = key0 + gl.arange(0, BLOCK_N // 2, layout=row_o)
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            if COLS:  # partials of (part, head g of KV head hk): slab ((part * GQ + g) * 2 + 0 / 1) * BQ * HKVQ + ...
                slab = ((part * GQ + hk % GQ) * 2 * BQ + b) * HKVQ + hk // GQ
                off = gl.expand_dims((slab.to(gl.int64) * NC + rows) * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
                dv_off = off + BQ * HKVQ * NC * HEAD_DIM
                smask = gl.expand_dims(rows < NC, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
            else:
                off = gl.expand_dims((pid_bk.to(gl.int64) * Sk + rows) * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
                dv_off = off
                smask = gl.expand_dims(rows < Sk, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
            gl.store(DK + off, (dk * sm_scale).to(DK.dtype.element_ty), mask=smask)
            gl.store(DV + dv_off, dv.to(DV.dtype.element_ty), mask=smask)
            t += 1

    @gluon.jit(do_not_specialize=LIST_ARGS)
    def _gl_dkdv_kernel(q_desc, do_desc, k_desc, v_desc, DK, DV, QPos, KPos, Lse2, Delta, BIdx, BCnt, BNm,
                        qk_scale, sm_scale, Sq, Sk, H, HKV, GROUP, n_k, total,
                        sib, sih, sin, scb, sch, scn, snb, snh, snn, NPART, Bits, sbb, sbh, sbm, J, NC, GQ, HKVQ, BQ,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, COLS: gl.constexpr, SNAKE: gl.constexpr):
        RQ: gl.constexpr = q_desc.block_type.shape[0]
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        row_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        qpos_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, RQ], row_sl)
        lse2_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, RQ], row_sl)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, RQ], row_sl)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        row_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        mbarrier.init(kv_empty, count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
            mbarrier.init(row_ready.index(i), count=1)
        gl.warp_specialize([
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, qpos_bufs,
                              lse2_bufs, delta_bufs, kv_ready, kv_empty, q_ready, q_empty, row_ready, BIdx, BCnt,
                              QPos, Lse2, Delta, Sq, Sk, H, HKV, GROUP, n_k, total, sib, sih, sin, scb, sch, scn,
                              NPART, BLOCK_M, BLOCK_N, STAGES, SNAKE)),
            (_dkdv_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, qpos_bufs, lse2_bufs, delta_bufs, kv_ready, kv_empty,
                              q_ready, q_empty, row_ready, DK, DV, KPos, BCnt, BNm, qk_scale, sm_scale, Sk, HKV,
                              GROUP, n_k, total, scb, sch, scn, snb, snh, snn, NPART, BIdx, sib, sih, sin, Bits, sbb,
                              sbh, sbm, J, NC, GQ, HKVQ, BQ, gl.constexpr(0), HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                              COLS, SNAKE)),
            (_dkdv_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, qpos_bufs, lse2_bufs, delta_bufs, kv_ready, kv_empty,
                              q_ready, q_empty, row_ready, DK, DV, KPos, BCnt, BNm, qk_scale, sm_scale, Sk, HKV,
                              GROUP, n_k, total, scb, sch, scn, snb, snh, snn, NPART, BIdx, sib, sih, sin, Bits, sbb,
                              sbh, sbm, J, NC, GQ, HKVQ, BQ, gl.constexpr(1), HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                              COLS, SNAKE)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])

    _LAUNCH_DQ, _LAUNCH_DKDV = (Launcher(f) for f in (_gl_dq_kernel, _gl_dkdv_kernel))


def _backward_inputs(which, q, k, v, dout, lse2, delta, q_pos, k_pos, tiles):
    """The checks and layout both Gluon backward kernels need: bf16/fp16 inputs of one dtype, D 64/128, 128 x 128
    tiles, dout / lse2 / delta matching q; contiguous tensors, float32 rows, int32 positions on q's device."""
    B, H, Sq, D = q.shape
    ok = D in (64, 128) and q.dtype in (torch.bfloat16, torch.float16) and tiles.block_m == tiles.block_n == 128
    if not ok or k.dtype != q.dtype or v.dtype != q.dtype or dout.dtype != q.dtype:
        raise ValueError(f"gluon {which}: needs sm_90, bf16/fp16 inputs of one dtype, head dim 64/128 and 128 x 128 "
                         f"tiles; got {q.device} {q.dtype}/{k.dtype}/{v.dtype}/{dout.dtype}, D={D}, tiles "
                         f"{tiles.block_m} x {tiles.block_n}")
    if dout.shape != q.shape or lse2.shape != (B, H, Sq) or delta.shape != (B, H, Sq):
        raise ValueError(f"gluon {which}: dout {tuple(dout.shape)}, lse2 {tuple(lse2.shape)}, delta "
                         f"{tuple(delta.shape)} do not match q {tuple(q.shape)}")
    q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))
    lse2, delta = lse2.float().contiguous(), delta.float().contiguous()
    q_pos = q_pos.to(device=q.device, dtype=torch.int32).contiguous()
    k_pos = k_pos.to(device=q.device, dtype=torch.int32).contiguous()
    return q, k, v, dout, lse2, delta, q_pos, k_pos


def gluon_block_dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse2: torch.Tensor,
    delta: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tiles: TileLists,
    dq_dtype: torch.dtype = torch.float32,
    stages: int = 2,
    k_stages: int = 2,
    consumer_regs: int = 240,
    programs: int | None = None,
    warmup_only: bool = False,
    cache: dict | None = None,
    item_order: str = "strided",
):
    """dq of :func:`mtraining_kernels.vertical_slash.block_backward` (same pairs, 128 x 128 tiles) by a
    warp-specialised Gluon kernel built like :func:`mtraining_kernels.gluon_forward.gluon_block_forward` (``cache``,
    ``k_stages``: as there).
    ``lse2`` (base-2 lse, +inf where a row has no pair) and ``delta`` (rowsum(dout * out)) are the contiguous float32
    [B, H, Sq] rows of the backward's preprocess pass. Returns dq [B, H, Sq, D] in ``dq_dtype``; one program writes
    each row (deterministic)."""
    q, k, v, dout, lse2, delta, q_pos, k_pos = _backward_inputs("dq", q, k, v, dout, lse2, delta, q_pos, k_pos,
                                                                tiles)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    dq = torch.empty(B, H, Sq, D, dtype=dq_dtype, device=q.device)
    n_q = triton.cdiv(Sq, 128)
    total = n_q * B * H
    kd, vd, ckd, cvd, cpos, steps, bits, NCp, J, bstr, has_cols = key_side_args(k, v, k_pos, tiles, H, cache)
    fi, fc, fn = tiles.fwd_idx, tiles.fwd_cnt, tiles.fwd_nmask
    qd, dod = tma_descriptor(q, ROWS, cache, "q"), tma_descriptor(dout, ROWS, cache, "dout")
    args = (qd, dod, kd, vd, ckd, cvd, dq, lse2, delta, q_pos, k_pos, fi, fc, fn, steps, cpos, bits, scale * LOG2E,
            scale, Sq, Sk, H, H // Hkv, n_q, total, NCp, J, *batch_strides(fi), *batch_strides(fc),
            *batch_strides(fn), *bstr)
    meta = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, STAGES=stages, HAS_COLS=has_cols, QBUF=1 if D > 64 else 2,
                CONSUMER_REGS=consumer_regs, K_STAGES=k_stages, SNAKE=snake_order(item_order))
    kernel = launch_persistent(_LAUNCH_DQ, q, total, programs, args, meta, warmup_only)
    return kernel if warmup_only else dq


def gluon_block_dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse2: torch.Tensor,
    delta: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tiles: TileLists,
    grad_dtype: torch.dtype = torch.float32,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    stages: int = 2,
    consumer_regs: int = 240,
    programs: int | None = None,
    warmup_only: bool = False,
    cache: dict | None = None,
    item_order: str = "snake",
):
    """dk, dv of the key TILES of :func:`mtraining_kernels.vertical_slash.block_backward` (the gathered columns' share:
    :func:`gluon_block_dkdv_cols`, or the Triton column kernel), by a warp-specialised Gluon kernel: one work item per
    (key tile, batch, KV head), the K/V tile resident in shared memory, every query head of the group and every query
    tile of its list ``tiles.bwd_idx`` walked 64 rows at a time. One program writes each dk/dv row (deterministic), into
    ``dk`` / ``dv`` when given (contiguous, k's shape; any float dtype), else new ``grad_dtype`` tensors. ``cache``: as
    in :func:`mtraining_kernels.gluon_forward.gluon_block_forward` (the Q and dO descriptors of the dq kernel are
    reused). The default on sm_90 (``KernelConfig.dkdv="auto"``)."""
    q, k, v, dout, lse2, delta, q_pos, k_pos = _backward_inputs("dk/dv", q, k, v, dout, lse2, delta, q_pos,
                                                                k_pos, tiles)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    for name, t in (("dk", dk), ("dv", dv)):
        if t is not None and (t.shape != k.shape or not t.is_contiguous()):
            raise ValueError(f"gluon dk/dv: output {name} {tuple(t.shape)} must be contiguous and shaped like k "
                             f"{tuple(k.shape)}")
    dk = torch.empty(B, Hkv, Sk, D, dtype=grad_dtype, device=q.device) if dk is None else dk
    dv = torch.empty_like(dk) if dv is None else dv
    n_k = triton.cdiv(Sk, 128)
    total = n_k * B * Hkv
    qd, dod = tma_descriptor(q, ROWS, cache, "q"), tma_descriptor(dout, ROWS, cache, "dout")
    kd, vd = tma_descriptor(k, 64, cache, "k"), tma_descriptor(v, 64, cache, "v")
    bi, bc, bn = tiles.bwd_idx, tiles.bwd_cnt, tiles.bwd_nmask
    args = (qd, dod, kd, vd, dk, dv, q_pos, k_pos, lse2, delta, bi, bc, bn, scale * LOG2E, scale, Sq, Sk, H, Hkv,
            H // Hkv, n_k, total, *batch_strides(bi), *batch_strides(bc), *batch_strides(bn), 1, bc, 0, 0, 0, 0, 0, 1,
            1, 1)
    meta = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, STAGES=stages, CONSUMER_REGS=consumer_regs, COLS=False,
                SNAKE=snake_order(item_order))
    kernel = launch_persistent(_LAUNCH_DKDV, q, total, programs, args, meta, warmup_only)
    return kernel if warmup_only else (dk, dv)


def column_query_lists(tiles: TileLists, n_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every 128-slot chunk pair of each head's gathered columns, the query tiles with a bit set in either
    64-slot word, ascending: (lists [B', H', n_pairs, Mq] int32, valid entries first; counts [B', H', n_pairs]
    int32). A few torch ops on the bit words (about eight launches), no host sync."""
    bits = tiles.col_bits
    if bits is None:
        raise ValueError("column_query_lists: the lists have no gathered columns")
    J = bits.shape[-1]
    nz = bits != 0
    if 2 * n_pairs > J:
        nz = torch.nn.functional.pad(nz, (0, 2 * n_pairs - J))
    seen = nz.view(*nz.shape[:-1], n_pairs, 2).any(-1).transpose(-1, -2)  # [B', H', n_pairs, Mq]
    Mq = seen.shape[-1]
    m = torch.arange(Mq, device=bits.device, dtype=torch.int32)
    lists = torch.sort(torch.where(seen, m, m + Mq), dim=-1).values.remainder_(Mq)  # int32
    # the kernel reads a list with unit stride; `seen` is a transposed view, so where/sort may follow its strides
    return lists.contiguous(), seen.sum(-1, dtype=torch.int32)


def gluon_block_dkdv_cols(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse2: torch.Tensor,
    delta: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tiles: TileLists,
    parts: int,
    stages: int = 2,
    consumer_regs: int = 240,
    programs: int | None = None,
    warmup_only: bool = False,
    cache: dict | None = None,
    item_order: str = "strided",
):
    """The gathered columns' share of dk/dv (what ``_vs_bwd_dkdv_cols_kernel`` computes) by the Gluon dk/dv
    kernel run over the columns' dense rows (:func:`gather_columns`, reused from the forward through ``cache``):
    one work item per (128-slot chunk pair, batch, query head, part), the query tiles with a bit in the chunk pair
    (:func:`column_query_lists`) split into ``parts`` equal shares, every step masked by the tile's bit word and
    ``k_pos <= q_pos``. Returns the float32 partials [parts, G, 2, B, Hkv, NC, D] (G = H // Hkv; [.., 0] dk
    already scaled, [.., 1] dv) of the Triton column kernel's layout, to be summed over parts and added by
    ``_dkdv_cols_epilogue_kernel`` (deterministic: one writer per element)."""
    q, k, v, dout, lse2, delta, q_pos, k_pos = _backward_inputs("dk/dv columns", q, k, v, dout, lse2, delta, q_pos,
                                                                k_pos, tiles)
    col_bits = tiles.col_bits
    if tiles.col_idx is None or col_bits is None or col_bits.shape[-1] == 0:
        raise ValueError("gluon dk/dv columns: the lists have no gathered columns")
    B, H, Sq, D = q.shape
    Hkv = k.shape[1]
    NC = tiles.col_idx.shape[-1]
    if cache is not None and "cols" in cache:
        kc, vc, cpos = cache["cols"]
    else:
        kc, vc, cpos, _ = gather_columns(k, v, k_pos, tiles, H)
    NCp = kc.shape[2]
    n_pairs = NCp // 128
    lists, counts = column_query_lists(tiles, n_pairs)
    bits = col_bits if col_bits.stride(-1) == 1 else col_bits.contiguous()
    parts = max(1, int(parts))
    dkvc = torch.empty(parts, H // Hkv, 2, B, Hkv, NC, D, dtype=torch.float32, device=q.device)
    total = n_pairs * B * H * parts
    qd, dod = tma_descriptor(q, ROWS, cache, "q"), tma_descriptor(dout, ROWS, cache, "dout")
    kd, vd = tma_descriptor(kc, 64, cache, "kc"), tma_descriptor(vc, 64, cache, "vc")
    args = (qd, dod, kd, vd, dkvc, dkvc, q_pos, cpos, lse2, delta, lists, counts, counts, scale * LOG2E, scale, Sq,
            NCp, H, H, 1, n_pairs, total, *batch_strides(lists), *batch_strides(counts), *batch_strides(counts), parts,
            bits, *batch_strides(bits), bits.shape[-1], NC, H // Hkv, Hkv, B)
    meta = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, STAGES=stages, CONSUMER_REGS=consumer_regs, COLS=True,
                SNAKE=snake_order(item_order))
    kernel = launch_persistent(_LAUNCH_DKDV, q, total, programs, args, meta, warmup_only)
    return kernel if warmup_only else dkvc
