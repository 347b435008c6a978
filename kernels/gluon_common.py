"""What the Gluon (warp-specialised Hopper, sm_90) kernels of :mod:`mtraining_kernels.gluon_forward` and
:mod:`mtraining_kernels.gluon_backward` share: whether they can run (:func:`gluon_supported`), the persistent
kernels' order of work items, the producer partition of the forward and dq kernels (TMA loads of Q / dO and K / V,
the key positions of masked steps), the per-item list reads of their consumers, host TMA descriptors, the launch of
a persistent kernel, and the copy of the gathered key columns into dense rows that TMA can load
(:func:`gather_columns`, a Triton kernel).

Gluon, like Triton, resolves the names a jit function calls in that function's own module: each kernel module
imports by name the helpers its kernels call.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .host import batch_strides
from .indexing import COL_CHUNK, TileLists
from .launch import Launcher

try:  # Gluon is in Triton >= 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - older Triton
    HAS_GLUON = False

__all__ = [
    "HAS_GLUON", "LIST_ARGS", "gather_columns", "gluon_supported", "key_side_args", "launch_persistent", "snake_order",
    "tma_descriptor",
]

ROWS = 64  # query rows per consumer warpgroup
NUM_WARPS_DEFAULT = 4  # the default partition is the producer (a warpgroup: Gluon needs multiples of 4 warps)
POS_MAX = gl.constexpr(2**31 - 1) if HAS_GLUON else None  # a key past the end: never visible
POS_MIN = gl.constexpr(-(2**31)) if HAS_GLUON else None  # a query past the end: sees nothing
POS_MAX_INT = 2**31 - 1
# Arguments of the Gluon kernels (and the column gather) that come from the sparse pattern, never specialised
# (``do_not_specialize``; see :mod:`mtraining_kernels.launch`), so that one compiled kernel serves every pattern:
# key lengths and work-item counts that follow the columns (the column dk/dv runs over NCp gathered keys, in
# ``total`` items of ``NPART`` parts), column counts and bit words, the lists (and their placeholders, views at
# offsets that depend on the list widths) and their strides. They only address scalar loads and one-element-per-thread
# rows. A name a kernel does not take is ignored.
LIST_ARGS = [
    "Sk", "J", "NC", "NCp", "n_k", "total", "NPART", "FIdx", "FCnt", "FNm", "NCS", "CPos", "ColBits", "BIdx", "BCnt",
    "BNm", "Bits", "CI", "sfb", "sfh", "sfm", "scb", "sch", "scm", "scn", "snb", "snh", "snm", "snn", "sib", "sih",
    "sin", "sbb", "sbh", "sbm",
]
# bit words per step of the column gather's scan for a query tile's last word (fixed: not the pattern's J)
_GATHER_WORDS = 16

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
        wave's lightest. The plain stride (item ``pid + i * nprog``) gives one program the heaviest item of every
        wave, and the dk/dv kernel's items (one key tile, every query head of its group) differ by thousands of
        steps."""
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


def gluon_supported(q: torch.Tensor, tiles: TileLists | None = None) -> bool:
    """Whether the Gluon kernels can run these inputs (Gluon present, a CUDA sm_90 device, bf16/fp16, head dim 64
    or 128, 128 x 128 tiles)."""
    if not HAS_GLUON or q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    return tiles is None or (tiles.block_m == 128 and tiles.block_n == 128)


@functools.cache
def _smem_layout(rows: int, D: int, bf16: bool):
    # the same few layouts on every launch: building one costs ~7 us of host time (measured on CPU), per descriptor
    return gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16 if bf16 else gl.float16)


if HAS_GLUON:
    _DESC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                      if f.default is not dataclasses.MISSING}
    _missing = {f.name for f in dataclasses.fields(TensorDescriptor)} - set(_DESC_DEFAULTS) - {
        "base", "shape", "strides", "block_shape", "layout"}
    if _missing:  # pragma: no cover - a Triton whose descriptor needs more: fail at import, not at launch
        raise ImportError(f"mtraining_kernels.gluon_common: TensorDescriptor needs fields {sorted(_missing)}")


def tma_descriptor(t: torch.Tensor, rows: int, cache: dict | None = None, name: str | None = None):
    """A host TMA descriptor of the contiguous ``t`` seen as ``[-1, D]`` rows, loaded ``rows`` at a time.

    Built without the dataclass's ``__post_init__`` checks (microseconds of host time per descriptor, about 15 per
    fwd+bwd): what they check holds by construction here
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


@triton.jit(do_not_specialize=LIST_ARGS)
def _gather_columns_kernel(K, V, KPos, CI, Bits, KC, VC, CPos, Steps, H, G, NC, NCp, Mq, J,
                           skb, skh, sks, svb, svh, svs, sib, sih, sin, sbb, sbh, sbm,
                           HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_J: tl.constexpr, WORDS_PER_STEP: tl.constexpr):
    """Grid (column blocks + query-tile blocks, B*H). The first cdiv(NCp, BLOCK_C) programs of a head copy
    BLOCK_C gathered key rows of K and V (and their positions; past-the-end slots: zeros, never-visible
    position); the others compute the column steps of BLOCK_R query tiles from their bit words (BLOCK_J at a
    time)."""
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
        last = tl.zeros([BLOCK_R], dtype=tl.int32)  # 1 + the last word with a bit set, BLOCK_J words at a time
        for j0 in range(0, J, BLOCK_J):
            offs_j = j0 + tl.arange(0, BLOCK_J)
            ok = (offs_m[:, None] < Mq) & (offs_j[None, :] < J)
            w = tl.load(Bits + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_j[None, :], mask=ok, other=0)
            last = tl.maximum(last, tl.max(tl.where(w != 0, offs_j[None, :] + 1, 0), axis=1))
        tl.store(Steps + bh.to(tl.int64) * Mq + offs_m, (last + WORDS_PER_STEP - 1) // WORDS_PER_STEP,
                 mask=offs_m < Mq)


_LAUNCH_GATHER = Launcher(_gather_columns_kernel)


def gather_columns(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, tiles: TileLists, H: int,
                   block: int = 128, use_kernel: bool | None = None):
    """The gathered key columns of every query head as dense rows, for TMA: (K_c, V_c [B, H, NCp, D], positions
    [B, H, NCp] int32 (past-the-end slots: zeros and a position no query sees), column steps per query tile
    [B, H, Mq] int32), NCp = NC rounded up to ``block``. A query tile's steps cover its column chunks up to the
    last with a bit set.

    ``use_kernel`` (default: on CUDA) does it in one Triton launch (``_gather_columns_kernel``); otherwise ~15
    torch ops, the reference the kernel is tested against. Those ops' host time would show in short calls, hence
    the kernel."""
    B, Hkv, _, D = k.shape
    ci, bits = tiles.col_idx, tiles.col_bits
    if ci is None or bits is None:
        raise ValueError("gather_columns: the lists have no gathered columns")
    NC = ci.shape[-1]
    NCp = -(-NC // block) * block
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
                              *batch_strides(k), *batch_strides(v), *batch_strides(ci), *batch_strides(bits)),
                       dict(HEAD_DIM=D, BLOCK_C=BLOCK_C, BLOCK_R=BLOCK_R, BLOCK_J=_GATHER_WORDS,
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


def key_side_args(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, tiles: TileLists, H: int,
                   cache: dict | None = None):
    """What the forward and dq kernels take for the key side: K/V descriptors, and the gathered columns
    (descriptors, positions, steps per query tile, bit words, padded count NCp, words J, bit strides; placeholders
    when there are none). With a ``cache`` (one dict per forward+backward of the same k, v, positions and lists) it
    is built once: the dq kernel reuses the forward's gathered columns (kept alive until the backward: 2 * B * H *
    NCp * D elements, e.g. 9.4 MB per layer at 128K with ~1100 columns and 16 heads)."""
    if cache is not None and "key_side" in cache:
        return cache["key_side"]
    kd, vd = tma_descriptor(k, 128, cache, "k"), tma_descriptor(v, 128, cache, "v")
    bits = tiles.col_bits
    res: tuple
    if tiles.col_idx is None or bits is None or bits.shape[-1] == 0:  # no gathered columns
        fc = tiles.fwd_cnt
        res = kd, vd, kd, vd, fc, fc, fc, 0, 0, [0, 0, 0], False
    else:
        kc, vc, cpos, steps = gather_columns(k, v, k_pos, tiles, H)
        if cache is not None:
            cache["cols"] = (kc, vc, cpos)  # for the column dk/dv kernel of the backward
        res = (kd, vd, tma_descriptor(kc, 128), tma_descriptor(vc, 128), cpos, steps, bits, kc.shape[2],
               bits.shape[-1], batch_strides(bits), True)
    if cache is not None:
        cache["key_side"] = res
    return res


def snake_order(item_order: str) -> bool:
    """``item_order`` of the persistent kernels: "snake" (every other wave of work items walked backwards: the
    default of :func:`mtraining_kernels.gluon_backward.gluon_block_dkdv`) or "strided" (program p runs items p,
    p + P, p + 2P, ...: the default of the others). These defaults are ``KernelConfig(item_order="auto")``'s
    choice: snake levels the dk/dv kernel's heavy work items; the dq kernel's items are much smaller, and there the
    plain stride is faster."""
    if item_order not in ("snake", "strided"):
        raise ValueError(f"gluon kernels: item_order={item_order!r}; expected 'snake' or 'strided'")
    return item_order == "snake"


def launch_persistent(launch: Launcher, q: torch.Tensor, total: int, programs: int | None, args: tuple, meta: dict,
                       warmup_only: bool):
    """Launch a persistent kernel on ``programs`` programs (default: one per SM), at most one per work item
    (``total``); with ``warmup_only``, compile it without launching and return the compiled kernel (else None)."""
    grid = (max(1, min(programs or _num_sms(q), total)),)
    if warmup_only:
        return launch.fn.warmup(*args, **meta, num_warps=NUM_WARPS_DEFAULT, grid=grid)
    launch(grid, args, dict(meta, num_warps=NUM_WARPS_DEFAULT))
    return None
