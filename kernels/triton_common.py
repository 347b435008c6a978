"""What the Triton vertical-slash kernels share on the device: constants, the arguments never specialised, and the jit
helpers both kernel files call (their launchers' host-side helpers are in :mod:`mtraining_kernels.host`).

The kernels are in :mod:`mtraining_kernels.triton_forward` and :mod:`mtraining_kernels.triton_backward`; the shape
legend and which kernel runs are in :mod:`mtraining_kernels.vertical_slash`. Triton resolves the names a jit
function calls in that function's own module, so each kernel module imports by name the helpers and constants its
kernels use (and a helper here finds its own helpers here).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .host import LOG2E
from .lists import COL_CHUNK

LN2 = tl.constexpr(0.6931471805599453)
LOG2E_C = tl.constexpr(LOG2E)
POS_MAX = tl.constexpr(2**31 - 1)  # position of a key past the end: never visible
POS_MIN = tl.constexpr(-(2**31))  # position of a query past the end: sees nothing
CHUNK = tl.constexpr(COL_CHUNK)  # column slots per bit word
# Bit words per step of the forward and dq kernels' scan for a query tile's last column chunk: a fixed size (not the
# number of words J, which comes from the pattern) so that the launch key does not depend on the pattern
COL_WORDS = 16
# Arguments of the attention kernels that come from the sparse pattern, never specialised (``do_not_specialize``), so
# that one compiled kernel serves every pattern: the key length (a ring step over the pattern's gathered vertical keys
# has as many keys as the pattern has verticals), the number of column bit words, the lists (views of one buffer
# per ring step, at offsets that depend on the list widths) and their strides (the list widths). They only address
# scalar or short loads, which specialisation would not vectorise. A name a kernel does not take is ignored.
LIST_ARGS = [
    "Sk", "J", "FIdx", "FCnt", "FNm", "BIdx", "BCnt", "BNm", "ColIdx", "ColBits",
    "sfb", "sfh", "sfm", "scb", "sch", "scm", "snb", "snh", "snm", "sib", "sih", "sbb", "sbh", "sbm",
]


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
    """1 + the last column chunk with a bit set in this query tile's row of bits (0 if none), reading the J words
    BLOCK_J at a time. Columns are sorted, so the chunks a query tile sees form a prefix; walking [0, end) without a
    branch lets the loads pipeline (a chunk with no bit set inside it, e.g. wholly covered by computed tiles, is
    computed fully masked)."""
    end = 0
    for j0 in range(0, J, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        row = tl.load(bits_base + offs_j, mask=offs_j < J, other=0)
        end = tl.maximum(end, tl.max(tl.where(row != 0, offs_j + 1, 0), 0))
    return end


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
