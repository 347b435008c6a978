"""Benchmark: the per-ring-step list builders, torch (``step_tile_lists(..., backend="torch")``, ~40 torch ops a step)
against Triton (``backend="triton"``, one launch a step; ``step_tile_lists_batched``: one launch for all W steps).

Commands (repo root)::

    python benchmarks/list_builder_bench.py --out runs/list_builder.json            # GPU: 128K and 512K, W = 8
    python benchmarks/list_builder_bench.py --cpu-smoke --out /tmp/list_builder.json  # CPU, tiny sizes, torch only

Setting (what one rank builds per layer in the sparse ring, ``lightning_mtraining.ring.steps.build_step_lists``): the
striped layout with W = 8 ranks, T = 128 tiles (stripe block 128), B = 1, H = 16 heads; rank 0's queries against
each rank's key chunk. Pattern per head (a different random draw per head): verticals = sinks 0..3 plus ~1000 at
random positions; slashes = the local band 0..127 plus 100 far offsets at random (about 2 computed tile offsets
each). ``prepare_pattern_tiles`` (once per layer, one host sync) is not timed. Before timing, the Triton lists are
checked against the torch lists (counts, col_idx and col_bits equal).

Columns: ``step_ms`` one step (rank 0 against rank W - 1's keys); ``layer_ms`` all W steps, one call each;
``batched_ms`` all W steps in one call (Triton only). Times are medians of ``triton.testing.do_bench`` (CUDA
events; the host's launch cost shows where the GPU waits for it); ``*_host_ms`` are wall-clock times per call of
back-to-back calls ending in one synchronize (the host's cost per call when nothing else is queued). With
``--cpu-smoke`` every time is wall-clock on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

from lightning_mtraining.core.layouts import global_positions
from mtraining_kernels.indexing import prepare_pattern_tiles, step_tile_lists, step_tile_lists_batched


def make_pattern(S: int, H: int, n_vertical: int, n_far: int, dev: torch.device, seed: int = 0):
    """Verticals [1, H, 4 + n_vertical] (sinks 0..3 + random) and slashes [1, H, 128 + n_far] (0..127 + random)."""
    g = torch.Generator().manual_seed(seed)
    vi = torch.cat([torch.arange(4).expand(1, H, 4), torch.randint(4, S, (1, H, n_vertical), generator=g)], -1)
    far = torch.randint(128, S, (1, H, n_far), generator=g)
    si = torch.cat([torch.arange(128).expand(1, H, 128), far], -1)
    return vi.to(dev), si.to(dev)


def wall_ms(fn, reps: int, sync) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


def check_equal(ref, got, where: str) -> None:
    for name in ("fwd_cnt", "fwd_nmask", "bwd_cnt", "bwd_nmask", "col_idx", "col_bits"):
        a, b = getattr(ref, name), getattr(got, name)
        if not ((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))):
            raise AssertionError(f"{where}: {name} differs between the torch and the Triton builder")


def bench_one(S: int, W: int, T: int, H: int, n_vertical: int, n_far: int, dev: torch.device, backends, reps: int):
    vi, si = make_pattern(S, H, n_vertical, n_far, dev)
    pt = prepare_pattern_tiles(vi, si, S, T)
    q_pos = global_positions(S, 0, W, "striped", T, device=dev)
    k_steps = torch.stack([global_positions(S, s, W, "striped", T, device=dev) for s in range(W)])
    if dev.type == "cuda":
        from triton.testing import do_bench

        sync = torch.cuda.synchronize
        timer = lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    else:
        sync = lambda: None  # noqa: E731
        timer = lambda fn: wall_ms(fn, reps, sync)  # noqa: E731
    if "triton" in backends:
        for s, got in enumerate(step_tile_lists_batched(pt, q_pos, k_steps, backend="triton")):
            check_equal(step_tile_lists(pt, q_pos, k_steps[s], backend="torch"), got, f"S={S} step {s}")
    rows = []
    for backend in backends:
        step = lambda: step_tile_lists(pt, q_pos, k_steps[W - 1], backend=backend)  # noqa: E731
        layer = lambda: [step_tile_lists(pt, q_pos, k, backend=backend) for k in k_steps]  # noqa: E731
        batched = lambda: step_tile_lists_batched(pt, q_pos, k_steps, backend=backend)  # noqa: E731
        row = dict(seq_len=S, world_size=W, tile=T, heads=H, offsets_L=pt.offsets.shape[-1],
                   verticals_NV=pt.verticals.shape[-1], backend=backend,
                   step_ms=timer(step), layer_ms=timer(layer),
                   batched_ms=timer(batched) if backend == "triton" else None,
                   step_host_ms=wall_ms(step, reps, sync), layer_host_ms=wall_ms(layer, reps, sync),
                   batched_host_ms=wall_ms(batched, reps, sync) if backend == "triton" else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny sizes, torch builder only")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--verticals", type=int, default=1000)
    ap.add_argument("--far-slashes", type=int, default=100)
    ap.add_argument("--reps", type=int, default=50, help="calls per wall-clock measurement")
    args = ap.parse_args()
    T = 128
    if args.cpu_smoke:
        dev, backends = torch.device("cpu"), ["torch"]
        seqlens, W, H, n_vertical, n_far, reps = [8192], 4, 2, 100, 10, 3
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --cpu-smoke for the CPU check")
        dev, backends = torch.device("cuda"), ["torch", "triton"]
        seqlens, W, H, n_vertical, n_far, reps = args.seqlens, args.world_size, args.heads, args.verticals, \
            args.far_slashes, args.reps
    rows = []
    for S in seqlens:
        rows += bench_one(S, W, T, H, n_vertical, n_far, dev, backends, reps)
    print(f"\n{'S':>7} {'W':>2} {'L':>4} {'NV':>5} {'backend':>7} {'step ms':>8} {'layer ms':>9} {'batched ms':>10}"
          f" {'step host':>9} {'layer host':>10} {'batch host':>10}")
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for r in rows:
        print(f"{r['seq_len']:>7} {r['world_size']:>2} {r['offsets_L']:>4} {r['verticals_NV']:>5} {r['backend']:>7}"
              f" {fmt(r['step_ms']):>8} {fmt(r['layer_ms']):>9} {fmt(r['batched_ms']):>10}"
              f" {fmt(r['step_host_ms']):>9} {fmt(r['layer_host_ms']):>10} {fmt(r['batched_host_ms']):>10}")
    info = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                cpu_smoke=args.cpu_smoke)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
