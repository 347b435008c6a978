"""Benchmark: the sparse ring on one GPU, every virtual rank's per-step kernel time, against the dense ring.

Command (GPU, repo root, the package installed: ``pip install --no-deps --no-build-isolation -e .``, which maps
the import name ``mtraining_kernels`` to ``kernels/``)::

    python benchmarks/sparse_ring.py --out runs/sparse_ring.json
    python benchmarks/sparse_ring.py --cases 524288:32 --reps 2 --dense-reps 1 --out runs/sparse_ring_512k.json
    python benchmarks/sparse_ring.py --cases 524288:32 --skip-dense 524288 --out runs/sparse_ring_512k.json
    python benchmarks/sparse_ring.py --cpu-smoke --out /tmp/sparse_ring_smoke.json   # CPU, tiny, torch ops

Shape: Qwen2.5-3B attention (16 query heads, 2 KV heads, head dim 128), bf16, batch 1, causal. Cases ``N:W``
(default 128K on W = 8 and 512K on W = 32), layouts striped (128-token blocks) and zigzag.

Pattern: one layer of the synthetic Qwen2.5-3B pattern of ``benchmarks/imbalance.py`` (``synthetic_pattern``,
imported: MInference's per-head budgets, far-slash share ``--far-share``), its first 16 rows (16 heads of a random
draw of budgets), one pattern per query head, T = 128.

Per case and layout, :class:`~lightning_mtraining.ring.simulated.SimulatedRing` runs all W virtual ranks' steps in
this process (``time_steps=True``: CUDA events around each step's ``forward_step`` / ``backward_step``: the block
op plus the merge of the forward, the dq add and dK/dV stack of the backward):

- ``sparse``: ``SimulatedRing(W, layout, 128, pattern=...)`` with its default ``verticals="gathered"``, the Triton
  block op (``TritonBlockOp(128, 128)``, the sparse default on CUDA). Each ring step computes exactly its tile lists
  (``build_step_lists`` in gathered mode: the tiles); steps without any pair skip. The pattern's vertical columns
  are gathered once per layer and computed in one extra step after the W ring steps, which ``SimulatedRing`` times
  as step W and this script counts as the last step of every rank (its own wait: every rank runs it);
- ``dense``: ``SimulatedRing(W, layout, 128)`` with its default op (FlexAttention); ``--skip-dense N`` skips it at
  N (512K on 32 virtual ranks: W^2 = 1024 FlexAttention steps, about 15 s per pass on an H200).

Per-step times are medians over ``--reps`` passes (after one warm-up pass). Reported: ``critical`` = sum over steps of
the slowest rank's step, forward and backward separately (each ring step waits for its slowest rank; communication
assumed hidden), their sum; the measured time imbalance from the per-rank-per-step times
(:func:`~lightning_mtraining.sparsity.balance.imbalance`: ``total`` = max over mean of the ranks' totals,
``critical_path`` = critical over the sum of the mean rank's steps) next to the exact work imbalance of the same pattern
and layout in the schedule that ran (:func:`~lightning_mtraining.sparsity.balance.ring_step_work`): ``work_imbalance``
(sparse: ``verticals="gathered"``, the vertical step last; dense: the full pattern) and ``work_imbalance_arrival`` (each
vertical's pairs at the step its key's chunk arrives, W steps); the correlation over (rank, step) of time with the work
of the schedule that ran; TFLOP/s on all the allowed pairs, the vertical step's included (4 D per pair forward, x3.5
forward+backward) over W x critical; the sparse speed-up over the dense ring; and ``single``: the pattern's
forward+backward on the whole sequence on one GPU (``vertical_slash_attention``, ``do_bench`` median) divided by W, the
ideal per-rank share (a lower bound of ``critical``). Launch gaps inside a step count: a step whose kernels are shorter
than their launches is timed at the host's pace, as it runs in eager mode.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from lightning_mtraining.core.layouts import shard_sequence
from lightning_mtraining.ring.simulated import SimulatedRing
from lightning_mtraining.sparsity.balance import allowed_pairs, imbalance, ring_step_work
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ run as scripts, not a package
from _timing import median_ms, write_results  # noqa: E402
from imbalance import synthetic_pattern  # noqa: E402

H, HKV, D, T = 16, 2, 128, 128


def layer_pattern(seq: int, far_share: float, seed: int, first_row: int) -> VerticalSlashPattern:
    """16 consecutive rows of the synthetic 576-row pattern: one layer's heads, padding columns trimmed. Entries
    >= seq (only below ~6.2K tokens, where a slash budget is wider than the sequence) become padding."""
    full = synthetic_pattern(seq, far_share, seed)
    v = full.vertical_idx[:, first_row:first_row + H]
    s = full.slash_idx[:, first_row:first_row + H]
    if v.shape[1] != H:
        raise ValueError(f"--first-row {first_row}: the synthetic pattern has {full.num_heads} rows, need {H} from it")
    # order within a row is free (patterns are sets); descending puts the padding last, then trim it
    v, s = (torch.where(x < seq, x, -1).sort(-1, descending=True).values for x in (v, s))
    v = v[..., :max(1, int((v >= 0).sum(-1).max()))]
    s = s[..., :max(1, int((s >= 0).sum(-1).max()))]
    return VerticalSlashPattern(v.contiguous(), s.contiguous(), T)


def run_ring(sim: SimulatedRing, q, k, v, douts, reps: int) -> dict:
    """One warm-up pass, then ``reps`` passes; per (rank, step) the median of each phase's times, and the wall
    time of a pass (host work included: step lists, launches)."""
    W = sim.world_size
    per = {}
    walls = []
    for i in range(reps + 1):
        sim.timings.clear()
        t0 = time.perf_counter()
        sim.forward(q, k, v)
        sim.backward(douts)
        if q.is_cuda:
            torch.cuda.synchronize()
        if i:  # pass 0 warms up (compiles, fills caches)
            walls.append((time.perf_counter() - t0) * 1e3)
            for key, ms in sim.timings.items():
                per.setdefault(key, []).append(ms)
    med = {key: statistics.median(ms) for key, ms in per.items()}
    # steps 0..W-1 are the ring's; step W, where present, the gathered-vertical step (every rank has it or none)
    steps = W + 1 if (0, W, "fwd") in med else W
    fwd = torch.tensor([[med[(r, s, "fwd")] for s in range(steps)] for r in range(W)], dtype=torch.float64)
    bwd = torch.tensor([[med[(r, s, "bwd")] for s in range(steps)] for r in range(W)], dtype=torch.float64)
    return {"fwd_ms": fwd, "bwd_ms": bwd, "wall_ms": statistics.median(walls)}


def summarise(res: dict, work: torch.Tensor, useful_flops: float) -> dict:
    fwd, bwd = res["fwd_ms"], res["bwd_ms"]
    both = torch.cat([fwd, bwd], 1)  # each phase's steps are separate waits
    W = fwd.shape[0]
    crit_f, crit_b = float(fwd.max(0).values.sum()), float(bwd.max(0).values.sum())
    t = (fwd + bwd).flatten()
    w = work.double().flatten()
    corr = float(torch.corrcoef(torch.stack([t, w]))[0, 1]) if float(w.std()) > 0 and float(t.std()) > 0 else math.nan
    return {
        "critical_ms": crit_f + crit_b, "fwd_critical_ms": crit_f, "bwd_critical_ms": crit_b,
        "mean_rank_ms": float((fwd + bwd).sum(1).mean()), "wall_ms": res["wall_ms"],
        "time_imbalance": {"fwd": imbalance(fwd), "bwd": imbalance(bwd), "both": imbalance(both)},
        "work_imbalance": imbalance(work), "time_work_corr": corr,
        "tflops": useful_flops / ((crit_f + crit_b) * W) / 1e9,
        "fwd_ms": fwd.tolist(), "bwd_ms": bwd.tolist(), "work_pairs": work.tolist(),
    }


def single_gpu_ms(q, k, v, dout, pattern: VerticalSlashPattern) -> float:
    """Forward+backward of the pattern on the whole sequence, one device (median; ``do_bench`` on CUDA)."""
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    if q.is_cuda:
        from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists
        from mtraining_kernels.vertical_slash import vertical_slash_attention

        vi, si = (expand_pattern(t.to(q.device), H, HKV) for t in (pattern.vertical_idx, pattern.slash_idx))
        tiles = pattern_tile_lists(vi, si, q.shape[2], T, T)
        return median_ms(lambda: vertical_slash_attention(qg, kg, vg, tiles).backward(dout), q.device, [qg, kg, vg])
    from lightning_mtraining.sparsity.attention import sparse_attention

    return median_ms(lambda: sparse_attention(qg, kg, vg, pattern.vertical_idx, pattern.slash_idx,
                                              block_size=T).backward(dout), q.device, [qg, kg, vg])


def run(args) -> tuple[dict, list[dict]]:
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    hd = 32 if smoke else D
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "device": "cpu" if smoke else torch.cuda.get_device_name(),
            "dtype": str(dtype), "head_dim": hd, "args": vars(args)}
    print(info, flush=True)
    if not smoke:
        torch._dynamo.config.cache_size_limit = 256  # FlexAttention: one compile per block shape (ring_dense.py)
    rows = []
    for case in args.cases:
        N, W = (int(x) for x in case.split(":"))
        pattern = layer_pattern(N, args.far_share, args.seed, args.first_row)
        pairs = allowed_pairs(pattern, N)  # [1, H]
        density = (pairs.double() / (N * (N + 1) / 2)).flatten()
        sparse_flops = 4 * hd * float(pairs.sum()) * 3.5
        dense_flops = 4 * hd * H * N * (N + 1) / 2 * 3.5
        g = torch.Generator(device=device).manual_seed(N + W)
        q, dout = (torch.randn(1, H, N, hd, device=device, dtype=dtype, generator=g) for _ in range(2))
        k, v = (torch.randn(1, HKV, N, hd, device=device, dtype=dtype, generator=g) for _ in range(2))
        single = single_gpu_ms(q, k, v, dout, pattern)
        base = {"N": N, "W": W, "density": float(density.mean()), "density_min": float(density.min()),
                "density_max": float(density.max()), "single_ms": single, "single_over_W_ms": single / W}
        print(f"N={N} W={W}: pattern density {base['density']:.4f} [{base['density_min']:.4f}, "
              f"{base['density_max']:.4f}], single-device fwd+bwd {single:.1f} ms", flush=True)
        for layout in args.layouts:
            douts = [shard_sequence(dout, 2, r, W, layout, T).contiguous() for r in range(W)]
            kinds = [("sparse", pattern, sparse_flops)]
            if N not in args.skip_dense:
                kinds.append(("dense", None, dense_flops))
            for kind, pat, flops in kinds:
                t0 = time.perf_counter()
                sim = SimulatedRing(W, layout, T, pattern=pat, time_steps=True)
                reps = args.reps if kind == "sparse" else args.dense_reps
                try:
                    res = run_ring(sim, q, k, v, douts, reps)
                except torch.OutOfMemoryError as e:
                    rows.append({**base, "layout": layout, "kind": kind, "error": f"OOM: {e}"[:300]})
                    print(f"  {layout} {kind}: OOM", flush=True)
                    continue
                finally:
                    del sim
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                full = pat if pat is not None else VerticalSlashPattern.full(1, H, N, T)
                arrival = ring_step_work(full, N, W, layout, T, verticals="arrival")
                work = arrival
                if res["fwd_ms"].shape[1] == W + 1:  # the schedule that ran: ring steps, then the vertical step
                    gathered = ring_step_work(full, N, W, layout, T, verticals="gathered")
                    work = torch.cat([gathered[:, 1:], gathered[:, :1]], 1)
                row = {**base, "layout": layout, "kind": kind, "reps": reps, **summarise(res, work, flops),
                       "work_imbalance_arrival": imbalance(arrival), "bench_s": time.perf_counter() - t0}
                rows.append(row)
                print(f"  {layout} {kind}: critical {row['critical_ms']:.1f} ms (fwd {row['fwd_critical_ms']:.1f}, "
                      f"bwd {row['bwd_critical_ms']:.1f}), wall per pass {row['wall_ms']:.0f} ms, "
                      f"{row['bench_s']:.0f} s", flush=True)
        del q, k, v, dout, douts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        if r.get("kind") == "sparse" and "critical_ms" in r:
            dense = [d for d in rows if d.get("kind") == "dense" and "critical_ms" in d
                     and (d["N"], d["W"], d["layout"]) == (r["N"], r["W"], r["layout"])]
            if dense:
                r["speedup_vs_dense"] = dense[0]["critical_ms"] / r["critical_ms"]
    return info, rows


def print_table(rows: list[dict]) -> None:
    print("\ncritical = sum over steps of the slowest rank (fwd + bwd); imbalance cells: critical_path / total "
          "(max over mean); single/W: one device's fwd+bwd of the whole pattern over W")
    print(f"{'N':>7} {'W':>3} {'layout':<8} {'kind':<6} {'density':>7} {'crit ms':>9} {'fwd':>8} {'bwd':>8} "
          f"{'single/W':>8} {'time imb':>13} {'work imb':>13} {'corr':>5} {'TF/s':>5} {'x dense':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['N']:>7} {r['W']:>3} {r['layout']:<8} {r['kind']:<6} {r['error']}")
            continue
        ti, wi = r["time_imbalance"]["both"], r["work_imbalance"]
        print(f"{r['N']:>7} {r['W']:>3} {r['layout']:<8} {r['kind']:<6} "
              f"{(r['density'] if r['kind'] == 'sparse' else 1.0):>7.3f} {r['critical_ms']:>9.1f} "
              f"{r['fwd_critical_ms']:>8.1f} {r['bwd_critical_ms']:>8.1f} "
              f"{(r['single_over_W_ms'] if r['kind'] == 'sparse' else math.nan):>8.1f} "
              f"{ti['critical_path']:>6.3f}/{ti['total']:<6.3f} {wi['critical_path']:>6.3f}/{wi['total']:<6.3f} "
              f"{r['time_work_corr']:>5.2f} {r['tflops']:>5.0f} {r.get('speedup_vs_dense', math.nan):>7.2f}")
    print("\nper step (slowest rank / mean rank): forward ms, backward ms, work in M pairs")
    for r in rows:
        if "error" in r:
            continue
        fwd, bwd = torch.tensor(r["fwd_ms"]), torch.tensor(r["bwd_ms"])
        work = torch.tensor(r["work_pairs"], dtype=torch.float64) / 1e6
        cells = " | ".join(f"{s}: {fwd[:, s].max():.2f}/{fwd[:, s].mean():.2f} {bwd[:, s].max():.2f}/"
                           f"{bwd[:, s].mean():.2f} {work[:, s].max():.0f}/{work[:, s].mean():.0f}"
                           for s in range(fwd.shape[1]))
        print(f"{r['N']} W={r['W']} {r['layout']} {r['kind']}: {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["131072:8", "524288:32"], help="N:W pairs")
    ap.add_argument("--layouts", nargs="+", default=["striped", "zigzag"], choices=["striped", "zigzag", "contiguous"])
    ap.add_argument("--skip-dense", type=int, nargs="*", default=[], help="sequence lengths without the dense ring")
    ap.add_argument("--reps", type=int, default=3, help="timed passes of the sparse ring (after one warm-up)")
    ap.add_argument("--dense-reps", type=int, default=2, help="timed passes of the dense ring (after one warm-up)")
    ap.add_argument("--far-share", type=float, default=0.02, help="synthetic_pattern's far-slash share")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-row", type=int, default=0, help="first of the 16 synthetic rows taken as the layer")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CPU, float32, head dim 32, 4K tokens on W = 4, torch block ops (checks the script runs)")
    ap.add_argument("--out", default="sparse_ring.json")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.cases, args.reps, args.dense_reps = ["4096:4"], 1, 1
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --cpu-smoke)")
    info, rows = run(args)
    write_results(args.out, info, rows, print_table)


if __name__ == "__main__":
    main()
