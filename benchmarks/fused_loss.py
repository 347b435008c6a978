"""Benchmark: the language-model loss with and without logits, forward+backward, one GPU.

Command (GPU, repo root; Liger-Kernel and cut-cross-entropy are optional: rows say when they are missing)::

    python benchmarks/fused_loss.py --out $OUT/fused_loss.json
    python benchmarks/fused_loss.py --cpu-smoke --out /tmp/fused_loss_smoke.json   # CPU, tiny, plain and ours

Hidden ``[T, 2048]`` and head ``[151936, 2048]`` in bf16 (Qwen2.5-3B), T = 8K, 32K, 64K rows (``--rows``), targets
random with 5% ignored (-100). Implementations, each the sum of the token losses:

- ``plain``: ``F.linear``, ``.float()``, ``F.cross_entropy`` (what a Hugging Face model does with labels);
- ``ours``: :func:`lightning_mtraining.losses.fused_linear_cross_entropy` (chunks of rows, gradients in forward);
- ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss(reduction="sum")``;
- ``cce``: cut-cross-entropy's ``linear_cross_entropy(..., reduction="sum")``.

Per row: the median forward+backward time, the peak memory above the inputs (``max_memory_allocated`` minus what
was allocated before), and the errors against a float32 plain reference of the same inputs (relative error of the
loss, max abs error of ``d hidden`` and ``d weight`` over their max abs value); "OOM" when it did not fit.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_mtraining.losses import fused_linear_cross_entropy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_ms, write_results  # noqa: E402


def implementations() -> dict:
    impls = {
        "plain": lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100, reduction="sum"),
        "ours": lambda h, w, t: fused_linear_cross_entropy(h, w, t),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum", ignore_index=-100)
        impls["liger"] = lambda h, w, t: liger(w, h, t)
    except Exception as e:  # noqa: BLE001 - optional
        impls["liger"] = f"not importable: {type(e).__name__}: {e}"
    try:
        from cut_cross_entropy import linear_cross_entropy

        impls["cce"] = lambda h, w, t: linear_cross_entropy(h, w, t, reduction="sum", ignore_index=-100)
    except Exception as e:  # noqa: BLE001 - optional
        impls["cce"] = f"not importable: {type(e).__name__}: {e}"
    return impls


def run(args) -> tuple[dict, list[dict]]:
    cuda = not args.cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    D, V = (2048, 151936) if cuda else (64, 1013)
    impls = implementations()
    if not cuda:
        impls = {k: impls[k] for k in ("plain", "ours")}
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "D": D, "V": V, "dtype": str(dtype), "args": vars(args)}
    for mod in ("triton", "liger_kernel", "cut_cross_entropy"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception:  # noqa: BLE001
            pass
    print(info, flush=True)
    rows = []
    for T in args.rows:
        g = torch.Generator(device=device).manual_seed(T)
        h0 = torch.randn(T, D, device=device, generator=g).to(dtype)
        w0 = (torch.randn(V, D, device=device, generator=g) * 0.02).to(dtype)
        t = torch.randint(0, V, (T,), device=device, generator=g)
        t[torch.rand(T, device=device, generator=g) < 0.05] = -100
        ref = None
        try:  # float32 plain reference of the same (rounded) inputs
            hr, wr = (x.detach().float().clone().requires_grad_(True) for x in (h0, w0))
            loss = F.cross_entropy(F.linear(hr, wr), t, ignore_index=-100, reduction="sum")
            loss.backward()
            ref = (loss.detach(), hr.grad, wr.grad)
            del hr, wr, loss
        except torch.OutOfMemoryError:
            print(f"T={T}: no float32 reference (out of memory)", flush=True)
        if cuda:
            torch.cuda.empty_cache()
        for name, fn in impls.items():
            row = {"T": T, "impl": name}
            if isinstance(fn, str):
                row["status"] = fn
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            h, w = (x.detach().clone().requires_grad_(True) for x in (h0, w0))
            try:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                loss = fn(h, w, t)
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
                    row["peak_above_inputs_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
                if ref is not None:
                    row["loss_rel_err"] = float((loss.detach().float() - ref[0]).abs() / ref[0].abs())
                    row["dh_err"] = float((h.grad.float() - ref[1]).abs().max() / ref[1].abs().max())
                    row["dw_err"] = float((w.grad.float() - ref[2]).abs().max() / ref[2].abs().max())
                del loss

                def step():
                    fn(h, w, t).backward()

                row["fwd_bwd_ms"] = median_ms(step, device, [h, w])
                row["status"] = "ok"
            except torch.OutOfMemoryError:
                row["status"] = "OOM"
            except Exception as e:  # noqa: BLE001 - a failing library is a row
                row["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
            del h, w
            if cuda:
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ref
    return info, rows


def print_table(rows: list[dict]) -> None:
    nan = float("nan")
    print(f"\n{'T':>7} {'impl':<6} {'fwd+bwd ms':>11} {'peak GiB':>9} {'loss rel':>9} {'dh err':>8} {'dw err':>8}"
          "  status")
    for r in rows:
        print(f"{r['T']:>7} {r['impl']:<6} {r.get('fwd_bwd_ms', nan):>11.2f} "
              f"{r.get('peak_above_inputs_gib', nan):>9.2f} "
              f"{r.get('loss_rel_err', nan):>9.2e} {r.get('dh_err', nan):>8.2e} {r.get('dw_err', nan):>8.2e}  "
              f"{r.get('status')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8192, 32768, 65536])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out", default="fused_loss.json")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.rows = [256, 1000]
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --cpu-smoke)")
    info, rows = run(args)
    write_results(args.out, info, rows, print_table)


if __name__ == "__main__":
    main()
