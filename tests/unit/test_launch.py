"""The direct-launch cache of :mod:`mtraining_kernels.launch`, on CPU: its key must capture everything Triton's JIT
specialises a kernel on, or a repeat launch could run a kernel compiled for other arguments (wrong results). The
check compiles for sm_90 offline (no GPU) and compares with the JIT's own choice of compiled kernel."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mtraining_kernels.launch import Launcher, _arg_key

_CHECK = r"""
import json, torch
from mtraining_kernels import gluon_tooling
from mtraining_kernels.launch import specialization_key
from mtraining_kernels.triton_backward import _bwd_preprocess_kernel as fn

gluon_tooling.install_offline_sm90_target()  # compile for sm_90 without a GPU (no launches)
buf = torch.zeros(4096, dtype=torch.bfloat16)
f32 = torch.zeros(4096, dtype=torch.float32)

def variant(sq=64, h=2, out=buf, block=64, lse_off=0, stride=128):
    args = (out, buf, f32[lse_off:], f32, f32, sq, h, stride, stride, 1, stride, stride, 1, 64, 64, 1)
    return args, dict(HEAD_DIM=16, BLOCK=block)

variants = [variant(), variant(sq=4096), variant(sq=63), variant(sq=1), variant(h=1), variant(h=16),
            variant(sq=2**31 + 16), variant(out=buf.half()), variant(out=buf[1:]), variant(out=buf[8:]),
            variant(block=32), variant(lse_off=1), variant(lse_off=4), variant(stride=130), variant(stride=2**31)]
seen, pairs = {}, []
for i, (args, meta) in enumerate(variants):
    kern = fn.warmup(*args, **meta, grid=(1,))
    key = repr(specialization_key(args, meta))
    pairs.append((key, id(kern)))
print(json.dumps(pairs))
"""


def test_equal_keys_mean_the_same_compiled_kernel():
    res = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    pairs = json.loads(res.stdout.strip().splitlines()[-1])
    kernel_of: dict[str, int] = {}
    for key, kern in pairs:
        # soundness: a key seen before must come with the kernel the JIT chose then
        assert kernel_of.setdefault(key, kern) == kern, f"one key, two compiled kernels: {key}"
    # and the variants do exercise the specialisations: alignment, value 1, divisibility by 16, i64, dtype,
    # constexpr (the JIT compiled more than a handful of distinct kernels, and the key told them apart)
    assert len(set(k for _, k in pairs)) >= 8 and len(kernel_of) >= len(set(k for _, k in pairs))


def test_key_features():
    t = torch.zeros(64, dtype=torch.bfloat16)
    key = _arg_key  # the per-argument part of specialization_key (the rest needs a GPU driver for the device)
    assert key(t) != key(t[1:])  # 16-byte alignment
    assert key(t) != key(t.half())  # dtype
    assert key(16) != key(17) and key(1) != key(33) and key(16) != key(2**31 + 16)  # %16, == 1, i32 / i64
    assert key(16) == key(32) and key(0.5) == key(2.0)  # what the JIT does not specialise on shares a key
    assert key(t) == key(torch.zeros(8, dtype=torch.bfloat16))  # sizes are not part of a pointer's key
    assert key(True) != key(False) and key(None) != key(0)
    with pytest.raises(TypeError, match="no specialisation rule"):
        key(object())


def test_launcher_without_compiled_kernels_defers_to_the_jit():
    # the Triton interpreter's functions have no compiled kernels: every call goes through the JIT object
    calls = []

    class _Interpreted:
        arg_names = ["X", "N"]

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    launch = Launcher(_Interpreted())
    assert not launch.direct
    launch((3,), (1,), {"N": 2})
    launch((3,), (1,), {"N": 2})
    assert calls == [((3,), (1,), {"N": 2})] * 2
