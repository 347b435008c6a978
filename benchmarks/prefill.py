"""Benchmark: the sparse prefill (``register_sparse_prefill``) against SDPA, one attention layer, one GPU.

Command (GPU, repo root, ``kernels/`` importable as ``mtraining_kernels``, see ``benchmarks/estimation.py``)::

    python benchmarks/prefill.py --out runs/prefill.json
    python benchmarks/prefill.py --smoke --out /tmp/prefill_smoke.json   # CPU, float32, 512 tokens

Shape: Qwen2.5-3B attention (16 query heads, 2 KV heads, head dim 128), bf16, batch 1, causal, forward only (a
prefill runs no backward); N = 32K, 64K, 128K, 256K, 512K (``--seqlens``). What is timed is one call of each
``AttentionInterface`` function a model layer would make with the prompt's post-RoPE Q, K, V:

- ``sdpa``: transformers' ``sdpa_attention_forward`` (what ``attn_implementation="sdpa"`` runs: PyTorch SDPA,
  flash backend, ``enable_gqa``);
- ``sparse``: :func:`lightning_mtraining.hf.prefill.sparse_prefill_attention` (what the registered name runs at
  prefill): the online estimate (``estimate_pattern``, one device), the tile lists and the Triton kernels, all
  included; ``estimate`` alone is timed too. Two configs: top-p 0.9 with caps 4096/4096 (MTraining's training
  setting) and top-k 1024/1024, one pattern per query head, 4 sinks, a 128-token window, last_q 64.

Inputs: :func:`estimation.peaked_qk` (benchmarks/estimation.py's Q/K with sinks, heavy columns, a local decay and
repeated-text slashes; random Q/K would make top-p keep nearly everything), V random. Each row prints the pattern's
density (share of causal pairs computed, mean over heads) and recall (``attention_recall``, 64 evenly spaced rows):
a speed-up is only worth its recall. Timing: ``triton.testing.do_bench`` median, L2 flushed, at least 5 timed calls
(``_timing.median_ms``).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from lightning_mtraining.hf.prefill import sparse_prefill_attention
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.estimation import attention_recall, estimate_pattern

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ run as scripts, not a package
from _timing import median_ms, write_results  # noqa: E402
from estimation import HKV, D, H, peaked_qk  # noqa: E402


def configs(args) -> dict[str, SparsityConfig]:
    tile = args.tile_size
    return {
        f"top-p {args.top_p:g} caps {args.caps[0]}/{args.caps[1]}": SparsityConfig(
            top_p=args.top_p, max_vertical=args.caps[0], max_slash=args.caps[1], tile_size=tile, local_window=tile,
            last_q=64),
        f"top-k {args.topk[0]}/{args.topk[1]}": SparsityConfig(
            vertical_topk=args.topk[0], slash_topk=args.topk[1], tile_size=tile, local_window=tile, last_q=64),
    }


def run(args) -> tuple[dict, list[dict]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    module = SimpleNamespace(layer_idx=0, is_causal=True, num_key_value_groups=H // HKV)  # what a layer passes
    scale = D ** -0.5
    rows = []
    for n in args.seqlens:
        q, k = peaked_qk(n, device, dtype, seed=n)
        v = torch.randn(1, HKV, n, D, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(1))
        with torch.no_grad():
            sdpa_ms = median_ms(lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scale), device)
            print(f"{n:>7} sdpa {sdpa_ms:9.2f} ms", flush=True)
            for name, cfg in configs(args).items():
                pattern = estimate_pattern(q, k, cfg, layout="contiguous", block_size=cfg.tile_size, scale=scale)
                density = pattern.to("cpu").density(n)
                recall = attention_recall(q, k, pattern, rows=64, layout="contiguous", block_size=cfg.tile_size,
                                          scale=scale)
                est_ms = median_ms(lambda: estimate_pattern(q, k, cfg, layout="contiguous",
                                                            block_size=cfg.tile_size, scale=scale), device)
                sparse_ms = median_ms(lambda: sparse_prefill_attention(module, q, k, v, None, scale, sparsity=cfg),
                                      device)
                rows.append(dict(N=n, config=name, sdpa_ms=sdpa_ms, sparse_ms=sparse_ms, estimate_ms=est_ms,
                                 speedup=sdpa_ms / sparse_ms, density=float(density.mean()),
                                 density_min=float(density.min()), density_max=float(density.max()),
                                 recall=float(recall.mean()), recall_min=float(recall.min())))
                r = rows[-1]
                print(f"{n:>7} {name:<24} sparse {sparse_ms:9.2f} ms (estimate {est_ms:7.2f})  x{r['speedup']:.2f}  "
                      f"density {r['density']:.3f}  recall {r['recall']:.3f}", flush=True)
        q = k = v = None  # free before the next length
        if device.type == "cuda":
            torch.cuda.empty_cache()
    import transformers

    info = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, transformers=transformers.__version__, dtype=str(dtype),
                shape=dict(H=H, HKV=HKV, D=D), command=" ".join(sys.argv))
    return info, rows


def print_table(rows: list[dict]) -> None:
    print("| N | config | SDPA ms | sparse prefill ms (estimate) | speed-up | density | recall (min) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        n = f"{r['N'] // 1024}K" if r["N"] % 1024 == 0 else str(r["N"])
        print(f"| {n} | {r['config']} | {r['sdpa_ms']:.1f} | {r['sparse_ms']:.1f} "
              f"({r['estimate_ms']:.1f}) | {r['speedup']:.2f}x | {r['density']:.3f} | {r['recall']:.3f} "
              f"({r['recall_min']:.3f}) |")


def main(argv=None) -> tuple[dict, list[dict]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 65536, 131072, 262144, 524288])
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--caps", type=int, nargs=2, default=[4096, 4096], help="top-p caps (vertical, slash)")
    ap.add_argument("--topk", type=int, nargs=2, default=[1024, 1024], help="top-k budgets (vertical, slash)")
    ap.add_argument("--tile-size", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="CPU, float32, 512 tokens (checks the script runs)")
    ap.add_argument("--out", default="prefill.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seqlens, args.topk, args.caps, args.tile_size = [512], [16, 2], [128, 32], 32
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --smoke)")
    info, rows = run(args)
    write_results(args.out, info, rows, print_table)
    return info, rows


if __name__ == "__main__":
    main()
