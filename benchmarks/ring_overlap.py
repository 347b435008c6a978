"""Benchmark: the real ring over NCCL on N GPUs: results against one GPU, per-step overlap from the ring
instrumentation (``lightning_mtraining.ring.trace``), and the scale model's prediction next to the measurement.

Commands (repo root, ``kernels/`` importable as ``mtraining_kernels``; one host, N GPUs)::

    torchrun --nproc-per-node 8 benchmarks/ring_overlap.py --seq 131072 --out runs/ring_overlap_w8_128k.json
    torchrun --nproc-per-node 8 benchmarks/ring_overlap.py --seq 131072 --inner 4 --out runs/ring_overlap_2x4.json
    torchrun --nproc-per-node 2 benchmarks/ring_overlap.py --cpu-smoke        # CPU, gloo, tiny shapes, torch ops

``--inner g`` runs the hierarchical ring with inner rings of g GPUs (the "nodes" are then simulated on one host: both
rings run on NVLink, and the prediction uses NVLink for both). Shape: Qwen2.5-3B attention (16 query heads, 2 KV
heads, head dim 128), bf16, batch 1, striped layout, block 128. Variants: the dense ring (FlexAttention block op) and
the sparse ring on one layer of the synthetic pattern (``imbalance.synthetic_pattern(N, 0.02, heads=16)``, the rows
``sparse_ring.py`` and ``scale_model.py`` use). Each variant: one warm-up, then ``--reps`` timed forward+backward
passes (CUDA synchronised around each) with a ``RingTrace`` on the last one.

Reported per variant (rank 0 prints and writes; per-rank trace means are gathered): wall ms of forward+backward (max
over ranks), the trace's per-step means (compute, wait on the inner / outer ring, bytes), the share of step time not
spent waiting, ``max_abs_err`` / ``rel_err`` of out, dq, dk, dv against the same attention on one GPU (rank 0, whole
sequence: SDPA for dense, ``sparse_attention`` for sparse; bf16 both, so differences of order 1e-2 are rounding), and
the scale model's predicted per-layer forward and backward ms for the same configuration.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lightning_mtraining import ring_attention, shard_sequence, unshard_sequence  # noqa: E402
from lightning_mtraining.ring import RingTrace  # noqa: E402
from lightning_mtraining.sparsity.attention import sparse_attention  # noqa: E402
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern  # noqa: E402


def _groups(world: int, inner: int) -> tuple:
    outer = world // inner
    rank = dist.get_rank()
    inners = [dist.new_group([o * inner + i for i in range(inner)]) for o in range(outer)]
    outers = [dist.new_group([o * inner + i for o in range(outer)]) for i in range(inner)]
    return inners[rank // inner], outers[rank % inner]


def _pattern(n: int, heads: int, smoke: bool, tile: int) -> VerticalSlashPattern:
    if smoke:
        vert = torch.tensor([0, 3, n // 2, n - 5]).expand(1, heads, 4).contiguous()
        slash = torch.tensor([0, 1, tile + 2]).expand(1, heads, 3).contiguous()
        return VerticalSlashPattern(vert, slash, tile_size=tile)
    from imbalance import synthetic_pattern

    return synthetic_pattern(n, 0.02, heads=heads)


def _reference(q, k, v, do, pattern):
    """One GPU, whole sequence: (out, dq, dk, dv)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    if pattern is None:
        rep = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             is_causal=True)
    else:
        out = sparse_attention(q, k, v, pattern.vertical_idx.to(q.device), pattern.slash_idx.to(q.device),
                               block_size=pattern.tile_size)
    out.backward(do)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def _gather(x: torch.Tensor, world: int, block: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return unshard_sequence(parts, 2, "striped", block)


def run_variant(name, q, k, v, do, pattern, rank, world, block, groups, reps, check) -> dict:
    sh = lambda x: shard_sequence(x, 2, rank, world, "striped", block)  # noqa: E731
    ql, kl, vl, dol = (sh(t) for t in (q, k, v, do))
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)

    def once():
        a, b, c = (t.detach().clone().requires_grad_(True) for t in (ql, kl, vl))
        out = ring_attention(a, b, c, layout="striped", block_size=block, sparsity=pattern, **groups)
        out.backward(dol)
        return out, a.grad, b.grad, c.grad

    once()
    times = []
    trace = RingTrace()
    for i in range(reps):
        sync()
        dist.barrier()
        t = time.perf_counter()
        if i == reps - 1:
            with trace:
                res = once()
        else:
            res = once()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    summary = trace.summary()
    wall = torch.tensor([min(times)], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    sums = torch.tensor([summary.get(k, 0.0) for k in sorted(summary)], dtype=torch.float64)
    dist.all_reduce(sums)
    row = {"variant": name, "wall_ms": float(wall), "trace_mean_over_ranks": dict(zip(sorted(summary),
                                                                                      (sums / world).tolist()))}
    for phase in ("fwd", "bwd"):
        kind = "dense" if pattern is None else "sparse"
        m = row["trace_mean_over_ranks"]
        c = m.get(f"{phase}/{kind}/compute_ms", 0.0)
        w = sum(val for key, val in m.items() if key.startswith(f"{phase}/{kind}/wait_"))
        row[f"{phase}_hidden_share"] = 1.0 - w / (c + w) if c + w > 0 else 1.0
    full = [_gather(x.detach(), world, block) for x in res]
    if check and rank == 0:
        ref = _reference(q, k, v, do, pattern)
        row["max_abs_err"] = [float((a.float() - b.float()).abs().max()) for a, b in zip(full, ref)]
        row["rel_err"] = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(full, ref)]
    return row


def predicted(n: int, world: int, inner: int | None, method: str) -> dict:
    import scale_model as sm

    hw = sm.PRESETS["h100-ndr"]
    hw = sm.dataclasses.replace(hw, ib_gbs=hw.nvlink_gbs, ib_latency_us=hw.nvlink_latency_us)  # one host
    per_node = inner or world
    layer = sm.attention_layer(method, sm.REFERENCE, n, world // per_node, per_node, hw, sm.measured_step_costs())
    return {"fwd_ms": layer["fwd_s"] * 1e3, "bwd_ms": layer["bwd_s"] * 1e3,
            "fwd_exposed_comm_ms": layer["fwd_exposed_comm_s"] * 1e3,
            "bwd_exposed_comm_ms": layer["bwd_exposed_comm_s"] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--inner", type=int, help="inner ring size (hierarchical ring); default: a flat ring")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-check", action="store_true", help="skip the one-GPU comparison")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    dist.init_process_group("gloo" if smoke else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not smoke:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cpu") if smoke else torch.device("cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    h, hkv, d, block = (4, 2, 16, 16) if smoke else (16, 2, 128, 128)
    n = 3 * world * block if smoke else args.seq
    g = torch.Generator(device="cpu").manual_seed(0)
    q, do = (torch.randn(1, h, n, d, generator=g).to(dev, dtype) for _ in range(2))
    k, v = (torch.randn(1, hkv, n, d, generator=g).to(dev, dtype) for _ in range(2))
    pattern = _pattern(n, h, smoke, block)
    groups = {"group": dist.group.WORLD}
    if args.inner and args.inner < world:
        inner, outer = _groups(world, args.inner)
        groups.update(inner_group=inner, outer_group=outer)
    rows = []
    for name, pat in (("dense", None), ("sparse", pattern)):
        row = run_variant(name, q, k, v, do, pat, rank, world, block, groups, args.reps, not args.no_check)
        if not smoke and rank == 0:
            row["predicted"] = predicted(n, world, args.inner, "dense" if pat is None else
                                         ("hier" if args.inner and args.inner < world else "flat"))
        rows.append(row)
    if rank == 0:
        info = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "torch": torch.__version__, "python": platform.python_version(), "world": world, "seq": n,
                "inner": args.inner, "device": torch.cuda.get_device_name() if not smoke else "cpu (gloo)",
                "args": vars(args)}
        print(json.dumps({"info": info, "rows": rows}, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
