"""Repeat launches of a Triton / Gluon JIT kernel without the JIT's per-call argument binding.

Why: at 32K tokens and 2% density one forward+backward is ~2 ms of GPU work spread over ~10 kernel launches, so the
host's cost of enqueueing them decides the eager call's time. ``kernel[grid](*args)`` binds and specialises every
argument (tens of microseconds for ~45 arguments) and looks the compiled kernel up before it launches; launching the
compiled kernel directly skips that work.

:class:`Launcher` keeps, per JIT function, the compiled kernels it has launched, under a key that captures
everything the JIT specialises on (Triton 3.6, ``native_specialize_impl``):

- tensors: dtype and whether the address is 16-byte aligned;
- integers: whether the value is 1 (then a compile-time constant), divisible by 16, and i32 / i64 / u64 range;
- floats, bools, None: their kind (bools and None by value);
- host TMA descriptors: dtype, block shape and shared-memory layout;
- the constexpr arguments and launch options by value, the device, and the JIT's debug / instrumentation knobs.

The first call with a key goes through the JIT (which compiles if needed) and records the kernel it returns; later
calls with the same key launch that kernel directly. With a launch hook installed (a profiler such as Proton), every
call goes through the JIT, so the hook sees it. ``tests/unit/test_launch.py`` checks against the JIT itself that equal
keys never map to different compiled kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

__all__ = ["Launcher", "specialization_key"]

_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)


def _arg_key(a: Any):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None:  # (bool before int: a bool is an int)
        return ("c", a)
    if isinstance(a, int):
        rng = 0 if _I32[0] <= a < _I32[1] else 1 if _I64[0] <= a < _I64[1] else 2
        return (a == 1, a % 16 == 0, rng)
    if isinstance(a, float):
        return "f"
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor):  # a host TensorDescriptor (Triton or Gluon)
        return ("desc", base.dtype, tuple(a.block_shape), getattr(a, "layout", None))
    raise TypeError(f"Launcher: no specialisation rule for an argument of type {type(a).__name__}")


def specialization_key(args, meta: dict) -> tuple:
    """The cache key of one launch: every argument's specialisation-relevant features, the constexprs and options
    by value, the device, and the JIT knobs that change what it compiles."""
    return (tuple(_arg_key(a) for a in args), tuple(meta.items()), driver.active.get_current_device(),
            bool(knobs.runtime.debug), getattr(knobs.compilation, "instrumentation_mode", None))


class Launcher:
    """``Launcher(jit_fn)(grid, args, meta)`` launches ``jit_fn[grid](*args, **meta)``, directly after the first time.

    ``args`` are the kernel's leading non-constexpr parameters, positionally and complete; ``meta`` holds the
    remaining (constexpr) parameters by name, plus launch options such as ``num_warps``. Returns the compiled kernel.
    """

    _OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

    def __init__(self, fn) -> None:
        self.fn = fn
        self.names = list(fn.arg_names)
        self.kernels: dict[tuple, Any] = {}
        # the Triton interpreter (TRITON_INTERPRET=1) runs kernels in Python, with no compiled kernel to reuse
        self.direct = hasattr(fn, "device_caches")

    def __call__(self, grid: tuple[int, ...], args: tuple, meta: dict):
        if not self.direct:
            return self.fn[grid](*args, **meta)
        key = specialization_key(args, meta)
        kern = self.kernels.get(key)
        if kern is None or knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None:
            kern = self.fn[grid](*args, **meta)
            if hasattr(kern, "packed_metadata"):  # (a Triton whose compiled kernels differ: always the JIT)
                self.kernels[key] = kern
            return kern
        consts = [meta[n] for n in self.names[len(args):]]
        stream = driver.active.get_current_stream(key[2])
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kern.run(grid[0], g1, g2, stream, kern.function, kern.packed_metadata, None, None, None, *args, *consts)
        return kern

    def lookup(self, args: tuple, meta: dict):
        """The compiled kernel a call with these arguments would launch directly (None before the first such call)."""
        return self.kernels.get(specialization_key(args, meta))
