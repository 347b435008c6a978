"""A plain Fabric training loop with context parallelism (MTrainingFabricStrategy).

    python examples/fabric_train.py                                   # 2 CPU processes, 4K-token sequences
    python examples/fabric_train.py --accelerator cuda --devices 8 --seq-len 131072 --precision bf16-true \
        --sparsity paper

Fabric never calls ``batch_to_device``; the strategy shards in ``fabric.setup_dataloaders``: every batch the
loop sees is already this rank's shard of the sequence (padded to the layout's unit), and the model's loss is
the exact full-sequence loss on every rank. Sparse attention (``--sparsity``, top-k 64/16 on 32-token tiles by
default; ``none`` for dense): each layer's pattern is estimated online, and ``strategy.attention_metrics()`` gives
the patterns' density and the ring's imbalance, printed every step here. Data: byte-level tokens of Python
standard-library sources.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, Qwen2Config

from lightning_mtraining import MTrainingFabricStrategy, SparseAttentionCallback
from lightning_mtraining.sparsity.config import parse_sparsity


def stdlib_windows(seq_len: int, num_samples: int, packages=("json", "email", "logging")) -> list[dict]:
    root = sysconfig.get_paths()["stdlib"]
    text = bytearray()
    for package in packages:
        for dirpath, _, files in sorted(os.walk(os.path.join(root, package))):
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(dirpath, name), "rb") as f:
                    text += f.read()
    while len(text) < seq_len * num_samples:
        text += text
    tokens = torch.frombuffer(text, dtype=torch.uint8)[: seq_len * num_samples].long().view(num_samples, seq_len)
    return [{"input_ids": t, "labels": t} for t in tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--context-parallel-size", default="auto")
    parser.add_argument("--layout", default="striped", choices=["striped", "zigzag", "contiguous"])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sparsity", default="topk:64,16@32",
                        help="'none', 'paper', 'topp:P' or 'topk:V,S', each with an optional '@T' tile (default 128)")
    parser.add_argument("--tile-size", type=int, default=None,
                        help="tile for a --sparsity that names none (default 128)")
    args = parser.parse_args()

    cp = args.context_parallel_size if args.context_parallel_size == "auto" else int(args.context_parallel_size)
    strategy = MTrainingFabricStrategy(context_parallel_size=cp, layout=args.layout, block_size=args.block_size,
                                       sparsity=parse_sparsity(args.sparsity, tile_size=args.tile_size),
                                       attention=SparseAttentionCallback(log_every_n_steps=1))
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                    precision=args.precision, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)

    config = Qwen2Config(vocab_size=256, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(args.seq_len, 4096))
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)  # HF attention -> ring attention, hooks installed

    data = stdlib_windows(args.seq_len, args.steps * args.batch_size * strategy.dp_size)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch_size, shuffle=True))

    fabric.print(f"world {fabric.world_size} = dp {strategy.dp_size} x cp {strategy.cp_size}, "
                 f"{args.seq_len} tokens per sequence, {args.seq_len // strategy.cp_size}+ per rank")
    start = time.perf_counter()
    for step, batch in enumerate(loader):
        loss = model(**batch).loss  # exact full-sequence loss on every rank
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        attention = strategy.attention_metrics()  # {} when dense
        shown = "".join(f"  {k.split('/')[-1]} {attention[k]:.3f}" for k in ("attention/density", "attention/imbalance")
                        if k in attention)
        fabric.print(f"step {step:3d}  loss {loss.item():.4f}{shown}")
    elapsed = time.perf_counter() - start
    tokens = len(loader) * args.batch_size * args.seq_len * strategy.dp_size
    fabric.print(f"{tokens / elapsed:,.0f} tokens/s over {elapsed:.1f}s")


if __name__ == "__main__":
    main()
