"""The half-precision rule the kernels are held to, shared by the GPU tests and ``benchmarks/kernel_precision.py``.

A kernel's error against a float32 reference must be at most twice the error of the same computation done by torch
at the kernel's precision (:func:`~mtraining_kernels.testing.references.attention_chunked_ref` with ``dtype``
bfloat16 or float16, float32 accumulation inside matmuls), plus a floor for outputs whose torch error is itself ~0
(1e-3 in bfloat16, scaled by the ratio of the dtypes' machine epsilons for float16: 1.25e-4).
:func:`check_half_precision` applies it to any (out, dq, dk, dv); :func:`half_precision_case` runs one fwd+bwd of the
kernels on a fixed pattern (:func:`random_pattern`) and applies it; :data:`HALF_PRECISION_CASES` are the cases the
float16 GPU test and the precision report run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..config import KernelConfig
from ..reference import vertical_slash_mask
from .references import attention_chunked_ref

__all__ = [
    "HALF_PRECISION_CASES", "check_half_precision", "half_precision_case", "half_precision_floor", "kernel_config",
    "max_abs_errors", "random_pattern",
]

# (S, D, tile size, KernelConfig spec) of the float16 GPU test; benchmarks/kernel_precision.py reports their margins
HALF_PRECISION_CASES = [(8191, 128, 128, ""), (8191, 64, 128, ""), (8191, 128, 64, ""),
                        (32767, 128, 128, "item_order=snake")]


def max_abs_errors(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> list[float]:
    """Max abs difference of each tensor of ``got`` from its partner in ``ref``, in float32."""
    return [(g.float() - r.float()).abs().max().item() for g, r in zip(got, ref)]


def half_precision_floor(dtype: torch.dtype) -> float:
    """The rule's absolute floor at ``dtype``: 1e-3 in bfloat16, scaled by the ratio of machine epsilons."""
    return 1e-3 * torch.finfo(dtype).eps / torch.finfo(torch.bfloat16).eps


def check_half_precision(got, q, k, v, dout, mask_rows, scale: float, dtype: torch.dtype, what: str = "kernel",
                         softcap: float | None = None) -> tuple[list[float], list[float]]:
    """Assert the rule for ``got = (out, dq, dk, dv)`` computed from ``q, k, v, dout`` (in ``dtype``) over the
    pairs ``mask_rows(r0, r1)`` (see :func:`attention_chunked_ref`); returns the max abs errors against float32 of
    ``got`` and of torch at ``dtype``. Raises ``AssertionError`` naming the gradient, both errors and the floor."""
    ref = attention_chunked_ref(q, k, v, dout, mask_rows, scale, torch.float32, softcap=softcap)
    same = attention_chunked_ref(q, k, v, dout, mask_rows, scale, dtype, softcap=softcap)
    names = ("out", "dq", "dk", "dv")
    ref4, same4 = (ref[0], *ref[2:]), (same[0], *same[2:])
    err = max_abs_errors(got, ref4)
    err_torch = max_abs_errors(same4, ref4)
    floor = half_precision_floor(dtype)
    for n, e, et in zip(names, err, err_torch):
        assert e <= 2 * et + floor, f"{n}: {what} error {e:.3e} > 2 x torch {dtype} error {et:.3e} + {floor:.1e}"
    return err, err_torch


def random_pattern(B: int, G: int, S: int, n_vertical: int, slashes: Sequence[int], seed: int,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A test pattern ``(vertical_idx, slash_idx)``, each [B, G, n]: ``n_vertical`` random key positions (the first
    four the sinks 0-3) from a CPU generator seeded ``seed``, and the diagonal offsets ``slashes``, of which heads
    1.. drop the last (per-head budgets), on ``device``."""
    g = torch.Generator().manual_seed(seed)
    vi = torch.randint(0, S, (B, G, n_vertical), generator=g)
    vi[..., :4] = torch.arange(4)  # sinks
    si = torch.tensor(slashes).expand(B, G, -1).clone()
    si[:, 1:, -1] = -1  # per-head different budgets: later heads drop their last slash
    return vi.to(device), si.to(device)


def kernel_config(spec: str) -> KernelConfig:
    """A :class:`~mtraining_kernels.config.KernelConfig` from ``"key=value,..."`` (kernel names and
    ``item_order`` as strings, the other fields as ints), as the GPU tests and the precision report name them."""
    items = (i.partition("=") for i in spec.split(","))
    kw: dict = {key: val if key in ("forward", "dq", "dkdv", "dkdv_cols", "item_order") else int(val)
                for key, _, val in items}
    return KernelConfig(**kw)


def half_precision_case(S: int, D: int, block: int | tuple[int, int], config=None, *,
                        dtype: torch.dtype = torch.bfloat16, softcap: float | None = None, q_gain: float = 1.0,
                        attention: Callable | None = None) -> tuple[list[float], list[float]]:
    """One fwd+bwd of the kernels held to the rule on CUDA; returns the max abs errors of (out, dq, dk, dv) against
    float32 for the kernels and for torch at ``dtype``.

    Qwen2.5-3B attention heads (16 query, 2 KV), head dim ``D``, ``S`` tokens (seed 0, q scaled by ``q_gain``),
    300 verticals and six slashes (:func:`random_pattern`, seed ``S``), tiles ``block`` (T or (BM, BN)).
    The kernels run through ``vertical_slash_attention`` with ``config`` and ``softcap``, or, if given,
    ``attention(q, k, v, vertical_idx, slash_idx, block) -> out`` (the tests pass the public ``sparse_attention``).
    """
    from ..indexing import expand_pattern, pattern_tile_lists
    from ..vertical_slash import vertical_slash_attention

    torch.manual_seed(0)
    B, H, Hkv = 1, 16, 2
    q, k, v, dout = (torch.randn(B, h, S, D, device="cuda", dtype=dtype) for h in (H, Hkv, Hkv, H))
    q = q * q_gain
    vi, si = random_pattern(B, Hkv, S, 300, [0, 1, 64, 100, 1000, 3333], seed=S, device="cuda")
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    vih, sih = expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv)
    bm, bn = (block, block) if isinstance(block, int) else block
    if attention is not None:
        out = attention(qg, kg, vg, vi, si, block)
    else:
        out = vertical_slash_attention(qg, kg, vg, pattern_tile_lists(vih, sih, S, bm, bn), config=config,
                                       softcap=softcap)
    out.backward(dout)

    def mask_rows(r0, r1):
        return vertical_slash_mask(vih, sih, S, bm, rows=(r0, r1), block_n=bn)

    return check_half_precision((out, qg.grad, kg.grad, vg.grad), q, k, v, dout, mask_rows, D**-0.5, dtype,
                                softcap=softcap)
