"""Every kernel launch of this package: repeat launches of a Triton / Gluon JIT kernel without the JIT's per-call
argument binding, and a record of the launch keys (how many compiled specialisations the data asked for).

Why direct launches: at 32K tokens and 2% density one forward+backward is ~2 ms of GPU work spread over ~10 kernel
launches, so the host's cost of enqueueing them decides the eager call's time. ``kernel[grid](*args)`` binds and
specialises every argument (tens of microseconds for ~45 arguments) and looks the compiled kernel up before it
launches; launching the compiled kernel directly skips that work.

:class:`Launcher` keeps, per JIT function, the compiled kernels it has launched, under a key that captures
everything the JIT specialises on (Triton 3.6, ``create_function_from_signature`` and ``native_specialize_impl``):

- tensors: dtype and whether the address is 16-byte aligned (not the alignment for a parameter listed in the
  kernel's ``do_not_specialize`` or ``do_not_specialize_on_alignment``);
- integers: whether the value is 1 (then a compile-time constant) and whether it is divisible by 16, unless the
  parameter is listed in ``do_not_specialize``; always the range: i32, i64 or u64;
- floats: nothing (fp32); bools: nothing (a runtime ``u1``); None: its value (a constexpr);
- host TMA descriptors: dtype, block shape and shared-memory layout;
- the constexpr arguments and launch options by value, the device, and the JIT's debug / instrumentation knobs.

The first call with a key goes through the JIT (which compiles if needed) and records the kernel it returns; later
calls with the same key launch that kernel directly. With a launch hook installed (a profiler such as Proton), every
call goes through the JIT, so the hook sees it. ``tests/unit/test_launch.py`` checks against the JIT itself that equal
keys never map to different compiled kernels, and that arguments listed in ``do_not_specialize`` share a kernel.

Launch keys that do not grow with the data: the kernels list every argument that comes from a pattern (list widths
and their strides, column counts, the pointers of lists that may be views at a data-dependent offset) in
``do_not_specialize``, and take block sizes derived from the data from a small fixed set, so a run compiles a bounded
number of kernels during its first steps and nothing after. :func:`record_launch_keys` collects the keys of every
launch inside a ``with`` block, in the Triton interpreter as well as on the GPU (where :class:`Launcher` would launch
directly), so a test can count the specialisations a sequence of patterns asks for.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

__all__ = ["Launcher", "arg_key", "count_launches", "interpreting", "param_flags", "record_launch_keys",
           "specialization_key"]

_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)

# the active :func:`record_launch_keys` blocks (innermost last); each is {kernel name: set of launch keys}
_RECORDERS: list[dict[str, set]] = []
# the active :func:`count_launches` blocks: each is called with the kernel's name at every launch
_COUNTERS: list[Callable[[str], None]] = []
# launches running in the Triton interpreter right now (their host-side emulation is no part of what a GPU runs)
_INTERPRETING = [0]


def interpreting() -> bool:
    """Whether a kernel is running in the Triton interpreter right now: the torch ops the interpreter issues to emulate
    it (copies of its arguments to and from numpy) are not ops the kernel's caller issues."""
    return _INTERPRETING[0] > 0


def arg_key(a: Any, specialize: bool = True, align: bool = True):
    """The specialisation-relevant features of one argument; ``specialize`` / ``align`` False for a parameter listed
    in the kernel's ``do_not_specialize`` / ``do_not_specialize_on_alignment``."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, specialize and align and a.data_ptr() % 16 == 0)
    if isinstance(a, bool):  # (before int: a bool is an int) a runtime u1, whatever its value
        return "u1"
    if a is None:
        return ("c", None)
    if isinstance(a, int):
        rng = 0 if _I32[0] <= a < _I32[1] else 1 if _I64[0] <= a < _I64[1] else 2
        return (a == 1, a % 16 == 0, rng) if specialize else ("i", rng)
    if isinstance(a, float):
        return "f"
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor):  # a host TensorDescriptor (Triton or Gluon)
        return ("desc", base.dtype, tuple(a.block_shape), getattr(a, "layout", None))
    raise TypeError(f"Launcher: no specialisation rule for an argument of type {type(a).__name__}")


def param_flags(fn) -> tuple[tuple[bool, bool], ...]:
    """Per parameter of the JIT function ``fn``: (specialised, specialised on alignment), i.e. not listed in its
    ``do_not_specialize`` / ``do_not_specialize_on_alignment``. Works for compiled JIT functions (Triton and Gluon)
    and for the interpreter's, which keep the decorator's arguments."""
    params = getattr(fn, "params", None)
    if params is not None:
        return tuple((not p.do_not_specialize, not p.do_not_specialize_on_alignment) for p in params)
    kw = getattr(fn, "kwargs", None) or {}
    dns = kw.get("do_not_specialize") or ()
    dna = kw.get("do_not_specialize_on_alignment") or ()
    return tuple((not (i in dns or n in dns), not (i in dna or n in dna)) for i, n in enumerate(fn.arg_names))


def specialization_key(args, meta: dict, flags: tuple[tuple[bool, bool], ...] | None = None,
                       device: int | None = None) -> tuple:
    """The cache key of one launch: every argument's specialisation-relevant features (``flags``: the kernel's
    :func:`param_flags`; None: every argument specialised), the constexprs and options by value, the device (None:
    the current one) and the JIT knobs that change what it compiles."""
    if flags is None:
        arg_keys = tuple(arg_key(a) for a in args)
    else:
        arg_keys = tuple(arg_key(a, s, al) for a, (s, al) in zip(args, flags))
    dev = driver.active.get_current_device() if device is None else device
    return (arg_keys, tuple(meta.items()), dev, bool(knobs.runtime.debug),
            getattr(knobs.compilation, "instrumentation_mode", None))


def _kernel_name(fn) -> str:
    inner = getattr(fn, "fn", None)
    return getattr(inner, "__name__", None) or getattr(fn, "__name__", None) or type(fn).__name__


@contextlib.contextmanager
def record_launch_keys() -> Iterator[dict[str, set]]:
    """Inside the block, every launch through a :class:`Launcher` (every kernel launch of this package) adds its
    specialisation key to the yielded dict ``{kernel name: set of keys}``: the number of keys of a kernel is the
    number of compiled kernels the JIT needs for those launches (on the GPU or in the Triton interpreter, which
    compiles nothing but is keyed the same way). Blocks may nest; each sees every launch inside it."""
    keys: dict[str, set] = {}
    _RECORDERS.append(keys)
    try:
        yield keys
    finally:
        _RECORDERS[:] = [r for r in _RECORDERS if r is not keys]


@contextlib.contextmanager
def count_launches(on_launch: Callable[[str], None] | None = None) -> Iterator[collections.Counter]:
    """Inside the block, every launch through a :class:`Launcher` (every kernel launch of this package, on the GPU or
    in the Triton interpreter) adds one to the yielded ``Counter`` under the kernel's name, and calls ``on_launch``
    with that name if given. Blocks may nest."""
    counts: collections.Counter = collections.Counter()

    def note(name: str) -> None:
        counts[name] += 1
        if on_launch is not None:
            on_launch(name)

    _COUNTERS.append(note)
    try:
        yield counts
    finally:
        _COUNTERS[:] = [c for c in _COUNTERS if c is not note]


class Launcher:
    """``Launcher(jit_fn)(grid, args, meta)`` launches ``jit_fn[grid](*args, **meta)``, directly after the first time.

    ``args`` are the kernel's leading non-constexpr parameters, positionally and complete; ``meta`` holds the
    remaining (constexpr) parameters by name, plus launch options such as ``num_warps``. Returns the compiled kernel
    (in the Triton interpreter: whatever the interpreter returns).
    """

    _OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

    def __init__(self, fn) -> None:
        self.fn = fn
        self.name = _kernel_name(fn)
        self.names = list(fn.arg_names)
        self.flags = param_flags(fn)
        self.kernels: dict[tuple, Any] = {}
        # the Triton interpreter (TRITON_INTERPRET=1) runs kernels in Python, with no compiled kernel to reuse
        self.direct = hasattr(fn, "device_caches")

    def key(self, args: tuple, meta: dict) -> tuple:
        """The specialisation key of a launch with these arguments (device -1 in the interpreter, which has none)."""
        return specialization_key(args, meta, self.flags, None if self.direct else -1)

    def _record(self, key: tuple) -> None:
        for rec in _RECORDERS:
            rec.setdefault(self.name, set()).add(key)

    def __call__(self, grid: tuple[int, ...], args: tuple, meta: dict):
        for note in _COUNTERS:
            note(self.name)
        if not self.direct:
            if _RECORDERS:
                self._record(self.key(args, meta))
            _INTERPRETING[0] += 1
            try:
                return self.fn[grid](*args, **meta)
            finally:
                _INTERPRETING[0] -= 1
        key = self.key(args, meta)
        if _RECORDERS:
            self._record(key)
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
        return self.kernels.get(self.key(args, meta))

    def compiled(self) -> int:
        """How many kernels the JIT has compiled for this function (its own cache, every device; 0 in the
        interpreter)."""
        caches = getattr(self.fn, "device_caches", None)
        return sum(len(c[0]) for c in caches.values()) if caches else 0
