"""Scale model: predicted attention and training step time of dense ring, flat sparse ring and hierarchical sparse
ring attention on 1 x 8 to 32 x 8 GPUs, 128K to 4M tokens; a check against the MTraining paper; a planner.

A model, not a measurement: no multi-GPU machine has run any of this. Commands (CPU, repo root, ``kernels/`` importable
as ``mtraining_kernels``)::

    python benchmarks/scale_model.py grid --out benchmarks/data/scale_model_qwen2.5-3b_h100_ndr_2026-12-06.json \\
        --plot benchmarks/data/scale_model_qwen2.5-3b_h100_ndr_2026-12-06.png
    python benchmarks/scale_model.py paper                 # the check against the paper's 4 x 8 A100 figures
    python benchmarks/scale_model.py plan --model Qwen/Qwen2.5-3B --tokens 524288 --gpus-per-node 8 --nodes 4 \\
        --config-out plan.yaml             # the table, then a config that `python examples/cli.py fit --config` runs

Inputs
------
(a) **Per-step compute, measured.** ``benchmarks/sparse_ring.py`` timed every virtual rank's ring steps on one
    NVIDIA H100 80GB HBM3 (2026-12-05; ``data/sparse_ring_128k_w8_*`` and ``data/sparse_ring_512k_w32_*``: 16K
    tokens per rank, striped and zigzag, 40M-560M pairs a step). Per phase a line ``t = t0 + c * pairs`` is
    fitted to the mean rank's time of every ring step but the first (least squares, :func:`fit_step_cost`); ``c``
    is not allowed below the kernels' own rate on the whole sequence (``single_ms`` of the same files, split 1 : 2.5
    forward : backward as FLOPs are), since a ring step cannot compute pairs faster than the kernel does on one
    sequence. ``t0`` is the fixed cost of a step (launches, host work, the float32 merge): about 0.6-0.9 ms, which
    is why small steps do not get cheaper. The dense ring (FlexAttention block op, the same files): the same
    ``t0`` and ``c`` from its mean step (2.15G pairs). Scaling rules: per-step time follows the step's pairs
    through the line (pairs from (b)); heads and head dim other than Qwen2.5-3B's (16, 128) scale pairs by H / 16
    and ``c`` by D / 128; another GPU scales ``c`` and the rest of the step by ``Hardware.compute_scale``
    (H100 = 1; the A100 preset 312 / 989, the dense bf16 peaks); ``t0`` does not scale (it is host time).
(b) **Exact work.** Per layer, the first 16 rows of ``imbalance.synthetic_pattern(N, 0.02)`` (the rows the
    simulated ring ran: MInference's Qwen2.5-3B budgets, fixed per head, so the density falls with N: 0.21 at
    128K, 0.065 at 512K, ~0.011 at 4M); ``balance.ring_step_work`` (gathered verticals, the ring's real flat or
    hierarchical schedule); each step costs its slowest rank's pairs (every step waits for it; an upper bound,
    RESULTS "Balance"). Dense: ``H * S * (S + 128) / 2`` pairs a step (S = N / W tokens per rank; striped dense
    work imbalance measured 1.007).
(c) **Links, parameters.** ``Hardware``: bandwidth per GPU per direction and latency per message, NVLink inside a
    node and InfiniBand across (one NIC per GPU); presets ``h100-ndr`` (NVLink 4 450 GB/s, NDR 50 GB/s) and
    ``a100-hdr`` (the paper's: NVLink 3 300 GB/s, HDR 25 GB/s); ``efficiency`` scales both (1 = nominal).

The schedule (Note [Ring schedule] in ``lightning_mtraining/ring/walk.py``), per layer, ``Wo`` nodes x ``Wi`` ranks:

- forward inner step: ``max(compute, transfer(kv))`` (the next chunk is posted before the compute, waited after;
  the last inner step sends nothing); outer step: ``max(sum of its inner steps, transfer_outer(kv))``.
- backward inner step: ``max(compute, transfer(kv + dkv))`` (K/V and the previous step's float32 dK/dV share the
  link), then the last dK/dV hop of each inner ring is exposed; outer step ``max(inner ring, transfer_outer(kv +
  dkv))``, and the last outer dK/dV hop is exposed.
- the gathered vertical step: its compute plus an all-reduce of the columns' K/V (bf16; float32 dK/dV backward):
  ring all-reduce ``2 (W - 1) / W * bytes / bandwidth + 2 (W - 1) latency`` over the slowest link the group spans.
- a flat ring on more than one node waits on InfiniBand at every step (the slowest hop sets the pace); one node:
  NVLink.
- messages: ``kv = 2 * Hkv * S * D * 2`` bytes (bf16, batch 1), ``dkv`` the same in float32.

Training step per GPU = ``rest_per_token * S`` (measured: the rest of a Qwen2.5-3B step on one H100, MLP, norms,
checkpointed recompute and loss, ``data/train_throughput_liger_budget_h100_2026-12-06.json``: 50-51 us per token
at 32K-128K; scaled by parameter count for other shapes) + ``L * (2 fwd + bwd)`` attention (activation
checkpointing recomputes the forward) + the exposed part of DDP's gradient all-reduce (``2 P`` bf16 bytes over all
W GPUs, hidden behind the backward up to its length). Not modelled: pattern estimation and list building (1-2% of a
step at 32-128K on one GPU, RESULTS "Training throughput"), congestion, NCCL protocol effects, kernel speed at
per-rank lengths other than 16K beyond the fitted line.

Memory per GPU (planner): model states ``bytes_per_param * P`` (default 16: bf16 weights and gradients, float32
master and Adam moments; ``/ W`` with FSDP) + activations ``S * act_bytes_per_token``, the per-token slope measured
on one H100 (Qwen2.5-3B, checkpointing, bf16-true: 18.6 / 26.8 / 47.2 GiB at 32K / 64K / 128K: 0.30 MiB a token),
scaled for other shapes (checkpointed layer inputs ``2 L h`` bytes plus the rest in proportion to ``ffn + h``).
``--tiled-mlp`` (the sequence-tiled MLP, ``tiled_mlp=``): the per-token saving is the difference of two lines fitted
to peaks measured with and without it at three lengths or more on one card (``benchmarks/data/`` files named by
``MEMORY_GLOB``, :func:`measured_tiled_mlp`), scaled by ``ffn``; never assumed: without such files the planner says
how to measure it and stops. With
activation offload the checkpointed inputs of the fewest layers that make a GPU's share fit are counted in host
memory instead (``offload_activations=N``, or ``True`` for all; within ``--host-mem-gib`` a node when given; a rule,
not fitted to a measurement). Their host-device copies are in the step time: out in the forward, back in the backward,
``2 x bytes / host_gbs``, not overlapped (they run on the compute stream), ``Hardware.host_gbs`` 25 GB/s per GPU each
way by default (pinned memory over PCIe; ``--host-gbs``; a rule, not measured here). The plan prefers candidates that
fit without offload; where an offloading one predicts more tokens/s, the plan names it and why it was not chosen.

Planner output: the table, then the best candidate as a LightningCLI config for ``examples/cli.py`` (``plan_config``:
the strategy, activation checkpointing, offload where memory needs it, devices and nodes, the model's shape, the
example's data; ``--config-out`` writes it, ``--cpu`` writes its CPU-sized variant, ``--studio-job`` submits it as a
Lightning Studio job), with the launch command of each launcher in its header.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
SPARSE_RING_FILES = ("sparse_ring_128k_w8_vertical_step_h100_2026-12-05.json",
                     "sparse_ring_512k_w32_vertical_step_h100_2026-12-05.json")
TRAIN_FILE = "train_throughput_liger_budget_h100_2026-12-06.json"
# peaks of train_throughput.py runs with and without --tiled-mlp on one card (rows carry tiled_mlp), measured by
# TILED_MLP_COMMAND
MEMORY_GLOB = "train_throughput_memory_*.json"
TILED_MLP_COMMAND = (
    "python benchmarks/train_throughput.py --variants sparse_topk --topk 1024 32 --seqlens 32768 65536 131072 "
    "--warmup 1 --steps 1 --no-split [--tiled-mlp 8192] --out benchmarks/data/train_throughput_memory_<name>.json "
    "(once with and once without --tiled-mlp, on one card)")
MIN_LENGTHS = 3  # measured lengths a memory line is fitted to
MEASURED_ON = "one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0"
PATTERN_ROWS = 16  # heads of the synthetic pattern per layer (what the simulated ring ran)
FP_SPLIT = 1.0 / 3.5  # forward's share of forward+backward FLOPs: the backward is 2.5 times the forward's
GIB = 2**30
NEAR_TIE = 0.99  # planner: candidates within 1% of the best tokens/s are equal as far as the model can tell


# --- hardware and model shapes ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Hardware:
    """Links (GB/s per GPU per direction, microseconds per message) and compute relative to the measured H100."""

    name: str
    nvlink_gbs: float
    ib_gbs: float
    nvlink_latency_us: float = 10.0
    ib_latency_us: float = 20.0
    efficiency: float = 1.0
    compute_scale: float = 1.0
    gpu_mem_gib: float = 80.0
    host_mem_gib: float | None = None  # host memory per node for offloaded activations (None: not a limit)
    host_gbs: float = 25.0  # host-device copies of offloaded activations, GB/s per GPU each way (a rule, not measured)


PRESETS = {
    "h100-ndr": Hardware("H100, NVLink 4 450 GB/s, InfiniBand NDR 50 GB/s per GPU", 450.0, 50.0),
    "h200-ndr": Hardware("H200, NVLink 4 450 GB/s, InfiniBand NDR 50 GB/s per GPU", 450.0, 50.0, gpu_mem_gib=141.0),
    "a100-hdr": Hardware("A100 (the paper's), NVLink 3 300 GB/s, InfiniBand HDR 25 GB/s per GPU", 300.0, 25.0,
                         compute_scale=312.0 / 989.0, gpu_mem_gib=80.0),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (Hugging Face config names in the comments)."""

    layers: int  # num_hidden_layers
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int
    ffn: int  # intermediate_size
    vocab: int
    tied: bool = False  # tie_word_embeddings

    def params(self) -> int:
        """Parameters: embeddings and LM head, attention, gated MLP, norms (biases left out)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn
        emb = (1 if self.tied else 2) * self.vocab * self.hidden
        return emb + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden


MODELS = {
    "Qwen/Qwen2.5-3B": ModelShape(36, 2048, 16, 2, 128, 11008, 151936, tied=True),
    "Qwen/Qwen2.5-7B": ModelShape(28, 3584, 28, 4, 128, 18944, 152064),
    "meta-llama/Llama-3.1-8B": ModelShape(32, 4096, 32, 8, 128, 14336, 128256),
}
REFERENCE = MODELS["Qwen/Qwen2.5-3B"]  # the shape every measurement used


# --- (a) per-step compute, fitted to measurements ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepCost:
    """Per-step time ``t0 + c * pairs`` (ms, ms per 1e9 pairs), forward and backward."""

    t0_fwd: float
    c_fwd: float
    t0_bwd: float
    c_bwd: float

    def ms(self, pairs: float, phase: str) -> float:
        return (self.t0_fwd + self.c_fwd * pairs / 1e9) if phase == "fwd" else (self.t0_bwd + self.c_bwd * pairs / 1e9)


def fit_step_cost(points: list[tuple[float, float]], c_min: float) -> tuple[float, float]:
    """Least-squares ``t = t0 + c * pairs / 1e9`` over ``(pairs, ms)`` points, with ``c >= c_min`` (then ``t0`` is
    the mean residual at ``c = c_min``). Returns ``(t0, c)``."""
    if len(points) < 2:
        raise ValueError(f"need at least two (pairs, ms) points to fit a line, got {len(points)}")
    xs = [p / 1e9 for p, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else c_min
    c = max(c, c_min)
    return my - c * mx, c


def measured_step_costs(data_dir: Path = DATA) -> dict:
    """Fit the sparse and dense ring's per-step costs to the simulated-ring files (module docstring, (a))."""
    sparse = {"fwd": [], "bwd": []}
    dense = {"fwd": [], "bwd": []}
    single = []  # (ms, pairs) of the whole pattern forward+backward on one GPU
    for name in SPARSE_RING_FILES:
        rows = json.loads((data_dir / name).read_text())["rows"]
        for r in rows:
            w = r["W"]
            for s in range(1, w):  # ring steps but the first (own chunk: no merge) and the vertical step
                for ph in ("fwd", "bwd"):
                    t = statistics.fmean(r[f"{ph}_ms"][k][s] for k in range(w))
                    pairs = statistics.fmean(r["work_pairs"][k][s] for k in range(w))
                    (sparse if r["kind"] == "sparse" else dense)[ph].append((pairs, t))
            if r["kind"] == "sparse" and r["layout"] == "striped":
                total_pairs = sum(sum(row) for row in r["work_pairs"])
                single.append((r["single_ms"], total_pairs))
    c_single = statistics.fmean(ms / (pairs / 1e9) for ms, pairs in single)  # ms per 1e9 pairs, fwd+bwd
    t0f, cf = fit_step_cost(sparse["fwd"], FP_SPLIT * c_single)
    t0b, cb = fit_step_cost(sparse["bwd"], (1 - FP_SPLIT) * c_single)
    sp = StepCost(t0f, cf, t0b, cb)
    resid = {ph: math.sqrt(statistics.fmean((sp.ms(p, ph) - t) ** 2 for p, t in sparse[ph])) for ph in sparse}
    dpairs = {ph: statistics.fmean(p for p, _ in dense[ph]) for ph in dense}
    dms = {ph: statistics.fmean(t for _, t in dense[ph]) for ph in dense}
    de = StepCost(t0f, (dms["fwd"] - t0f) / (dpairs["fwd"] / 1e9), t0b, (dms["bwd"] - t0b) / (dpairs["bwd"] / 1e9))
    return {"sparse": sp, "dense": de, "sparse_rms_ms": resid, "c_single_ms_per_gpair": c_single,
            "points": {ph: len(v) for ph, v in sparse.items()}, "files": list(SPARSE_RING_FILES),
            "hardware": MEASURED_ON}


def measured_rest(data_dir: Path = DATA) -> dict:
    """The rest of a Qwen2.5-3B training step (not attention, estimation or lists) per token on one H100, and
    the activation memory slope (bytes per token), from the training-throughput file."""
    d = json.loads((data_dir / TRAIN_FILE).read_text())
    rows = [r for r in d["call1_sparse_topk_1024_32_32k_128k_256k"]["rows"] if r.get("status") == "ok"]
    per_token = [r["split_ms"]["rest"] * 1e-3 / r["N"] for r in rows]
    xs = [r["N"] for r in rows]
    _, slope = fit_line([(r["N"], r["peak_gib"] * GIB) for r in rows])
    return {"rest_s_per_token": statistics.fmean(per_token), "rest_per_token_range_us": [min(per_token) * 1e6,
            max(per_token) * 1e6], "act_bytes_per_token": slope, "lengths": xs, "file": TRAIN_FILE,
            "tiled_mlp": measured_tiled_mlp(data_dir)}


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``y = a + b x`` through ``(x, y)`` points (two distinct x at least)."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    if len(set(xs)) < 2:
        raise ValueError(f"fit_line needs two distinct x values, got {sorted(set(xs))}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def measured_tiled_mlp(data_dir: Path = DATA) -> dict | None:
    """What the sequence-tiled MLP (``tiled_mlp``) saves in activation memory, fitted to measured peaks: lines through
    the peak device memory of the runs without and with it (``MEMORY_GLOB`` files, rows of ``train_throughput.py``
    carrying ``tiled_mlp``, at least ``MIN_LENGTHS`` lengths each, one card), their slopes' difference in bytes per
    token. None where no such measurement exists (the planner then offers no tiled MLP: it is never assumed)."""
    groups: dict[int, list[tuple[float, float]]] = {}
    files, devices = [], set()
    for path in sorted(data_dir.glob(MEMORY_GLOB)):
        d = json.loads(path.read_text())
        chunk = int(d.get("info", {}).get("args", {}).get("tiled_mlp") or 0)
        rows = [r for r in d.get("rows", []) if r.get("status") == "ok" and r.get("peak_gib") is not None]
        for r in rows:
            groups.setdefault(int(r.get("tiled_mlp", chunk) or 0), []).append((r["N"], r["peak_gib"] * GIB))
        if rows:
            files.append(path.name)
            devices.add(d.get("info", {}).get("device"))
    tiled = {c: pts for c, pts in groups.items() if c and len({n for n, _ in pts}) >= MIN_LENGTHS}
    plain = groups.get(0, [])
    if not tiled or len({n for n, _ in plain}) < MIN_LENGTHS:
        return None
    if len(devices) > 1:
        raise ValueError(f"{MEMORY_GLOB} files come from several cards ({sorted(map(str, devices))}): the tiled MLP's "
                         "saving is the difference of two lines measured on one card; keep one card's files")
    chunk = max(tiled, key=lambda c: len(tiled[c]))
    a0, b0 = fit_line(plain)
    a1, b1 = fit_line(tiled[chunk])
    resid = max(abs(y - (a + b * x)) / y for (a, b), pts in (((a0, b0), plain), ((a1, b1), tiled[chunk]))
                for x, y in pts)
    return {"tiled_mlp": chunk, "untiled_bytes_per_token": b0, "tiled_bytes_per_token": b1,
            "saving_bytes_per_token": b0 - b1, "lengths": sorted({int(n) for n, _ in tiled[chunk]}),
            "max_rel_residual": resid, "files": files, "device": next(iter(devices))}


# --- (c) links ------------------------------------------------------------------------------------------------------

def transfer_s(nbytes: float, gbs: float, latency_us: float, efficiency: float = 1.0) -> float:
    """One point-to-point message: latency plus bytes over the achieved bandwidth (0 bytes: nothing sent)."""
    if nbytes <= 0:
        return 0.0
    return latency_us * 1e-6 + nbytes / (gbs * 1e9 * efficiency)


def allreduce_s(nbytes: float, n: int, gbs: float, latency_us: float, efficiency: float = 1.0) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` GPUs: ``2 (n - 1)`` hops of ``nbytes / n`` each."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * (latency_us * 1e-6 + nbytes / n / (gbs * 1e9 * efficiency))


def links(hw: Hardware, inner: int, gpus: int, per_node: int) -> dict:
    """(GB/s, latency) of the inner ring, the outer ring and the whole group's all-reduce: NVLink while a ring stays
    inside one node, InfiniBand once it spans nodes."""
    nv, ib = (hw.nvlink_gbs, hw.nvlink_latency_us), (hw.ib_gbs, hw.ib_latency_us)
    one_node = gpus <= per_node
    return {"inner": nv if inner <= per_node else ib, "outer": nv if one_node else ib, "group": nv if one_node else ib}


# --- the schedule -------------------------------------------------------------------------------------------------

def ring_layer_time(fwd_ms: list[float], bwd_ms: list[float], inner: int, kv_bytes: float, dkv_bytes: float,
                    link_inner: tuple[float, float], link_outer: tuple[float, float], efficiency: float = 1.0,
                    vertical: dict | None = None) -> dict:
    """One layer's ring attention, forward and backward, in seconds (module docstring, the schedule).

    ``fwd_ms`` / ``bwd_ms``: per-step compute of the slowest rank, in schedule order (``W`` steps; step
    ``so * inner + si``); ``inner``: ranks per inner ring (W for a flat ring); ``link_*``: (GB/s, latency us);
    ``vertical``: the gathered vertical step, ``{"fwd_ms", "bwd_ms", "allreduce_fwd_s", "allreduce_bwd_s"}``.
    Returns totals and their parts: compute (sum of steps), exposed communication (the rest).
    """
    w = len(fwd_ms)
    if len(bwd_ms) != w or w % inner:
        raise ValueError(f"need W = len(fwd_ms) = len(bwd_ms) divisible by inner; got {w}, {len(bwd_ms)}, {inner}")
    wo, wi = w // inner, inner

    def t_in(b: float) -> float:
        return transfer_s(b, link_inner[0], link_inner[1], efficiency)

    def t_out(b: float) -> float:
        return transfer_s(b, link_outer[0], link_outer[1], efficiency)

    fwd = bwd = 0.0
    for so in range(wo):
        ring_f = ring_b = 0.0
        for si in range(wi):
            k = so * wi + si
            ring_f += max(fwd_ms[k] * 1e-3, t_in(kv_bytes if si < wi - 1 else 0))
            sent = (kv_bytes if si < wi - 1 else 0) + (dkv_bytes if si >= 1 else 0)
            ring_b += max(bwd_ms[k] * 1e-3, t_in(sent))
        if wi > 1:
            ring_b += t_in(dkv_bytes)  # the last dK/dV hop returns the chunk to its starter: nothing hides it
        fwd += max(ring_f, t_out(kv_bytes if so < wo - 1 else 0))
        bwd += max(ring_b, t_out((kv_bytes if so < wo - 1 else 0) + (dkv_bytes if so >= 1 else 0)))
    if wo > 1:
        bwd += t_out(dkv_bytes)  # the last outer dK/dV hop
    comp_f, comp_b = sum(fwd_ms) * 1e-3, sum(bwd_ms) * 1e-3
    out = {"fwd_s": fwd, "bwd_s": bwd, "fwd_compute_s": comp_f, "bwd_compute_s": comp_b}
    if vertical:
        out["fwd_s"] += vertical["fwd_ms"] * 1e-3 + vertical["allreduce_fwd_s"]
        out["bwd_s"] += vertical["bwd_ms"] * 1e-3 + vertical["allreduce_bwd_s"]
        out["fwd_compute_s"] += vertical["fwd_ms"] * 1e-3
        out["bwd_compute_s"] += vertical["bwd_ms"] * 1e-3
    out["fwd_exposed_comm_s"] = out["fwd_s"] - out["fwd_compute_s"]
    out["bwd_exposed_comm_s"] = out["bwd_s"] - out["bwd_compute_s"]
    return out


def message_bytes(shape: ModelShape, tokens_per_rank: int) -> tuple[float, float]:
    """(K/V chunk in bf16, dK/dV chunk in float32) of one rank, batch 1."""
    n = 2 * shape.kv_heads * tokens_per_rank * shape.head_dim
    return 2.0 * n, 4.0 * n


# --- (b) exact work -------------------------------------------------------------------------------------------------

def _pattern(seq_len: int, cache: dict):
    if seq_len not in cache:
        sys.path.insert(0, str(HERE))
        from imbalance import synthetic_pattern  # benchmarks/imbalance.py

        cache[seq_len] = synthetic_pattern(seq_len, 0.02, heads=PATTERN_ROWS)
    return cache[seq_len]


def sparse_work(seq_len: int, gpus: int, inner: int | None, layout: str = "striped", cache: dict | None = None) -> dict:
    """Per step, the slowest rank's pairs of one layer (16 heads), in schedule order, plus the vertical step's and
    the number of gathered vertical columns (exact: ``balance.ring_step_work``)."""
    import torch

    from lightning_mtraining.sparsity.balance import ring_step_work

    cache = {} if cache is None else cache
    pattern = _pattern(seq_len, cache)
    key = ("work", seq_len, gpus, inner, layout)
    if key not in cache:
        work = ring_step_work(pattern, seq_len, gpus, layout, 128, inner_size=None if inner in (None, gpus) else inner,
                              verticals="gathered")
        v = pattern.vertical_idx
        nv = int(torch.unique(v[(v >= 0) & (v < seq_len)]).numel()) if gpus > 1 else 0
        density = float(work.sum()) / (PATTERN_ROWS * seq_len * (seq_len + 1) / 2)  # the total is allowed_pairs'
        cache[key] = {"steps": work[:, 1:].max(0).values.tolist(), "vertical": float(work[:, 0].max()),
                      "n_vertical": nv, "density": density,
                      "mean_steps": work[:, 1:].double().mean(0).tolist()}
    return cache[key]


# --- putting it together --------------------------------------------------------------------------------------------

def attention_layer(method: str, shape: ModelShape, seq_len: int, nodes: int, per_node: int, hw: Hardware,
                    costs: dict, inner: int | None = None, layout: str = "striped", cache: dict | None = None) -> dict:
    """One layer's attention forward and backward (seconds) for ``method`` in ``("dense", "flat", "hier")``:
    dense ring (flat), flat sparse ring, hierarchical sparse ring (inner ring = ``inner`` or one node)."""
    gpus = nodes * per_node
    s = seq_len // gpus
    kv, dkv = message_bytes(shape, s)
    heads_scale = shape.heads / PATTERN_ROWS
    d_scale = shape.head_dim / REFERENCE.head_dim / hw.compute_scale
    if method == "dense":
        ring_inner = gpus
        pairs = shape.heads * s * (s + 128) / 2
        cost = costs["dense"]
        steps = [pairs] * gpus
        vertical = None
        density = 1.0
    elif method in ("flat", "hier"):
        ring_inner = gpus if method == "flat" else (inner or min(per_node, gpus))
        work = sparse_work(seq_len, gpus, ring_inner, layout, cache)
        cost = costs["sparse"]
        steps = [p * heads_scale for p in work["steps"]]
        density = work["density"]
        vertical = None
        if gpus > 1:
            grp = links(hw, ring_inner, gpus, per_node)["group"]
            cols = 2 * shape.kv_heads * work["n_vertical"] * shape.head_dim
            vpairs = work["vertical"] * heads_scale
            vertical = {"fwd_ms": _ms(cost, vpairs, "fwd", d_scale), "bwd_ms": _ms(cost, vpairs, "bwd", d_scale),
                        "allreduce_fwd_s": allreduce_s(2.0 * cols, gpus, *grp, hw.efficiency),
                        "allreduce_bwd_s": allreduce_s(4.0 * cols, gpus, *grp, hw.efficiency)}
    else:
        raise ValueError(f"method must be 'dense', 'flat' or 'hier', got {method!r}")
    lk = links(hw, ring_inner, gpus, per_node)
    out = ring_layer_time([_ms(cost, p, "fwd", d_scale) for p in steps], [_ms(cost, p, "bwd", d_scale) for p in steps],
                          ring_inner, kv, dkv, lk["inner"], lk["outer"], hw.efficiency, vertical)
    out.update(method=method, inner=ring_inner, layout=layout, density=density, kv_bytes=kv,
               step_pairs_max=max(steps),
               step_fwd_ms_mean=statistics.fmean(_ms(cost, p, "fwd", d_scale) for p in steps))
    return out


def _ms(cost: StepCost, pairs: float, phase: str, d_scale: float) -> float:
    """A step's time with the per-pair term scaled (head dim, GPU); the fixed cost is host time and stays."""
    base = cost.t0_fwd if phase == "fwd" else cost.t0_bwd
    return base + (cost.ms(pairs, phase) - base) * d_scale


def training_step(layer: dict, shape: ModelShape, seq_len: int, gpus: int, hw: Hardware, rest: dict,
                  per_node: int, offload_bytes: float = 0.0) -> dict:
    """Training step per GPU (seconds): rest + L (2 fwd + bwd) attention + the exposed gradient all-reduce + the
    host-device copies of ``offload_bytes`` offloaded activations (out and back, not overlapped)."""
    s = seq_len // gpus
    rest_s = rest["rest_s_per_token"] * s * shape.params() / REFERENCE.params() / hw.compute_scale
    attn_s = shape.layers * (2 * layer["fwd_s"] + layer["bwd_s"])
    gbs, lat = links(hw, 1, gpus, per_node)["group"]
    grad_s = allreduce_s(2.0 * shape.params(), gpus, gbs, lat, hw.efficiency)
    backward_s = shape.layers * (layer["fwd_s"] + layer["bwd_s"]) + 0.75 * rest_s  # recompute + backward
    exposed = max(0.0, grad_s - backward_s)
    offload_s = 2.0 * offload_bytes / (hw.host_gbs * 1e9)
    step = rest_s + attn_s + exposed + offload_s
    return {"step_s": step, "rest_s": rest_s, "attention_s": attn_s, "grad_allreduce_s": grad_s,
            "grad_exposed_s": exposed, "offload_s": offload_s, "tokens_per_s": seq_len / step}


def memory_gib(shape: ModelShape, seq_len: int, gpus: int, rest: dict, bytes_per_param: float = 16.0,
               fsdp: bool = False, offload: bool | int = False, tiled_mlp: bool = False) -> dict:
    """Model states and activations per GPU (GiB); see the module docstring. ``offload``: the checkpointed layer
    inputs wait in host memory, of every layer (``True``, ``offload_activations=True``) or of the first N
    (``offload_activations=N``), so they leave the GPU's share; ``host_gib`` is what they take there, per GPU.
    ``tiled_mlp``: the MLP runs a chunk of tokens at a time; its measured saving per token
    (``rest["tiled_mlp"]``, :func:`measured_tiled_mlp`) scaled by the MLP width (the intermediates it no longer
    holds for the whole sequence); a ValueError where it was not measured."""
    s = seq_len // gpus
    states = bytes_per_param * shape.params() / (gpus if fsdp else 1)
    ckpt = lambda m: 2.0 * m.layers * m.hidden  # noqa: E731 - checkpointed layer inputs, bf16, bytes per token
    layers = shape.layers if offload is True else int(offload)
    ref_rest = rest["act_bytes_per_token"] - ckpt(REFERENCE)
    moved = ckpt(shape) * layers / shape.layers
    per_token = ckpt(shape) - moved + ref_rest * (shape.ffn + shape.hidden) / (REFERENCE.ffn + REFERENCE.hidden)
    if tiled_mlp:
        tiled = rest.get("tiled_mlp")
        if not tiled:
            raise ValueError("the tiled MLP's memory is not measured yet (no benchmarks/data/" + MEMORY_GLOB + " with "
                             f"{MIN_LENGTHS} lengths with and without it): measure it with {TILED_MLP_COMMAND}")
        per_token -= tiled["saving_bytes_per_token"] * shape.ffn / REFERENCE.ffn
    act = s * per_token
    return {"states_gib": states / GIB, "activations_gib": act / GIB, "total_gib": (states + act) / GIB,
            "offload": offload, "host_gib": s * moved / GIB, "tiled_mlp": bool(tiled_mlp)}


def offload_needed(shape: ModelShape, seq_len: int, gpus: int, rest: dict, hw: Hardware, per_node: int,
                   bytes_per_param: float = 16.0, fsdp: bool = False, tiled_mlp: bool = False) -> bool | int | None:
    """The fewest decoder layers whose checkpointed inputs must wait in host memory for a GPU's share to fit
    ``hw.gpu_mem_gib``: False when nothing needs to, True when every layer's must, N otherwise; None when even all
    of them do not make it fit, or the host (``hw.host_mem_gib`` per node, ``per_node`` GPUs offloading) cannot hold
    the fewest that would."""
    for n in range(shape.layers + 1):
        mem = memory_gib(shape, seq_len, gpus, rest, bytes_per_param, fsdp, offload=n, tiled_mlp=tiled_mlp)
        if mem["total_gib"] <= hw.gpu_mem_gib:
            if hw.host_mem_gib is not None and mem["host_gib"] * per_node > hw.host_mem_gib:
                return None
            return False if n == 0 else True if n == shape.layers else n
    return None


# --- the paper check ------------------------------------------------------------------------------------------------

PAPER = {"inter_ms": 0.98, "intra_ms": 0.13, "compute_ms": 0.51, "fwd_flat_ms": 34.1, "fwd_hier_ms": 19.5,
         "train_speedup_max": 6.0, "nodes": 4, "per_node": 8, "seq_len": 524288}


def schedule_only(step_compute_ms: float, inter_ms: float, intra_ms: float, nodes: int, per_node: int) -> dict:
    """Forward attention (ms) of the flat and hierarchical schedules from given per-step times (no vertical step,
    every step alike): flat ``W max(c, inter)``, hierarchical ``Wo`` outer steps of ``max(Wi max(c, intra),
    inter)`` (the last outer step waits for nothing)."""
    w = nodes * per_node
    flat = (w - 1) * max(step_compute_ms, inter_ms) + step_compute_ms
    inner_ring = (per_node - 1) * max(step_compute_ms, intra_ms) + step_compute_ms
    hier = (nodes - 1) * max(inner_ring, inter_ms) + inner_ring
    return {"flat_ms": flat, "hier_ms": hier, "hier_over_flat": hier / flat}


def paper_check(costs: dict, rest: dict, cache: dict | None = None) -> dict:
    """Our model at the paper's setting (Qwen2.5-3B, 512K, 4 x 8, the A100 preset) next to the paper's figures."""
    hw = PRESETS["a100-hdr"]
    shape, n, nodes, per_node = REFERENCE, PAPER["seq_len"], PAPER["nodes"], PAPER["per_node"]
    gpus = nodes * per_node
    kv, _ = message_bytes(shape, n // gpus)
    out = {"kv_bytes": kv,
           "inter_ms": transfer_s(kv, hw.ib_gbs, hw.ib_latency_us) * 1e3,
           "intra_ms": transfer_s(kv, hw.nvlink_gbs, hw.nvlink_latency_us) * 1e3}
    out["achieved_ib_gbs_paper"] = kv / (PAPER["inter_ms"] * 1e-3) / 1e9
    out["achieved_nvlink_gbs_paper"] = kv / (PAPER["intra_ms"] * 1e-3) / 1e9
    out["schedule_with_paper_steps"] = schedule_only(PAPER["compute_ms"], PAPER["inter_ms"], PAPER["intra_ms"], nodes,
                                                     per_node)
    layers = {m: attention_layer(m, shape, n, nodes, per_node, hw, costs, cache=cache)
              for m in ("dense", "flat", "hier")}
    out["compute_ms_model"] = layers["hier"]["step_fwd_ms_mean"]
    out["fwd_ms_model"] = {m: layers[m]["fwd_s"] * 1e3 for m in layers}
    steps = {m: training_step(layers[m], shape, n, gpus, hw, rest, per_node) for m in layers}
    out["train_step_s_model"] = {m: steps[m]["step_s"] for m in steps}
    out["train_speedup_hier_vs_dense"] = steps["dense"]["step_s"] / steps["hier"]["step_s"]
    out["attention_speedup_hier_vs_dense"] = steps["dense"]["attention_s"] / steps["hier"]["attention_s"]
    # the same with the paper's own per-step compute (0.51 ms forward) in place of our fitted kernels
    out["density_512k"] = layers["hier"]["density"]
    return out


# --- grid, planner, CLI ---------------------------------------------------------------------------------------------

def grid(shape: ModelShape, hw: Hardware, seq_lens: list[int], nodes_list: list[int], per_node: int, costs: dict,
         rest: dict, cache: dict | None = None) -> list[dict]:
    rows = []
    cache = {} if cache is None else cache
    for n in seq_lens:
        for nodes in nodes_list:
            gpus = nodes * per_node
            if n % (gpus * 128):
                continue
            for method in ("dense", "flat", "hier"):
                layer = attention_layer(method, shape, n, nodes, per_node, hw, costs, cache=cache)
                step = training_step(layer, shape, n, gpus, hw, rest, per_node)
                mem = memory_gib(shape, n, gpus, rest)
                rows.append({"seq_len": n, "nodes": nodes, "gpus": gpus, **layer, **step, **mem})
    return rows


def plan(shape: ModelShape, hw: Hardware, seq_len: int, nodes: int, per_node: int, costs: dict, rest: dict,
         bytes_per_param: float = 16.0, fsdp: bool = False, cache: dict | None = None,
         cp_sizes: list[int] | None = None, tiled_mlp: bool = False) -> dict:
    """Every (context-parallel size, inner ring size, layout) of the sparse ring, best first by tokens/s among those
    that fit in memory; and the dense ring over all GPUs. ``cp_sizes`` (default: every divisor of the GPU count
    that is a multiple or a divisor of ``per_node``): CP groups of that size, the rest of the GPUs data-parallel
    (``dp = GPUs / cp`` sequences at once).

    Memory: every candidate trains with activation checkpointing (what the step time models: the forward is
    recomputed). One that does not fit may fit with activation offload (``offload_activations``: the checkpointed
    inputs of the fewest layers that make it fit in host memory, :func:`offload_needed`, within ``hw.host_mem_gib``;
    its host-device copies are in its step time, at ``hw.host_gbs``). Order: candidates that fit
    without offload, then those that fit only with it (``"offload"``: True for every layer, or the number of layers),
    then those that fit in neither way;
    each group by tokens/s, except that the first is the one with the strategy's default inner ring (the largest
    that fits a node) when it is within 1% of the fastest of the same CP size and layout. ``"memory"`` is what a
    candidate needs as it would run (with offload where it needs it). ``tiled_mlp``: every candidate runs the
    sequence-tiled MLP, its memory from the measured saving (:func:`memory_gib`; a ValueError where unmeasured)."""
    gpus = nodes * per_node
    if cp_sizes is None:
        cp_sizes = [d for d in range(2, gpus + 1) if gpus % d == 0 and (d % per_node == 0 or per_node % d == 0)]
    cands = []
    for cp in cp_sizes:
        unit = 2 * cp * 128
        if seq_len % unit:
            raise ValueError(f"--tokens {seq_len} must be a multiple of 2 x {cp} CP ranks x 128 = {unit} (zigzag's "
                             "unit; the strategy pads batches to its layout's unit): pad or pick another length")
        cp_nodes, cp_per_node = (cp // per_node, per_node) if cp >= per_node else (1, cp)
        inners = sorted({d for d in range(2, cp_per_node + 1) if cp_per_node % d == 0} | {cp})
        mem = memory_gib(shape, seq_len, cp, rest, bytes_per_param, fsdp, tiled_mlp=tiled_mlp)
        fits = mem["total_gib"] <= hw.gpu_mem_gib
        offload = False if fits else offload_needed(shape, seq_len, cp, rest, hw, per_node,
                                                    bytes_per_param, fsdp, tiled_mlp) or False
        every = memory_gib(shape, seq_len, cp, rest, bytes_per_param, fsdp, offload=True, tiled_mlp=tiled_mlp)
        if offload:
            mem = memory_gib(shape, seq_len, cp, rest, bytes_per_param, fsdp, offload=offload, tiled_mlp=tiled_mlp)
        for layout in ("striped", "zigzag", "contiguous"):
            for inner in inners:
                method = "flat" if inner == cp else "hier"
                layer = attention_layer(method, shape, seq_len, cp_nodes, cp_per_node, hw, costs, inner=inner,
                                        layout=layout, cache=cache)
                step = training_step(layer, shape, seq_len, cp, hw, rest, cp_per_node,
                                     offload_bytes=mem["host_gib"] * GIB if offload else 0.0)
                dp = gpus // cp
                cands.append({**layer, **step, "cp": cp, "dp": dp, "tokens_per_s": dp * step["tokens_per_s"],
                              "memory": mem, "fits": fits, "offload": offload, "memory_offloaded": every})
    tier = lambda r: 0 if r["fits"] else 1 if r["offload"] else 2  # noqa: E731
    cands.sort(key=lambda r: (tier(r), -r["tokens_per_s"]))
    # Within 1% the model cannot tell candidates apart: prefer the inner ring the strategy picks by itself
    # (inner_ring_size=None: the largest that fits a node), same CP size and layout.
    from lightning_mtraining.distributed.mesh import resolve_inner_ring_size

    top = cands[0]
    for i, c in enumerate(cands):
        if (tier(c), c["cp"], c["layout"]) == (tier(top), top["cp"], top["layout"]) and \
                c["tokens_per_s"] >= NEAR_TIE * top["tokens_per_s"] and \
                c["inner"] == resolve_inner_ring_size(None, c["cp"], per_node):
            cands.insert(0, cands.pop(i))
            break
    dense = []  # the dense ring at the same CP sizes (flat), its best fitting one the baseline
    for cp in cp_sizes:
        cp_nodes, cp_per_node = (cp // per_node, per_node) if cp >= per_node else (1, cp)
        layer = attention_layer("dense", shape, seq_len, cp_nodes, cp_per_node, hw, costs, cache=cache)
        step = training_step(layer, shape, seq_len, cp, hw, rest, cp_per_node)
        mem = memory_gib(shape, seq_len, cp, rest, bytes_per_param, fsdp, tiled_mlp=tiled_mlp)
        dense.append({**layer, **step, "cp": cp, "dp": gpus // cp, "tokens_per_s": gpus // cp * step["tokens_per_s"],
                      "memory": mem, "fits": mem["total_gib"] <= hw.gpu_mem_gib})
    dense.sort(key=lambda r: (not r["fits"], -r["tokens_per_s"]))
    return {"candidates": cands, "best": cands[0], "dense": dense[0], "memory": cands[0]["memory"], "gpus": gpus,
            "tiled_mlp": rest["tiled_mlp"]["tiled_mlp"] if tiled_mlp else None}


def _plot(rows: list[dict], path: str, hw: Hardware) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted({r["seq_len"] for r in rows})
    fig, axes = plt.subplots(1, len(lens), figsize=(3.2 * len(lens), 3.4), sharey=False)
    names = {"dense": "dense ring", "flat": "flat sparse ring", "hier": "hierarchical sparse ring"}
    for ax, n in zip(axes, lens):
        for m, style in (("dense", "k-o"), ("flat", "C1-s"), ("hier", "C0-^")):
            rs = sorted((r for r in rows if r["seq_len"] == n and r["method"] == m), key=lambda r: r["gpus"])
            ax.plot([r["gpus"] for r in rs], [r["tokens_per_s"] for r in rs], style, label=names[m], ms=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{n // 1024}K tokens", fontsize=9)
        ax.set_xlabel("GPUs (8 per node)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("predicted tokens/s (training)", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Scale model, Qwen2.5-3B, {hw.name} (a model, not a measurement)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _fmt_plan(p: dict, shape_name: str, hw: Hardware, seq_len: int, nodes: int, per_node: int) -> str:
    b, d, m = p["best"], p["dense"], p["memory"]
    lines = [f"plan: {shape_name}, {seq_len} tokens, {nodes} nodes x {per_node} GPUs, {hw.name} (model, not measured)",
             f"{'cp':>4} {'dp':>3} {'layout':>10} {'inner':>5} {'attn fwd ms':>11} {'attn bwd ms':>11} "
             f"{'exposed comm ms':>15} {'step s':>7} {'tokens/s':>9} {'GiB/GPU':>7}"]
    for c in p["candidates"]:
        note = ("" if c["fits"] else f"  (offload {_offload_words(c['offload'])}: {c['offload_s']:.2f} s of host "
                f"copies in the step, at {hw.host_gbs:g} GB/s, a rule)" if c["offload"] else "  (does not fit)")
        lines.append(f"{c['cp']:>4} {c['dp']:>3} {c['layout']:>10} {c['inner']:>5} {c['fwd_s'] * 1e3:>11.1f} "
                     f"{c['bwd_s'] * 1e3:>11.1f} {(c['fwd_exposed_comm_s'] + c['bwd_exposed_comm_s']) * 1e3:>15.1f} "
                     f"{c['step_s']:>7.2f} {c['tokens_per_s']:>9.0f} {c['memory']['total_gib']:>7.1f}" + note)
    if b["fits"]:
        fits = "fits"
    elif b["offload"]:
        fits = (f"fits with activation offload of {_offload_words(b['offload'])} (offload_activations="
                f"{b['offload']}; {m['host_gib'] * per_node:.1f} GiB of host memory a node; its host-device copies, "
                f"{b['offload_s']:.2f} s a step, are a rule at {hw.host_gbs:g} GB/s per GPU each way, not measured)")
    else:
        every = b.get("memory_offloaded", m)
        why = (f"offloading every layer's inputs leaves {every['total_gib']:.1f} GiB a GPU"
               if every["total_gib"] > hw.gpu_mem_gib else
               f"the offload it needs is more than {hw.host_mem_gib:.0f} GiB of host memory a node")
        fits = f"does NOT fit {hw.gpu_mem_gib:.0f} GiB ({why}; nothing does: try --fsdp, more GPUs or fewer tokens)"
    lines += [
        f"best dense ring: context_parallel_size={d['cp']} (x {d['dp']} data-parallel), step {d['step_s']:.2f} s, "
        f"{d['tokens_per_s']:.0f} tokens/s" + ("" if d["fits"] else " (does not fit)"),
        f"best: context_parallel_size={b['cp']} (x {b['dp']} data-parallel), layout={b['layout']!r}, "
        f"inner_ring_size={b['inner']} ({_ring_words(b['cp'], b['inner'], per_node)}): step {b['step_s']:.2f} s, "
        f"{b['tokens_per_s']:.0f} tokens/s ({b['tokens_per_s'] / d['tokens_per_s']:.2f}x the dense ring); pattern "
        f"density {b['density']:.3f} (synthetic fixed budgets)",
        f"memory per GPU: {m['total_gib']:.1f} GiB ({m['states_gib']:.1f} model states + {m['activations_gib']:.1f} "
        f"activations, checkpointed{', offloaded' if m.get('offload') else ''}"
        f"{', tiled MLP of ' + str(p['tiled_mlp']) + ' tokens' if p.get('tiled_mlp') else ''}): {fits}",
    ]
    faster = [c for c in p["candidates"] if c["offload"] and c["tokens_per_s"] > b["tokens_per_s"]]
    if b["fits"] and faster:
        f = faster[0]
        lines.append(
            f"best despite faster-looking rows: context_parallel_size={f['cp']} ({f['layout']}, inner_ring_size="
            f"{f['inner']}) predicts {f['tokens_per_s']:.0f} tokens/s but needs activation offload of "
            f"{_offload_words(f['offload'])}, whose host-device copies are a rule ({hw.host_gbs:g} GB/s per GPU each "
            f"way), not a measurement; the plan prefers what fits without offload (--cp {f['cp']} plans that size)")
    return "\n".join(lines)


def _offload_words(offload: bool | int) -> str:
    return "every layer" if offload is True else f"{offload} layers"


def _ring_words(cp: int, inner: int, per_node: int) -> str:
    """Where the candidate's rings run (CP groups are consecutive ranks; a node holds ``per_node`` of them)."""
    in_a_node = per_node % cp == 0
    if inner == cp:
        return "flat ring within a node" if in_a_node else "flat ring across nodes"
    if in_a_node:
        return f"hierarchical: {cp // inner} outer x {inner} inner, all within a node"
    return f"hierarchical: {cp // inner} outer across nodes x {inner} inner within a node"


# --- the plan as a LightningCLI config (examples/cli.py) ------------------------------------------------------------

# examples/cli.py's StdlibBytesDataModule reads these standard-library packages (about 4 MB of source; the text
# repeats when a run needs more windows than it holds). Replace the data section with your own LightningDataModule.
DATA_PACKAGES = ["json", "email", "asyncio", "unittest", "multiprocessing", "xml", "concurrent", "encodings"]
CPU_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "vocab_size": 256}


def precision_of(bytes_per_param: float) -> str:
    """The Trainer precision whose model states the memory model counts: 16 bytes a parameter are float32 weights,
    gradients and Adam moments (``bf16-mixed``); fewer, bfloat16 weights (``bf16-true``)."""
    return "bf16-mixed" if bytes_per_param >= 12 else "bf16-true"


def plan_config(p: dict, shape_name: str, shape: ModelShape, seq_len: int, nodes: int, per_node: int, *,
                bytes_per_param: float = 16.0, fsdp: bool = False, max_steps: int = 100, cpu: bool = False) -> dict:
    """The plan's best candidate as a config for ``python examples/cli.py fit --config``: the strategy with its CP
    size, inner ring, layout and sparsity (the paper's top-p 0.9, caps 4096), activation checkpointing (the step time
    assumes it) and offload where memory needs it; the Trainer with devices and nodes; the model's shape; the data.

    ``cpu=True``: the same world, strategy and ring on CPU processes, scaled down to run anywhere (a tiny model of the
    same family, ``2 x cp x block`` - 1 tokens, float32, 2 steps, no logger or checkpoints)."""
    from lightning_mtraining.strategies.cluster import trainer_config

    b = p["best"]
    family = "llama" if "llama" in shape_name.lower() else "qwen2"
    if not cpu and shape.hidden != shape.heads * shape.head_dim:
        raise ValueError(f"examples/cli.py's model derives head_dim = hidden / heads = {shape.hidden // shape.heads}, "
                         f"not {shape.head_dim}: give --hidden and --heads with hidden = heads x head_dim")
    block = 128
    common = dict(nodes=nodes, devices=per_node, context_parallel_size=b["cp"], inner_ring_size=b["inner"],
                  layout=b["layout"], block_size=block, activation_checkpointing=True,
                  offload_activations=b["offload"], tiled_mlp=p.get("tiled_mlp"), fsdp=fsdp)
    if cpu:  # the tiny model has fewer layers: offload all of them where the plan offloads some
        common["offload_activations"] = bool(b["offload"])
        if common["tiled_mlp"]:  # chunks that tile the short sequence
            common["tiled_mlp"] = 64
        trainer = trainer_config(**common, accelerator="cpu", precision="32-true", max_steps=2, limit_val_batches=0,
                                 num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                                 enable_model_summary=False)
        model = {"family": family, **CPU_MODEL, "max_position_embeddings": 4096, "lr": 1e-3}
        data = {"packages": ["json", "email"], "seq_len": 2 * b["cp"] * block - 1, "batch_size": 1,
                "num_samples": 1 + 2 * b["dp"]}
    else:
        trainer = trainer_config(**common, accelerator="gpu", precision=precision_of(bytes_per_param),
                                 max_steps=max_steps, log_every_n_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
                                 enable_checkpointing=False, default_root_dir="lightning_logs/plan")
        model = {"family": family, "vocab_size": shape.vocab, "hidden_size": shape.hidden,
                 "intermediate_size": shape.ffn, "num_layers": shape.layers, "num_heads": shape.heads,
                 "num_kv_heads": shape.kv_heads, "tie_word_embeddings": shape.tied,
                 "max_position_embeddings": seq_len, "lr": 3e-4}
        data = {"packages": DATA_PACKAGES, "seq_len": seq_len, "batch_size": 1, "num_samples": 1 + 4 * b["dp"]}
    return {"seed_everything": 0, "trainer": trainer, "model": model, "data": data}


def config_comments(p: dict, plan_text: str, command: str, config_path: str | None, nodes: int, per_node: int,
                    cpu: bool) -> list[str]:
    """The header of the emitted config: how it was made, what the model predicts, how to launch it."""
    from lightning_mtraining.strategies.cluster import launch_commands

    b = p["best"]
    path = config_path or "plan.yaml"
    launch = launch_commands(f"examples/cli.py fit --config {path}", nodes=nodes, devices=per_node,
                             machine=f"H100_X_{per_node}")
    lines = [f"made by: {command}", ""]
    if cpu:
        lines += ["The CPU-sized variant of the plan below: the same world, strategy and ring on CPU processes, a tiny",
                  "model and short sequences (to check the setup runs end to end, not to train).", ""]
    lines += [line for line in plan_text.splitlines() if line.startswith(("plan:", "best", "memory"))]
    lines += ["", f"predicted: step {b['step_s']:.2f} s, {b['tokens_per_s']:.0f} tokens/s over {nodes * per_node} GPUs "
              "(a model, not a measurement: its work counts", "use fixed synthetic budgets; the config trains with "
              "the paper's setting, top-p 0.9 with caps of 4096)", "", "launch (every machine runs the same command):"]
    if nodes == 1:
        lines += [f"  one machine:  {launch['python']}"]
    lines += [f"  Lightning Studio:  {launch['studio']}",
              f"  torchrun, on each node:  {launch['torchrun']}",
              f"  SLURM, in an allocation of {nodes} node(s):  {launch['slurm']}",
              "", f"dry run first, on any CPU machine (every rank's strategy and mesh, no GPU): python examples/cli.py "
              f"check --config {path}",
              "", "model and data: examples/cli.py's byte-level standard-library corpus; replace them with yours."]
    return lines


def _hardware(args) -> Hardware:
    hw = PRESETS[args.preset]
    over = {k: v for k, v in (("nvlink_gbs", args.nvlink_gbs), ("ib_gbs", args.ib_gbs),
                              ("nvlink_latency_us", args.nvlink_latency_us), ("ib_latency_us", args.ib_latency_us),
                              ("efficiency", args.efficiency), ("gpu_mem_gib", args.gpu_mem_gib),
                              ("host_mem_gib", args.host_mem_gib), ("host_gbs", args.host_gbs)) if v is not None}
    return dataclasses.replace(hw, **over)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("grid", "paper", "plan"))
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h100-ndr")
    ap.add_argument("--nvlink-gbs", type=float)
    ap.add_argument("--ib-gbs", type=float)
    ap.add_argument("--nvlink-latency-us", type=float)
    ap.add_argument("--ib-latency-us", type=float)
    ap.add_argument("--efficiency", type=float, help="achieved share of nominal link bandwidth (default 1)")
    ap.add_argument("--gpu-mem-gib", type=float)
    ap.add_argument("--host-mem-gib", type=float,
                    help="host memory per node for offloaded activations (default: no limit)")
    ap.add_argument("--host-gbs", type=float,
                    help="host-device copy bandwidth of offloaded activations, GB/s per GPU each way (default 25)")
    ap.add_argument("--model", default="Qwen/Qwen2.5-3B", help=f"one of {sorted(MODELS)} (a '-shape' suffix is fine)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--tokens", type=int, nargs="+", default=[131072, 262144, 524288, 1048576, 2097152, 4194304])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--bytes-per-param", type=float, default=16.0)
    ap.add_argument("--fsdp", action="store_true", help="model states sharded over every GPU (mtraining_fsdp)")
    ap.add_argument("--tiled-mlp", action="store_true", help="plan: every candidate runs the sequence-tiled MLP "
                    "(tiled_mlp=, the measured chunk), its memory saving measured (an error where it is not)")
    ap.add_argument("--cp", type=int, nargs="+", help="plan: context-parallel sizes to try (default: all that fit "
                    "the node shape)")
    ap.add_argument("--config-out", help="plan: also write the LightningCLI config (examples/cli.py) to this file")
    ap.add_argument("--cpu", action="store_true", help="plan: emit the config's CPU-sized variant (same world, "
                    "strategy and ring; a tiny model, short sequences, 2 steps)")
    ap.add_argument("--max-steps", type=int, default=100, help="plan: the config's trainer.max_steps")
    ap.add_argument("--studio-job", metavar="NAME", help="plan: submit the config as a Lightning Studio job of this "
                    "name (needs lightning-sdk, --config-out inside the Studio, and --machine)")
    ap.add_argument("--machine", help="plan: the Studio machine type, e.g. H100_X_8 (GPUs = --gpus-per-node)")
    ap.add_argument("--studio", help="plan: the Studio whose environment the job runs in (default: this one)")
    ap.add_argument("--teamspace", help="plan: the Studio's teamspace (default: the SDK's)")
    ap.add_argument("--out", help="JSON output")
    ap.add_argument("--plot", help="PNG of predicted tokens/s against GPUs (grid)")
    args = ap.parse_args(argv)

    name = args.model.removesuffix("-shape")
    if name not in MODELS:
        raise SystemExit(f"--model {args.model!r}: known shapes are {sorted(MODELS)}; or give --layers/--hidden/... "
                         "with the closest one")
    shape = dataclasses.replace(MODELS[name], **{k: v for k, v in (
        ("layers", args.layers), ("hidden", args.hidden), ("heads", args.heads), ("kv_heads", args.kv_heads),
        ("head_dim", args.head_dim), ("ffn", args.ffn), ("vocab", args.vocab)) if v is not None})
    hw = _hardware(args)
    costs, rest = measured_step_costs(), measured_rest()
    cache: dict = {}
    info = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "command": " ".join(sys.argv), "hardware": dataclasses.asdict(hw),
            "model": {"name": name, **dataclasses.asdict(shape), "params": shape.params()},
            "inputs_measured_on": MEASURED_ON,
            "step_cost": {k: dataclasses.asdict(costs[k]) for k in ("sparse", "dense")},
            "sparse_fit_rms_ms": costs["sparse_rms_ms"], "c_single_ms_per_gpair": costs["c_single_ms_per_gpair"],
            "rest": rest}
    print(f"step cost fit (ms, ms per 1e9 pairs; {MEASURED_ON}): sparse {costs['sparse']}, rms "
          f"{ {k: round(v, 3) for k, v in costs['sparse_rms_ms'].items()} }; dense {costs['dense']}")
    if args.command == "paper":
        res = paper_check(costs, rest, cache)
        print(json.dumps(res, indent=1))
        result = {"info": info, "paper": PAPER, "model": res}
    elif args.command == "plan":
        if len(args.tokens) != 1 or len(args.nodes) != 1:
            raise SystemExit("plan takes one --tokens and one --nodes")
        tokens, nodes, per_node = args.tokens[0], args.nodes[0], args.gpus_per_node
        if args.studio_job and not (args.config_out and args.machine):
            raise SystemExit("--studio-job needs --config-out (a path the job can read, inside the Studio) and "
                             "--machine (e.g. H100_X_8)")
        if args.tiled_mlp and not rest["tiled_mlp"]:
            raise SystemExit("--tiled-mlp: the tiled MLP's memory saving is not measured yet (the planner does not "
                             f"assume it); measure it on a GPU with {TILED_MLP_COMMAND}")
        res = plan(shape, hw, tokens, nodes, per_node, costs, rest, args.bytes_per_param, args.fsdp, cache, args.cp,
                   tiled_mlp=args.tiled_mlp)
        text = _fmt_plan(res, name, hw, tokens, nodes, per_node)
        print(text)
        from lightning_mtraining.strategies.cluster import cli_command, submit_studio_job, to_yaml

        config = plan_config(res, name, shape, tokens, nodes, per_node, bytes_per_param=args.bytes_per_param,
                             fsdp=args.fsdp, max_steps=args.max_steps, cpu=args.cpu)
        command = "python benchmarks/scale_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
        yaml_text = to_yaml(config, config_comments(res, text, command, args.config_out, nodes, per_node, args.cpu))
        print(f"\n--- LightningCLI config (python examples/cli.py fit --config {args.config_out or 'plan.yaml'}) ---")
        print(yaml_text, end="")
        if args.config_out:
            Path(args.config_out).write_text(yaml_text)
            print(f"--- written to {args.config_out} ---")
        if args.studio_job:
            job = submit_studio_job(cli_command(args.config_out), name=args.studio_job, machine=args.machine,
                                    num_machines=nodes, devices=per_node, studio=args.studio,
                                    teamspace=args.teamspace)
            print(f"submitted Lightning Studio job {args.studio_job!r} on {nodes} x {args.machine}: {job}")
        result = {"info": info, "plan": res, "config": config}
    else:
        rows = grid(shape, hw, args.tokens, args.nodes, args.gpus_per_node, costs, rest, cache)
        print(f"{'tokens':>8} {'GPUs':>4} {'method':>6} {'density':>7} {'fwd ms':>8} {'bwd ms':>8} {'exposed ms':>10} "
              f"{'step s':>8} {'tokens/s':>9} {'GiB/GPU':>7}")
        for r in rows:
            print(f"{r['seq_len']:>8} {r['gpus']:>4} {r['method']:>6} {r['density']:>7.3f} {r['fwd_s'] * 1e3:>8.1f} "
                  f"{r['bwd_s'] * 1e3:>8.1f} {(r['fwd_exposed_comm_s'] + r['bwd_exposed_comm_s']) * 1e3:>10.1f} "
                  f"{r['step_s']:>8.2f} {r['tokens_per_s']:>9.0f} {r['total_gib']:>7.1f}")
        result = {"info": info, "rows": rows}
        if args.plot:
            _plot(rows, args.plot, hw)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=lambda o: dataclasses.asdict(o)))


if __name__ == "__main__":
    main()
