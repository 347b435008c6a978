"""Probe: a warp-specialised Hopper matmul in Gluon (Triton 3.6's low-level dialect), the building blocks that an
FA3-style vertical-slash kernel needs (the Triton kernels run each step's matmuls and softmax serially: ncu on an
H200, ``benchmarks/journal/kernels-2026-12-03.md``, "five launch options"; overlapping them takes hand-scheduled
warps).

One 1-warp producer partition issues TMA loads of A and B tiles into a ring of STAGES shared-memory buffers
(``ready`` / ``empty`` mbarriers per stage); the default partition (``num_warps`` warps, one or two warpgroups)
runs ``warpgroup_mma`` on each stage and stores C by TMA. bf16 in, fp32 accumulate, bf16 out.

Commands::

    python benchmarks/gluon_probe.py --compile-only   # no GPU: compile for sm_90 and print the resources
    python benchmarks/gluon_probe.py --out runs/gluon_probe.json   # GPU: check against torch, time both
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K, BK: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    for i in range(gl.cdiv(K, BK)):
        s = i % S
        mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)  # a fresh barrier counts as phase 1 complete
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [off_n, i * BK], ready.index(s), b_bufs.index(s))


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, c_desc, off_m, off_n, K, BM: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, num_warps: gl.constexpr):
    S: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN, 16])
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    for i in range(gl.cdiv(K, BK)):
        s = i % S
        mbarrier.wait(ready.index(s), (i // S) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def ws_matmul_kernel(a_desc, b_desc, c_desc, K, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    off_m = gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, c_desc, off_m, off_n, K, BM, BN, BK, num_warps)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K, BK)),
    ], [1], [24])


def _descs(A, B, C, BM, BN, BK):
    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))
    return desc(A, [BM, BK]), desc(B, [BN, BK]), desc(C, [BM, BN])


def ws_matmul(A, B, BM=128, BN=128, BK=64, stages=4, num_warps=8, warmup_only=False):
    """C = A @ B.T for bf16 A [M, K], B [N, K] (M, N multiples of the tiles)."""
    M, K = A.shape
    N = B.shape[0]
    C = torch.empty(M, N, dtype=torch.bfloat16, device=A.device)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    a, b, c = _descs(A, B, C, BM, BN, BK)
    if warmup_only:
        return ws_matmul_kernel.warmup(a, b, c, K, stages, num_warps=num_warps, grid=grid)
    ws_matmul_kernel[grid](a, b, c, K, stages, num_warps=num_warps)
    return C


CONFIGS = [(128, 128, 64, 4, 4), (128, 128, 64, 4, 8), (128, 256, 64, 3, 8)]  # BM, BN, BK, stages, warps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--out", default="gluon_probe.json")
    args = ap.parse_args()
    rows = []
    if args.compile_only:
        from mtraining_kernels.testing.gluon import install_offline_sm90_target

        install_offline_sm90_target()
        A = torch.empty(1024, 1024, dtype=torch.bfloat16)
        for BM, BN, BK, st, w in CONFIGS:
            k = ws_matmul(A, A, BM, BN, BK, st, w, warmup_only=True)
            ptx = k.asm["ptx"]
            print(f"BM={BM} BN={BN} BK={BK} stages={st} warps={w}: smem={k.metadata.shared} "
                  f"setmaxnreg={'setmaxnreg' in ptx} wgmma/iter={ptx.count('wgmma.mma_async')}")
        return
    S = args.size
    torch.manual_seed(0)
    A, B = (torch.randn(S, S, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = (A.float() @ B.float().T)
    flops = 2 * S**3
    t_torch = triton.testing.do_bench(lambda: A @ B.T, warmup=50, rep=300, return_mode="median")
    print(f"torch.matmul {S}^3 bf16: {t_torch:.3f} ms, {flops / t_torch / 1e9:.0f} TFLOP/s", flush=True)
    rows.append({"kernel": "torch.matmul", "ms": t_torch, "tflops": flops / t_torch / 1e9})
    for BM, BN, BK, st, w in CONFIGS:
        try:
            C = ws_matmul(A, B, BM, BN, BK, st, w)
            err = ((C.float() - ref).abs().max() / ref.abs().max()).item()
            t = triton.testing.do_bench(lambda: ws_matmul(A, B, BM, BN, BK, st, w), warmup=50, rep=300,
                                        return_mode="median")
            row = {"kernel": f"gluon ws BM={BM} BN={BN} BK={BK} stages={st} warps={w}", "ms": t,
                   "tflops": flops / t / 1e9, "max_rel_err": err}
        except Exception as e:  # noqa: BLE001 - a config that fails is a result too
            row = {"kernel": f"gluon ws BM={BM} BN={BN} BK={BK} stages={st} warps={w}", "error": repr(e)[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    info = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
