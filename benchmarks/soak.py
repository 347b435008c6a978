"""Soak: many training steps through ``Trainer(strategy=MTrainingStrategy(...))`` with memory recorded every step;
the memory must stay flat (no growth with the step count: a leak in the ring, the estimator, the hooks or the
per-step lists would show as a slope).

Commands::

    python benchmarks/soak.py --steps 1000 --devices 2 --out /tmp/soak_cpu.json --plot /tmp/soak_cpu.png   # CPU
    python benchmarks/soak.py --gpu --steps 200 --seq-len 131072 --qwen-3b --out $OUT/soak_gpu.json      # GPU

What runs: a random-init Qwen2 model (CPU: 2 layers, hidden 64, 4 heads on 2 KV heads, vocabulary 1013; ``--qwen-3b``:
the Qwen2.5-3B shape with HF gradient checkpointing, bf16), sparse attention (top-p 0.9, tiles of 16 on CPU, 128 on
the GPU; ``--dense`` for the dense ring), ``--devices`` processes (context parallel over all of them), SGD, a new
batch of random tokens every step, validation every ``--val-every`` steps (the sharded eval path too). Recorded on
every rank after every step: the process's resident set size (``VmRSS``), and on the GPU ``memory_allocated`` and
``memory_reserved``. Reported: the values at a few steps, and the least-squares slope over the second half of the
run (after allocator and cache warm-up) in KiB per step, per rank; ``flat`` when every rank's slope times the run's
length stays under ``--tolerance-mib`` (default 8 MiB: well under one step's activations, well over allocator
noise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def slope_per_step(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    num = sum((i - mx) * (v - my) for i, v in enumerate(values))
    den = sum((i - mx) ** 2 for i in range(n))
    return num / den


def run(args) -> None:
    import lightning as L
    import torch
    import transformers

    from lightning_mtraining import MTrainingStrategy, SparsityConfig

    cuda = args.gpu
    if args.qwen_3b:
        shape = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6)
    else:
        shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1013, tie_word_embeddings=True)
    tile = 128 if cuda else 16
    sparsity = None if args.dense else SparsityConfig(top_p=0.9, max_vertical=64, max_slash=64, last_q=16,
                                                      local_window=tile, tile_size=tile)

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.Qwen2Config(**shape, max_position_embeddings=max(args.seq_len, 4096))
            self.model = transformers.Qwen2ForCausalLM(config)
            if args.qwen_3b:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(**batch).loss, sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, count: int, seed: int) -> None:
            self.count, self.seed = count, seed

        def __len__(self) -> int:
            return self.count

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            ids = torch.randint(0, shape["vocab_size"], (args.seq_len,), generator=g)
            return {"input_ids": ids, "labels": ids}

    class Record(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_end(self, trainer, *a):
            row = {"step": trainer.global_step, "rss": rss_bytes(), "t": time.time()}
            if cuda:
                row.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved())
            self.rows.append(row)
            if trainer.global_rank == 0 and trainer.global_step % max(1, args.steps // 10) == 0:
                print(f"step {trainer.global_step}: rss {row['rss'] / 2**20:.1f} MiB", flush=True)

    record = Record()
    strategy = MTrainingStrategy(sparsity=sparsity, block_size=tile, activation_checkpointing=False)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
        precision="bf16-true" if cuda else "32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
        val_check_interval=args.val_every, check_val_every_n_epoch=None, limit_val_batches=1,
        num_sanity_val_steps=0, use_distributed_sampler=False,
    )
    torch.manual_seed(0)
    module = LM()
    train = torch.utils.data.DataLoader(Tokens(args.steps, seed=1), batch_size=1)
    val = torch.utils.data.DataLoader(Tokens(1, seed=2), batch_size=1)
    trainer.fit(module, train, val)
    rank = trainer.global_rank
    part = Path(f"{args.out}.rank{rank}")
    part.write_text(json.dumps(record.rows))
    trainer.strategy.barrier()
    if rank != 0:
        return
    ranks = []
    for r in range(trainer.world_size):
        p = Path(f"{args.out}.rank{r}")
        ranks.append(json.loads(p.read_text()))
        p.unlink()
    report(args, ranks, cuda, torch.__version__)


def report(args, ranks: list[list[dict]], cuda: bool, torch_version: str) -> None:
    keys = ["rss"] + (["allocated", "reserved"] if cuda else [])
    n = len(ranks[0])
    out = {"info": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
                    "torch": torch_version, "args": vars(args), "seconds": ranks[0][-1]["t"] - ranks[0][0]["t"]},
           "ranks": []}
    flat = True
    show = sorted({1, 10, 100, n // 4, n // 2, 3 * n // 4, n} & set(range(1, n + 1)))
    print(f"\n{'rank':>4} {'what':>9} " + " ".join(f"{'step ' + str(s):>11}" for s in show)
          + f" {'slope KiB/step':>15} {'growth MiB':>11}")
    for r, rows in enumerate(ranks):
        entry = {"rank": r}
        for key in keys:
            values = [row[key] for row in rows]
            tail = values[len(values) // 2:]
            s = slope_per_step(tail)
            growth = s * n / 2**20
            flat &= growth < args.tolerance_mib
            entry[key] = {"values": values, "slope_bytes_per_step": s, "growth_mib_over_run": growth}
            print(f"{r:>4} {key:>9} " + " ".join(f"{values[i - 1] / 2**20:>11.1f}" for i in show)
                  + f" {s / 1024:>15.3f} {growth:>11.2f}")
        out["ranks"].append(entry)
    out["flat"] = flat
    print(f"\n{n} steps in {out['info']['seconds']:.0f} s; memory flat (growth over the run < "
          f"{args.tolerance_mib} MiB on every rank, from the second half's slope): {flat}", flush=True)
    Path(args.out).write_text(json.dumps(out))
    print(f"wrote {args.out}")
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            print("no plot: matplotlib is not installed (pip install '.[bench]')")
            return

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for e in out["ranks"]:
            for key in keys:
                ax.plot([v / 2**20 for v in e[key]["values"]], label=f"rank {e['rank']} {key}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("MiB")
        ax.set_title(f"soak: {n} steps, {len(ranks)} ranks, {'dense' if args.dense else 'sparse'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=509)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--qwen-3b", action="store_true")
    ap.add_argument("--tolerance-mib", type=float, default=8.0)
    ap.add_argument("--plot", default="")
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args()
    if not args.gpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    run(args)


if __name__ == "__main__":
    main()
