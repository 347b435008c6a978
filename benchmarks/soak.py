"""Soak: many training steps through ``Trainer(strategy=MTrainingStrategy(...))`` with memory recorded every step;
the memory must stay flat (no growth with the step count: a leak in the ring, the estimator, the hooks or the
per-step lists would show as a slope).

Commands::

    python benchmarks/soak.py --steps 1000 --devices 2 --out /tmp/soak_cpu.json --plot /tmp/soak_cpu.png   # CPU
    python benchmarks/soak.py --gpu --devices 1 --steps 200 --seq-len 131072 --qwen-3b --layers 4 \
        --out runs/soak_gpu.json --plot runs/soak_gpu.png                                              # GPU

What runs: a random-init Qwen2 model (CPU: 2 layers, hidden 64, 4 heads on 2 KV heads, vocabulary 1013; ``--qwen-3b``:
the Qwen2.5-3B shape with HF gradient checkpointing, bf16; ``--layers`` fewer decoder layers, so 200 steps at 128K take
minutes, not an hour), sparse attention (top-p 0.9, tiles of 16 on CPU, 128 on the GPU; ``--dense`` for the dense ring),
``--devices`` processes (context parallel over all of them), AdamW, a new batch every step, validation every
``--val-every`` steps (the sharded eval path too). The data can be learnt only through long-range attention: each
sequence repeats one fixed random block of ``--period`` tokens from a random offset, so from the second period on
every token is the one ``period`` positions back (a diagonal of the vertical-slash pattern) and the loss falls from
``ln(vocab)`` as the model finds it.

Recorded on every rank after every step: the loss, the process's resident set size (``VmRSS``), and on the GPU
``memory_allocated`` and ``memory_reserved``. Reported: the values at a few steps, and the least-squares slope over
the second half of the run (after allocator and cache warm-up) in KiB per step, per rank; ``flat`` when every rank's
slope times the run's length stays under ``--tolerance-mib`` (default 8 MiB: well under one step's activations, well
over allocator noise) and, for the GPU's allocated memory, under ``--tolerance-rel`` of its median (default 1%);
``finite`` when every loss is; ``falling`` when the mean loss of the last tenth of the steps is below the first
tenth's; ``ok`` when all three hold (the exit status is 1 otherwise). ``--plot``: memory and loss against the step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
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


def run(args) -> dict | None:
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
    if args.layers:
        shape["num_hidden_layers"] = args.layers
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
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, count: int, seed: int) -> None:
            self.count, self.seed = count, seed

        def __len__(self) -> int:
            return self.count

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            start = int(torch.randint(0, args.period, (1,), generator=g))
            ids = block[(start + torch.arange(args.seq_len)) % args.period]
            return {"input_ids": ids, "labels": ids}

    # the one block every sequence repeats (see the module docstring)
    block = torch.randint(0, shape["vocab_size"], (args.period,), generator=torch.Generator().manual_seed(7))

    class Record(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, *a):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            row = {"step": trainer.global_step, "rss": rss_bytes(), "t": time.time(), "loss": float(loss)}
            if cuda:
                row.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved())
            self.rows.append(row)
            if trainer.global_rank == 0 and trainer.global_step % max(1, args.steps // 10) == 0:
                print(f"step {trainer.global_step}: loss {row['loss']:.3f}, rss {row['rss'] / 2**20:.1f} MiB",
                      flush=True)

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
        return None
    ranks = []
    for r in range(trainer.world_size):
        p = Path(f"{args.out}.rank{r}")
        ranks.append(json.loads(p.read_text()))
        p.unlink()
    return report(args, ranks, cuda, torch.__version__)


def summarize(ranks: list[list[dict]], cuda: bool, tolerance_mib: float, tolerance_rel: float) -> dict:
    """The verdicts of a soak from every rank's per-step rows (``loss``, ``rss`` and on the GPU ``allocated`` and
    ``reserved``; see the module docstring): per rank and quantity the second half's slope and the growth over the
    run, ``flat``, ``finite``, ``falling`` and ``ok``."""
    keys = ["rss"] + (["allocated", "reserved"] if cuda else [])
    n = len(ranks[0])
    out: dict = {"ranks": [], "flat": True}
    for r, rows in enumerate(ranks):
        entry: dict = {"rank": r}
        for key in keys:
            values = [row[key] for row in rows]
            tail = values[len(values) // 2:]
            s = slope_per_step(tail)
            growth = s * n / 2**20
            ok = growth < tolerance_mib
            if key == "allocated":
                median = sorted(tail)[len(tail) // 2]
                ok &= s * n < tolerance_rel * median
            out["flat"] &= ok
            entry[key] = {"values": values, "slope_bytes_per_step": s, "growth_mib_over_run": growth}
        out["ranks"].append(entry)
    losses = [row["loss"] for row in ranks[0]]
    tenth = max(1, n // 10)
    out["loss"] = losses
    out["finite"] = all(math.isfinite(x) for rows in ranks for x in (row["loss"] for row in rows))
    out["loss_first"], out["loss_last"] = statistics.fmean(losses[:tenth]), statistics.fmean(losses[-tenth:])
    out["falling"] = out["finite"] and out["loss_last"] < out["loss_first"]
    out["ok"] = out["flat"] and out["finite"] and out["falling"]
    return out


def report(args, ranks: list[list[dict]], cuda: bool, torch_version: str) -> dict:
    keys = ["rss"] + (["allocated", "reserved"] if cuda else [])
    n = len(ranks[0])
    out = {"info": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
                    "torch": torch_version, "args": vars(args), "seconds": ranks[0][-1]["t"] - ranks[0][0]["t"]},
           **summarize(ranks, cuda, args.tolerance_mib, args.tolerance_rel)}
    show = sorted({1, 10, 100, n // 4, n // 2, 3 * n // 4, n} & set(range(1, n + 1)))
    print(f"\n{'rank':>4} {'what':>9} " + " ".join(f"{'step ' + str(s):>11}" for s in show)
          + f" {'slope KiB/step':>15} {'growth MiB':>11}")
    for e in out["ranks"]:
        for key in keys:
            values = e[key]["values"]
            print(f"{e['rank']:>4} {key:>9} " + " ".join(f"{values[i - 1] / 2**20:>11.1f}" for i in show)
                  + f" {e[key]['slope_bytes_per_step'] / 1024:>15.3f} {e[key]['growth_mib_over_run']:>11.2f}")
    print(f"\n{n} steps in {out['info']['seconds']:.0f} s; memory flat (growth over the run < {args.tolerance_mib} "
          f"MiB on every rank{f' and < {args.tolerance_rel:.0%} of the allocated memory' if cuda else ''}, from the "
          f"second half's slope): {out['flat']}; loss finite: {out['finite']}; falling: {out['falling']} "
          f"({out['loss_first']:.3f} over the first tenth of the steps, {out['loss_last']:.3f} over the last)",
          flush=True)
    Path(args.out).write_text(json.dumps(out))
    print(f"wrote {args.out}")
    if args.plot:
        plot(out, keys, args.plot, f"soak: {n} steps, {len(ranks)} ranks, {'dense' if args.dense else 'sparse'}")
    return out


def plot(out: dict, keys: list[str], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install '.[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, loss) = plt.subplots(1, 2, figsize=(11, 4))
    for e in out["ranks"]:
        for key in keys:
            mem.plot([v / 2**20 for v in e[key]["values"]], label=f"rank {e['rank']} {key}")
    mem.set_xlabel("optimizer step")
    mem.set_ylabel("MiB")
    mem.set_title(f"{title}: memory")
    mem.grid(alpha=0.3)
    mem.legend(fontsize=8)
    loss.plot(out["loss"])
    loss.set_xlabel("optimizer step")
    loss.set_ylabel("training loss (rank 0)")
    loss.set_title("loss")
    loss.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=509)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--qwen-3b", action="store_true")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the shape's own)")
    ap.add_argument("--period", type=int, default=257, help="tokens of the block every sequence repeats")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tolerance-mib", type=float, default=8.0)
    ap.add_argument("--tolerance-rel", type=float, default=0.01,
                    help="the GPU's allocated memory may grow by at most this share of its median over the run")
    ap.add_argument("--plot", default="")
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args()
    if not args.gpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    out = run(args)
    if out is not None and not out["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
