"""Benchmark: the online pattern estimator's time against the sparse attention it feeds, per layer, one GPU.

Command (GPU, repo root, the package installed: ``pip install --no-deps --no-build-isolation -e .``, which maps
the import name ``mtraining_kernels`` to ``kernels/``)::

    python benchmarks/estimation.py --out runs/estimation.json
    python benchmarks/estimation.py --cpu-smoke --out /tmp/estimation_smoke.json   # CPU, tiny sizes, torch paths

Shape: Qwen2.5-3B attention (16 query heads, 2 KV heads, head dim 128), bf16, batch 1, causal; N = 32K, 64K, 128K,
256K, 512K tokens (``--seqlens``). Estimator configs (:class:`SparsityConfig`, one pattern per query head, sinks 4,
local window 128, last_q 64): top-p 0.9 with caps 4096 / 4096 (the MTraining reference setting) and top-k 1024 / 1024.

Inputs: random q/k make every probe's softmax nearly uniform, so top-p 0.9 would keep nearly everything (a dense
pattern, a slow denominator, a flattering ratio). :func:`peaked_qk` builds q/k whose logits (scale 1/sqrt(D)) are
the sum of parts in separate head-dim blocks, so the parts do not interfere:

- dims 0..63, local: rotations at 32 frequencies log-spaced from 1/64 to 1/16384 give ``L_loc * mean_f
  cos(theta_f (i - j))``: ~L_loc up to distance 64, falling like log(16384 / d) to ~0 at 16K (with a ripple of
  ~L_loc / 8 beyond), the smooth decay with distance that RoPE gives real heads;
- dim 64, sinks: keys 0..3 get ``L_sink`` with every query;
- dims 65..72, heavy columns: 8 directions per KV head, each with 64 random key positions; query head h takes
  direction h mod 8, so heads of one KV group see different columns (``L_vert``);
- dims 80..127, repeats: content vectors repeat with period N / 8, so query i and key j score ``L_rep`` when
  i - j is a multiple of N / 8 (slashes of repeated text) and ~N(0, L_rep^2 / 48) otherwise;
- all dims: Gaussian noise, std 0.3.

Each query head scales its four L by its own factor in [0.8, 1.2]. Measured on the CPU (float32; the GPU draws
other random numbers, same structure): at 128K the last row of heads 0, 5, 10, 15 puts 0.06-0.2 of its mass on
the sinks and 0.55-0.65 on the local window; the top-p patterns are 9.7% dense (5.5-12.8% over the heads) at 128K
and 4.8% (0.2-6.2%) at 512K, close to the 93.7% sparsity MTraining reports at 512K; top-k 1024/1024 gives 3.3% at
512K; recall 0.94-0.96. The run prints each pattern's density (mean and range over the 16 heads) and recall
(``attention_recall``, 64 evenly spaced rows).

Timed (``triton.testing.do_bench``, median; at least 5 timed calls, the L2 flushed before each):

- ``est1``: ``estimate_pattern(q, k, cfg)`` on the whole sequence (W = 1), eager: the median wall time of a
  call from enqueue to the end of its last kernel, so host-bound calls count their host time. ``est1 GPU``: the
  same call captured in a CUDA graph and replayed (its kernels only). In training the host enqueues the estimator
  while the GPU still runs earlier layers, so the GPU time is what a step pays once the host keeps ahead.
  ``est8 GPU``: the same for ``est8`` (the fake group's collectives are captured as no-ops).
- ``est8``: one rank's share of the estimator at W = 8 (striped, 128-token blocks). One GPU has no 8-rank process
  group, so the real per-rank code (``estimate_pattern`` on the rank's shard, the N-long slash buffer, the
  selection over its owned offsets) runs in a single-process ``fake`` process group
  (``torch.testing._internal.distributed.fake_pg``) whose collectives only copy local data: the time is this
  rank's compute without communication. The rank timed is W - 1, which owns the probe rows. If the fake group
  cannot be created, the fallback times the W = 1 estimator on the rank's N / W keys (same probe count, a slash
  buffer N / W long instead of N); the JSON records which (``est8_method``). Communication is given separately:
  bytes each rank sends per layer from the formula of Note [Distributed estimation] in
  ``lightning_mtraining/estimation.py`` (ring algorithms: all-reduce 2 (W-1)/W, all-gather and reduce-scatter
  (W-1)/W of the full buffer), and a model time at ``--nvlink-gbs`` (a model, not a measurement).
- ``kern``: the sparse attention forward+backward of the same layer over the estimated pattern: the Triton
  kernels (``vertical_slash_attention``) with the pattern's tile lists built beforehand; ``idx``: building the
  lists (``pattern_tile_lists``); ``e2e``: ``sparse_attention`` forward+backward (validation, lists, kernels).

Ratios: ``est1 / kern`` (W = 1) and ``est8 / (kern / 8)``: at W = 8 the denominator is the ideal per-rank share of
the single-GPU sparse time, a lower bound on any rank's real sparse time (imbalance and per-step costs only add),
so the W = 8 ratio is an upper bound. The target: both ratios below 3% from 128K on.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from lightning_mtraining.core.layouts import shard_sequence
from lightning_mtraining.sparsity import estimation
from lightning_mtraining.sparsity.attention import sparse_attention
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.estimation import attention_recall, estimate_pattern

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ run as scripts, not a package
from _timing import median_ms as bench  # noqa: E402
from _timing import write_results

H, HKV, D = 16, 2, 128
W_SIM = 8  # the simulated CP size of ``est8``
LAYOUT, BLOCK = "striped", 128


def peaked_qk(seq: int, device, dtype, seed: int = 0, sink: float = 13.0, vert: float = 9.0, local: float = 9.0,
              repeat: float = 7.0, n_heavy: int = 64, repeats: int = 8, noise: float = 0.3, reach: float = 16384.0):
    """q ``[1, H, seq, D]`` and k ``[1, HKV, seq, D]`` with the peaked logits of the module docstring (the
    arguments are the logit heights L of the parts)."""
    g = torch.Generator(device=device).manual_seed(seed)
    amp = lambda L: math.sqrt(L * math.sqrt(D))  # noqa: E731 (q_i . k_j / sqrt(D) = L when both carry amp(L))
    n_rope, sink_dim, heavy_dim, rep = 32, 64, 65, slice(80, D)
    pos = torch.arange(seq, device=device, dtype=torch.float32)
    # frequencies log-spaced from 1/64 to 1/reach: the mean cosine is ~1 up to distance 64, then falls like
    # log(reach / d) / log(reach / 64) to ~0 at d = reach (a smooth local decay), with ~L/8 ripple beyond
    theta = torch.logspace(math.log10(1 / 64), math.log10(1 / reach), n_rope, device=device)
    ang = pos[:, None] * theta[None, :]
    rope = torch.stack([ang.cos(), ang.sin()], -1).flatten(-2) / math.sqrt(n_rope)  # [seq, 64], unit rows
    del ang
    period = max(1, seq // repeats)
    G = H // HKV
    q = torch.empty(1, H, seq, D, dtype=dtype, device=device)
    k = torch.empty(1, HKV, seq, D, dtype=dtype, device=device)
    for kv in range(HKV):
        content = torch.nn.functional.normalize(torch.randn(period, D - rep.start, device=device, generator=g), dim=-1)
        content = content.repeat(-(-seq // period), 1)[:seq]  # row j is content[j mod period]
        kk = noise * torch.randn(seq, D, device=device, generator=g)
        kk[:, :2 * n_rope] += amp(local) * rope
        kk[:4, sink_dim] += amp(sink)
        for c in range(8):
            heavy = torch.randperm(seq - 4, device=device, generator=g)[:n_heavy] + 4
            kk[heavy, heavy_dim + c] += amp(vert)
        kk[:, rep] += amp(repeat) * content
        k[0, kv] = kk.to(dtype)
        for h in range(kv * G, (kv + 1) * G):
            f = (0.8 + 0.4 * torch.rand(4, device=device, generator=g)).tolist()  # this head's own heights
            qq = noise * torch.randn(seq, D, device=device, generator=g)
            qq[:, :2 * n_rope] += amp(local * f[0]) * rope
            qq[:, sink_dim] += amp(sink * f[1])
            qq[:, heavy_dim + h % 8] += amp(vert * f[2])
            qq[:, rep] += amp(repeat * f[3]) * content
            q[0, h] = qq.to(dtype)
        del content, kk, qq
    return q, k


def configs(topk: tuple[int, int], caps: tuple[int, int], top_p: float) -> dict[str, SparsityConfig]:
    return {
        f"top-p {top_p:g} caps {caps[0]}/{caps[1]}": SparsityConfig(top_p=top_p, max_vertical=caps[0],
                                                                    max_slash=caps[1], last_q=64),
        f"top-k {topk[0]}/{topk[1]}": SparsityConfig(vertical_topk=topk[0], slash_topk=topk[1], last_q=64),
    }


def comm_bytes(B: int, n_total: int, cp_size: int, cfg: SparsityConfig, itemsize: int) -> dict[str, float]:
    """Bytes one rank sends per layer in each collective of Note [Distributed estimation] (ring algorithms)."""
    W = cp_size
    G = H if cfg.pattern_heads == "query" else HKV
    K = max(max(cfg.head_budgets(G)[0]), max(cfg.head_budgets(G)[1]))
    S = n_total // W
    part = (W - 1) / W
    return {
        "probes_allreduce": 2 * part * B * H * cfg.last_q * D * itemsize,
        "normalisers_allgather": part * W * B * H * cfg.last_q * 4,
        "slash_reduce_scatter": part * B * G * n_total * 4,
        # one payload of int64 keys of the local best min(K, local entries), + total and forced mass (float32 scores)
        "candidates_allgather": part * W * B * G * ((min(K, S) + 2) + (min(K, n_total // W) + 2)) * 8,
    }


def fake_group(rank: int, world: int):
    """Initialise a single-process 'fake' process group of ``world`` ranks (this process is ``rank``); returns
    whether its all-gather copies the local input into every slot (torch 2.13 does; older fake groups may leave
    the output untouched)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_mtraining.core.collectives import all_gather_stacked

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    probe = torch.arange(3.0)
    return bool(torch.equal(all_gather_stacked(probe, None, world)[0], probe))


def time_rank_share(q, k, cfg: SparsityConfig, device, gpu_times: list | None = None) -> tuple[float, str]:
    """``est8``: one rank's estimator time at W = W_SIM (see the module docstring); with the fake group and a list
    ``gpu_times``, appends the call's GPU time (:func:`graph_ms`, None if not capturable)."""
    import torch.distributed as dist

    rank = W_SIM - 1
    ql, kl = (shard_sequence(t, 2, rank, W_SIM, LAYOUT, BLOCK).contiguous() for t in (q, k))
    try:
        copies = fake_group(rank, W_SIM)
    except Exception as e:  # noqa: BLE001 - fall back and say so
        print(f"  fake process group unavailable ({e!r}); timing the W=1 estimator on the rank's keys", flush=True)
        return bench(lambda: estimate_pattern(ql, kl, cfg), device), "w1_on_rank_keys"
    try:
        if not copies:
            # the first call's cross-rank shape check all-gathers the shapes; a fake all-gather that leaves its
            # output uninitialised would fail it, so mark these shapes checked (the check does no compute)
            key = (id(dist.group.WORLD), tuple(ql.shape), tuple(kl.shape), (ql.shape[2] * W_SIM,))
            estimation._CHECKED_GROUPS.add(key)
        call = lambda: estimate_pattern(ql, kl, cfg, layout=LAYOUT, block_size=BLOCK)  # noqa: E731
        ms = bench(call, device)
        if gpu_times is not None and device.type == "cuda":
            gpu_times.append(graph_ms(call, device))
    finally:
        dist.destroy_process_group()
    return ms, "fake_pg" if copies else "fake_pg_nocopy"


def graph_ms(fn, device) -> float | None:
    """GPU time of ``fn()``: the median replay of a CUDA graph that captured one call (no host work, which
    overlaps the previous layers' kernels in training), or None where the call cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - a host sync or an uncapturable op: report, do not fail the run
        print(f"  not capturable in a CUDA graph: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return None
    ms = bench(graph.replay, device)
    del graph
    return ms


def run(args) -> tuple[dict, list[dict]]:
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    cfgs = configs(tuple(args.topk), tuple(args.caps), args.top_p)
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "device": torch.cuda.get_device_name() if not smoke else "cpu",
            "dtype": str(dtype), "args": vars(args)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    print(info, flush=True)
    rows = []
    for N in args.seqlens:
        q, k = peaked_qk(N, device, dtype, seed=N)
        g = torch.Generator(device=device).manual_seed(N + 1)
        v = torch.randn(1, HKV, N, D, device=device, dtype=dtype, generator=g)
        dout = torch.randn(1, H, N, D, device=device, dtype=dtype, generator=g)
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        for name, cfg in cfgs.items():
            row = {"N": N, "config": name}
            pattern = estimate_pattern(q, k, cfg)
            density = pattern.density(N).flatten()
            recall = attention_recall(q, k, pattern).flatten()
            row.update(density=float(density.mean()), density_min=float(density.min()),
                       density_max=float(density.max()), recall=float(recall.mean()), recall_min=float(recall.min()),
                       n_vertical=float((pattern.vertical_idx >= 0).sum(-1).double().mean()),
                       n_slash=float((pattern.slash_idx >= 0).sum(-1).double().mean()))
            row["est1_ms"] = bench(lambda: estimate_pattern(q, k, cfg), device)
            if device.type == "cuda":
                row["est1_gpu_ms"] = graph_ms(lambda: estimate_pattern(q, k, cfg), device)
            gpu8: list = []
            row["est8_ms"], row["est8_method"] = time_rank_share(q, k, cfg, device, gpu8)
            row["est8_gpu_ms"] = gpu8[0] if gpu8 else None
            if args.torch_scorer:  # the same calls with the torch scorer (the one before the Triton scorer)
                estimation._SCORER = "torch"
                try:
                    row["est1_torch_ms"] = bench(lambda: estimate_pattern(q, k, cfg), device)
                    row["est8_torch_ms"] = time_rank_share(q, k, cfg, device)[0]
                finally:
                    estimation._SCORER = "auto"
            comm = comm_bytes(1, N, W_SIM, cfg, q.element_size())
            row["est8_comm_bytes"] = comm
            row["est8_comm_model_ms"] = sum(comm.values()) / (args.nvlink_gbs * 1e9) * 1e3

            def e2e():
                sparse_attention(qg, kg, vg, pattern.vertical_idx, pattern.slash_idx).backward(dout)

            if device.type == "cuda":
                from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists
                from mtraining_kernels.vertical_slash import vertical_slash_attention

                vi, si = (expand_pattern(t, H, HKV) for t in (pattern.vertical_idx, pattern.slash_idx))
                row["idx_ms"] = bench(lambda: pattern_tile_lists(vi, si, N, 128, 128), device)
                tiles = pattern_tile_lists(vi, si, N, 128, 128)

                def kern():
                    vertical_slash_attention(qg, kg, vg, tiles).backward(dout)

                row["kern_fb_ms"] = bench(kern, device, [qg, kg, vg])
                tiles = None  # freed before the next config (a del would leave the name unbound for ruff)
            row["e2e_fb_ms"] = bench(e2e, device, [qg, kg, vg])
            denom = row.get("kern_fb_ms", row["e2e_fb_ms"])  # CPU smoke: the torch path is the only one
            row["ratio1"] = row["est1_ms"] / denom
            row["ratio8"] = row["est8_ms"] / (denom / W_SIM)
            if row.get("est1_gpu_ms") is not None:
                row["ratio1_gpu"] = row["est1_gpu_ms"] / denom
            if row.get("est8_gpu_ms") is not None:
                row["ratio8_gpu"] = row["est8_gpu_ms"] / (denom / W_SIM)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        q = k = v = dout = qg = kg = vg = None  # freed before the next length
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return info, rows


def print_table(rows: list[dict]) -> None:
    print("\nW=8: est8 = one rank's estimator compute (fake process group); ratio8 = est8 / (kern / 8), an upper "
          "bound; comm = bytes each rank sends per layer and a model time at the given NVLink bandwidth")
    hdr = (f"{'N':>7} {'config':<24} {'density':>17} {'recall':>6} {'est1 ms':>8} {'kern f+b':>9} {'idx':>6} "
           f"{'e2e f+b':>9} {'ratio1':>7} {'est8 ms':>8} {'ratio8':>7} {'comm MB':>8} {'model ms':>8}")
    print(hdr)
    for r in rows:
        dens = f"{r['density']:.3f} [{r['density_min']:.3f},{r['density_max']:.3f}]"
        print(f"{r['N']:>7} {r['config']:<24} {dens:>17} {r['recall']:>6.3f} {r['est1_ms']:>8.2f} "
              f"{r.get('kern_fb_ms', math.nan):>9.2f} {r.get('idx_ms', math.nan):>6.2f} {r['e2e_fb_ms']:>9.2f} "
              f"{100 * r['ratio1']:>6.2f}% {r['est8_ms']:>8.2f} {100 * r['ratio8']:>6.2f}% "
              f"{sum(r['est8_comm_bytes'].values()) / 1e6:>8.1f} {r['est8_comm_model_ms']:>8.3f}")
    if any(r.get("est1_gpu_ms") is not None for r in rows):
        print("\nGPU time of est1 and est8 (a CUDA graph of one call replayed: no host work), ratios as above:")
        for r in rows:
            if r.get("est1_gpu_ms") is not None:
                w8 = (f"   est8 GPU {r['est8_gpu_ms']:6.2f} ms   ratio8 GPU {100 * r['ratio8_gpu']:6.2f}%"
                      if r.get("est8_gpu_ms") is not None else "   est8 GPU: not captured")
                print(f"{r['N']:>7} {r['config']:<24} est1 GPU {r['est1_gpu_ms']:6.2f} ms   "
                      f"ratio1 GPU {100 * r['ratio1_gpu']:5.2f}%   (eager {r['est1_ms']:.2f} ms)" + w8)
    if any("est1_torch_ms" in r for r in rows):
        print("\nthe torch scorer (estimation._SCORER = 'torch') on the same calls:")
        for r in rows:
            if "est1_torch_ms" in r:
                print(f"{r['N']:>7} {r['config']:<24} est1 {r['est1_torch_ms']:8.2f} ms ({r['est1_ms']:.2f} "
                      f"default)   est8 {r['est8_torch_ms']:8.2f} ms ({r['est8_ms']:.2f} default)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 65536, 131072, 262144, 524288])
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--caps", type=int, nargs=2, default=[4096, 4096], help="top-p caps (vertical, slash)")
    ap.add_argument("--topk", type=int, nargs=2, default=[1024, 1024], help="top-k budgets (vertical, slash)")
    ap.add_argument("--nvlink-gbs", type=float, default=450.0, help="GB/s per GPU per direction (comm model)")
    ap.add_argument("--torch-scorer", action="store_true",
                    help="also time est1 and est8 with the torch scorer (estimation._SCORER = 'torch')")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CPU, float32, 1K and 2K tokens: every step through the torch paths (checks the script runs)")
    ap.add_argument("--out", default="estimation.json")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.seqlens = [1024, 2048]
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --cpu-smoke)")
    info, rows = run(args)
    write_results(args.out, info, rows, print_table)


if __name__ == "__main__":
    main()
