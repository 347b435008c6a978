"""The direct-launch cache of :mod:`mtraining_kernels.launch`, on CPU: its key must capture everything Triton's JIT
specialises a kernel on, or a repeat launch could run a kernel compiled for other arguments (wrong results), and
nothing the JIT does not specialise on (arguments listed in a kernel's ``do_not_specialize``), or the key would count
more compiled kernels than there are. The check compiles for sm_90 offline (no GPU) and compares with the JIT's own
choice of compiled kernel. Also: the launch-key recorder (:func:`~mtraining_kernels.launch.record_launch_keys`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mtraining_kernels.launch import Launcher, arg_key, param_flags, record_launch_keys

_CHECK = r"""
import json, torch
from mtraining_kernels.testing import gluon
from mtraining_kernels.launch import param_flags, specialization_key
from mtraining_kernels.triton_backward import _bwd_preprocess_kernel as fn
from mtraining_kernels.triton_backward import _dkdv_cols_epilogue_kernel as epi

gluon.install_offline_sm90_target()  # compile for sm_90 without a GPU (no launches)
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
    key = repr(specialization_key(args, meta, param_flags(fn)))
    pairs.append((key, id(kern)))

# a kernel with do_not_specialize arguments (ColIdx, Sk, NC, sib, sih: they come from the pattern): variants of
# those share one compiled kernel; the other arguments still specialise
i32 = torch.zeros(4096, dtype=torch.int32)

def epi_variant(sk=64, nc=64, ci_off=0, sib=0, sih=64, g=2, cast=True, i64=False):
    args = (f32, f32, buf, i32[ci_off:], sk, nc, g, 1, 2, sib, sih)
    if i64:  # an i64 value is another compiled kernel, listed or not
        args = args[:4] + (2**31 + 16,) + args[5:]
    return args, dict(HEAD_DIM=16, BLOCK_K=32, BLOCK_S=256, CH=32, CAST=cast, num_warps=4)

epi_pairs = []
unspecialised = [epi_variant(), epi_variant(sk=1), epi_variant(sk=17), epi_variant(nc=128), epi_variant(nc=1),
                 epi_variant(ci_off=1), epi_variant(ci_off=3), epi_variant(sib=1), epi_variant(sih=33)]
others = [epi_variant(g=1), epi_variant(g=16), epi_variant(cast=False), epi_variant(i64=True)]
for args, meta in unspecialised + others:
    kern = epi.warmup(*args, **meta, grid=(1,))
    epi_pairs.append((repr(specialization_key(args, meta, param_flags(epi))), id(kern)))
print(json.dumps({"pairs": pairs, "epi": epi_pairs, "n_unspecialised": len(unspecialised)}))
"""


def test_equal_keys_mean_the_same_compiled_kernel():
    res = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for pairs in (out["pairs"], out["epi"]):
        kernel_of: dict[str, int] = {}
        for key, kern in pairs:
            # soundness: a key seen before must come with the kernel the JIT chose then
            assert kernel_of.setdefault(key, kern) == kern, f"one key, two compiled kernels: {key}"
        # and exactness: as many keys as compiled kernels (a key never splits what the JIT shares)
        assert len(kernel_of) == len(set(k for _, k in pairs)), "the key tells apart launches the JIT does not"
    # the variants do exercise the specialisations: alignment, value 1, divisibility by 16, i64, dtype, constexpr
    # (the JIT compiled more than a handful of distinct kernels, and the key told them apart)
    assert len(set(k for _, k in out["pairs"])) >= 8
    # do_not_specialize: values 1, 17, 64, 128 and misaligned pointers of the listed arguments, one compiled kernel;
    # another value of an unlisted argument, a constexpr or an i64 value, another kernel each
    n = out["n_unspecialised"]
    epi = out["epi"]
    assert len({k for _, k in epi[:n]}) == 1 and len({key for key, _ in epi[:n]}) == 1
    assert len({k for _, k in epi}) == 1 + len(epi) - n


def test_key_features():
    t = torch.zeros(64, dtype=torch.bfloat16)
    key = arg_key  # the per-argument part of specialization_key (the rest needs a GPU driver for the device)
    assert key(t) != key(t[1:])  # 16-byte alignment
    assert key(t) != key(t.half())  # dtype
    assert key(16) != key(17) and key(1) != key(33) and key(16) != key(2**31 + 16)  # %16, == 1, i32 / i64
    assert key(16) == key(32) and key(0.5) == key(2.0)  # what the JIT does not specialise on shares a key
    assert key(t) == key(torch.zeros(8, dtype=torch.bfloat16))  # sizes are not part of a pointer's key
    assert key(True) == key(False) and key(None) != key(0)  # (a bool argument is a runtime u1 to the JIT)
    # an argument listed in do_not_specialize: only the integer's range, no alignment
    assert key(1, False) == key(16, False) == key(17, False) != key(2**31 + 16, False)
    assert key(t, False) == key(t[1:], False) and key(t, True, False) == key(t[1:], True, False)
    assert key(t, False) != key(t.half(), False)
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


def test_param_flags_follow_do_not_specialize():
    from mtraining_kernels.list_builder import _fwd_lists_kernel
    from mtraining_kernels.triton_forward import _vs_fwd_kernel

    flags = dict(zip(_vs_fwd_kernel.arg_names, param_flags(_vs_fwd_kernel)))
    for name in ("Sk", "J", "FIdx", "ColBits", "sfm", "sbm"):  # from the pattern: never specialised
        assert flags[name] == (False, True), name
    for name in ("Q", "Sq", "sqs", "H"):  # from the model and the sequence: specialised
        assert flags[name] == (True, True), name
    flags = dict(zip(_fwd_lists_kernel.arg_names, param_flags(_fwd_lists_kernel)))
    assert not flags["L"][0] and flags["UAsc"][0]


def test_recorder_collects_keys_of_every_launch():
    calls = []

    class _Interpreted:  # the interpreter's function: names, the decorator's arguments, launches through [grid]
        arg_names = ["X", "N", "BLOCK"]
        kwargs = {"do_not_specialize": ["N"]}

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(a)

    launch = Launcher(_Interpreted())
    x = torch.zeros(64)
    launch((1,), (x, 5), {"BLOCK": 16})  # outside any recorder: nothing recorded, still launched
    with record_launch_keys() as outer:
        launch((1,), (x, 5), {"BLOCK": 16})
        with record_launch_keys() as inner:
            launch((2,), (x, 32), {"BLOCK": 16})  # N is not specialised: the same key
            launch((2,), (x[1:], 1), {"BLOCK": 16})  # X is: another key (alignment)
            launch((2,), (x, 5), {"BLOCK": 32})  # a constexpr: another key
    launch((1,), (x, 5), {"BLOCK": 64})
    assert len(calls) == 6
    assert len(inner["_Interpreted"]) == 3 and outer["_Interpreted"] == inner["_Interpreted"]
