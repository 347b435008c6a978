"""Tooling for the Gluon (sm_90) kernels, apart from the kernels: compile them for sm_90 without a GPU
(:func:`install_offline_sm90_target`), report a compiled kernel's resources (:func:`compile_report`: shared memory,
``setmaxnreg`` counts, wgmma instructions, registers / stack per thread), and ptxas's note when it serialised the
wgmma instructions (:func:`wgmma_serialization_note`). Used by ``tests/unit/test_gluon_kernels.py``,
``tests/unit/test_launch.py`` and the benchmarks (``benchmarks/kernel_sparse.py``, ``benchmarks/gluon_probe.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from ..gluon_backward import gluon_block_dkdv, gluon_block_dkdv_cols, gluon_block_dq
from ..gluon_forward import gluon_block_forward

__all__ = ["compile_report", "install_offline_sm90_target", "wgmma_serialization_note"]


def install_offline_sm90_target() -> None:
    """Let the JIT compile for sm_90 on a machine without a GPU (``warmup`` only; nothing can be launched after
    this in the process: it replaces Triton's active driver)."""
    import importlib

    from triton.backends.compiler import GPUTarget

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

    # the module (loaded if it is not yet); ``triton.runtime.driver`` as an attribute is its ``driver`` object
    importlib.import_module("triton.runtime.driver").driver.set_active(_Offline())


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

    from ..indexing import expand_pattern, pattern_tile_lists

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
    kw: dict[str, Any] = dict(out=torch.zeros_like(q), lse=torch.zeros(1, H, S)) if has_prev else {}
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
    (waits for every wgmma right after issuing it, so nothing overlaps the tensor cores in the warpgroup); None when
    it did not."""
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
