"""Benchmark: the LM loss's forward+backward without its logits (``losses.fused_linear_cross_entropy``) against
the plain loss, Liger-Kernel's and cut-cross-entropy's fused losses, one GPU.

Commands (GPU, repo root, the package installed: ``pip install --no-deps --no-build-isolation -e .``; Liger-Kernel
and cut-cross-entropy are used where importable, a row says so where not)::

    python benchmarks/fused_loss.py --out runs/fused_loss.json
    python benchmarks/fused_loss.py --rows 8192 --methods plain ours --out runs/fused_loss_8k.json
    python benchmarks/fused_loss.py --cpu-smoke --out /tmp/fused_loss_smoke.json   # CPU, tiny, plain and ours only

Shape: the output embedding of Qwen2.5-3B, ``hidden [T, 2048]`` and ``weight [151936, 2048]``, both bf16, both
requiring grad; T = 8192, 32768, 65536 rows (``--rows``). Targets uniform in [0, V), about 5% set to -100 (ignored).
The loss is the sum over the targets (``reduction="sum"``) everywhere.

Methods (rows):

- ``plain``: ``F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")``, the computation of Hugging Face's
  causal-LM loss (bf16 logits, upcast to float32);
- ``ours``: ``fused_linear_cross_entropy(h, w, t, backend="torch")`` (``--chunk-size``, default: the function's
  own); ``auto``: the function's default backend (Liger-Kernel with float32 accumulation and
  ``losses.LIGER_CHUNK_MEM`` where installed, else ``ours``);
- ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, h, t)`` (weight first), its
  default ``accum_dtype=None`` (the weight gradient summed over chunks in bf16); ``liger-fp32acc``: the same with
  ``accum_dtype=torch.float32`` (summed in float32, as ``ours`` does); ``liger-fp32acc-cN``: that through
  ``losses._liger_loss`` with Liger's ``chunk_mem_const=N`` (rows per chunk ~ T * N * 2048 / V; the default is 1);
- ``cce``: cut-cross-entropy's ``linear_cross_entropy(h, w, t, reduction="sum")`` with its defaults (the CCE Triton
  kernels; ``filter_eps="high"`` skips gradient entries whose softmax is below a bf16-level threshold).

Measured per row: ``ms``, the median of forward+backward (``_timing.median_ms``: ``triton.testing.do_bench``, the
gradients set to None before each call); ``peak GiB``, ``max_memory_allocated`` during one forward+backward minus
``memory_allocated`` before it (so above the inputs; it includes the bf16 gradients of h and w that every method
returns, (T + V) x 2048 x 2 bytes = 0.65 GiB at T = 8192, 0.83 GiB at 65536); the error of that call against a
float32 reference: the loss's relative error, and the max abs error of grad_hidden and grad_weight, each also
divided by the reference's largest entry (``rel``). A method that runs out of memory is a row ``OOM``; one that is
not installed or fails is a row with the reason.

The reference is the plain computation in float32 (h and w upcast, float32 matmuls: TF32 as the run's
``allow_tf32`` in ``info``, off by default) computed once per T, in blocks of 2048 rows, each block through autograd
and the blocks' losses and weight gradients added: the same sums regrouped, so it fits at every T (the whole
float32 plain loss at 65536 rows needs ~120 GiB). It is kept on the host while the methods run.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_mtraining.hf.losses import fused_linear_cross_entropy

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ run as scripts, not a package
from _timing import median_ms, write_results  # noqa: E402

IGNORE_INDEX = -100
REF_BLOCK = 2048  # rows per block of the float32 reference
METHODS = ("plain", "ours", "auto", "liger", "liger-fp32acc", "liger-fp32acc-c1", "liger-fp32acc-c4",
           "liger-fp32acc-c8", "liger-fp32acc-c16", "cce")


def make_inputs(T: int, Dm: int, V: int, device: torch.device, dtype: torch.dtype, seed: int):
    """``hidden [T, Dm]`` (unit normal), ``weight [V, Dm]`` (std 0.02, a usual init: logits of std ~0.9) and
    ``targets [T]`` (uniform over the vocabulary, about 5% ignored)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(T, Dm, device=device, generator=g).to(dtype)
    w = (0.02 * torch.randn(V, Dm, device=device, generator=g)).to(dtype)
    t = torch.randint(0, V, (T,), device=device, generator=g)
    t[torch.rand(T, device=device, generator=g) < 0.05] = IGNORE_INDEX
    return h, w, t


def reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> dict:
    """The float32 plain loss and gradients, ``REF_BLOCK`` rows at a time (see the module docstring); on the host."""
    w32 = w.detach().float().requires_grad_(True)
    grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    loss = 0.0
    for start in range(0, h.shape[0], REF_BLOCK):
        h32 = h[start:start + REF_BLOCK].detach().float().requires_grad_(True)
        block = F.cross_entropy(F.linear(h32, w32), t[start:start + REF_BLOCK], reduction="sum",
                                ignore_index=IGNORE_INDEX)
        block.backward()
        loss += float(block.detach())
        grad_h[start:start + REF_BLOCK] = h32.grad
    return {"loss": loss, "grad_hidden": grad_h.cpu(), "grad_weight": w32.grad.cpu()}


def method_fn(name: str, chunk_size: int | None) -> Callable:
    """``loss(h, w, t)`` of method ``name``; raises ImportError where its library is absent."""
    if name == "plain":
        return lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, reduction="sum", ignore_index=IGNORE_INDEX)
    if name == "ours":
        return lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=chunk_size, ignore_index=IGNORE_INDEX,
                                                          backend="torch")
    if name == "auto":
        return lambda h, w, t: fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX)
    if name.startswith("liger-fp32acc-c"):
        from lightning_mtraining.hf.losses import _liger_function, _liger_loss

        if isinstance(_liger_function(), str):
            raise ImportError(_liger_function())
        const = int(name.removeprefix("liger-fp32acc-c"))
        return lambda h, w, t: _liger_loss(h, w, None, t, None, IGNORE_INDEX, chunk_mem_const=const)
    if name in ("liger", "liger-fp32acc"):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        accum = torch.float32 if name == "liger-fp32acc" else None
        loss = LigerFusedLinearCrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX, accum_dtype=accum)
        return lambda h, w, t: loss(w, h, t)  # Liger takes the weight first
    if name == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX, reduction="sum")
    raise ValueError(f"unknown method {name!r} (known: {METHODS})")


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def max_err(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, that divided by the reference's max abs entry); ``ref`` on the host, compared on got's device."""
    ref = ref.to(got.device)
    err = float((got.float() - ref).abs().max())
    scale = float(ref.abs().max())
    return err, err / scale if scale else float("nan")


def measure(name: str, fn: Callable, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, ref: dict | None,
            device: torch.device) -> dict:
    """One row: time, peak memory and errors of ``fn``'s forward+backward (see the module docstring)."""
    row: dict = {"method": name}

    def step():
        fn(h, w, t).backward()

    try:
        row["ms"] = median_ms(step, device, grads=[h, w])
        h.grad = w.grad = None
        free(device)
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss = fn(h, w, t)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        row["loss"] = float(loss)
        del loss
        if ref is not None:
            row["loss_rel_err"] = abs(row["loss"] - ref["loss"]) / abs(ref["loss"])
            row["dh_err"], row["dh_rel"] = max_err(h.grad, ref["grad_hidden"])
            row["dw_err"], row["dw_rel"] = max_err(w.grad, ref["grad_weight"])
        row["status"] = "ok"
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    except Exception as e:  # noqa: BLE001 - a library that fails is a row saying why, not a crash
        row["status"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    h.grad = w.grad = None
    free(device)
    return row


def library_versions() -> dict:
    out = {}
    for module in ("triton", "liger_kernel", "cut_cross_entropy"):
        try:
            mod = __import__(module)
            out[module] = getattr(mod, "__version__", "installed")
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            out[module] = f"absent ({type(e).__name__})"
    if out["liger_kernel"] == "installed":
        from importlib.metadata import version

        out["liger_kernel"] = version("liger_kernel")
    return out


def run(args) -> tuple[dict, list[dict]]:
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "device": torch.cuda.get_device_name() if not smoke else "cpu",
            "dtype": str(dtype), "hidden_size": args.hidden_size, "vocab": args.vocab, "ref_block_rows": REF_BLOCK,
            "allow_tf32": torch.backends.cuda.matmul.allow_tf32, "args": vars(args), **library_versions()}
    print(info, flush=True)
    rows = []
    for T in args.rows:
        h, w, t = make_inputs(T, args.hidden_size, args.vocab, device, dtype, seed=T)
        try:
            t0 = time.perf_counter()
            ref = reference(h, w, t)
            ref_note = f"float32 reference in {time.perf_counter() - t0:.1f} s"
        except torch.OutOfMemoryError:
            ref, ref_note = None, "float32 reference: OOM, no errors at this T"
        free(device)
        print(f"T={T}: {ref_note}", flush=True)
        h.requires_grad_(True)
        w.requires_grad_(True)
        for name in args.methods:
            try:
                fn = method_fn(name, args.chunk_size)
            except Exception as e:  # noqa: BLE001 - an absent library is a row saying why
                row = {"method": name, "status": f"unavailable: {type(e).__name__}: {str(e)[:200]}"}
            else:
                row = measure(name, fn, h, w, t, ref, device)
            row.update(T=T, reference=ref_note)
            rows.append(row)
            print({k: v for k, v in row.items() if k != "reference"}, flush=True)
        del h, w, t, ref
        free(device)
    return info, rows


def print_table(rows: list[dict]) -> None:
    print("\nforward+backward of the summed LM loss; peak: above the inputs, the returned gradients included; errors "
          "against the float32 reference: loss relative, gradients max abs (and / max |ref|)")
    print(f"{'T':>6} {'method':<14} {'ms':>9} {'peak GiB':>9} {'loss rel':>9} {'dh max abs (rel)':>20} "
          f"{'dw max abs (rel)':>20}  status")

    def cell(r, a, b):
        return f"{r[a]:.2e} ({r[b]:.1e})" if a in r else "-"

    for r in rows:
        ms = f"{r['ms']:9.2f}" if "ms" in r else f"{'-':>9}"
        peak = f"{r['peak_gib']:9.2f}" if "peak_gib" in r else f"{'-':>9}"
        rel = f"{r['loss_rel_err']:9.1e}" if "loss_rel_err" in r else f"{'-':>9}"
        print(f"{r['T']:>6} {r['method']:<14} {ms} {peak} {rel} {cell(r, 'dh_err', 'dh_rel'):>20} "
              f"{cell(r, 'dw_err', 'dw_rel'):>20}  {r['status']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8192, 32768, 65536], help="T, rows of hidden")
    ap.add_argument("--hidden-size", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--chunk-size", type=int, default=None, help="ours: rows per chunk (default: the function's)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CPU, float32, T 256, hidden 64, V 1013, plain and ours, 64-row chunks (checks the script)")
    ap.add_argument("--out", default="fused_loss.json")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.rows, args.hidden_size, args.vocab = [256], 64, 1013
        args.methods = ["plain", "ours"]
        args.chunk_size = args.chunk_size or 64
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --cpu-smoke)")
    info, rows = run(args)
    write_results(args.out, info, rows, print_table)


if __name__ == "__main__":
    main()
