"""Benchmark: vertical-slash sparse attention (Triton) against SDPA flash, FlexAttention dense causal and
FlexAttention with the covering BlockMask, forward + backward, Qwen2.5-3B attention shape, bf16, batch 1.

Command (on a GPU)::

    python benchmarks/kernel_sparse.py --seqlens 32768 131072 --fractions 0.02 0.05 0.1 0.2 --out runs/ks.json
    python benchmarks/kernel_sparse.py --seqlens 524288 --fractions 0.02 0.05 --anchors flex,cover --out runs/ks512.json

Patterns (one per KV head: G = H_kv = 2, a different random draw per head and per fraction), MTraining-like:
- sinks: key columns 0..63 as verticals; local window: slash offsets 0..255 (3 tile offsets at 128 x 128 tiles);
- min(1024, fraction * S / 2) verticals per KV head at random positions (token level: gathered, except inside
  computed tiles);
- slash bands: whole key-tile diagonals (offsets d * BN, d >= 5) at random, their number bisected so that the
  computed pairs at the benchmarked tile size come closest to the target fraction of the causal pairs
  (``fit_pattern``; a BM x BN tile with BM = 2 BN turns one band into two tile offsets, so coarser tiles get
  fewer bands for the same fraction).
Computed work = (tile pairs x BM x BN + gathered (query tile, column) pairs x BM) per head; TFLOP/s use
4 * D * pairs forward and x3.5 for forward+backward (the backward does 2.5 times the forward's matmul work). The
fraction reported is that work over the
causal S^2/2 pairs. FlexAttention "cover" gets a BlockMask (128 x 128) of every tile holding a computed pair,
full blocks below the diagonal and a causal mask_mod on the diagonal: the best a FlexAttention user can do.
``--graphs`` also times both fwd+bwd (ours and FlexAttention dense) replayed from a CUDA graph: the GPU time
with the host's launch cost removed, which is what decides short calls (32K at 2%) in eager mode.
Index conversion (pattern -> lists) is timed separately: ``idx_ms`` with the Triton list builder (the default on
CUDA), ``idx_torch_ms`` with the torch builder. Times are medians of triton.testing.do_bench.

Compiler resource report (registers, stack/spills per thread) of every kernel, for sm_90, WITHOUT a GPU (Triton
compiles to a cubin with its bundled ptxas; cuobjdump reads it)::

    python benchmarks/kernel_sparse.py --resources --block-sizes 128x64 --configs "" "sub_n=64"

Launch settings (:class:`mtraining_kernels.vertical_slash.KernelConfig`) are given as ``--configs
"key=value,..."``; the first is each row's result, the others are timed on the same pattern (a tuning sweep).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import triton

from mtraining_kernels.indexing import COL_CHUNK, expand_pattern, pattern_tile_lists
from mtraining_kernels.vertical_slash import vertical_slash_attention

H, HKV, D = 16, 2, 128


def make_pattern(S: int, T: int, n_vertical: int, seed: int, n_bands: int):
    """[1, HKV, n] verticals and slashes: sinks, window, ``n_vertical`` random verticals, ``n_bands`` random bands.

    Band offsets are multiples of T = BN at random tile diagonals >= 5, a different draw per KV head; the same
    seed gives the same verticals and the same band order, so the band count alone sets the density."""
    g = torch.Generator().manual_seed(seed)
    M = -(-S // T)
    vis, sis = [], []
    for _ in range(HKV):
        vis.append(torch.cat([torch.arange(64), torch.randint(64, S, (n_vertical,), generator=g)]))
        bands = (5 + torch.randperm(max(M - 5, 1), generator=g)[:n_bands]) * T
        sis.append(torch.cat([torch.arange(256), bands]))
    n_v, n_s = max(len(x) for x in vis), max(len(x) for x in sis)
    pad = lambda xs, n: torch.stack([torch.cat([x, x.new_full((n - len(x),), -1)]) for x in xs])[None]  # noqa
    return pad(vis, n_v), pad(sis, n_s)


def fit_pattern(S: int, BM: int, BN: int, frac: float, n_vertical: int, seed: int, dev):
    """The pattern of :func:`make_pattern` whose band count brings the computed pairs closest to ``frac`` of the
    causal pairs at these tiles (bisection on the band count; lists are built on the GPU in milliseconds)."""
    M = -(-S // BN)

    def build(n):
        vi, si = (t.to(dev) for t in make_pattern(S, BN, n_vertical, seed, n))
        tiles = pattern_tile_lists(expand_pattern(vi, H, HKV), expand_pattern(si, H, HKV), S, BM, BN)
        return vi, si, tiles, computed_pairs(tiles) / (H * S * S / 2)

    lo, hi = 0, max(M - 5, 0)
    while lo < hi:
        mid = (lo + hi) // 2
        if build(mid)[3] < frac:
            lo = mid + 1
        else:
            hi = mid
    best = min((build(n) for n in {max(lo - 1, 0), lo}), key=lambda r: abs(r[3] - frac))
    return best[0], best[1]


def computed_pairs(tiles) -> float:
    """Pairs the kernel computes (tile pairs x BM x BN + gathered columns x BM), summed over heads."""
    t = tiles.tile_pairs().sum().item() * tiles.block_m * tiles.block_n
    c = tiles.gathered_columns().sum().item() * tiles.block_m
    return float(t + c)


def flex_cover_mask(tiles, S: int, device):
    """BlockMask (128 x 128) of every tile holding a computed pair: full below the diagonal, causal on it."""
    from torch.nn.attention.flex_attention import BlockMask

    FB = 128
    assert FB % tiles.block_m == 0
    r = FB // tiles.block_m
    Mf = -(-S // FB)
    Hp = tiles.fwd_idx.shape[1]
    grid = torch.zeros(Hp, Mf, Mf + 1, dtype=torch.bool, device=device)
    Mq, L = tiles.fwd_idx.shape[2], tiles.fwd_idx.shape[3]
    live = torch.arange(L, device=device) < tiles.fwd_cnt[0, :, :, None]
    kb = torch.where(live, tiles.fwd_idx[0].long() * tiles.block_n // FB, Mf)
    qb = (torch.arange(Mq, device=device) // r)[None, :, None].expand_as(kb)
    grid[torch.arange(Hp, device=device)[:, None, None].expand_as(kb), qb, kb] = True
    if tiles.col_idx is not None:
        J = tiles.col_bits.shape[-1]
        for j in range(J):  # chunks of 64 columns
            bits = tiles.col_bits[0, :, :, j]  # [H, Mq]
            cols = tiles.col_idx[0, :, j * COL_CHUNK:(j + 1) * COL_CHUNK].long() // FB  # [H, 64]
            sel = ((bits[..., None] >> torch.arange(COL_CHUNK, device=device)) & 1).bool()  # [H, Mq, 64]
            hh = torch.arange(Hp, device=device)[:, None, None].expand_as(sel)
            mm = (torch.arange(Mq, device=device) // r)[None, :, None].expand_as(sel)
            cc = cols[:, None, :].expand_as(sel)
            grid[hh[sel], mm[sel], cc[sel]] = True
    grid = grid[..., :Mf]
    diag = torch.eye(Mf, dtype=torch.bool, device=device)[None]
    partial = grid & diag
    full = grid & ~diag & torch.ones(Mf, Mf, dtype=torch.bool, device=device).tril()[None]

    def lists(m):
        cnt = m.sum(-1, dtype=torch.int32)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return cnt[None].contiguous(), order[None].contiguous()

    kv_num, kv_idx = lists(partial)
    full_num, full_idx = lists(full)

    def causal(b, h, q_idx, kv_idx_):
        return kv_idx_ <= q_idx

    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FB, mask_mod=causal,
                                  seq_lengths=(S, S))
    return bm, float(grid.sum().item()) / (Hp * Mf * (Mf + 1) / 2)


def bench(fn, grads, long: bool) -> float:
    """Median ms. Long runs (512K: seconds per call): one warm-up and 3 timed calls with CUDA events, because
    do_bench's own estimate loop alone would call a 10-s anchor 6 times."""
    if not long:
        return triton.testing.do_bench(fn, warmup=50, rep=300, grad_to_none=grads, return_mode="median")
    times = []
    for i in range(4):
        for g in grads or []:
            g.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(step, grads, long: bool) -> float:
    """Median ms of ``step`` (a fwd+bwd) replayed from a CUDA graph: the GPU time with the host's launch cost
    removed (what ``torch.cuda.graph`` / ``make_graphed_callables`` give a user). Captured with the grads None,
    after three warm-up calls on a side stream, as torch's CUDA-graph notes prescribe."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for g in grads:
                g.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for g in grads:
        g.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = bench(graph.replay, None, long)
    for g in grads:
        g.grad = None
    del graph
    return ms


def _parse_block(spec: str) -> tuple[int, int]:
    bm, _, bn = str(spec).partition("x")
    return int(bm), int(bn or bm)


def resources(block_m=64, block_n=64, head_dims=(64, 128), config=None) -> None:
    """Print cuobjdump's register / stack report of each kernel compiled for sm_90 (no GPU needed)."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mtraining_kernels import list_builder as lb
    from mtraining_kernels import triton_backward as tb
    from mtraining_kernels import triton_forward as tf
    from mtraining_kernels.host import default_num_warps
    from mtraining_kernels.testing.gluon import wgmma_serialization_note
    from mtraining_kernels.vertical_slash import DEFAULT_CONFIG

    cfg = config or DEFAULT_CONFIG
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "Out": "*bf16", "ColBits": "*i64"}
    ptrs.update({n: "*i32" for n in "QPos KPos FIdx FCnt FNm ColIdx BIdx BCnt BNm".split()})
    ptrs.update({n: "*fp32" for n in "Lse Lse2 Delta DQ DK DV DKC DVC".split()})
    ptrs.update({n: "*i32" for n in "Comp UAsc VUniq Counts".split()}, Slash="*i64", VSort="*i64")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    target = GPUTarget("cuda", 90, 32)
    for D in head_dims:
        common = dict(HEAD_DIM=D, BLOCK_M=block_m)
        sub = min(block_m, cfg.sub_m)
        bw = lambda bm, bn: cfg.bwd_warps or default_num_warps(bm, bn, D)  # noqa: E731
        rows = min(block_m, cfg.q_rows or block_m)
        sub_n = min(block_n, cfg.sub_n)
        qprog = dict(ROWS=rows, HEAVY_FIRST=cfg.heavy_first)
        kernels = [(tf._vs_fwd_kernel, dict(BLOCK_N=block_n, BLOCK_C=cfg.col_step, SUB_N=sub_n, HAS_COLS=True,
                                            HAS_PREV=False, BLOCK_J=32, **qprog),
                    cfg.fwd_stages, cfg.fwd_warps or default_num_warps(rows, block_n, D))]
        kernels.append((tb._vs_bwd_dq_kernel, dict(BLOCK_N=block_n, BLOCK_C=cfg.col_step, SUB_N=sub_n,
                                                   HAS_COLS=True, BLOCK_J=32, **qprog),
                        cfg.bwd_stages, cfg.dq_warps or bw(rows, sub_n)))
        kernels += [
            (tb._vs_bwd_dkdv_kernel, dict(BLOCK_N=block_n, SUB_M=sub), cfg.bwd_stages,
             bw(sub, block_n)),
            (tb._vs_bwd_dkdv_cols_kernel, dict(BLOCK_C=cfg.col_block, SUB_M=min(block_m, cfg.col_sub_m or sub)),
             cfg.bwd_stages, bw(sub, COL_CHUNK)),
        ]
        kernels.append((tb._bwd_preprocess_kernel, dict(BLOCK=64), 1, 4))
        if D == head_dims[0]:  # the list builder (head-dim free): compiled once per tile shape
            r = block_m // block_n
            tiles = dict(BM=block_m, BN=block_n, R=r)
            kernels += [
                (lb._mark_kernel, dict(BLOCK=256, **tiles), 1, 4),
                (lb._compact_kernel, dict(R=r, BLOCK_U=1024, BLOCK_V=1024), 1, 4),
                (lb._fwd_lists_kernel, dict(R=r, BLOCK_M=32, BLOCK_L=64), 1, 4),
                (lb._bwd_lists_kernel, dict(R=r, BLOCK_T=32, BLOCK_L=64), 1, 4),
                (lb._col_bits_kernel, dict(BLOCK_M=32, BLOCK_C=COL_CHUNK, **tiles), 1, 4),
            ]
        for fn, const, stages, warps in kernels:
            const = {n: c for n, c in const.items() if n in fn.arg_names}
            const = {**{n: c for n, c in common.items() if n in fn.arg_names}, **const}
            sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if "scale" in n else "i32")
                   for n in fn.arg_names}
            # the JIT's specialisation at the benchmark's shapes: 16-byte aligned pointers, and sizes / tensor
            # strides that are multiples of 16 marked divisible (list strides and counts left unmarked), so the
            # loads vectorise as on the GPU (without this the report compiles 2-byte loads)
            div16 = {"Sq", "Sk", "H", "HKV", "BH", "NC"}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in const and (
                sig[n].startswith("*") or n in div16 or re.fullmatch(r"s[qkvdol][bhs]", n))}
            k = triton.compile(ASTSource(fn, sig, const, attrs), target=target,
                               options={"num_warps": warps, "num_stages": stages})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                rep = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True)
            line = next((ln.strip() for ln in rep.stdout.splitlines() if "REG:" in ln), rep.stdout[-200:])
            wgmma = "wgmma" in k.asm["ptx"]
            serial = wgmma_serialization_note(k.asm["ptx"]) is not None
            print(f"{block_m}x{block_n} D={D} {fn.__name__:<26} warps={warps} stages={stages} sub_m={sub} "
                  f"sub_n={sub_n} wgmma={wgmma} serialized={serial} smem={k.metadata.shared} "
                  f"{line.split(' SHARED')[0]}", flush=True)


def _config(spec: str):
    """'key=value,...' -> KernelConfig, e.g. 'bwd_warps=4,bwd_stages=1,sub_n=64' or 'forward=auto'."""
    from mtraining_kernels.vertical_slash import KernelConfig

    kw = {}
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        if key in ("forward", "dq", "dkdv", "dkdv_cols", "item_order"):
            kw[key] = val
        else:
            kw[key] = bool(int(val)) if key == "heavy_first" else int(val)
    return KernelConfig(**kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--resources", action="store_true", help="compiler report only (no GPU needed)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2])
    ap.add_argument("--block-sizes", nargs="+", default=["128"], help="tile sizes: 128, or BMxBN such as 128x64")
    ap.add_argument("--n-vertical", type=int, default=1024)
    ap.add_argument("--anchors", default="sdpa,flex,cover")
    ap.add_argument("--configs", nargs="+", default=[""],
                    help="KernelConfig settings to time, 'key=value,...' ('' = defaults); the first one is the "
                         "row's main result, the others are timed on the same pattern (e.g. bwd_warps=4,bwd_stages=3)")
    ap.add_argument("--same-pattern", action="store_true",
                    help="fit each fraction's pattern at the first block size and time that same pattern at every "
                         "block size (each row reports its own computed fraction), instead of fitting per size")
    ap.add_argument("--profile-idx", action="store_true", help="print a torch.profiler table of the index conversion")
    ap.add_argument("--profile-attn", action="store_true",
                    help="print a torch.profiler table (GPU time per kernel) of one forward+backward per row")
    ap.add_argument("--graphs", action="store_true",
                    help="also time fwd+bwd replayed from a CUDA graph (ours and FlexAttention dense): GPU time "
                         "without the host's launch cost")
    ap.add_argument("--out", default="kernel_sparse.json")
    args = ap.parse_args()
    configs = [_config(c) for c in args.configs]
    if args.resources:
        for spec in args.block_sizes:
            for cfg in configs:
                resources(*_parse_block(spec), config=cfg)
        return
    anchors = set(args.anchors.split(",")) if args.anchors else set()
    dev = torch.device("cuda")
    rows = []
    fitted = {}
    info = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(info, flush=True)
    flex = None
    if anchors & {"flex", "cover"}:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    for S in args.seqlens:
        long = S > 262144
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(1, h, S, D, device=dev, dtype=torch.bfloat16) for h in (H, HKV, HKV, H))
        q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
        dense_flops = 4 * S * S * D * H / 2
        base = {}

        def fb(f):
            def run():
                f().backward(dout)
            return run

        if "sdpa" in anchors:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def sdpa():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            try:
                base["sdpa_fb_ms"] = bench(fb(sdpa), [q, k, v], long)
            except Exception as e:  # noqa: BLE001 - record and go on
                base["sdpa_error"] = repr(e)[:200]
        if "flex" in anchors:
            try:
                from lightning_mtraining.ring.block_ops import FlexBlockOp

                pos = torch.arange(S, device=dev)
                dense_bm = FlexBlockOp(tile=128).block_mask(pos, pos)
                base["flex_fb_ms"] = bench(fb(lambda: flex(q, k, v, block_mask=dense_bm, enable_gqa=True)),
                                           [q, k, v], long)
                if args.graphs:
                    try:
                        base["flex_fb_graph_ms"] = graph_ms(
                            fb(lambda: flex(q, k, v, block_mask=dense_bm, enable_gqa=True)), [q, k, v], long)
                    except Exception as e:  # noqa: BLE001
                        base["flex_graph_error"] = repr(e)[:200]
                del dense_bm
            except Exception as e:  # noqa: BLE001
                base["flex_error"] = repr(e)[:200]
        for tf_key, ms_key in (("sdpa_tflops", "sdpa_fb_ms"), ("flex_tflops", "flex_fb_ms"),
                               ("flex_fb_graph_tflops", "flex_fb_graph_ms")):
            if ms_key in base:
                base[tf_key] = dense_flops * 3.5 / base[ms_key] / 1e9
        print(S, base, flush=True)
        for spec in args.block_sizes:
            BM, BN = _parse_block(spec)
            for frac in args.fractions:
                n_vertical = min(args.n_vertical, int(frac * S / 2))  # at 32K, 1024 verticals alone are ~5%
                if args.same_pattern:
                    fit_at = _parse_block(args.block_sizes[0])
                    if (S, frac) not in fitted:
                        fitted[(S, frac)] = fit_pattern(S, *fit_at, frac, n_vertical, int(frac * 1000) + S, dev)
                    vi, si = fitted[(S, frac)]
                else:
                    vi, si = fit_pattern(S, BM, BN, frac, n_vertical, int(frac * 1000) + S, dev)
                vih, sih = expand_pattern(vi, H, HKV), expand_pattern(si, H, HKV)
                idx_ms = triton.testing.do_bench(lambda: pattern_tile_lists(vih, sih, S, BM, BN), warmup=5, rep=50,
                                                 return_mode="median")
                idx_torch_ms = triton.testing.do_bench(
                    lambda: pattern_tile_lists(vih, sih, S, BM, BN, backend="torch"), warmup=5, rep=50,
                    return_mode="median")
                tiles = pattern_tile_lists(vih, sih, S, BM, BN)
                if args.profile_idx:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(5):
                            pattern_tile_lists(vih, sih, S, BM, BN)
                        torch.cuda.synchronize()
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
                pairs = computed_pairs(tiles)
                row = {"S": S, "T": f"{BM}x{BN}", "target": frac, "fraction": pairs / (H * S * S / 2), "idx_ms": idx_ms,
                       "idx_torch_ms": idx_torch_ms, "n_slash": int((si >= 0).sum(-1).max()),
                       "n_vertical": int((vi >= 0).sum(-1).max()), **base}
                f_ms = bench(lambda: vertical_slash_attention(q, k, v, tiles, config=configs[0]), None, long)
                fb_ms = bench(fb(lambda: vertical_slash_attention(q, k, v, tiles, config=configs[0])), [q, k, v],
                              long)
                row.update(vs_f_ms=f_ms, vs_fb_ms=fb_ms, vs_tflops=4 * D * pairs * 3.5 / fb_ms / 1e9,
                           vs_f_tflops=4 * D * pairs / f_ms / 1e9, config=args.configs[0])
                if args.profile_attn:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(3):
                            fb(lambda: vertical_slash_attention(q, k, v, tiles, config=configs[0]))()
                        torch.cuda.synchronize()
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
                if args.graphs:
                    try:
                        g_ms = graph_ms(fb(lambda: vertical_slash_attention(q, k, v, tiles, config=configs[0])),
                                        [q, k, v], long)
                        row.update(vs_fb_graph_ms=g_ms, vs_graph_tflops=4 * D * pairs * 3.5 / g_ms / 1e9)
                        if "flex_fb_graph_tflops" in base:
                            row["graph_pct_of_flex_graph"] = 100 * row["vs_graph_tflops"] / base["flex_fb_graph_tflops"]
                    except Exception as e:  # noqa: BLE001
                        row["vs_graph_error"] = repr(e)[:200]
                if "flex_fb_ms" in base:
                    row["speedup_vs_flex_dense"] = base["flex_fb_ms"] / fb_ms
                    row["pct_of_flex"] = 100 * row["vs_tflops"] / base["flex_tflops"]
                for spec_c, cfg in zip(args.configs[1:], configs[1:]):  # other launch settings, same pattern
                    try:
                        c_f = bench(lambda: vertical_slash_attention(q, k, v, tiles, config=cfg), None, long)
                        c_fb = bench(fb(lambda: vertical_slash_attention(q, k, v, tiles, config=cfg)), [q, k, v],
                                     long)
                        row.setdefault("other_configs", []).append(
                            {"config": spec_c, "vs_f_ms": c_f, "vs_fb_ms": c_fb,
                             "vs_tflops": 4 * D * pairs * 3.5 / c_fb / 1e9})
                        print(f"  config {spec_c or 'default'}: fwd {c_f:.2f} ms, fwd+bwd {c_fb:.2f} ms "
                              f"(default {f_ms:.2f} / {fb_ms:.2f})", flush=True)
                    except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result too
                        row.setdefault("other_configs", []).append({"config": spec_c, "error": repr(e)[:300]})
                if "cover" in anchors:
                    try:
                        bm, cover_frac = flex_cover_mask(tiles, S, dev)
                        row["cover_fraction"] = cover_frac
                        row["flex_cover_fb_ms"] = bench(
                            fb(lambda: flex(q, k, v, block_mask=bm, enable_gqa=True)), [q, k, v], long)
                        row["speedup_vs_flex_cover"] = row["flex_cover_fb_ms"] / fb_ms
                        del bm
                    except Exception as e:  # noqa: BLE001
                        row["cover_error"] = repr(e)[:200]
                rows.append(row)
                print(json.dumps(row), flush=True)
                tiles = None  # freed before the next row (a del would leave the name unbound for ruff)
                torch.cuda.empty_cache()
        q = k = v = dout = None  # freed before the next length
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    hdr = (f"{'S':>7} {'T':>6} {'frac':>6} {'idx ms':>7} {'idx tch':>7} {'vs f':>8} {'vs f+b':>8} {'TF/s':>5} "
           f"{'flexD':>8} {'TF/s':>5} {'cover':>8} {'x flexD':>7} {'x cover':>7} {'sdpa':>8} {'graph':>7} {'TF/s':>5} "
           f"{'flexDg':>7} {'TF/s':>5}")
    print(hdr)
    for r in rows:
        print(f"{r['S']:>7} {r['T']:>6} {r['fraction']:>6.3f} {r['idx_ms']:>7.2f} {r['idx_torch_ms']:>7.2f} "
              f"{r['vs_f_ms']:>8.2f} "
              f"{r['vs_fb_ms']:>8.2f} {r['vs_tflops']:>5.0f} {r.get('flex_fb_ms', math.nan):>8.1f} "
              f"{r.get('flex_tflops', math.nan):>5.0f} {r.get('flex_cover_fb_ms', math.nan):>8.1f} "
              f"{r.get('speedup_vs_flex_dense', math.nan):>7.1f} {r.get('speedup_vs_flex_cover', math.nan):>7.1f} "
              f"{r.get('sdpa_fb_ms', math.nan):>8.1f} {r.get('vs_fb_graph_ms', math.nan):>7.2f} "
              f"{r.get('vs_graph_tflops', math.nan):>5.0f} {r.get('flex_fb_graph_ms', math.nan):>7.2f} "
              f"{r.get('flex_fb_graph_tflops', math.nan):>5.0f}")


if __name__ == "__main__":
    main()
