"""The straight per-layer path (Note [The straight path] in ``lightning_mtraining.ring.straight``) on the code a GPU
runs, in the Triton interpreter: what it computes and what it costs the host.

What is compared:

- the fused selection (``mtraining_kernels.pattern_select``: candidate keys, ``torch.topk``, the finishing kernel)
  against the torch functions it replaces (``estimation._select`` / ``_forced`` / ``_sorted_indices``,
  ``indexing.prepare_pattern_tiles``, ``pattern.head_pairs`` / ``decide_dense_heads``) on the same float32 scores:
  the pattern, the list builder's tiles, their counts, the pair counts and the decisions exactly equal (the same
  integer and float64 arithmetic; the top-p sums in float64 in another order, and no seeded score lies within that
  rounding of a threshold), top-k and top-p, per-head budgets with a zero, ragged rows, query and KV pattern heads,
  a head given every tile (the previous forward's decision);
- the batch estimator's Triton route (the scorer's partials merged in its kernel) against ``estimate_pattern`` with
  the Triton scorer: the same index sets (float32 sums in other orders; no seeded boundary within that noise), on
  one process and on 3 gloo processes (striped);
- a prepared model's sparse layer, through the Hugging Face hook: the straight path's output and gradients against
  ``ring_attention`` with the same pattern (the same kernels and pairs: bit-identical);
- what the host issues for one sparse layer's training step (``core.op_count``: forward, checkpointed recompute,
  backward), against the budget: at most 60 ATen ops and 20 kernel launches (ATen ops that launch a kernel plus the
  package's Triton launches) and no host read, top-k and top-p, at 512 and 1024 tokens alike (the count is the
  code's structure, not the length, but for one sum of the column gradients' query-range parts, split where the
  query tiles allow), also for a layer whose previous forward decided some heads dense; and per step (outside the
  layers) at most a fixed handful (the decisions' copy and read); over 2 and 3 gloo ranks, a bounded number on top
  of one rank's and per further ring step (:data:`RING_FIXED_OPS`, :data:`RING_STEP_OPS`).

The checks run in ONE subprocess with ``TRITON_INTERPRET=1`` (``run_interpreter_checks``); run this file directly
to see them: ``TRITON_INTERPRET=1 python tests/unit/test_straight_path.py``.
"""

from __future__ import annotations

import os
import sys

import pytest

from helpers.interpreter import run_interpreter_checks

pytestmark = pytest.mark.slow  # a Triton-interpreter subprocess: a few minutes on 2 cores

# per sparse layer and training step (forward + recompute + backward), at one rank
OP_BUDGET, LAUNCH_BUDGET = 60, 20
# per forward outside the layers: the last forward's decisions copied and read (a concatenation, a cast, the read)
STEP_OPS = 8
# over W ranks (a layer's training step): what W = 2 adds to one rank (the estimator's four collectives and what they
# need, the gathered verticals, the ring's second step), and what each further ring step adds
RING_FIXED_OPS, RING_STEP_OPS, RING_STEP_LAUNCHES = 200, 40, 20

CHECKS = ["fused_selection_topk", "fused_selection_topp", "fused_selection_kv_ragged", "fused_selection_dense_heads",
          "estimator_triton_route_w1", "estimator_triton_route_w3_gloo", "straight_layer_equals_ring_attention",
          "op_budget_topk", "op_budget_topp", "op_budget_with_dense_heads", "op_count_independent_of_length",
          "op_count_per_ring_step_gloo"]


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_checks(__file__, timeout=1500)


@pytest.mark.parametrize("name", CHECKS)
def test_interpreter(interpreter_results, name):
    assert interpreter_results.get(name) == "ok", interpreter_results.get(name, "missing")


# ---------------------------------------------------------------------------------------------------------------
# The checks (run only in the subprocess, with TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------------------------

def _estimator_worker(rank, world_size):
    """The batch estimator's Triton route and ``estimate_pattern`` (Triton scorer) on this rank's striped shard."""
    import torch

    from helpers.interpreter import shim_interpreter

    shim_interpreter()
    import lightning_mtraining.sparsity.estimation as est
    from lightning_mtraining import SparsityConfig, estimate_pattern
    from lightning_mtraining.core.layouts import shard_sequence
    from lightning_mtraining.sparsity.batch_estimator import BatchEstimator

    B, H, Hkv, N, D, T = 2, 4, 2, 768, 16, 32
    lens = [768, 700]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, N, D, generator=g)
    k = torch.randn(B, Hkv, N, D, generator=g)
    k[:, :, :4] += 2.0  # sinks
    group = None if world_size == 1 else torch.distributed.group.WORLD
    qs = shard_sequence(q, 2, rank, world_size, "striped", T)
    ks = shard_sequence(k, 2, rank, world_size, "striped", T)
    out = {}
    for name, cfg in (("topk", SparsityConfig(vertical_topk=24, slash_topk=4, last_q=16, local_window=32,
                                              tile_size=T)),
                      ("topp-kv", SparsityConfig(top_p=0.85, max_vertical=40, max_slash=6, last_q=16, local_window=32,
                                                 tile_size=T, pattern_heads="kv", dense_above=0.4))):
        be = BatchEstimator(batch=B, heads=H, kv_heads=Hkv, local_len=qs.shape[2], head_dim=D, dtype=q.dtype,
                            device=q.device, lengths=tuple(lens), group=group, cp_rank=rank, cp_size=world_size,
                            layout="striped", block_size=T, route="triton")
        assert be.applies(cfg), name
        got = be.estimate(qs, ks, cfg, None, D ** -0.5)
        est._SCORER = "triton"
        ref = estimate_pattern(qs, ks, cfg, group=group, block_size=T, seq_len=lens, scale=D ** -0.5)
        est._SCORER = "auto"
        out[name] = [got.pattern.vertical_idx, got.pattern.slash_idx, ref.vertical_idx, ref.slash_idx,
                     got.allowed, got.decided, got.tiles.offsets, got.tiles.verticals, torch.tensor(cfg.dense_above)]
    return out


def _ring_count_worker(rank, world_size):
    """One sparse layer's training step on this rank's shard (W ranks, striped), counted as in the budget checks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers.interpreter import shim_interpreter
    from helpers.scripts import load_script

    shim_interpreter()
    from lightning_mtraining import apply_context_parallel
    from lightning_mtraining.core.op_count import count_ops

    ops = load_script("benchmarks/hot_path_ops.py", "hot_path_ops")
    H, Hkv, D, T, N = 4, 2, 16, 32, 768
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=H * D, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=H, num_key_value_heads=Hkv, max_position_embeddings=N,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    cp = apply_context_parallel(model, mesh, sparsity=ops.sparsity_of("topk", T), block_size=T, fused_loss=False)
    cp.shard({"input_ids": torch.randint(0, 64, (1, N), generator=torch.Generator().manual_seed(0))})
    cp.schedule.set_step(1)
    cp.plan.kernels = "triton"
    layer = ops.Layer(model.model.layers[0].self_attn, cp, N // world_size, H, Hkv, D)
    ops.layer_step(layer)
    with count_ops() as counts:
        ops.layer_step(layer, counts, seed=1)
    assert cp.schedule._patterns[0].steps is not None
    return counts.as_dict()


def _canon(idx):
    return [[sorted(x for x in row if x >= 0) for row in b] for b in idx.tolist()]


def _run_checks() -> dict[str, str]:

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from helpers.interpreter import shim_interpreter

    shim_interpreter()
    import torch

    from helpers import selection
    from helpers.scripts import load_script

    ops = load_script("benchmarks/hot_path_ops.py", "hot_path_ops")

    def fused_case(B, G, H, N, T, lens, sink, window, vb, sb, top_p, dense_above, seed, dense=None):
        def check():
            vert, slash = selection.random_scores(B, G, N, lens, seed)
            args = (vert, slash, lens, H, T, sink, window, vb, sb, top_p, dense_above, dense)
            selection.compare(selection.fused(*args), selection.reference(*args), N)
        return check

    def estimator_checks(world_size):
        def check():
            from lightning_mtraining.sparsity.pattern import VerticalSlashPattern, decide_dense_heads, head_pairs

            if world_size == 1:
                per_rank = [_estimator_worker(0, 1)]
            else:
                from helpers.dist import run_distributed

                per_rank = run_distributed(_estimator_worker, world_size, timeout=900)
            for out in per_rank:
                for name, (gv, gs, rv, rs, allowed, decided, _, _, dense_above) in out.items():
                    assert _canon(gv) == _canon(rv) and _canon(gs) == _canon(rs), f"{name}: patterns differ"
                    pattern = VerticalSlashPattern(gv, gs, 32)
                    ref_allowed, causal = head_pairs(pattern, [768, 700])
                    assert torch.equal(allowed, ref_allowed), name
                    want = decide_dense_heads(ref_allowed, causal, float(dense_above))
                    assert torch.equal(decided.bool(), want), name
                    for a, b in zip(out[name], per_rank[0][name]):  # every rank the same pattern and tiles
                        assert torch.equal(a, b), f"{name}: ranks differ"
        return check

    def straight_equals_ring():
        from lightning_mtraining import SparsityConfig, ring_attention
        from lightning_mtraining.hf.attention import ring_attention_forward

        cfg = SparsityConfig(vertical_topk=16, slash_topk=2, last_q=16, local_window=32, tile_size=32,
                             dense_above=None)
        layer = ops.make_layer("topk", tokens=512, heads=4, kv_heads=2, head_dim=16, tile=32, sparsity=cfg)
        layer.cp.plan.kernels = "triton"
        g = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(1, h, 512, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
        layer.cp.plan.begin_forward(training=True)
        out = ring_attention_forward(layer.module, q, k, v, None, scaling=0.25)[0]  # [B, S, H, D]
        run = layer.cp.schedule._patterns[0]
        out.transpose(1, 2).sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        from mtraining_kernels.vertical_slash import TritonBlockOp

        ref = ring_attention(q, k, v, block_size=32, sparsity=run.estimate.pattern, scale=0.25,
                             op=TritonBlockOp(32, 32))
        ref.sum().backward()
        assert torch.equal(out.transpose(1, 2), ref)
        for a, t in zip(grads, (q, k, v)):
            assert torch.equal(a, t.grad)

    def budget(variant, tokens=512, dense_first=False):
        def check():
            counts = _count(variant, tokens, dense_first)
            phases = ("forward", "recompute", "backward")
            total = sum(counts["ops"].get(p, 0) for p in phases)
            launches = sum(counts["launches"].get(p, 0) for p in phases)
            reads = sum(counts["host_reads"].get(p, 0) for p in phases)
            assert total <= OP_BUDGET and launches <= LAUNCH_BUDGET and reads == 0, (total, launches, reads, counts)
            assert counts["ops"].get("step", 0) <= STEP_OPS, counts["by_op"].get("step")
            return counts
        return check

    def independent_of_length():
        # (lengths with the same number of query-range parts in the column gradients' kernel: 2 here, and on a GPU
        # at long sequences; one part, at short ones, skips their sum)
        a, b = _count("topk", 1024), _count("topk", 1536)
        for what in ("ops", "launches"):
            assert a[what] == b[what], (a[what], b[what])

    def per_ring_step():
        from helpers.dist import run_distributed

        phases = ("forward", "recompute", "backward")
        one = _count("topk", 768)
        per_w = {w: run_distributed(_ring_count_worker, w, timeout=900) for w in (2, 3)}
        for w, ranks in per_w.items():
            for c in ranks:
                assert sum(c["host_reads"].get(p, 0) for p in phases) == 0, (w, c["host_reads"])
        total = {w: (sum(per_w[w][0]["ops"].get(p, 0) for p in phases),
                     sum(per_w[w][0]["launches"].get(p, 0) for p in phases)) for w in (2, 3)}
        total[1] = (sum(one["ops"].get(p, 0) for p in phases), sum(one["launches"].get(p, 0) for p in phases))
        step_ops, step_launches = total[3][0] - total[2][0], total[3][1] - total[2][1]
        assert step_ops <= RING_STEP_OPS and step_launches <= RING_STEP_LAUNCHES, total
        assert total[2][0] - total[1][0] - step_ops <= RING_FIXED_OPS, total

    def _count(variant, tokens, dense_first=False):
        from lightning_mtraining import SparsityConfig
        from lightning_mtraining.core.op_count import count_ops

        cfg = None
        if dense_first:  # a threshold below every head's share: the second forward runs every head dense but one
            cfg = SparsityConfig(vertical_topk=16, slash_topk=2, last_q=16, local_window=32, tile_size=32,
                                 dense_above=0.0)
        layer = ops.make_layer(variant, tokens=tokens, heads=4, kv_heads=2, head_dim=16, tile=32, sparsity=cfg)
        layer.cp.plan.kernels = "triton"
        ops.layer_step(layer)  # warm: caches, and the decisions the next forward uses
        if dense_first:  # keep one head sparse, so the layer runs mixed: the sparse kernels with full tiles
            schedule = layer.cp.schedule
            schedule._read_decisions()
            heads = len(schedule._dense_heads[0][0])
            schedule._dense_heads[0] = ((True,) + (False,) * (heads - 1),)
        with count_ops() as counts:
            ops.layer_step(layer, counts, seed=1)
        run = layer.cp.schedule._patterns[0]
        assert run.steps is not None  # the sparse kernels ran
        if dense_first:
            assert run.estimate.dense[0][0]
        return counts.as_dict()

    checks = {
        "fused_selection_topk": fused_case(1, 3, 3, 512, 32, [512], 4, 32, [20] * 3, [3] * 3, None, 0.3, 0),
        "fused_selection_topp": fused_case(2, 2, 4, 512, 16, [512, 300], 4, 16, [40, 9], [6, 0], 0.9, 0.5, 1),
        "fused_selection_kv_ragged": fused_case(2, 2, 6, 384, 32, [384, 131], 2, 32, [12, 3], [2, 5], 0.7, 0.2, 2),
        "fused_selection_dense_heads": fused_case(1, 2, 4, 256, 16, [256], 4, 16, [8, 8], [3, 3], None, 0.5, 3,
                                                  dense=torch.tensor([[1, 0]], dtype=torch.int8)),
        "estimator_triton_route_w1": estimator_checks(1),
        "estimator_triton_route_w3_gloo": estimator_checks(3),
        "straight_layer_equals_ring_attention": straight_equals_ring,
        "op_budget_topk": budget("topk"),
        "op_budget_topp": budget("topp"),
        "op_budget_with_dense_heads": budget("topk", dense_first=True),
        "op_count_independent_of_length": independent_of_length,
        "op_count_per_ring_step_gloo": per_ring_step,
    }
    from helpers.interpreter import collect

    return collect(checks)



if __name__ == "__main__":
    from helpers.interpreter import script_main

    script_main(_run_checks)
