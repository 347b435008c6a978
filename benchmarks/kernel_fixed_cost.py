"""Benchmark: the per-program fixed cost of the vertical-slash kernels (where short programs lose their time).

Every query tile (128 x 128 tiles) gets the same number n of key tiles (slash offsets 0 .. n*128-1: the diagonal
tile, masked, plus n-1 full tiles) and no gathered column, at 32K, Qwen2.5-3B attention shape (16 heads, 2 KV
heads, head dim 128), bf16. Timing forward and forward+backward for n = 1, 2, 4, 8 and fitting time = a + b * n
separates the fixed cost of a launch of 4096 programs (``a``: loading Q and the lists, the loops' pipeline fills,
the epilogue, the wave tail) from the cost per key tile (``b``). Both are printed per config and written as JSON.

Commands (on a GPU; repo root)::

    python benchmarks/kernel_fixed_cost.py --out runs/fixed.json
    # one forward+backward of the kernel_sparse.py pattern at 32K/2%, for Nsight Compute:
    ncu --clock-control none --kernel-name regex:"_vs_fwd|_vs_bwd_dq|_vs_bwd_dkdv" --launch-skip 4 \
        --launch-count 4 --section SpeedOfLight --section Occupancy python benchmarks/kernel_fixed_cost.py \
        --one-call 32768 0.02
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_sparse import HKV, D, H, _config, fit_pattern  # noqa: E402

from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists  # noqa: E402
from mtraining_kernels.vertical_slash import vertical_slash_attention  # noqa: E402


def _inputs(S: int, dev: torch.device):
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, S, D, device=dev, dtype=torch.bfloat16) for h in (H, HKV, HKV, H))
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, dout


def one_call(S: int, frac: float) -> None:
    """Three forward+backward calls on the kernel_sparse.py pattern (the first compiles): a target for ncu."""
    dev = torch.device("cuda")
    q, k, v, dout = _inputs(S, dev)
    vi, si = fit_pattern(S, 128, 128, frac, min(1024, int(frac * S / 2)), int(frac * 1000) + S, dev)
    tiles = pattern_tile_lists(expand_pattern(vi, H, HKV), expand_pattern(si, H, HKV), S, 128, 128)
    t = tiles.tile_pairs().sum().item() * 128 * 128
    c = tiles.gathered_columns().sum().item() * 128
    print(f"S={S} frac={frac} tile_pairs={t:.3e} col_pairs={c:.3e} col_share={c / (t + c):.2f}", flush=True)
    for _ in range(3):
        vertical_slash_attention(q, k, v, tiles).backward(dout)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--tiles", type=int, nargs="+", default=[1, 2, 4, 8], help="key tiles per query tile")
    ap.add_argument("--configs", nargs="+", default=["", "q_rows=64,fwd_warps=4,dq_warps=4,sub_n=64"])
    ap.add_argument("--one-call", nargs=2, metavar=("S", "FRACTION"), help="run one pattern for a profiler, then exit")
    ap.add_argument("--out", default="kernel_fixed_cost.json")
    args = ap.parse_args()
    if args.one_call:
        one_call(int(args.one_call[0]), float(args.one_call[1]))
        return
    S, dev = args.seqlen, torch.device("cuda")
    q, k, v, dout = _inputs(S, dev)
    no_cols = torch.full((1, HKV, 1), -1, device=dev)
    rows = []
    for n in args.tiles:
        si = torch.arange(n * 128, device=dev)[None, None].expand(1, HKV, -1).contiguous()
        tiles = pattern_tile_lists(expand_pattern(no_cols, H, HKV), expand_pattern(si, H, HKV), S, 128, 128)
        for spec in args.configs:
            cfg = _config(spec)
            f = triton.testing.do_bench(lambda: vertical_slash_attention(q, k, v, tiles, config=cfg), warmup=30,
                                        rep=200, return_mode="median")
            fb = triton.testing.do_bench(lambda: vertical_slash_attention(q, k, v, tiles, config=cfg).backward(dout),
                                         warmup=30, rep=200, grad_to_none=[q, k, v], return_mode="median")
            rows.append({"tiles": n, "config": spec, "fwd_ms": f, "fb_ms": fb})
            print(json.dumps(rows[-1]), flush=True)
    fits = {}
    print(f"{'config':<45} {'fwd fixed ms':>12} {'fwd ms/tile':>11} {'f+b fixed ms':>12} {'f+b ms/tile':>11}")
    for spec in args.configs:
        pts = [r for r in rows if r["config"] == spec]
        x = torch.tensor([float(r["tiles"]) for r in pts], dtype=torch.float64)
        fit = {}
        for key in ("fwd_ms", "fb_ms"):
            y = torch.tensor([r[key] for r in pts], dtype=torch.float64)
            slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
            fit[key] = (float(y.mean() - slope * x.mean()), float(slope))  # (fixed, per tile)
        fits[spec or "default"] = fit
        print(f"{spec or 'default':<45} {fit['fwd_ms'][0]:>12.3f} {fit['fwd_ms'][1]:>11.3f} {fit['fb_ms'][0]:>12.3f} "
              f"{fit['fb_ms'][1]:>11.3f}")
    info = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(), "S": S}
    with open(args.out, "w") as fh:
        json.dump({"info": info, "rows": rows, "fits": fits}, fh, indent=1)


if __name__ == "__main__":
    main()
