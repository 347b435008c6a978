"""Load imbalance of vertical-slash sparse ring attention: exact work per CP rank and ring step (CPU, no GPU).

    python benchmarks/imbalance.py --inner 0 8 --out benchmarks/data/imbalance_synthetic_128k_1m_2026-12-05.json \\
        --plot benchmarks/data/imbalance_synthetic_128k_1m_2026-12-05.png
    python benchmarks/imbalance.py --patterns layers.pt --seq 524288 --out imbalance_estimated.json

For every sequence length N, CP size W, layout (contiguous, zigzag, striped with 128-token blocks) and vertical mode,
:func:`lightning_mtraining.sparsity.balance.ring_step_work` counts the exact allowed (query, key) pairs of every rank at
every step of the ring's real schedule (flat, or hierarchical with ``--inner``), and
:func:`~lightning_mtraining.sparsity.balance.imbalance` reports

- ``total``: max over mean of the ranks' whole work;
- ``critical``: sum over steps of the slowest rank's work, over the sum of the mean rank's (each step waits for
  its slowest rank, communication assumed hidden).

Vertical modes: ``arrival`` counts a vertical's pairs at the step its key's chunk arrives (the ring as it runs
now); ``gathered`` all-gathers the selected vertical columns once per layer and computes every rank's vertical
pairs (those not under a computed tile) in one extra step, the ring steps doing tile work only.

Patterns, B = 1 and 576 rows (36 layers x 16 heads, Qwen2.5-3B), tile T = 128:

(a) synthetic, from the per-head (vertical, slash) budgets of MInference's offline search for Qwen2.5-3B:
    (1000, 6096) x310, (3500, 100) x107, (30, 800) x96, (100, 800) x44, (500, 700) x17, (100, 750) x2, assigned to
    the 576 heads in a seeded random order. Every head also keeps the sinks (key positions 0..29) and the
    diagonals 0..99. Distributions (seeded, ``--seed``):

    - verticals: the budget's number of distinct key positions, uniform over [30, N);
    - slashes: a share ``--far-share`` f of the budget (rounded) is "far" lines, offsets log-uniform over
      [100 + near, N) (duplicates allowed, as an estimator's top-k of nearby scores would not be); the other
      ``near`` = budget - far are the contiguous band of offsets 100 .. 100 + near - 1 (top slash scores are the
      local window's). f = 0.02 gives 93.7% +- 4.6% sparsity at 512K (mean +- std over heads), matching the
      93.7% +- 3.9% reported for training at 512K; f = 0 gives 98.3%, f = 0.05 88.4%. With fixed budgets the
      sparsity grows with N (reported per row).

(b) ``--patterns path.pt`` (repeatable): ``torch.save`` of a VerticalSlashPattern, a dict with ``vertical_idx``,
    ``slash_idx``, ``tile_size`` (and optionally ``seq_len``), or a list of these (e.g. one per layer from the
    online estimator); all are concatenated along the head axis into one pattern (index lists padded with -1).
    Rows count equally: for per-KV-group patterns (G = H_kv) every row stands for the same number of query heads,
    so the ratios are unchanged. ``--seq`` defaults to the files' ``seq_len`` when they give one.

Output: a table (per N and W: the density, then critical / total for each layout and vertical mode), a JSON of
every row with the run's metadata, and with ``--plot`` a PNG: imbalance against W at ``--plot-seq`` (critical
path and total), and against N at W = ``--plot-world``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch

from lightning_mtraining.core.layouts import LAYOUTS
from lightning_mtraining.sparsity.balance import imbalance, ring_step_work
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern

BUDGETS = [(1000, 6096, 310), (3500, 100, 107), (30, 800, 96), (100, 800, 44), (500, 700, 17), (100, 750, 2)]
SINKS, WINDOW, TILE = 30, 100, 128
MODES = ("arrival", "gathered")


def synthetic_pattern(seq_len: int, far_share: float, seed: int = 0, heads: int | None = None) -> VerticalSlashPattern:
    """The synthetic Qwen2.5-3B pattern of the module docstring, [1, 576, n]; ``heads``: only its first rows (the
    same rows as the whole draw's first ``heads``, drawn without the others)."""
    g = torch.Generator().manual_seed(seed)
    budgets = [(v, s) for v, s, count in BUDGETS for _ in range(count)]
    heads = [budgets[i] for i in torch.randperm(len(budgets), generator=g).tolist()][:heads]
    n_vert = SINKS + max(v for v, _ in heads)
    n_slash = WINDOW + max(s for _, s in heads)
    vertical = torch.full((len(heads), n_vert), -1, dtype=torch.int64)
    slash = torch.full((len(heads), n_slash), -1, dtype=torch.int64)
    vertical[:, :SINKS] = torch.arange(SINKS)
    for h, (n_v, n_s) in enumerate(heads):
        vertical[h, SINKS:SINKS + n_v] = torch.randperm(seq_len - SINKS, generator=g)[:n_v] + SINKS
        far = round(far_share * n_s)
        near_end = WINDOW + n_s - far
        slash[h, :near_end] = torch.arange(near_end)
        log_u = torch.rand(far, generator=g) * math.log(seq_len / near_end) + math.log(near_end)
        slash[h, near_end:near_end + far] = log_u.exp().long().clamp(near_end, seq_len - 1)
    return VerticalSlashPattern(vertical[None], slash[None], TILE)


def _as_pattern(item) -> tuple[VerticalSlashPattern, int | None]:
    if isinstance(item, VerticalSlashPattern):
        return item, None
    if isinstance(item, dict) and {"vertical_idx", "slash_idx"} <= item.keys():
        pattern = VerticalSlashPattern(item["vertical_idx"], item["slash_idx"], int(item.get("tile_size", TILE)))
        return pattern, item.get("seq_len")
    raise TypeError(
        f"a patterns file must hold VerticalSlashPattern objects or dicts with vertical_idx/slash_idx[/tile_size/"
        f"seq_len], or a list of them; got {type(item).__name__}"
    )


def load_patterns(paths: list[str]) -> tuple[VerticalSlashPattern, int | None]:
    """All patterns of the files, concatenated along the head axis; and their common seq_len, if they give one."""
    items = []
    for path in paths:
        # weights_only=False: a VerticalSlashPattern is a pickled dataclass. Load only files you trust.
        obj = torch.load(path, map_location="cpu", weights_only=False)
        items += [_as_pattern(x) for x in (obj if isinstance(obj, (list, tuple)) else [obj])]
    if not items:
        raise ValueError(f"no patterns in {paths}")
    tiles = {p.tile_size for p, _ in items}
    batches = {p.batch_size for p, _ in items}
    if len(tiles) > 1 or len(batches) > 1:
        raise ValueError(f"patterns to concatenate must share tile_size and batch; got tiles {tiles}, batches "
                         f"{batches}")
    lengths = {n for _, n in items if n is not None}
    if len(lengths) > 1:
        raise ValueError(f"the patterns were estimated at different seq_len {sorted(lengths)}; load one length at a "
                         "time")

    def cat(name: str) -> torch.Tensor:
        width = max(getattr(p, name).shape[-1] for p, _ in items)
        padded = [torch.nn.functional.pad(getattr(p, name).long(), (0, width - getattr(p, name).shape[-1]), value=-1)
                  for p, _ in items]
        return torch.cat(padded, dim=1)

    pattern = VerticalSlashPattern(cat("vertical_idx"), cat("slash_idx"), tiles.pop())
    return pattern, (lengths.pop() if lengths else None)


def measure(pattern: VerticalSlashPattern, source: str, seqs: list[int], worlds: list[int], layouts: list[str],
            inners: list[int], block_size: int) -> list[dict]:
    rows = []
    for seq in seqs:
        pattern.validate(seq)
        density = pattern.density(seq).flatten()
        for world in worlds:
            for inner in inners:
                if inner and (inner >= world or world % inner):
                    continue  # hierarchical only where it has several nodes
                schedule = f"{inner}x{world // inner}" if inner else "flat"
                for layout in layouts:
                    row = {"source": source, "seq": seq, "world": world, "schedule": schedule, "layout": layout,
                           "density": float(density.mean()), "density_std": float(density.std())}
                    t0 = time.perf_counter()
                    for mode in MODES:
                        steps = ring_step_work(pattern, seq, world, layout, block_size,
                                               inner_size=inner or None, verticals=mode)
                        stats = imbalance(steps)
                        row[f"{mode}_total"], row[f"{mode}_critical"] = stats["total"], stats["critical_path"]
                        if mode == "gathered":  # column 0: the vertical pairs outside computed tiles
                            row["vertical_share"] = float(steps[:, 0].sum() / steps.sum())
                    row["count_s"] = (time.perf_counter() - t0) / len(MODES)
                    rows.append(row)
    return rows


def print_table(rows: list[dict], layouts: list[str]) -> None:
    """One line per (source, N, W, schedule): density, vertical share, then critical / total per layout and mode."""
    cols = [(layout, mode) for layout in layouts for mode in MODES]
    head = " | ".join(f"{layout} {mode}" for layout, mode in cols)
    print(f"| source | tokens | W | schedule | density | vertical share | {head} |")
    print("|" + "---|" * (6 + len(cols)))
    keys = []
    for r in rows:
        key = (r["source"], r["seq"], r["world"], r["schedule"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        by_layout = {r["layout"]: r for r in rows if (r["source"], r["seq"], r["world"], r["schedule"]) == key}
        first = next(iter(by_layout.values()))
        cells = " | ".join(f"{by_layout[layout][f'{mode}_critical']:.3f} / {by_layout[layout][f'{mode}_total']:.3f}"
                           for layout, mode in cols)
        print(f"| {key[0]} | {key[1] // 1024}K | {key[2]} | {key[3]} | {first['density']:.3f} +- "
              f"{first['density_std']:.3f} | {first['vertical_share']:.3f} | {cells} |")


def plot(rows: list[dict], path: str, plot_seq: int, plot_world: int) -> None:
    """Imbalance against W at plot_seq (critical path, total) and against N at W = plot_world, flat schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = sorted({r["source"] for r in rows})
    fig, axes = plt.subplots(len(sources), 3, figsize=(16, 4.6 * len(sources)), squeeze=False)
    styles = {"contiguous": "tab:red", "zigzag": "tab:orange", "striped": "tab:blue"}
    for row_axes, source in zip(axes, sources):
        flat = [r for r in rows if r["source"] == source and r["schedule"] == "flat"]
        panels = [("critical", "world", plot_seq, "critical path"), ("total", "world", plot_seq, "total"),
                  ("critical", "seq", plot_world, "critical path")]
        for ax, (metric, x_key, fixed, label) in zip(row_axes, panels):
            fixed_key = "seq" if x_key == "world" else "world"
            for layout, color in styles.items():
                for mode, dash, marker in zip(MODES, ("-", "--"), ("o", "s")):
                    pts = sorted((r[x_key], r[f"{mode}_{metric}"]) for r in flat
                                 if r["layout"] == layout and r[fixed_key] == fixed)
                    if pts:
                        ax.plot(*zip(*pts), dash, color=color, marker=marker, label=f"{layout}, verticals {mode}")
            ax.set_xscale("log", base=2)
            ax.axhline(1.05, color="gray", lw=0.8, ls=":")
            ticks = sorted({r[x_key] for r in flat})
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{x // 1024}K" if x_key == "seq" else str(x) for x in ticks])
            ax.minorticks_off()
            if x_key == "world":
                ax.set_xlabel("CP size W (flat ring)")
                ax.set_title(f"{source}: {label} imbalance, {fixed // 1024}K tokens")
            else:
                ax.set_xlabel("tokens")
                ax.set_title(f"{source}: {label} imbalance, W = {fixed}")
            ax.set_ylabel("max / mean work")
            ax.grid(True, alpha=0.3)
        row_axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=None,
                    help="tokens (default 128K 256K 512K 1M, or the patterns files' seq_len)")
    ap.add_argument("--world", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--inner", type=int, nargs="+", default=[0],
                    help="ranks per node of the hierarchical ring; 0 = flat (e.g. --inner 0 8)")
    ap.add_argument("--block-size", type=int, default=128, help="striped block (tokens)")
    ap.add_argument("--far-share", type=float, nargs="+", default=[0.02],
                    help="synthetic patterns: share of each slash budget spread log-uniformly far from the diagonal")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--patterns", action="append", default=None, help="torch.save'd patterns (repeatable)")
    ap.add_argument("--out", default="imbalance.json")
    ap.add_argument("--plot", default=None, help="write a PNG here")
    ap.add_argument("--plot-seq", type=int, default=524288)
    ap.add_argument("--plot-world", type=int, default=32)
    args = ap.parse_args()

    rows = []
    if args.patterns:
        pattern, file_seq = load_patterns(args.patterns)
        seqs = args.seq or ([file_seq] if file_seq else None)
        if not seqs:
            ap.error("--seq is required: the patterns files give no seq_len")
        name = "+".join(os.path.basename(p) for p in args.patterns)
        rows += measure(pattern, name, seqs, args.world, args.layouts, args.inner, args.block_size)
    else:
        seqs = args.seq or [131072, 262144, 524288, 1048576]
        for far_share in args.far_share:
            for seq in seqs:
                pattern = synthetic_pattern(seq, far_share, args.seed)
                rows += measure(pattern, f"synthetic far={far_share:g}", [seq], args.world, args.layouts,
                                args.inner, args.block_size)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs", "torch": torch.__version__, "python": platform.python_version(),
            "args": vars(args)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(meta)
    print("cells: critical path / total imbalance (max over mean); density: mean +- std over pattern rows")
    print_table(rows, args.layouts)
    print(f"wrote {args.out}")
    if args.plot:
        plot(rows, args.plot, args.plot_seq, args.plot_world)


if __name__ == "__main__":
    main()
