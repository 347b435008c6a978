"""Launch settings of the vertical-slash kernels (:class:`KernelConfig`): the Triton kernels' warps, stages and step
sizes, and which kernel runs each part of the call (Triton or, on Hopper, Gluon) together with the Gluon kernels'
options. Read by :mod:`mtraining_kernels.vertical_slash` (the dispatch) and the Triton launchers; re-exported there.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT_CONFIG", "KernelConfig"]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch settings of the kernels (the defaults are the fastest found on Hopper; ``benchmarks/kernel_sparse.py
    --configs`` compares settings).

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
            :mod:`mtraining_kernels.gluon_forward`; an error where it cannot run), or "auto" (the default: gluon
            where it can run, i.e. sm_90, bf16/fp16, head dim 64/128, 128 x 128 tiles; triton elsewhere, so CPU,
            the interpreter and other GPUs are unchanged).
        dq: which dq kernel of the backward, the same choice ("triton", "gluon" or "auto" = the default; the
            Gluon one is :func:`mtraining_kernels.gluon_backward.gluon_block_dq`).
        dkdv: the dk/dv kernel of the key tiles, the same choice ("auto" = the default; the Gluon one is
            :func:`mtraining_kernels.gluon_backward.gluon_block_dkdv`).
        dkdv_cols: the gathered columns' dk/dv, the same choice: "gluon" runs the Gluon dk/dv kernel over the
            columns' dense rows (:func:`mtraining_kernels.gluon_backward.gluon_block_dkdv_cols`; ``col_split``
            parts per 128-slot chunk pair), "triton" the Triton column kernel (``col_block``, ``col_sub_m``,
            ``col_split``).
        k_stages: buffers of the K ring of the Gluon forward and dq kernels (2 or 3; V keeps 2). K is freed as soon
            as a step's scores are computed, so a third buffer lets its load start one more step ahead; at head dim
            128 the kernels then use 231,384 of the 232,448 bytes of shared memory a block may have, and 3 is no
            faster, so the default is 2; the results are bit-identical either way.
        item_order: the order in which the persistent Gluon kernels' programs take their work items (heaviest
            first): "snake" (every other wave of items walked backwards, so the program that took one wave's
            heaviest item takes the next wave's lightest), "strided" (program p takes items p, p + P, p + 2P, ...:
            the first order) or "auto" (the default: snake for the dk/dv kernel of the key tiles, strided for the
            forward, dq and column dk/dv kernels). The strided order gives one dk/dv program the heaviest item of
            every wave, which the snake order levels; the other kernels' items are much smaller and run faster
            strided. Results are bit-identical in every order.
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
