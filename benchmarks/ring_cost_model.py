"""Cost model: flat vs hierarchical ring attention on 8 to 64 GPUs (no GPU needed; a model, not a measurement).

    python benchmarks/ring_cost_model.py --seq 524288 --gpus 8 16 32 64 --density 1.0 0.25 0.06 --out cost.json

Inputs are a measured attention throughput (``--tflops``, per GPU, forward+backward, from
``benchmarks/RESULTS.md``) and link bandwidths per GPU per direction (``--nvlink-gbs`` inside a node,
``--ib-gbs`` across nodes, one NIC per GPU). Shape: Qwen2.5-3B attention (16 heads, 2 KV heads, head dim 128),
bf16 K/V on the wire, float32 dK/dV in backward.

Per ring step and rank (striped layout: every rank does the same work, DESIGN.md):
  compute  t_c = density * F / W^2 / rate,   F = 4 N^2 D H / 2 * 3.5 (causal, forward+backward)
  traffic  b   = kv (forward) + kv + 2 kv (backward: K/V again plus float32 dK/dV),  kv = 2 (N/W) Hkv D 2 bytes
Flat ring over W GPUs on several nodes: each step waits for the slowest hop, an inter-node one:
  step = max(t_c, b / ib),  total = W * step.
Hierarchical (inner ring of g GPUs per node, outer ring over nodes): an outer step posts the inter-node
transfer, runs g inner steps, then waits:
  inner = max(t_c, b / nvlink),  outer = max(g * inner, b / ib),  total = (W / g) * outer.
Not modelled: latency per message, kernel launch gaps, the diagonal step's extra masking, congestion.
"""

from __future__ import annotations

import argparse
import json

H, HKV, D = 16, 2, 128


def model(seq: int, gpus: int, per_node: int, density: float, tflops: float, nvlink: float, ib: float) -> dict:
    flops = 4 * seq * seq * D * H / 2 * 3.5
    t_c = density * flops / gpus**2 / (tflops * 1e12)
    kv = 2 * (seq // gpus) * HKV * D * 2
    traffic = kv + kv + 2 * kv
    if gpus <= per_node:
        step = max(t_c, traffic / (nvlink * 1e9))
        flat = hier = gpus * step
    else:
        flat = gpus * max(t_c, traffic / (ib * 1e9))
        inner = max(t_c, traffic / (nvlink * 1e9))
        hier = (gpus // per_node) * max(per_node * inner, traffic / (ib * 1e9))
    ideal = gpus * t_c
    return {"seq": seq, "gpus": gpus, "density": density, "compute_s": ideal, "flat_s": flat, "hier_s": hier,
            "flat_comm_bound": flat > ideal * 1.0001, "hier_vs_flat": hier / flat}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--density", type=float, nargs="+", default=[1.0, 0.25, 0.06])
    ap.add_argument("--tflops", type=float, default=350.0, help="achieved attention TFLOP/s per GPU (fwd+bwd)")
    ap.add_argument("--nvlink-gbs", type=float, default=450.0, help="GB/s per GPU per direction inside a node")
    ap.add_argument("--ib-gbs", type=float, default=50.0, help="GB/s per GPU per direction across nodes")
    ap.add_argument("--out", default="ring_cost_model.json")
    args = ap.parse_args()
    rows = [model(s, g, args.gpus_per_node, d, args.tflops, args.nvlink_gbs, args.ib_gbs)
            for s in args.seq for d in args.density for g in args.gpus]
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"{'seq':>7} {'density':>7} {'GPUs':>4} {'compute s':>9} {'flat s':>8} {'hier s':>8} {'hier/flat':>9}")
    for r in rows:
        print(f"{r['seq']:>7} {r['density']:>7.2f} {r['gpus']:>4} {r['compute_s']:>9.3f} {r['flat_s']:>8.3f} "
              f"{r['hier_s']:>8.3f} {r['hier_vs_flat']:>9.2f}")


if __name__ == "__main__":
    main()
