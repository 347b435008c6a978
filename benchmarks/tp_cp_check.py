"""Check and time the N-dimensional mesh (dp_replicate x dp_shard x cp x tp) on GPUs: tensor parallel decoder layers,
ring attention over cp, FSDP2 over dp x cp, in a plain torch loop (``apply_context_parallel`` + ``apply_fsdp``).

Commands (repo root, ``kernels/`` importable as ``mtraining_kernels``; one process per GPU)::

    torchrun --nproc_per_node 4 benchmarks/tp_cp_check.py --cp 2 --tp 2 --out runs/tp2_cp2.json
    torchrun --nproc_per_node 4 benchmarks/tp_cp_check.py --cp 4 --tp 1 --out runs/tp1_cp4.json
    torchrun --nproc_per_node 2 benchmarks/tp_cp_check.py --cp 1 --tp 2 --out runs/tp2.json
    torchrun --nproc_per_node 4 benchmarks/tp_cp_check.py --cpu-smoke --cp 2 --tp 2      # CPU, gloo, tiny

1. Correctness (float32, a small Qwen2, dense and sparse): every rank also trains the same model on one device
   (its own GPU, no split) on the same samples; the report gives the largest loss and parameter differences over
   ``--check-steps`` SGD steps (expect ~1e-5 in float32 with TF32 off).
2. Timing (bf16, a Qwen2.5-3B-shaped model with ``--layers`` layers: 16 query heads, 2 KV heads, so tp <= 2):
   median step time (forward, backward, AdamW step) over ``--steps`` steps after 2 warm-up steps, tokens per second
   per sample, peak memory of this rank, dense and sparse (PAPER_SPARSITY). Compare layouts on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def build(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, dtype: torch.dtype,
          device: torch.device, seed: int = 0, init: float = 0.02):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1 << 20,
                         attn_implementation="eager" if device.type == "cpu" else "sdpa", tie_word_embeddings=False,
                         initializer_range=init)
    return AutoModelForCausalLM.from_config(config).to(dtype=dtype, device=device)


def parallel_model(args, mesh, sparsity, **shape):
    from lightning_mtraining import apply_context_parallel
    from lightning_mtraining.hf import apply_fsdp

    model = build(**shape)
    handle = apply_context_parallel(model, mesh, block_size=args.block_size, sparsity=sparsity)
    apply_fsdp(model, mesh)
    return model, handle


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float()


def check(args, mesh, solo, axes, device, sparse: bool) -> dict:
    from lightning_mtraining import SparsityConfig, apply_context_parallel

    # initializer_range 0.3: sharp attention, as in the CPU tests, so that a wrong position or pattern shows
    shape = dict(hidden=args.check_hidden, layers=2, heads=4, kv_heads=2, inter=2 * args.check_hidden, vocab=512,
                 dtype=torch.float32, device=device, init=args.check_init)
    sparsity = SparsityConfig(vertical_topk=(64, 32), slash_topk=(16, 8), last_q=64, tile_size=args.tile,
                              pattern_heads="kv") if sparse else None
    model, handle = parallel_model(args, mesh, sparsity, **shape)
    ref = build(**shape)
    ref_handle = apply_context_parallel(ref, solo, block_size=args.block_size, sparsity=sparsity)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 512, (1, args.check_seq), generator=g) for _ in range(args.check_steps * axes.dp)]
    worst_loss = 0.0
    for s in range(args.check_steps):
        mine = data[s * axes.dp + axes.dp_rank].to(device)
        loss = model(**handle.shard({"input_ids": mine, "labels": mine})).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses = [ref(**ref_handle.shard({"input_ids": x.to(device), "labels": x.to(device)})).loss
                      for x in data[s * axes.dp:(s + 1) * axes.dp]]
        worst_loss = max(worst_loss, abs(float(loss.detach()) - float(ref_losses[axes.dp_rank].detach())))
        torch.stack(ref_losses).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    worst_param = max((full(p) - ref_params[n].detach().float()).abs().max().item()
                      for n, p in model.named_parameters())
    handle.restore()
    return {"max_loss_diff": worst_loss, "max_param_diff": worst_param}


def timing(args, mesh, axes, device, sparse: bool) -> dict:
    from lightning_mtraining.sparsity.config import PAPER_SPARSITY

    shape = dict(hidden=2048, layers=args.layers, heads=16, kv_heads=2, inter=11008, vocab=151936,
                 dtype=torch.bfloat16, device=device)
    model, handle = parallel_model(args, mesh, PAPER_SPARSITY if sparse else None, **shape)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(2)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps + 2):
        x = torch.randint(0, 151936, (1, args.seq), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = model(**handle.shard({"input_ids": x, "labels": x})).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= 2:
            times.append(time.perf_counter() - start)
    handle.restore()
    median = statistics.median(times)
    return {"median_step_s": median, "tokens_per_s_per_sample": args.seq / median, "steps": times,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--tile", type=int, default=128)
    p.add_argument("--check-seq", type=int, default=4096)
    p.add_argument("--check-hidden", type=int, default=256)
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--check-init", type=float, default=0.3)
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, tiny sizes, no timing")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.cpu_smoke:
        args.block_size, args.tile, args.check_seq, args.check_hidden, args.check_steps = 16, 16, 200, 64, 2
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_mtraining.distributed import MeshAxes, build_mesh

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu_smoke:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    mesh = build_mesh(device.type, dp_replicate=args.dp_replicate, cp=args.cp, tp=args.tp)
    axes = MeshAxes.of(mesh)
    # the one-device reference's own CP group of one rank (mesh=None would leave the sparse estimator the default group)
    solo = DeviceMesh.from_group(dist.new_subgroups(1)[0], device.type, mesh_dim_names=("cp",))
    report = {"world": dist.get_world_size(), "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    for sparse in (False, True):
        report[f"check_{'sparse' if sparse else 'dense'}"] = check(args, mesh, solo, axes, device, sparse)
    if not args.cpu_smoke:
        for sparse in (False, True):
            report[f"timing_{'sparse' if sparse else 'dense'}"] = timing(args, mesh, axes, device, sparse)
    if dist.get_rank() == 0:
        print(json.dumps(report, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
