"""Host-side helpers of the kernels' launchers, defined once for the Triton and Gluon files (and the benchmarks that
launch the kernels with their own settings): the log2 constant the kernels' scores use, the strides of tensors that
broadcast over batch and heads, the launch arguments of the tile lists, the soft-cap argument, the 1-D query grid,
how many parts a column block's queries are split into, and the default warp count.

The device (``@triton.jit`` / ``@gluon.jit``) helpers the kernels call stay in :mod:`mtraining_kernels.triton_common`
and :mod:`mtraining_kernels.gluon_common` with Triton's underscore names: a jit function resolves the names it calls
in its own module. Nothing here is jit-compiled; ``triton`` is imported for ``triton.cdiv`` only.
"""

from __future__ import annotations

import torch
import triton

from .lists import TileLists

__all__ = [
    "LOG2E",
    "batch_strides",
    "column_args",
    "column_split",
    "default_num_warps",
    "query_grid",
    "softcap_log2",
    "tile_list_args",
]

LOG2E = 1.4426950408889634  # log2(e): the kernels compute exp2 of scores scaled by scale * log2(e)


def batch_strides(t: torch.Tensor, nd: int = 3) -> list[int]:
    """Strides of the first ``nd`` dims, 0 where the dim has size 1 (lists broadcast over batch and heads)."""
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(nd)]


def tile_list_args(tiles: TileLists, which: str) -> tuple[tuple[torch.Tensor, ...], list[int]]:
    """The ``which`` ("fwd" or "bwd") lists of ``tiles`` as kernel arguments: ``(idx, cnt, nmask)`` and their
    batch / head / tile strides, in that order."""
    idx, cnt, nm = (getattr(tiles, f"{which}_{n}") for n in ("idx", "cnt", "nmask"))
    return (idx, cnt, nm), [*batch_strides(idx), *batch_strides(cnt), *batch_strides(nm)]


def column_args(tiles: TileLists, dummy: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], list[int], int]:
    """The gathered columns of ``tiles`` as kernel arguments: ``((col_idx, col_bits), strides, J)`` with J the bit
    words per query tile; without columns ``dummy`` stands in for both tensors, the strides are 0 and J is 0."""
    if tiles.col_idx is None or tiles.col_bits is None:
        return (dummy, dummy), [0, 0, 0, 0, 0], 0
    ci, cb = tiles.col_idx, tiles.col_bits
    return (ci, cb), [*batch_strides(ci, 2), *batch_strides(cb)], cb.shape[-1]


def softcap_log2(softcap: float | None) -> float:
    """The kernels' ``cap2`` argument: the soft-cap in log2 units (1.0, unused, without one). Raises ``ValueError``
    for a soft-cap that is not a positive number, before any launch."""
    if softcap is None:
        return 1.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(
            f"softcap must be a positive float (scores become softcap * tanh(s / softcap)), got {softcap!r}")
    return float(softcap) * LOG2E


def query_grid(bh: int, sq: int, bm: int, rows: int) -> tuple[int]:
    """1-D grid of the Triton forward / dq kernels: (query tiles * bm / rows) * (batch * heads) programs (the
    order: ``triton_common._query_program``)."""
    return (triton.cdiv(sq, bm) * (bm // rows) * bh,)


def column_split(programs: int, mq: int, device: torch.device) -> int:
    """Query-range parts per column block of the column dk/dv kernels: about 8 programs per SM (CUDA; 1 SM
    elsewhere), parts of at least 16 query tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(triton.cdiv(8 * sms, max(programs, 1)), mq // 16))


def default_num_warps(bm: int, bn: int, d: int) -> int:
    """Warps of a Triton attention kernel whose ``KernelConfig`` names none, for ``bm`` x ``bn`` tiles of head dim
    ``d``."""
    # 8 warps: at 64x64 tiles and D=128, 4 warps spill (255 registers + 200-300 B stack per thread in the
    # forward, dq and dk/dv kernels; cuobjdump --dump-resource-usage on an sm_90 build), 8 warps do not
    # (except dq: 72 B).
    return 8 if d >= 64 else 4
