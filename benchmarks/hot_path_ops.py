"""What the host issues for one attention layer's training step: ATen ops, kernel launches and host reads of the
forward, the checkpointed recompute and the backward, for dense attention and the sparse variants.

A sparse layer that dispatches hundreds of small ops is bound by the host, whatever its kernels cost; the count is a
property of the code's structure (the same at 1K and 32K tokens), so a CPU run of the path a GPU takes counts it:
the Triton scorer, list builder and attention kernels run in the Triton interpreter, chosen as on CUDA
(:func:`gpu_path_on_cpu`). The layer is the first attention module of a one-layer Llama with SmolLM2-135M's head
shape (9 query heads on 3 KV heads, head dim 64) prepared by ``apply_context_parallel`` on one process, called
through the Hugging Face hook as the model would call it, inside non-reentrant activation checkpointing; the second
of two steps is counted (the first fills the caches a run fills once).

    TRITON_INTERPRET=1 python benchmarks/hot_path_ops.py --paths straight general --out runs/hot_path_ops.json

Prints one row per variant and path (ops / launches / host reads per phase; the straight path, Note [The straight
path] in ``lightning_mtraining.ring.straight``, and the general one, which packed documents and soft-capped layers
take) and the largest emitters; writes the full counts as JSON. ``--tokens`` changes the length (the counts should
not move). ``tests/unit/test_straight_path.py`` holds the sparse layer to its budget with the same harness.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator

import torch

VARIANTS = ("dense", "topk", "topp")
PHASES = ("forward", "recompute", "backward")  # per layer; "step": once a forward, before the layers


@contextlib.contextmanager
def gpu_path_on_cpu() -> Iterator[None]:
    """Choose on CPU tensors what the package chooses on CUDA ones: the straight path's Triton kernels, and on the
    general path (``--path general``) the Triton scorer, the Triton list builders with bounded widths and the Triton
    attention kernels (``TritonBlockOp``)."""
    import lightning_mtraining.ring.attention as ring_attention
    import lightning_mtraining.ring.steps as steps
    import lightning_mtraining.sparsity.estimation as estimation
    import mtraining_kernels.indexing as indexing
    from mtraining_kernels.vertical_slash import TritonBlockOp

    saved = (estimation._SCORER, indexing._use_triton, ring_attention.sparse_block_op, steps.prepare_pattern_tiles)

    def sparse_block_op(op, device, tile):
        return TritonBlockOp(tile, tile) if op is None else saved[2](op, device, tile)

    def bounded(*args, **kwargs):
        kwargs["widths"] = "bounded"
        return saved[3](*args, **kwargs)

    estimation._SCORER = "triton"
    indexing._use_triton = lambda backend, x: backend != "torch"
    ring_attention.sparse_block_op = sparse_block_op
    steps.prepare_pattern_tiles = bounded
    try:
        yield
    finally:
        estimation._SCORER, indexing._use_triton, ring_attention.sparse_block_op, steps.prepare_pattern_tiles = saved


def sparsity_of(variant: str, tile: int):
    """The variant's config: top-k (32 verticals, 2 slashes) or top-p 0.9, both with ``dense_above`` as shipped."""
    from lightning_mtraining.sparsity.config import SparsityConfig

    if variant == "dense":
        return None
    if variant == "topk":
        return SparsityConfig(vertical_topk=32, slash_topk=2, local_window=tile, tile_size=tile, last_q=16)
    return SparsityConfig(top_p=0.9, max_vertical=64, max_slash=4, local_window=tile, tile_size=tile, last_q=16)


@dataclasses.dataclass
class Layer:
    module: torch.nn.Module
    cp: object  # the ContextParallel handle
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int


def make_layer(variant: str, tokens: int = 1024, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
               tile: int = 64, device: str = "cpu", sparsity=None) -> Layer:
    """The first attention module of a one-layer Llama prepared for ``variant`` (or the config ``sparsity``) on one
    process, its batch sharded, on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_mtraining.hf.parallel import apply_context_parallel

    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  max_position_embeddings=tokens, attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().to(device)
    cp = apply_context_parallel(model, sparsity=sparsity if sparsity is not None else sparsity_of(variant, tile),
                                block_size=tile, fused_loss=False)
    cp.shard({"input_ids": torch.randint(0, 64, (1, tokens), device=device)})
    if cp.schedule is not None:
        cp.schedule.set_step(1)  # not a logging step (those read the statistics on the host)
    module = model.model.layers[0].self_attn
    return Layer(module, cp, tokens, heads, kv_heads, head_dim)


def layer_step(layer: Layer, counts=None, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One training step of the layer's attention on ``dtype`` inputs: forward under non-reentrant checkpointing, then
    backward (which recomputes the forward); labelled phases in ``counts`` (an
    :class:`~lightning_mtraining.core.op_count.OpCounts`) when given. Returns the output."""
    from torch.utils.checkpoint import checkpoint

    from lightning_mtraining.hf.attention import CONFIG_ATTR, ring_attention_forward

    # dense attention on one process: the model keeps Hugging Face's own SDPA (what the strategy runs there)
    if getattr(layer.module, CONFIG_ATTR, None) is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as attention
    else:
        attention = ring_attention_forward
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, N, D = 1, layer.heads, layer.kv_heads, layer.tokens, layer.head_dim
    device = next(layer.module.parameters()).device
    q, k, v = (torch.randn(B, h, N, D, generator=g).to(device, dtype).requires_grad_() for h in (H, Hkv, Hkv))
    grad = torch.randn(B, N, H, D, generator=g).to(device, dtype)
    calls = []
    phase = counts.phase if counts is not None else (lambda name: contextlib.nullcontext())
    with phase("step"):  # what a model's forward does once, before its layers (the last forward's decisions read)
        layer.cp.plan.begin_forward(training=True)

    def attend(q, k, v):
        name = "forward" if not calls else "recompute"
        calls.append(name)
        with phase(name):
            return attention(layer.module, q, k, v, None, scaling=D ** -0.5)[0]

    out = checkpoint(attend, q, k, v, use_reentrant=False)
    with phase("backward"):
        out.backward(grad)
    return out.detach()


def count_variant(variant: str, tokens: int, path: str = "straight", **shape) -> dict:
    from lightning_mtraining.core.op_count import count_ops

    layer = make_layer(variant, tokens, **shape)
    layer.cp.plan.kernels = "triton"  # the straight path's kernels as on CUDA
    layer.cp.plan.straight_path = path == "straight"
    layer_step(layer)  # the first step fills what a run fills once (caches, compiled kernels)
    with count_ops() as counts:
        layer_step(layer, counts, seed=1)
    return counts.as_dict()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--paths", nargs="+", default=["straight"], choices=("straight", "general"),
                        help="sparse variants: the straight path, the general path, or both")
    parser.add_argument("--top", type=int, default=12, help="largest emitters printed per sparse variant")
    parser.add_argument("--out", default=None, help="write the counts here as JSON")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run with TRITON_INTERPRET=1: the Triton kernels run in the interpreter on the CPU", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from helpers.interpreter import shim_interpreter  # the interpreter under numpy >= 2.4

    shim_interpreter()
    rows = {}
    with gpu_path_on_cpu():
        for variant in args.variants:
            for path in (args.paths if variant != "dense" else ["straight"]):
                name = variant if path == "straight" else f"{variant} ({path})"
                rows[name] = count_variant(variant, args.tokens, path)
    print(f"one attention layer's training step at {args.tokens} tokens (SmolLM2 head shape), the path a GPU takes")
    print(f"{'variant':18} {'ops':>5} {'launches':>8} {'reads':>5}   "
          + "   ".join(f"{p} ops/launches" for p in PHASES) + "   per forward (outside the layers)")
    for variant, c in rows.items():
        total = sum(c["ops"].get(p, 0) for p in PHASES)
        launches = sum(c["launches"].get(p, 0) for p in PHASES)
        reads = sum(c["host_reads"].get(p, 0) for p in PHASES)
        per = "   ".join(f"{c['ops'].get(p, 0):>9}/{c['launches'].get(p, 0):<8}" for p in PHASES)
        print(f"{variant:18} {total:>5} {launches:>8} {reads:>5}   {per}   {c['ops'].get('step', 0)} ops")
    for variant, c in rows.items():
        if variant == "dense":
            continue
        merged: dict[str, int] = {}
        for per in c["by_op"].values():
            for name, n in per.items():
                merged[name] = merged.get(name, 0) + n
        top = sorted(merged.items(), key=lambda kv: -kv[1])[:args.top]
        print(f"{variant}: " + ", ".join(f"{name} {n}" for name, n in top))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"tokens": args.tokens, "torch": torch.__version__, "variants": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
