"""An FA3-style forward of the vertical-slash kernel in Gluon (Triton 3.6), Hopper (sm_90) only.

Why: the Triton forward runs each step's two matmuls and its softmax one after the other in every warp (ncu:
tensor pipe 46% busy at 128K/20%, 25% at 32K/2% on an H200; the hardware counters of
``benchmarks/journal/kernels-2026-12-03.md``, "five launch options"), and each program's load-Q / first-tile /
store chain is serial with the next program's on the SM. This kernel is scheduled by hand:

- one program per SM (persistent), walking the (query tile, batch * head) work items heaviest first;
- a producer partition (the default warpgroup, 24 registers per thread) issues TMA loads of the next work items'
  Q (two buffers), of the key tiles of ``tiles.fwd_idx`` and then of the query tile's gathered-column chunks
  (a K ring of ``K_STAGES`` and a V ring of ``STAGES`` buffers, one "ready" and one "empty" mbarrier per buffer),
  so loads run ahead of the math across work items; for every masked step it also writes the step's key
  positions into shared memory (a gathered column the query tile did not select gets a position no query sees),
  so the consumers mask by one compare. The consumers free a K buffer (and its positions) as soon as the step's
  scores are computed, and a V buffer after P V: with one barrier for both, the next load into a buffer waited
  for P V and the consumers then waited for K on every step (10-12% of the forward at 128K on an H200;
  ``benchmarks/journal/kernels-2026-12-04.md``, "K freed early in the forward");
- two consumer partitions (warpgroups, 240 registers per thread), each owning 64 of the 128 query rows, share
  the K/V buffers; within a consumer, the QK^T of step j is issued before step j-1's PV has finished
  (``warpgroup_mma`` is asynchronous): the softmax of step j runs while the tensor cores do PV of step j-1.

Computed pairs: exactly those of :func:`mtraining_kernels.vertical_slash.block_forward`: the key tiles of the
lists, with the token mask ``k_pos <= q_pos`` on the first ``fwd_nmask`` tiles, then the gathered columns whose
bit is set for the query tile (``tiles.col_bits``) and with ``k_pos <= q_pos``. The columns are first copied into
dense per-head rows (:func:`gather_columns`) so that TMA can load them like key tiles. Outputs out (q.dtype) and
natural-log lse (float32); rows with no computed pair get out 0 and lse -inf; a running ``(out, lse)`` is merged
into by log-sum-exp, in place.

Constraints: CUDA sm_90, bf16/fp16, q/k/v contiguous ``[B, H(kv), S, D]`` (copied otherwise), D in {64, 128},
128 x 128 tiles. Key rows past Sk of a ragged last tile are read from the next head's rows (or TMA zero fill at
the very end) and masked by position (such tiles are in the masked part of the lists).
The module also holds the dq and dk/dv kernels built the same way (:func:`gluon_block_dq`,
:func:`gluon_block_dkdv`, and the gathered columns' dk/dv by the same dk/dv kernel: :func:`gluon_block_dkdv_cols`).
Chosen by ``KernelConfig(forward= / dq= / dkdv= / dkdv_cols="auto" | "gluon")``; resources:
:func:`compile_report` (works offline, after :func:`install_offline_sm90_target`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from mtraining_kernels.indexing import COL_CHUNK, TileLists, dense_tile_lists
from mtraining_kernels.launch import Launcher

try:  # Gluon is in Triton >= 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - older Triton
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "column_query_lists", "compile_report", "gather_columns", "gluon_block_dkdv",
           "gluon_block_dkdv_cols", "gluon_block_dq", "gluon_block_forward", "gluon_supported",
           "install_offline_sm90_target", "wgmma_serialization_note"]

LOG2E = 1.4426950408889634
ROWS = 64  # query rows per consumer warpgroup
NUM_WARPS_DEFAULT = 4  # the default partition is the producer (a warpgroup: Gluon needs multiples of 4 warps)
POS_MAX = gl.constexpr(2**31 - 1) if HAS_GLUON else None  # a key past the end: never visible
POS_MIN = gl.constexpr(-(2**31)) if HAS_GLUON else None  # a query past the end: sees nothing
POS_MAX_INT = 2**31 - 1

if HAS_GLUON:

    @gluon.jit
    def _n_items(total, pid, nprog, SNAKE: gl.constexpr):
        """How many of the ``total`` work items program ``pid`` of ``nprog`` runs under :func:`_item`'s order."""
        if SNAKE:
            full = total // nprog
            slot = pid + (full % 2) * (nprog - 1 - 2 * pid)  # its position in the last, partial wave
            n = full + (slot < total % nprog).to(gl.int32)
        else:
            n = (total - pid + nprog - 1) // nprog
        return n

    @gluon.jit
    def _item(i, pid, nprog, SNAKE: gl.constexpr):
        """The work item of program ``pid``'s ``i``-th iteration: waves of ``nprog`` items, every other wave walked
        backwards. Work items come heaviest first, so a program that took a wave's heaviest item takes the next
        wave's lightest. The plain stride (item ``pid + i * nprog``) gave one program the heaviest item of every
        wave: at 128K/20% the dk/dv kernel's items (one key tile, 8 query heads) differ by up to ~3,300 steps,
        and its SMs were busy 88% of the kernel (ncu on an H200;
        ``benchmarks/journal/kernels-2026-12-04.md``, "dk/dv load imbalance found")."""
        if SNAKE:
            w = i * nprog + pid + (i % 2) * (nprog - 1 - 2 * pid)
        else:  # KernelConfig(item_order="strided"): the only order before the snake order was added
            w = pid + i * nprog
        return w

    @gluon.jit
    def _work_item(w, BH, n_q):
        """(query tile, batch * head) of work item w: batch * head fastest, the last query tiles first."""
        return n_q - 1 - w // BH, w % BH

    @gluon.jit
    def _load_rows_tma(is_tile, desc, col_desc, row, bar, buf):
        """TMA load of BLOCK_N rows into ``buf``, completing on ``bar``: rows of ``desc`` (a key tile of the lists)
        or of ``col_desc`` (gathered columns); both have the same block, so one expected byte count."""
        mbarrier.expect(bar, desc.block_type.nbytes)
        if is_tile:
            tma.async_copy_global_to_shared(desc, [row, 0], bar, buf)
        else:
            tma.async_copy_global_to_shared(col_desc, [row, 0], bar, buf)

    @gluon.jit
    def _producer(q_desc, do_desc, k_desc, v_desc, ck_desc, cv_desc, q_bufs, do_bufs, k_bufs, v_bufs, kpos_bufs,
                  q_ready, q_empty, k_ready, v_ready, pos_ready, k_empty, v_empty, FIdx, FCnt, FNm, NCS, KPos, CPos,
                  ColBits, Sq, Sk, H, GROUP, n_q, total, NCp, J, sfb, sfh, sfm, scb, sch, scm, snb, snh, snm, sbb, sbh,
                  sbm, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_COLS: gl.constexpr,
                  QBUF: gl.constexpr, WITH_DO: gl.constexpr, K_STAGES: gl.constexpr, SNAKE: gl.constexpr):
        """TMA loads of Q (and dO: ``WITH_DO``, the dq kernel) into ``QBUF`` buffers and of each step's K/V; for a
        masked step, the keys' positions with unselected gathered columns replaced by a never-visible position (so
        a consumer's mask is one compare), in shared memory."""
        pos_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        offs_n = gl.arange(0, BLOCK_N, layout=pos_layout)
        BH = total // n_q
        it = 0  # global K/V step counter (ring position), as in the consumers
        t = 0  # work items done by this program
        for i_w in range(_n_items(total, gl.program_id(0), gl.num_programs(0), SNAKE)):
            w = _item(i_w, gl.program_id(0), gl.num_programs(0), SNAKE)
            pid_m, pid_bh = _work_item(w, BH, n_q)
            b = pid_bh // H
            h = pid_bh % H
            qb = t % QBUF
            mbarrier.wait(q_empty.index(qb), ((t // QBUF) & 1) ^ 1)  # a fresh barrier passes phase 1
            row_q = pid_bh * Sq + pid_m * BLOCK_M
            if WITH_DO:
                mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(do_desc, [row_q, 0], q_ready.index(qb), do_bufs.index(2 * qb))
                tma.async_copy_global_to_shared(do_desc, [row_q + BLOCK_M // 2, 0], q_ready.index(qb),
                                                do_bufs.index(2 * qb + 1))
            else:
                mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row_q, 0], q_ready.index(qb), q_bufs.index(2 * qb))
            tma.async_copy_global_to_shared(q_desc, [row_q + BLOCK_M // 2, 0], q_ready.index(qb),
                                            q_bufs.index(2 * qb + 1))
            row_k = (b * (H // GROUP) + h // GROUP) * Sk
            row_c = pid_bh * NCp
            f_base = FIdx + b * sfb + h * sfh + pid_m * sfm
            bits_row = ColBits + b * sbb + h * sbh + pid_m * sbm
            cnt = gl.load(FCnt + b * scb + h * sch + pid_m * scm)
            nmask = gl.load(FNm + b * snb + h * snh + pid_m * snm)
            n_steps = cnt
            if HAS_COLS:
                n_steps = cnt + gl.load(NCS + pid_bh * n_q + pid_m)
            for j in range(n_steps):
                ks = it % K_STAGES  # K (and its positions) and V rings: see the consumers
                kph = ((it // K_STAGES) & 1) ^ 1  # a fresh barrier passes phase 1
                vs = it % STAGES
                vph = ((it // STAGES) & 1) ^ 1
                is_tile = j < cnt  # a key tile of the list, else BLOCK_N gathered columns (pre-gathered rows)
                t_idx = gl.load(f_base + j, mask=is_tile, other=0)  # loaded before the wait: off the critical path
                if is_tile:
                    row = row_k + t_idx * BLOCK_N
                else:
                    row = row_c + (j - cnt) * BLOCK_N
                # K and V have their own "empty" barriers: the consumers free K (and the step's positions) as soon
                # as the step's scores are computed, V only after P V, so the next K load starts a step earlier
                mbarrier.wait(k_empty.index(ks), kph)
                _load_rows_tma(is_tile, k_desc, ck_desc, row, k_ready.index(ks), k_bufs.index(ks))
                if j < nmask:
                    o = t_idx * BLOCK_N + offs_n
                    kpos_bufs.index(ks).store(gl.load(KPos + o, mask=o < Sk, other=POS_MAX))
                if HAS_COLS:
                    if j >= cnt:
                        c = j - cnt
                        kp = gl.load(CPos + row_c + c * BLOCK_N + offs_n)
                        wi = c * (BLOCK_N // 64) + offs_n // 64
                        word = gl.load(bits_row + wi, mask=wi < J, other=0)
                        sel = ((word >> (offs_n % 64).to(gl.int64)) & 1) != 0
                        kpos_bufs.index(ks).store(gl.where(sel, kp, POS_MAX))
                mbarrier.arrive(pos_ready.index(ks), count=1)  # every step, so the phases count steps
                mbarrier.wait(v_empty.index(vs), vph)
                _load_rows_tma(is_tile, v_desc, cv_desc, row, v_ready.index(vs), v_bufs.index(vs))
                it += 1
            t += 1

    @gluon.jit
    def _apply_mask(s, kpos_smem, q_pos, s_layout: gl.constexpr):
        kp = kpos_smem.load(gl.SliceLayout(0, s_layout))
        return gl.where(gl.expand_dims(kp, 0) <= gl.expand_dims(q_pos, 1), s, float("-inf"))

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
    def _item_meta(w, total, n_q, H, FCnt, FNm, NCS, QPos, Sq, scb, sch, scm, snb, snh, snm,
                   HALF: gl.constexpr, BLOCK_M: gl.constexpr, row_s: gl.constexpr, HAS_COLS: gl.constexpr):
        """(cnt, nmask, column steps, query positions) of work item w (zeros past the end)."""
        ok = w < total
        pid_m, pid_bh = _work_item(w, total // n_q, n_q)
        b = pid_bh // H
        h = pid_bh % H
        cnt = gl.load(FCnt + b * scb + h * sch + pid_m * scm, mask=ok, other=0)
        nmask = gl.load(FNm + b * snb + h * snh + pid_m * snm, mask=ok, other=0)
        ncs = cnt * 0
        if HAS_COLS:
            ncs = gl.load(NCS + pid_bh * n_q + pid_m, mask=ok, other=0)
        offs_m = pid_m * BLOCK_M + HALF * (BLOCK_M // 2) + gl.arange(0, BLOCK_M // 2, layout=row_s)
        q_pos = gl.load(QPos + offs_m, mask=(offs_m < Sq) & ok, other=POS_MIN)
        return cnt, nmask, ncs, q_pos

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

    @gluon.jit
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
        (with all four in registers ptxas serialised every wgmma at D=128, 7-11% slower at 128K;
        ``benchmarks/journal/kernels-2026-12-04.md``, "dq no longer serialised")."""
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

    @gluon.jit
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

    @gluon.jit
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

def _bstrides(t: torch.Tensor, nd: int = 3) -> list[int]:
    return [t.stride(i) if t.shape[i] > 1 else 0 for i in range(nd)]


def gluon_supported(q: torch.Tensor, tiles: TileLists | None = None) -> bool:
    """Whether the Gluon kernels can run these inputs (Gluon present, a CUDA sm_90 device, bf16/fp16, head dim 64
    or 128, 128 x 128 tiles)."""
    if not HAS_GLUON or q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    return tiles is None or (tiles.block_m == 128 and tiles.block_n == 128)


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, D: int, bf16: bool):
    # the same few layouts on every launch: building one costs ~7 us of host time (measured on CPU), per descriptor
    return gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16 if bf16 else gl.float16)


if HAS_GLUON:
    _DESC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                      if f.default is not dataclasses.MISSING}
    _missing = {f.name for f in dataclasses.fields(TensorDescriptor)} - set(_DESC_DEFAULTS) - {
        "base", "shape", "strides", "block_shape", "layout"}
    if _missing:  # pragma: no cover - a Triton whose descriptor needs more: fail at import, not at launch
        raise ImportError(f"mtraining_kernels.gluon_hopper: TensorDescriptor needs fields {sorted(_missing)}")


def _desc(t: torch.Tensor, rows: int, cache: dict | None = None, name: str | None = None):
    """A host TMA descriptor of the contiguous ``t`` seen as ``[-1, D]`` rows, loaded ``rows`` at a time.

    Built without the dataclass's ``__post_init__`` checks (a descriptor built through the dataclass cost 9.9 us of
    host time on the H200 machine's CPU, ~15 per fwd+bwd: ``benchmarks/journal/kernels-2026-12-04.md``,
    "host cost of the eager call cut"; the saving itself was not timed): what they check holds by construction here
    (contiguous bf16/fp16 rows of a power-of-two D >= 64, so 16-byte strides, an NVMMA layout, a valid block) except
    the base address, checked below. With a ``cache`` (one dict per forward+backward), the descriptor of tensor
    ``name`` is built once and reused."""
    D = t.shape[-1]
    if cache is not None:
        hit = cache.get((name, rows))
        if hit is not None and hit.base.data_ptr() == t.data_ptr() and hit.shape[0] * D == t.numel():
            return hit
    flat = t.view(-1, D)
    if flat.data_ptr() % 16:
        raise ValueError(f"gluon kernels: {name or 'a tensor'} is not 16-byte aligned (address {flat.data_ptr()})")
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(_DESC_DEFAULTS)  # fields this Triton's dataclass adds (with defaults) beyond those below
    desc.base, desc.shape, desc.strides = flat, [flat.shape[0], D], [D, 1]
    desc.block_shape, desc.layout, desc.padding = [rows, D], _smem_layout(rows, D, t.dtype == torch.bfloat16), "zero"
    if cache is not None:
        cache[(name, rows)] = desc
    return desc


@triton.jit
def _gather_columns_kernel(K, V, KPos, CI, Bits, KC, VC, CPos, Steps, H, G, NC, NCp, Mq, J,
                           skb, skh, sks, svb, svh, svs, sib, sih, sin, sbb, sbh, sbm,
                           HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_J: tl.constexpr, WORDS_PER_STEP: tl.constexpr):
    """Grid (column blocks + query-tile blocks, B*H). The first cdiv(NCp, BLOCK_C) programs of a head copy
    BLOCK_C gathered key rows of K and V (and their positions; past-the-end slots: zeros, never-visible
    position); the others compute the column steps of BLOCK_R query tiles from their bit words."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    n_cb = tl.cdiv(NCp, BLOCK_C)
    if pid < n_cb:
        offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        real = offs_c < NC
        ci = tl.load(CI + b * sib + h * sih + offs_c * sin, mask=real, other=0).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        hk = h // G
        kr = tl.load(K + b * skb + hk * skh + ci[:, None] * sks + d[None, :], mask=real[:, None], other=0.0)
        vr = tl.load(V + b * svb + hk * svh + ci[:, None] * svs + d[None, :], mask=real[:, None], other=0.0)
        dst = (bh.to(tl.int64) * NCp + offs_c)[:, None] * HEAD_DIM + d[None, :]
        tl.store(KC + dst, kr)
        tl.store(VC + dst, vr)
        kp = tl.load(KPos + ci, mask=real, other=2147483647)  # past the end: a key no query sees
        tl.store(CPos + bh.to(tl.int64) * NCp + offs_c, kp)
    else:
        offs_m = (pid - n_cb) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_j = tl.arange(0, BLOCK_J)
        ok = (offs_m[:, None] < Mq) & (offs_j[None, :] < J)
        w = tl.load(Bits + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_j[None, :], mask=ok, other=0)
        last = tl.max(tl.where(w != 0, offs_j[None, :] + 1, 0), axis=1)  # 1 + the last word with a bit set
        tl.store(Steps + bh.to(tl.int64) * Mq + offs_m, (last + WORDS_PER_STEP - 1) // WORDS_PER_STEP,
                 mask=offs_m < Mq)


_LAUNCH_GATHER = Launcher(_gather_columns_kernel)
if HAS_GLUON:
    _LAUNCH_FWD, _LAUNCH_DQ, _LAUNCH_DKDV = (Launcher(f) for f in (_gl_fwd_kernel, _gl_dq_kernel, _gl_dkdv_kernel))


def gather_columns(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, tiles: TileLists, H: int,
                   block: int = 128, use_kernel: bool | None = None):
    """The gathered key columns of every query head as dense rows, for TMA: (K_c, V_c [B, H, NCp, D], positions
    [B, H, NCp] int32 (past-the-end slots: zeros and a position no query sees), column steps per query tile
    [B, H, Mq] int32), NCp = NC rounded up to ``block``. A query tile's steps cover its column chunks up to the
    last with a bit set.

    ``use_kernel`` (default: on CUDA) does it in one Triton launch (``_gather_columns_kernel``); otherwise ~15
    torch ops, the reference the kernel is tested against. Those ops' host time (0.48 ms per call at 32K / 2%,
    twice per fwd+bwd) showed in the call's time (``benchmarks/journal/kernels-2026-12-03.md``, "Gluon forward
    and dq"), hence the kernel."""
    B, Hkv, _, D = k.shape
    ci = tiles.col_idx
    NC = ci.shape[-1]
    NCp = -(-NC // block) * block
    bits = tiles.col_bits
    J, Mq = bits.shape[-1], bits.shape[-2]
    if use_kernel is None:
        use_kernel = k.is_cuda
    if use_kernel:
        if k.stride(-1) != 1 or v.stride(-1) != 1 or D & (D - 1):
            raise ValueError(f"gather_columns: needs unit-stride rows and a power-of-two head dim, got D={D}")
        ci = ci if ci.stride(-1) == 1 else ci.contiguous()
        bits = bits if bits.stride(-1) == 1 else bits.contiguous()
        kc = torch.empty(B, H, NCp, D, dtype=k.dtype, device=k.device)
        vc = torch.empty_like(kc)
        cpos = torch.empty(B, H, NCp, dtype=torch.int32, device=k.device)
        steps = torch.empty(B, H, Mq, dtype=torch.int32, device=k.device)
        BLOCK_C, BLOCK_R = 32, 32
        grid = (triton.cdiv(NCp, BLOCK_C) + triton.cdiv(Mq, BLOCK_R), B * H)
        _LAUNCH_GATHER(grid, (k, v, k_pos, ci, bits, kc, vc, cpos, steps, H, H // Hkv, NC, NCp, Mq, J,
                              *_bstrides(k), *_bstrides(v), *_bstrides(ci), *_bstrides(bits)),
                       dict(HEAD_DIM=D, BLOCK_C=BLOCK_C, BLOCK_R=BLOCK_R, BLOCK_J=triton.next_power_of_2(max(J, 1)),
                            WORDS_PER_STEP=block // COL_CHUNK, num_warps=4))
        return kc, vc, cpos, steps
    ci = ci.long().expand(B, H, -1)
    bi = torch.arange(B, device=k.device)[:, None, None]
    hi = (torch.arange(H, device=k.device) // (H // Hkv))[None, :, None]
    kc = k.new_zeros(B, H, NCp, D)
    vc = v.new_zeros(B, H, NCp, D)
    kc[:, :, :NC] = k[bi, hi, ci]
    vc[:, :, :NC] = v[bi, hi, ci]
    cpos = torch.full((B, H, NCp), POS_MAX_INT, dtype=torch.int32, device=k.device)
    cpos[:, :, :NC] = k_pos[ci]
    word = torch.arange(1, J + 1, device=k.device, dtype=torch.int32)
    last = torch.where(bits != 0, word, 0).amax(-1) if J else torch.zeros(bits.shape[:-1], dtype=torch.int32,
                                                                          device=k.device)
    steps = (last + block // COL_CHUNK - 1) // (block // COL_CHUNK)
    steps = steps.expand(B, H, -1).to(torch.int32).contiguous()
    return kc, vc, cpos, steps


def _num_sms(q: torch.Tensor) -> int:
    return torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132


def _key_side_args(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, tiles: TileLists, H: int,
                   cache: dict | None = None):
    """What the forward and dq kernels take for the key side: K/V descriptors, and the gathered columns
    (descriptors, positions, steps per query tile, bit words, padded count NCp, words J, bit strides; placeholders
    when there are none). With a ``cache`` (one dict per forward+backward of the same k, v, positions and lists) it
    is built once: the dq kernel reuses the forward's gathered columns (kept alive until the backward: 2 * B * H *
    NCp * D elements, e.g. 9.4 MB per layer at 128K with ~1100 columns and 16 heads)."""
    if cache is not None and "key_side" in cache:
        return cache["key_side"]
    kd, vd = _desc(k, 128, cache, "k"), _desc(v, 128, cache, "v")
    has_cols = tiles.col_idx is not None and tiles.col_bits.shape[-1] > 0
    if not has_cols:
        fc = tiles.fwd_cnt
        res = kd, vd, kd, vd, fc, fc, fc, 0, 0, [0, 0, 0], False
    else:
        kc, vc, cpos, steps = gather_columns(k, v, k_pos, tiles, H)
        if cache is not None:
            cache["cols"] = (kc, vc, cpos)  # for the column dk/dv kernel of the backward
        bits = tiles.col_bits
        res = (kd, vd, _desc(kc, 128), _desc(vc, 128), cpos, steps, bits, kc.shape[2], bits.shape[-1],
               _bstrides(bits), True)
    if cache is not None:
        cache["key_side"] = res
    return res


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
    (:func:`gather_columns`) so that TMA can load them like key tiles. ``programs``: persistent programs (default:
    one per SM). ``warmup_only`` compiles without launching and returns the compiled kernel. ``cache``: a dict
    shared with the backward of the same call (:func:`gluon_block_dq`, :func:`gluon_block_dkdv`), which then
    reuses the gathered columns and the TMA descriptors built here. ``k_stages``: depth of the K ring (2 or 3;
    V's is ``stages``)."""
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
    grid = (max(1, min(programs or _num_sms(q), total)),)
    kd, vd, ckd, cvd, cpos, steps, bits, NCp, J, bstr, has_cols = _key_side_args(k, v, k_pos, tiles, H, cache)
    fi, fc, fn = tiles.fwd_idx, tiles.fwd_cnt, tiles.fwd_nmask
    qd = _desc(q, ROWS, cache, "q")
    args = (qd, kd, vd, ckd, cvd, out, lse, q_pos, k_pos, fi, fc, fn, steps, cpos, bits, scale * LOG2E, Sq, Sk, H,
            H // Hkv, n_q, total, NCp, J, *out.stride()[:3], *lse.stride(), *_bstrides(fi), *_bstrides(fc),
            *_bstrides(fn), *bstr)
    meta = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, STAGES=stages, HAS_PREV=has_prev, HAS_COLS=has_cols,
                CONSUMER_REGS=consumer_regs, K_STAGES=k_stages, SNAKE=_snake(item_order))
    if warmup_only:
        return _gl_fwd_kernel.warmup(*args, **meta, num_warps=NUM_WARPS_DEFAULT, grid=grid)
    _LAUNCH_FWD(grid, args, dict(meta, num_warps=NUM_WARPS_DEFAULT))
    return out, lse


def _snake(item_order: str) -> bool:
    """``item_order`` of the persistent kernels: "snake" (every other wave of work items walked backwards: the
    default of :func:`gluon_block_dkdv`) or "strided" (program p runs items p, p + P, p + 2P, ...: the default of the
    others). These defaults are ``KernelConfig(item_order="auto")``'s choice: snake made dk/dv 5% faster and dq
    6-8% slower at 128K on an H200 (``benchmarks/journal/kernels-2026-12-04.md``, "snake item order for dk/dv")."""
    if item_order not in ("snake", "strided"):
        raise ValueError(f"gluon kernels: item_order={item_order!r}; expected 'snake' or 'strided'")
    return item_order == "snake"


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
    warp-specialised Gluon kernel built like :func:`gluon_block_forward` (``cache``, ``k_stages``: as there).
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
    grid = (max(1, min(programs or _num_sms(q), total)),)
    kd, vd, ckd, cvd, cpos, steps, bits, NCp, J, bstr, has_cols = _key_side_args(k, v, k_pos, tiles, H, cache)
    fi, fc, fn = tiles.fwd_idx, tiles.fwd_cnt, tiles.fwd_nmask
    qd, dod = _desc(q, ROWS, cache, "q"), _desc(dout, ROWS, cache, "dout")
    args = (qd, dod, kd, vd, ckd, cvd, dq, lse2, delta, q_pos, k_pos, fi, fc, fn, steps, cpos, bits, scale * LOG2E,
            scale, Sq, Sk, H, H // Hkv, n_q, total, NCp, J, *_bstrides(fi), *_bstrides(fc), *_bstrides(fn), *bstr)
    meta = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, STAGES=stages, HAS_COLS=has_cols, QBUF=1 if D > 64 else 2,
                CONSUMER_REGS=consumer_regs, K_STAGES=k_stages, SNAKE=_snake(item_order))
    if warmup_only:
        return _gl_dq_kernel.warmup(*args, **meta, num_warps=NUM_WARPS_DEFAULT, grid=grid)
    _LAUNCH_DQ(grid, args, dict(meta, num_warps=NUM_WARPS_DEFAULT))
    return dq


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
    in :func:`gluon_block_forward` (the Q and dO descriptors of the dq kernel are reused). The default on sm_90
    (``KernelConfig.dkdv="auto"``); GPU checks and timing: ``benchmarks/RESULTS.md``, Kernels, and
    ``benchmarks/journal/kernels-2026-12-03.md``, "Gluon dk/dv"."""
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
    grid = (max(1, min(programs or _num_sms(q), total)),)
    qd, dod = _desc(q, ROWS, cache, "q"), _desc(dout, ROWS, cache, "dout")
    kd, vd = _desc(k, 64, cache, "k"), _desc(v, 64, cache, "v")
    bi, bc, bn = tiles.bwd_idx, tiles.bwd_cnt, tiles.bwd_nmask
    args = (qd, dod, kd, vd, dk, dv, q_pos, k_pos, lse2, delta, bi, bc, bn, scale * LOG2E, scale, Sq, Sk, H, Hkv,
            H // Hkv, n_k, total, *_bstrides(bi), *_bstrides(bc), *_bstrides(bn), 1, bc, 0, 0, 0, 0, 0, 1, 1, 1)
    meta = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, STAGES=stages, CONSUMER_REGS=consumer_regs, COLS=False,
                SNAKE=_snake(item_order))
    if warmup_only:
        return _gl_dkdv_kernel.warmup(*args, **meta, num_warps=NUM_WARPS_DEFAULT, grid=grid)
    _LAUNCH_DKDV(grid, args, dict(meta, num_warps=NUM_WARPS_DEFAULT))
    return dk, dv


def column_query_lists(tiles: TileLists, n_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every 128-slot chunk pair of each head's gathered columns, the query tiles with a bit set in either
    64-slot word, ascending: (lists [B', H', n_pairs, Mq] int32, valid entries first; counts [B', H', n_pairs]
    int32). A few torch ops on the bit words (about eight launches), no host sync."""
    bits = tiles.col_bits
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
    if tiles.col_idx is None or tiles.col_bits.shape[-1] == 0:
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
    bits = tiles.col_bits if tiles.col_bits.stride(-1) == 1 else tiles.col_bits.contiguous()
    parts = max(1, int(parts))
    dkvc = torch.empty(parts, H // Hkv, 2, B, Hkv, NC, D, dtype=torch.float32, device=q.device)
    total = n_pairs * B * H * parts
    grid = (max(1, min(programs or _num_sms(q), total)),)
    qd, dod = _desc(q, ROWS, cache, "q"), _desc(dout, ROWS, cache, "dout")
    kd, vd = _desc(kc, 64, cache, "kc"), _desc(vc, 64, cache, "vc")
    args = (qd, dod, kd, vd, dkvc, dkvc, q_pos, cpos, lse2, delta, lists, counts, counts, scale * LOG2E, scale, Sq,
            NCp, H, H, 1, n_pairs, total, *_bstrides(lists), *_bstrides(counts), *_bstrides(counts), parts, bits,
            *_bstrides(bits), bits.shape[-1], NC, H // Hkv, Hkv, B)
    meta = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, STAGES=stages, CONSUMER_REGS=consumer_regs, COLS=True,
                SNAKE=_snake(item_order))
    if warmup_only:
        return _gl_dkdv_kernel.warmup(*args, **meta, num_warps=NUM_WARPS_DEFAULT, grid=grid)
    _LAUNCH_DKDV(grid, args, dict(meta, num_warps=NUM_WARPS_DEFAULT))
    return dkvc


def install_offline_sm90_target() -> None:
    """Let the JIT compile for sm_90 on a machine without a GPU (``warmup`` only; nothing can be launched after
    this in the process: it replaces Triton's active driver)."""
    import sys

    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver as _  # noqa: F401 - make sure the module is loaded

    class _Offline:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

    sys.modules["triton.runtime.driver"].driver.set_active(_Offline())


def compile_report(head_dim: int = 128, has_cols: bool = True, has_prev: bool = False,
                   kernel: str = "forward") -> dict:
    """Compile the kernel for sm_90 (on the GPU, or offline: call :func:`install_offline_sm90_target` first) and
    report its resources: shared memory (bytes), the ``setmaxnreg`` register counts of the partitions, wgmma
    instructions, cuobjdump's registers / stack per thread, and ``wgmma_serialized``: ptxas's note when it
    serialised the wgmma instructions (None: it did not). ``kernel``: "forward", "dq", "dkdv" or "dkdv_cols" (has_prev:
    forward only; has_cols: not for "dkdv_cols")."""
    import os
    import re
    import subprocess
    import tempfile

    from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists

    S, H, Hkv = 1000, 4, 2
    dt = torch.bfloat16
    q = torch.zeros(1, H, S, head_dim, dtype=dt)
    k = torch.zeros(1, Hkv, S, head_dim, dtype=dt)
    pos = torch.arange(S)
    vi = torch.tensor([[[0, 300, 900], [1, 2, 700]]])
    si = torch.tensor([[[0, 600], [0, 129]]])
    tiles = pattern_tile_lists(expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv), S, 128, 128)
    if not has_cols:
        import dataclasses

        tiles = dataclasses.replace(tiles, col_idx=None, col_bits=None)
    kw = dict(out=torch.zeros_like(q), lse=torch.zeros(1, H, S)) if has_prev else {}
    if kernel == "dq":
        rows = torch.zeros(1, H, S)
        ker = gluon_block_dq(q, k, k, q, rows, rows, pos, pos, 0.1, tiles, warmup_only=True)
    elif kernel == "dkdv":
        rows = torch.zeros(1, H, S)
        ker = gluon_block_dkdv(q, k, k, q, rows, rows, pos, pos, 0.1, tiles, warmup_only=True)
    elif kernel == "dkdv_cols":
        rows = torch.zeros(1, H, S)
        ker = gluon_block_dkdv_cols(q, k, k, q, rows, rows, pos, pos, 0.1, tiles, 2, warmup_only=True)
    else:
        ker = gluon_block_forward(q, k, k, pos, pos, 0.1, tiles, warmup_only=True, **kw)
    ptx = ker.asm["ptx"]
    rep = {"shared": ker.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
           "setmaxnreg": [int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)]}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ker.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    rep["registers"], rep["stack"] = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    rep["wgmma_serialized"] = wgmma_serialization_note(ptx)
    return rep


def wgmma_serialization_note(ptx: str) -> str | None:
    """What ``ptxas -v`` (Triton's bundled one, sm_90a) says when it serialised the wgmma instructions of ``ptx``
    (waits for every wgmma right after issuing it, so nothing overlaps the tensor cores in the warpgroup: the
    Gluon dq kernel's D=128 build was so, and 7-11% slower at 128K, until fixed:
    ``benchmarks/journal/kernels-2026-12-04.md``, "dq no longer serialised"); None when it did not."""
    import os
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    notes = [ln.strip() for ln in (log.stdout + log.stderr).splitlines() if "serialized" in ln]
    return notes[0] if notes else None
