"""Dense ring attention on one GPU: the simulated ring's per-step and total forward+backward times.

    python benchmarks/ring_dense.py --seq 32768 131072 --world 1 4 8 --ops flex triton --out ring_dense.json

Shape: Qwen2.5-3B attention (16 query heads, 2 KV heads, head dim 128), bf16, batch 1, causal.
Measured in one run, side by side:

- ``sdpa_flash``: single-GPU SDPA with the flash backend (forward+backward): the dense anchor (H100, 16 heads of
  128 at 16K-64K: 305-326 TFLOP/s, where SDPA's default backend, cuDNN, reaches 550-567).
- ``flex_dense``: single-GPU FlexAttention, dense causal BlockMask (compiled), forward+backward.
- ``ring_w1_OP``: the production ``ring_attention`` at world size 1 (no process group), forward+backward, with
  block op OP (``flex``: FlexAttention; ``triton``: this project's Triton kernels, dense tile lists).
- ``sim_wW_OP``: :class:`~lightning_mtraining.ring.simulated.SimulatedRing` with W virtual ranks, striped layout: every
  virtual rank's step kernels timed with CUDA events. ``critical`` = sum over steps of the slowest rank's step
  (what a real ring costs if communication is hidden), ``mean_rank`` = mean over ranks of their total,
  ``imbalance`` = max/mean of the per-rank totals.

FLOPs: 4*S*S*D*H/2 forward for causal attention, x3.5 for forward+backward (the backward does 2.5 times the
forward's matmul work: dq, dk, dv and the recomputed scores). For the ring the same
useful FLOPs are divided by the critical path times W (it is W GPUs' worth of time).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from lightning_mtraining import ring_attention
from lightning_mtraining.core.layouts import shard_sequence
from lightning_mtraining.ring.block_ops import FlexBlockOp
from lightning_mtraining.ring.simulated import SimulatedRing

H, HKV, D = 16, 2, 128


def flops(seq: int) -> float:
    return 4 * seq * seq * D * H / 2 * 3.5


def bench(fn, reps: int) -> float:
    """Median wall time (ms) of fn() over reps runs after one warm-up, synchronised."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def inputs(seq: int):
    g = torch.Generator(device="cuda").manual_seed(seq)
    q = torch.randn(1, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, HKV, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, HKV, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def fwd_bwd(attn, q, k, v, do):
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = attn(qq, kk, vv)
    out.backward(do)


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def make_ops(names):
    ops = {}
    for name in names:
        if name == "flex":
            ops[name] = FlexBlockOp()
        elif name == "triton":
            from mtraining_kernels.vertical_slash import TritonBlockOp

            ops[name] = TritonBlockOp()
        else:
            raise ValueError(f"unknown op {name!r}")
    return ops


def run(seqs, worlds, reps, block_size, inner, op_names=("flex",), anchors=True):
    rows = []
    flex = FlexBlockOp()
    ops = make_ops(op_names)
    for seq in seqs:
        q, k, v, do = inputs(seq)
        pos = torch.arange(seq, device="cuda")
        base = {"seq": seq, "tflop": flops(seq) / 1e12}
        singles = [("flex_dense", lambda a, b, c: flex.differentiable(a, b, c, pos, pos, D**-0.5))]
        if anchors:
            singles.insert(0, ("sdpa_flash", sdpa_flash))
        for op_name, op in ops.items():
            singles.append((f"ring_w1_{op_name}",
                            lambda a, b, c, op=op: ring_attention(a, b, c, block_size=block_size, op=op)))
        for name, attn in singles:
            try:
                ms = bench(lambda: fwd_bwd(attn, q, k, v, do), reps)
                rows.append({**base, "variant": name, "world": 1, "ms": ms, "tflops": flops(seq) / ms / 1e9})
            except torch.OutOfMemoryError as e:
                rows.append({**base, "variant": name, "world": 1, "error": f"OOM: {e}"[:200]})
            torch.cuda.empty_cache()
        for (op_name, op), w in ((o, w) for o in ops.items() for w in worlds):
            if seq % (w * block_size):
                continue
            sim = SimulatedRing(w, "striped", block_size, inner_size=min(inner, w), op=op, time_steps=True)
            douts = [shard_sequence(do, 2, r, w, "striped", block_size) for r in range(w)]
            try:
                def once():
                    sim.timings.clear()
                    sim.forward(q, k, v)
                    sim.backward(douts)
                total = bench(once, reps)
                per_rank = [sum(t for (r, _, _), t in sim.timings.items() if r == rank) for rank in range(w)]
                steps = [max(sim.timings[(r, s, ph)] for r in range(w)) for s in range(w) for ph in ("fwd", "bwd")]
                critical = sum(steps)
                step_fwd = [max(sim.timings[(r, s, "fwd")] for r in range(w)) for s in range(w)]
                step_bwd = [max(sim.timings[(r, s, "bwd")] for r in range(w)) for s in range(w)]
                mean_rank = statistics.mean(per_rank)
                rows.append({**base, "variant": f"sim_w{w}_{op_name}", "world": w, "ms": critical, "sim_wall_ms": total,
                             "mean_rank_ms": mean_rank, "imbalance": max(per_rank) / mean_rank,
                             "step_fwd_ms": step_fwd, "step_bwd_ms": step_bwd,
                             "tflops": flops(seq) / (critical * w) / 1e9})
            except torch.OutOfMemoryError as e:
                rows.append({**base, "variant": f"sim_w{w}_{op_name}", "world": w, "error": f"OOM: {e}"[:200]})
            sim = None  # freed before the next world size (a del would leave the name unbound for ruff)
            torch.cuda.empty_cache()
        q = k = v = do = None  # freed before the next length
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--inner", type=int, default=8, help="ranks per node in the simulated hierarchical ring")
    ap.add_argument("--ops", nargs="+", default=["flex"], choices=["flex", "triton"], help="block ops for the ring")
    ap.add_argument("--no-anchors", action="store_true", help="skip SDPA flash (FlexAttention is always measured)")
    ap.add_argument("--out", default="ring_dense.json")
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256  # one compiled FlexAttention per block shape
    rows = run(args.seq, args.world, args.reps, args.block_size, args.inner, args.ops, not args.no_anchors)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version(), "args": vars(args)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    flex_ms = {r["seq"]: r["ms"] for r in rows if r["variant"] == "flex_dense" and "ms" in r}
    print(f"\n{meta}")
    print(f"{'seq':>7} {'variant':>16} {'W':>2} {'ms':>10} {'TFLOP/s':>8} {'vs flex':>8} {'imbal':>6}  "
          "per-step fwd/bwd max (ms)")
    for r in rows:
        if "error" in r:
            print(f"{r['seq']:>7} {r['variant']:>16} {r['world']:>2} {r['error']}")
            continue
        rel = r["ms"] * r["world"] / flex_ms[r["seq"]] if r["seq"] in flex_ms else float("nan")
        steps = ""
        if "step_fwd_ms" in r:
            steps = " ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(r["step_fwd_ms"], r["step_bwd_ms"]))
        print(f"{r['seq']:>7} {r['variant']:>16} {r['world']:>2} {r['ms']:>10.1f} {r['tflops']:>8.0f} {rel:>8.3f} "
              f"{r.get('imbalance', 1.0):>6.3f}  {steps}")


if __name__ == "__main__":
    main()
