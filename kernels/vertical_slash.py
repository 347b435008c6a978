"""Vertical-slash sparse attention in Triton: forward and backward over generic tile and column lists.

Shape legend: B batch, H query heads, Hkv key/value heads (GQA: query head h reads KV head h // (H // Hkv); K/V
are never repeated), Sq / Sk query / key lengths (may differ), D head dim (16..256, power of two; 64 and 128
tested), BM / BN query / key tile sizes, gathered key columns in chunks of 64 slots (one int64 bit word each).

Algorithm (flash-attention 2 style, online softmax in base 2):

- Forward, one program per (query tile m, batch b, query head h) (or per ``KernelConfig.q_rows``-row slice of
  one; the last query tiles are launched first): loops over (1) the key tiles of
  ``tiles.fwd_idx[b, h, m]`` that need the token mask ``k_pos <= q_pos`` (and key index < Sk), (2) the key
  tiles that need no mask, (3) the gathered key columns: the slots of ``tiles.col_idx[b, h]`` up to the last
  chunk whose bit word ``tiles.col_bits[b, h, m, j]`` is non-zero, ``KernelConfig.col_step`` (64) slots per
  step; the K/V rows are gathered and the bits plus the token mask select the pairs (no branch on the bits, so
  the loads pipeline). Writes out (q.dtype, or the dtype of a given running ``out``) and the natural-log
  ``lse`` (float32). With a running ``(out, lse)`` given, the block result is merged into it by log-sum-exp
  inside the kernel (in place), for ring use.
- Backward from the FINAL out and lse: a preprocess kernel (``delta = rowsum(dout * out)`` and the base-2 lse),
  then three kernels, no atomics, bit-identical across runs.
  dq: one program per query tile, the forward's loops; written in ``grad_dtype`` directly.
  dk/dv of tiles: one program per (key tile, batch, KV head), looping over the query heads of the group and the
  key-tile-major lists ``tiles.bwd_idx``, a query tile taller than ``KernelConfig.sub_m`` = 64 rows walked 64
  rows at a time in one flat loop; it owns its rows of dk/dv, so it writes them once.
  dk/dv of gathered columns: one program per (``KernelConfig.col_block`` = 128 column slots, batch * query head,
  part p): the query tiles from the first to the last with a bit set in those slots, split evenly over the P
  parts; it writes partials [P, G, B, Hkv, NC, D], summed over the parts (one torch sum, fixed order), and one
  epilogue launch (``_dkdv_cols_epilogue_kernel``: one program per 32 key rows of a KV head) adds them into float32
  dk/dv in a fixed order (the query heads of the group; a head's columns are unique, padding slots add exact zeros)
  and casts the result. Those two launches replaced ~16 torch ops (index arithmetic, one ``index_add_`` per query
  head, a cast) whose host time showed at 32K (``benchmarks/journal/kernels-2026-12-04.md``, "host cost of the
  eager call cut").
  Measured alternatives, not kept (``benchmarks/journal/kernels-2026-12-02.md``, "flat loops" and "Triton list
  builder, branchless column loops"; ``kernels-2026-12-03.md``, "heaviest query tiles first" and "five launch
  options"): dq accumulated inside the dk/dv kernels with float32 atomic adds or TMA reduce-adds (5 matmuls per
  tile pair instead of 7) was 2-16% slower end to end on an H200; 128-slot forward/dq steps were 0.5-11% slower
  (spills); 64-slot column dk/dv programs made the whole call 12-23% slower than 128-slot ones (separate runs); ONE
  forward/dq loop over tiles and columns (every step masked and gathered) was 10-78% slower in the forward; one
  masked loop over the tiles (+21% per tile), the list scalars loaded before Q, delta computed in the dq kernel,
  persistent grids and dk/dv on a second stream concurrent with dq gave nothing or lost. Kept as options, not
  defaults: forward/dq programs of 64 rows and 4 warps (``KernelConfig.q_rows``, ``dq_warps``; 2 programs per SM),
  with 64-key steps, are 2-4% faster at 32K for 2-5% density, within 1.3% at 32K/10% and 128K/2%, and 3-7% slower
  at 32K/20% and 128K/5-20%. Default: the heaviest query tiles are launched first
  (``KernelConfig.heavy_first``: 2-3.4% faster at 128K/20%, 1-1.5% slower at 128K/5-10%, neutral at 32K; kept for
  the densest, slowest calls).

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
import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from mtraining_kernels.indexing import COL_CHUNK, TileLists, dense_tile_lists
from mtraining_kernels.launch import Launcher

__all__ = [
    "DEFAULT_CONFIG",
    "KernelConfig",
    "TritonBlockOp",
    "block_backward",
    "block_forward",
    "vertical_slash_attention",
]

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
LOG2E_C = tl.constexpr(LOG2E)
POS_MAX = tl.constexpr(2**31 - 1)  # position of a key past the end: never visible
POS_MIN = tl.constexpr(-(2**31))  # position of a query past the end: sees nothing
CHUNK = tl.constexpr(COL_CHUNK)  # column slots per bit word

# --------------------------------------------------------------------------------------------------------------
# jit helpers
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _scores(qk, qk_scale, cap2, SOFTCAP: tl.constexpr):
    """Scores in log2 units from the raw products ``qk`` (``qk_scale`` = scale * log2(e)), and, with SOFTCAP,
    ``t = tanh(scale * qk / c)`` for the backward: the capped score ``c * tanh(scale * qk / c)`` is ``cap2 * t``
    with ``cap2`` = c * log2(e). tanh(x) = 1 - 2 / (exp(2x) + 1): +-1 where exp2 overflows or underflows, no NaN.
    Without SOFTCAP the second value is ``qk`` (unused)."""
    if SOFTCAP:
        t = 1.0 - 2.0 / (tl.math.exp2(qk * (2.0 * qk_scale / cap2) * LOG2E_C) + 1.0)
        return cap2 * t, t
    else:
        return qk * qk_scale, qk


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
def _query_program(Sq, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """(query tile, batch * head, row indices) of a forward / dq program on the 1-D grid of (query programs per head)
    x (batch * heads) programs, batch * head fastest: each ROWS-row slice of a BLOCK_M query tile is its own program,
    reading the tile's lists. With HEAVY_FIRST the last query tiles (the most columns visible under causality) are
    launched first, for all heads at once, so the short programs fill the tail of the launch."""
    R: tl.constexpr = BLOCK_M // ROWS
    n_q = tl.cdiv(Sq, BLOCK_M) * R  # query programs per (batch, head)
    pid = tl.program_id(0)
    bh_count = tl.num_programs(0) // n_q
    pid_bh = pid % bh_count
    p = pid // bh_count
    if HEAVY_FIRST:
        p = n_q - 1 - p
    pid_m = p // R
    return pid_m, pid_bh, pid_m * BLOCK_M + (p % R) * ROWS + tl.arange(0, ROWS)


@triton.jit
def _load_rows(base, offs, stride, offs_d, n):
    return tl.load(base + offs[:, None] * stride + offs_d[None, :], mask=offs[:, None] < n, other=0.0)


@triton.jit
def _tile_kv(f_base, i, k_base, v_base, KPos, q_pos, offs_n, offs_d, sks, svs, Sk, BLOCK_N: tl.constexpr,
             SUB_N: tl.constexpr, MASKED: tl.constexpr):
    """K/V of flat-loop step i of a query tile's key-tile list (tile i // R, slice i % R of SUB_N keys) and the mask
    of allowed pairs; unmasked tiles are loaded without bounds checks and return no mask (q_pos, unused)."""
    R: tl.constexpr = BLOCK_N // SUB_N
    offs_k = tl.load(f_base + i // R) * BLOCK_N + (i % R) * SUB_N + offs_n
    if MASKED:
        k = _load_rows(k_base, offs_k, sks, offs_d, Sk)
        v = _load_rows(v_base, offs_k, svs, offs_d, Sk)
        k_pos = tl.load(KPos + offs_k, mask=offs_k < Sk, other=POS_MAX)
        allowed = k_pos[None, :] <= q_pos[:, None]
    else:
        k = tl.load(k_base + offs_k[:, None] * sks + offs_d[None, :])
        v = tl.load(v_base + offs_k[:, None] * svs + offs_d[None, :])
        allowed = q_pos
    return k, v, allowed


@triton.jit
def _col_chunk_end(bits_base, J, BLOCK_J: tl.constexpr):
    """1 + the last column chunk with a bit set in this query tile's row of bits (0 if none). Columns are sorted,
    so the chunks a query tile sees form a prefix; walking [0, end) without a branch lets the loads pipeline (a
    chunk with no bit set inside it, e.g. wholly covered by computed tiles, is computed fully masked)."""
    offs_j = tl.arange(0, BLOCK_J)
    row = tl.load(bits_base + offs_j, mask=offs_j < J, other=0)
    return tl.max(tl.where(row != 0, offs_j + 1, 0), 0)


@triton.jit
def _col_sel(bits_row, j0, J, offs_c, BLOCK_C: tl.constexpr):
    """Which of the column slots ``j0 * 64 + offs_c`` are gathered, from a query tile's row of bit words (one word per
    64-slot chunk; chunks >= J, past the end, select nothing)."""
    if BLOCK_C == CHUNK:  # one word: a scalar load (fewer registers than a vector of words)
        word = tl.load(bits_row + j0, mask=j0 < J, other=0)
        return ((word >> offs_c.to(tl.int64)) & 1) != 0
    else:
        jj = j0 + offs_c // CHUNK
        word = tl.load(bits_row + jj, mask=jj < J, other=0)
        return ((word >> (offs_c % CHUNK).to(tl.int64)) & 1) != 0


@triton.jit
def _gather_cols(c_base, k_base, v_base, KPos, bits_row, j, J, offs_c, offs_d, sks, svs, BLOCK_C: tl.constexpr):
    """K/V rows and positions of column step j (slots j * BLOCK_C + offs_c) of a query tile; unselected slots give
    zero rows and an invisible position. The column indices are loaded independently of the bits (no chain)."""
    sel = _col_sel(bits_row, j * (BLOCK_C // CHUNK), J, offs_c, BLOCK_C)
    cols = tl.load(c_base + j * BLOCK_C + offs_c, mask=j * BLOCK_C + offs_c < J * CHUNK, other=0)
    k = tl.load(k_base + cols[:, None] * sks + offs_d[None, :], mask=sel[:, None], other=0.0)
    v = tl.load(v_base + cols[:, None] * svs + offs_d[None, :], mask=sel[:, None], other=0.0)
    k_pos = tl.load(KPos + cols, mask=sel, other=POS_MAX)
    return k, v, k_pos


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
# configs
# --------------------------------------------------------------------------------------------------------------


def _num_warps(bm: int, bn: int, d: int) -> int:
    # 8 warps: at 64x64 tiles and D=128, 4 warps spill (255 registers + 200-300 B stack per thread in the
    # forward, dq and dk/dv kernels; cuobjdump --dump-resource-usage on an sm_90 build), 8 warps do not
    # (except dq: 72 B).
    return 8 if d >= 64 else 4


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch settings of the kernels (defaults chosen on an H200 by the sweeps of
    ``benchmarks/journal/kernels-2026-12-02.md``; the times they give: ``benchmarks/RESULTS.md``, Kernels).

    Args:
        fwd_warps / bwd_warps: warps per program (None: 8 for head dim >= 64, else 4).
        fwd_stages / bwd_stages: software-pipelining depth of the loops.
        sub_m: query rows per dk/dv step (a taller query tile is walked sub_m rows at a time).
        sub_n: keys per forward / dq step (a wider key tile is walked sub_n keys at a time).
        col_split: programs per gathered-column chunk in the column dk/dv kernel, each taking an equal share of
            the query tiles that see the chunk and writing its own partial sums (None: ~8 programs per SM).
        col_sub_m: query rows per step of the column dk/dv kernel (None: ``sub_m``).
        col_step: gathered column slots per step of the forward and dq kernels (64, 128 or 256: whole 64-slot
            chunks).
        col_block: gathered column slots per program of the column dk/dv kernel (64, 128 or 256).
        q_rows: query rows per forward / dq program (None: the whole query tile). A smaller power of two splits
            each query tile of the lists into tile / q_rows programs (more, shorter programs that need fewer
            registers; the K/V of the tile are then read once per slice).
        dq_warps: warps per dq program (None: ``bwd_warps``).
        heavy_first: launch the forward / dq programs of the last query tiles first (they see the most keys
            under causality), all heads at once, so the short programs run last.
        forward: which forward kernel: "triton" (this module's), "gluon" (the warp-specialised Hopper kernel of
            :mod:`mtraining_kernels.gluon_hopper`; an error where it cannot run), or "auto" (the default: gluon
            where it can run, i.e. sm_90, bf16/fp16, head dim 64/128, 128 x 128 tiles; triton elsewhere, so CPU,
            the interpreter and other GPUs are unchanged). On an H200 the Gluon forward and dq took 5-16% off the
            call when they came, except at 32K/2% (host-bound; ``benchmarks/journal/kernels-2026-12-03.md``,
            "Gluon forward and dq").
        dq: which dq kernel of the backward, the same choice ("triton", "gluon" or "auto" = the default; the
            Gluon one is :func:`mtraining_kernels.gluon_hopper.gluon_block_dq`).
        dkdv: the dk/dv kernel of the key tiles, the same choice ("auto" = the default; the Gluon one is
            :func:`mtraining_kernels.gluon_hopper.gluon_block_dkdv`; ``benchmarks/journal/kernels-2026-12-03.md``,
            "Gluon dk/dv").
        dkdv_cols: the gathered columns' dk/dv, the same choice: "gluon" runs the Gluon dk/dv kernel over the
            columns' dense rows (:func:`mtraining_kernels.gluon_hopper.gluon_block_dkdv_cols`; ``col_split`` parts
            per 128-slot chunk pair), "triton" the Triton column kernel (``col_block``, ``col_sub_m``,
            ``col_split``). On an H200 the Gluon one took 3-9% off 32K calls (CUDA-graph replays and GPU-bound
            rows; ``benchmarks/journal/kernels-2026-12-04.md``, "Gluon column dk/dv").
        k_stages: buffers of the K ring of the Gluon forward and dq kernels (2 or 3; V keeps 2). K is freed as soon
            as a step's scores are computed, so a third buffer lets its load start one more step ahead; at head dim
            128 the kernels then use 231,384 of the 232,448 bytes of shared memory a block may have. Measured on an
            H200 (``benchmarks/journal/kernels-2026-12-04.md``, "K freed early in the forward"): 3 is 4% slower at
            128K/20% and equal elsewhere, so the default is 2; the results are bit-identical either way.
        item_order: the order in which the persistent Gluon kernels' programs take their work items (heaviest
            first): "snake" (every other wave of items walked backwards, so the program that took one wave's
            heaviest item takes the next wave's lightest), "strided" (program p takes items p, p + P, p + 2P, ...:
            the first order) or "auto" (the default: snake for the dk/dv kernel of the key tiles, strided for the
            forward, dq and column dk/dv kernels). On an H200 the strided order gave one dk/dv program the heaviest
            item of every wave (its SMs were busy 88% of its time at 128K/20%); the snake order made dk/dv 5%
            faster and dq 6-8% slower at 128K (``benchmarks/journal/kernels-2026-12-04.md``, "dk/dv load
            imbalance found" and "snake item order for dk/dv"), whose items are ~16x smaller, so "auto" takes
            it only where it pays. Results are bit-identical in every order.
    """

    fwd_warps: int | None = None
    fwd_stages: int = 3
    bwd_warps: int | None = None
    bwd_stages: int = 2
    sub_m: int = 64
    sub_n: int = 128
    col_split: int | None = None
    col_sub_m: int | None = None
    col_step: int = 64
    col_block: int = 128
    q_rows: int | None = None
    dq_warps: int | None = None
    heavy_first: bool = True
    forward: str = "auto"
    dq: str = "auto"
    dkdv: str = "auto"
    k_stages: int = 2
    dkdv_cols: str = "auto"
    item_order: str = "auto"

    def __post_init__(self) -> None:
        if self.item_order not in ("snake", "strided", "auto"):
            raise ValueError(f"KernelConfig.item_order={self.item_order!r}; expected 'snake', 'strided' or 'auto'")
        if self.k_stages not in (2, 3):
            raise ValueError(f"KernelConfig.k_stages={self.k_stages}; expected 2 or 3")
        for name in ("forward", "dq", "dkdv", "dkdv_cols"):
            if getattr(self, name) not in ("triton", "gluon", "auto"):
                raise ValueError(f"KernelConfig.{name}={getattr(self, name)!r}; expected 'triton', 'gluon' or 'auto'")
        for name in ("col_step", "col_block"):
            if getattr(self, name) not in (64, 128, 256):
                raise ValueError(f"KernelConfig.{name}={getattr(self, name)}; expected 64, 128 or 256")
        for name in ("sub_m", "sub_n", "col_sub_m", "q_rows"):
            val = getattr(self, name)
            if val is None and name in ("col_sub_m", "q_rows"):
                continue
            if val < 16 or val & (val - 1):
                raise ValueError(f"KernelConfig.{name}={val}; expected a power of two >= 16")
        if self.col_split is not None and self.col_split < 1:
            raise ValueError(f"KernelConfig.col_split={self.col_split}; expected None or >= 1")

    def order_of(self, kernel: str) -> str:
        """The item order ("snake" or "strided") of one persistent Gluon kernel: "forward", "dq", "dkdv" (the key
        tiles) or "dkdv_cols" (the gathered columns), under ``item_order``."""
        if kernel not in ("forward", "dq", "dkdv", "dkdv_cols"):
            raise ValueError(f"KernelConfig.order_of: kernel={kernel!r}; expected 'forward', 'dq', 'dkdv' or "
                             "'dkdv_cols'")
        if self.item_order != "auto":
            return self.item_order
        return "snake" if kernel == "dkdv" else "strided"


DEFAULT_CONFIG = KernelConfig()

# --------------------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
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


# the JIT's per-call argument binding skipped on repeat launches (mtraining_kernels.launch; host time decides
# short calls such as 32K at 2%: benchmarks/journal/kernels-2026-12-04.md, "host cost of the eager call cut")
_LAUNCH_FWD, _LAUNCH_PRE, _LAUNCH_DQ, _LAUNCH_DKDV, _LAUNCH_COLS, _LAUNCH_EPI = (
    Launcher(fn) for fn in (_vs_fwd_kernel, _bwd_preprocess_kernel, _vs_bwd_dq_kernel, _vs_bwd_dkdv_kernel,
                            _vs_bwd_dkdv_cols_kernel, _dkdv_cols_epilogue_kernel))


def _cap2(softcap: float | None) -> float:
    """The kernels' ``cap2`` argument: the soft-cap in log2 units (1.0, unused, without one)."""
    if softcap is None:
        return 1.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(f"softcap must be a positive float (scores become softcap * tanh(s / softcap)), got {softcap!r}")
    return float(softcap) * LOG2E


def _bstrides(t: torch.Tensor, nd: int = 3) -> list[int]:
    """Strides of the first ``nd`` dims, 0 where the dim has size 1 (lists broadcast over batch and heads)."""
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(nd)]


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


def _list_args(tiles: TileLists, which: str):
    idx, cnt, nm = (getattr(tiles, f"{which}_{n}") for n in ("idx", "cnt", "nmask"))
    return (idx, cnt, nm), [*_bstrides(idx), *_bstrides(cnt), *_bstrides(nm)]


def _col_args(tiles: TileLists, dummy: torch.Tensor):
    if tiles.col_idx is None:
        return (dummy, dummy), [0, 0, 0, 0, 0], 0
    ci, cb = tiles.col_idx, tiles.col_bits
    return (ci, cb), [*_bstrides(ci, 2), *_bstrides(cb)], cb.shape[-1]


def _query_grid(bh: int, sq: int, bm: int, rows: int) -> tuple[int]:
    """1-D grid of the forward / dq kernels: (query tiles * bm / rows) * (batch * heads); see ``_query_program``."""
    return (triton.cdiv(sq, bm) * (bm // rows) * bh,)


def _col_split(programs: int, mq: int, device: torch.device) -> int:
    """Query-range parts per column chunk: about 8 programs per SM (CUDA), parts of >= 16 query tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(triton.cdiv(8 * sms, max(programs, 1)), mq // 16))


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
    from mtraining_kernels.gluon_hopper import gluon_supported

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
    Hkv, Sk = k.shape[1], k.shape[2]
    has_prev = out is not None
    if has_prev != (lse is not None):
        raise ValueError("give both out and lse (a running result) or neither")
    if has_prev and (out.shape != q.shape or lse.shape != (B, H, Sq) or out.stride(-1) != 1):
        raise ValueError(f"running out {tuple(out.shape)} / lse {tuple(lse.shape)} do not match q {tuple(q.shape)}")
    prev_ok = not has_prev or (out.is_contiguous() and lse.dtype == torch.float32)
    if _use_gluon(cfg.forward, "forward", q, tiles, prev_ok, softcap):
        from mtraining_kernels.gluon_hopper import gluon_block_forward

        return gluon_block_forward(q, k, v, q_pos, k_pos, scale, tiles, out, lse, k_stages=cfg.k_stages,
                                   cache=cache, item_order=cfg.order_of("forward"))
    if not has_prev:
        out = torch.empty_like(q)
        lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    BM, BN = tiles.block_m, tiles.block_n
    (fi, fc, fn), fstr = _list_args(tiles, "fwd")
    (ci, cb), cstr, J = _col_args(tiles, fc)
    rows = min(BM, cfg.q_rows or BM)
    sub_n = min(BN, cfg.sub_n)
    _LAUNCH_FWD(
        _query_grid(B * H, Sq, BM, rows),
        (q, k, v, out, lse, q_pos, k_pos, fi, fc, fn, ci, cb, scale * LOG2E, _cap2(softcap), Sq, Sk, H, H // Hkv, J,
         *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *lse.stride(), *fstr, *cstr),
        dict(HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, BLOCK_C=cfg.col_step, SUB_N=sub_n, HAS_COLS=J > 0,
             HAS_PREV=has_prev, BLOCK_J=triton.next_power_of_2(max(J, 1)), ROWS=rows, HEAVY_FIRST=cfg.heavy_first,
             SOFTCAP=softcap is not None, num_warps=cfg.fwd_warps or _num_warps(rows, BN, D), num_stages=cfg.fwd_stages),
    )
    return out, lse


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
    columns' partials in a fixed order (the query heads of the KV group), see ``_dkdv_cols_epilogue_kernel``.
    """
    cfg = config or DEFAULT_CONFIG
    q, k, v, q_pos, k_pos, tiles = _prep(q, k, v, q_pos, k_pos, tiles, block_m, block_n)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = H // Hkv
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    out = out if out.stride(-1) == 1 else out.contiguous()
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != (B, H, Sq):
        raise ValueError(f"out {tuple(out.shape)}, dout {tuple(dout.shape)}, lse {tuple(lse.shape)} do not match q "
                         f"{tuple(q.shape)}")
    gdt = grad_dtype or torch.float32
    gluon_dq = _use_gluon(cfg.dq, "dq", q, tiles, True, softcap)  # (an error for dq='gluon' here, before any launch)
    gluon_dkdv = _use_gluon(cfg.dkdv, "dkdv", q, tiles, True, softcap)
    gluon_cols = tiles.col_idx is not None and _use_gluon(cfg.dkdv_cols, "dkdv_cols", q, tiles, True, softcap)
    cap2, capped = _cap2(softcap), softcap is not None
    delta = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    _LAUNCH_PRE((triton.cdiv(Sq, 64), B * H),
                (out, dout, lse, delta, lse2, Sq, H, *out.stride()[:3], *dout.stride()[:3], *lse.stride()),
                dict(HEAD_DIM=D, BLOCK=64))
    BM, BN = tiles.block_m, tiles.block_n
    has_cols = tiles.col_idx is not None
    dkv = torch.empty(2, B, Hkv, Sk, D, dtype=torch.float32 if has_cols else gdt, device=q.device)
    dk, dv = dkv[0], dkv[1]  # one buffer: the column epilogue reads and writes both in one launch
    sub_m, sub_n = min(BM, cfg.sub_m), min(BN, cfg.sub_n)
    strides = [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3]]
    (fi, fc, fn), fstr = _list_args(tiles, "fwd")
    (ci, cb), cstr, J = _col_args(tiles, fc)
    rows = min(BM, cfg.q_rows or BM)
    if gluon_dq:
        from mtraining_kernels.gluon_hopper import gluon_block_dq

        dq = gluon_block_dq(q, k, v, dout, lse2, delta, q_pos, k_pos, scale, tiles, dq_dtype=gdt,
                            k_stages=cfg.k_stages, cache=cache, item_order=cfg.order_of("dq"))
    else:
        dq = torch.empty(B, H, Sq, D, dtype=gdt, device=q.device)
        _LAUNCH_DQ(
            _query_grid(B * H, Sq, BM, rows),
            (q, k, v, dout, lse2, delta, dq, q_pos, k_pos, fi, fc, fn, ci, cb, scale * LOG2E, cap2, scale, Sq, Sk, H, G, J,
             *strides, *fstr, *cstr),
            dict(HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, BLOCK_C=cfg.col_step, SUB_N=sub_n, HAS_COLS=J > 0,
                 BLOCK_J=triton.next_power_of_2(max(J, 1)), ROWS=rows, HEAVY_FIRST=cfg.heavy_first, SOFTCAP=capped,
                 num_warps=cfg.dq_warps or cfg.bwd_warps or _num_warps(rows, sub_n, D), num_stages=cfg.bwd_stages),
        )
    if gluon_dkdv:
        from mtraining_kernels.gluon_hopper import gluon_block_dkdv

        gluon_block_dkdv(q, k, v, dout, lse2, delta, q_pos, k_pos, scale, tiles, dk=dk, dv=dv, cache=cache,
                         item_order=cfg.order_of("dkdv"))
    else:
        (bi, bc, bn), bstr = _list_args(tiles, "bwd")
        _LAUNCH_DKDV(
            (triton.cdiv(Sk, BN), B * Hkv),
            (q, k, v, dout, lse2, delta, dk, dv, q_pos, k_pos, bi, bc, bn, scale * LOG2E, cap2, scale, Sq, Sk, H, Hkv,
             G, *strides, *bstr),
            dict(HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, SUB_M=sub_m, SOFTCAP=capped,
                 num_warps=cfg.bwd_warps or _num_warps(sub_m, BN, D), num_stages=cfg.bwd_stages),
        )
    if J > 0:
        NC, Mq = J * COL_CHUNK, triton.cdiv(Sq, BM)
        if gluon_cols:
            from mtraining_kernels.gluon_hopper import gluon_block_dkdv_cols

            P = min(cfg.col_split or _col_split(triton.cdiv(NC, 128) * B * H, Mq, q.device), Mq)
            dkvc = gluon_block_dkdv_cols(q, k, v, dout, lse2, delta, q_pos, k_pos, scale, tiles, P, cache=cache,
                                         item_order=cfg.order_of("dkdv_cols"))
        else:
            P = min(cfg.col_split or _col_split(triton.cdiv(NC, cfg.col_block) * B * H, Mq, q.device), Mq)
            col_sub_m = min(BM, cfg.col_sub_m or cfg.sub_m)
            dkvc = torch.empty(P, G, 2, B, Hkv, NC, D, dtype=torch.float32, device=q.device)
            _LAUNCH_COLS(
                (triton.cdiv(NC, cfg.col_block), B * H, P),
                (q, k, v, dout, lse2, delta, dkvc[:, :, 0], dkvc[:, :, 1], q_pos, k_pos, ci, cb, scale * LOG2E,
                 cap2, scale, Sq, Sk, H, G, Mq, NC, P, B * H, *strides, *cstr),
                dict(HEAD_DIM=D, BLOCK_M=BM, BLOCK_C=cfg.col_block, SUB_M=col_sub_m, SOFTCAP=capped,
                     num_warps=cfg.bwd_warps or _num_warps(col_sub_m, COL_CHUNK, D), num_stages=cfg.bwd_stages),
            )
        # the parts summed in a fixed order (torch: parallel over the slots; a first version summed them inside the
        # epilogue, which made the program holding the sink columns a 1-3 ms tail: H200,
        # benchmarks/journal/kernels-2026-12-04.md, "host cost of the eager call cut"), then one launch adds the
        # partials into dkv (float32, in place) and writes the result in the grads' dtype
        part = dkvc.sum(0) if P > 1 else dkvc[0]  # [G, 2, B, Hkv, NC, D]
        res = dkv if gdt == torch.float32 else torch.empty(2, B, Hkv, Sk, D, dtype=gdt, device=q.device)
        _LAUNCH_EPI((triton.cdiv(Sk, 32), B * Hkv),
                    (dkv, part, res, ci, Sk, NC, G, B, Hkv, *cstr[:2]),
                    dict(HEAD_DIM=D, BLOCK_K=32, BLOCK_S=256, CH=32, CAST=res is not dkv, num_warps=4))
        dkv = res
    if dkv.dtype != gdt:  # (lists with an empty column list)
        dkv = dkv.to(gdt)
    return dq, dkv[0], dkv[1]


# --------------------------------------------------------------------------------------------------------------
# autograd Function and block op
# --------------------------------------------------------------------------------------------------------------


def _attention_range():
    """``mtraining::attention`` (``lightning_mtraining._profiling``) while a profiler runs, else nothing."""
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
        # q, k and v alive through the forward: 0.31 GiB a layer at 64K tokens for the Qwen2.5-3B shape, 11.3 GiB
        # over 36 layers (computed), against a measured 14.0 GiB more peak memory for the sparse than the dense
        # Trainer path at 64K (benchmarks/RESULTS.md "Training throughput", before this change; its effect is not
        # yet measured). The recomputed tensors have other addresses, so the descriptors would not be reused
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
    """The ring's per-block op protocol (``lightning_mtraining.attention_ops``) on the Triton kernels.

    ``forward`` returns (out in q.dtype, lse float32); ``backward`` takes the FINAL merged (out, lse) and returns
    float32 (dq, dk, dv). With ``tiles=`` (a sparse ring step's lists, T x T tiles) the kernels compute exactly those
    pairs; without, the tile lists come from :func:`dense_tile_lists` on every call (O((Sq/BM) * (Sk/BN)) torch
    work on the device).
    """

    supports_tiles = True
    supports_softcap = True  # ``softcap=`` on forward / backward / differentiable (the Triton kernels apply it)

    def __init__(self, block_m: int = 64, block_n: int = 64, config: KernelConfig | None = None) -> None:
        self.block_m, self.block_n, self.config = block_m, block_n, config

    def forward(self, q, k, v, q_pos, k_pos, scale, tiles=None, softcap=None):
        return block_forward(q, k, v, q_pos, k_pos, scale, tiles=tiles, block_m=self.block_m, block_n=self.block_n,
                             config=self.config, softcap=softcap)

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
