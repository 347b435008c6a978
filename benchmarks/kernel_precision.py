"""Precision report: the vertical-slash kernels' error against a float32 reference, next to torch's own error.

For each case of ``test_fp16_matches_fp32_reference`` (``tests/gpu/test_kernels_gpu.py``; the cases are
``mtraining_kernels.testing.HALF_PRECISION_CASES``: Gluon at 128 x 128 with head dim 128 and 64, Triton at 64 x 64,
the all-snake order at 32767), in bfloat16 and in float16, runs the tests' check
(``mtraining_kernels.testing.half_precision_case``: Qwen2.5-3B heads 16 / 2 KV, 300 verticals, six slashes,
per-head budgets, one fwd+bwd) and prints the max abs error of out, dq, dk and dv for the kernel and for the same
masked attention computed by torch at the same precision, both against float32, with their ratio. The check
asserts ratio <= 2 (flash-attention's rule) plus a small floor; this script shows the margin. Not a timing. (The
tests run the cases without a config through the public ``sparse_attention``, which on CUDA makes the same
``vertical_slash_attention`` call with the same tile lists and scale as this script.)

Command (on a GPU; repo root, with ``kernels/`` importable as ``mtraining_kernels``)::

    python benchmarks/kernel_precision.py --out runs/precision.json
"""

from __future__ import annotations

import argparse
import json

import torch

NAMES = ("out", "dq", "dk", "dv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="precision.json", help="JSON file for the rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_precision.py needs a CUDA GPU (the precision cases allocate on 'cuda')")
    from mtraining_kernels.testing import HALF_PRECISION_CASES, half_precision_case, kernel_config

    rows = []
    print(f"{'dtype':9} {'S':>6} {'D':>4} {'tiles':>9} {'order':>6} " + " ".join(f"{n + ' k/t':>22}" for n in NAMES))
    for dtype in (torch.bfloat16, torch.float16):
        for S, D, block, spec in HALF_PRECISION_CASES:
            kern, ref = half_precision_case(S, D, block, kernel_config(spec) if spec else None, dtype=dtype)
            row = dict(dtype=str(dtype).replace("torch.", ""), S=S, D=D, block=block, config=spec or "default",
                       kernel=kern, torch=ref, ratio=[a / b if b else None for a, b in zip(kern, ref)])
            rows.append(row)
            ratios = (float("nan") if r is None else r for r in row["ratio"])
            cells = " ".join(f"{a:.2e}/{b:.2e} {r:4.2f}" for a, b, r in zip(kern, ref, ratios))
            tiles = f"{block}x{block}"
            print(f"{row['dtype']:9} {S:>6} {D:>4} {tiles:>9} {spec.partition('=')[2] or 'auto':>6} {cells}")
    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name())
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
