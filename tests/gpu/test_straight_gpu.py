"""GPU checks of the straight per-layer path (Note [The straight path] in ``lightning_mtraining.ring.straight``;
skipped without CUDA): the fused selection kernels at 32K tokens against the torch functions they replace, the batch
estimator against ``estimate_pattern``, and a sparse layer's training step: no synchronising call, within the op
budget, and the attention of its own pattern."""

import pytest
import torch

from helpers import selection
from helpers.scripts import load_script

pytestmark = pytest.mark.gpu

N, T = 32768, 128


@pytest.mark.parametrize("top_p, vb, sb, dense", [(None, 1024, 32, None), (0.9, 4096, 4096, None),
                                                  (0.9, 2048, 64, "one")])
def test_fused_selection_matches_the_torch_selection_at_32k(top_p, vb, sb, dense):
    """9 pattern heads (SmolLM2's query heads), ragged rows: the same pattern, tiles, counts and decisions as the
    torch functions (exact: integer and float64 arithmetic on the same float32 scores)."""
    B, G, lens = 2, 9, [N, N - 1000]
    vert, slash = selection.random_scores(B, G, N, lens, seed=5, device="cuda")
    mask = None if dense is None else torch.tensor([[1] + [0] * (G - 1)] * B, dtype=torch.int8)
    args = (vert, slash, lens, G, T, 4, 128, [vb] * G, [sb] * G, top_p, 0.3, mask)
    selection.compare(selection.fused(*args), selection.reference(*args), N)


@pytest.mark.parametrize("pattern_heads", ["query", "kv"])
def test_the_batch_estimator_matches_estimate_pattern_at_32k(pattern_heads):
    """bf16, 16 query heads on 2 KV heads, head dim 128: the Triton route (the normaliser's partials merged in the
    scores kernel) against ``estimate_pattern`` with the Triton scorer (the partials merged in torch): float32 sums in
    other orders, so index sets within a few boundary swaps; the counts and decisions exact for its own pattern."""
    from lightning_mtraining import SparsityConfig, estimate_pattern
    from lightning_mtraining.sparsity.batch_estimator import BatchEstimator
    from lightning_mtraining.sparsity.pattern import VerticalSlashPattern, decide_dense_heads, head_pairs

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 2, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k[:, :, :8] += 2.0  # sinks, as trained models have
    cfg = SparsityConfig(top_p=0.9, max_vertical=1024, max_slash=1024, pattern_heads=pattern_heads)
    be = BatchEstimator(batch=1, heads=16, kv_heads=2, local_len=N, head_dim=128, dtype=q.dtype, device=q.device,
                        lengths=(N,), group=None, cp_rank=0, cp_size=1, layout="striped", block_size=128,
                        route="triton")
    assert be.applies(cfg)
    got = be.estimate(q, k, cfg, None, 128 ** -0.5)
    ref = estimate_pattern(q, k, cfg)
    for a, b in zip((got.pattern.vertical_idx, got.pattern.slash_idx), (ref.vertical_idx, ref.slash_idx)):
        for row_a, row_b in zip(a.flatten(0, 1), b.flatten(0, 1)):
            sa, sb = set(row_a.tolist()) - {-1}, set(row_b.tolist()) - {-1}
            assert len(sa ^ sb) <= max(4, len(sa) // 100), (len(sa), len(sb), len(sa ^ sb))
    pattern = VerticalSlashPattern(got.pattern.vertical_idx, got.pattern.slash_idx, 128)
    allowed, causal = head_pairs(pattern, [N])
    assert torch.equal(got.allowed, allowed)
    assert torch.equal(got.decided.bool(), decide_dense_heads(allowed, causal, cfg.dense_above))


def _layer(ops, tokens=8192):
    from lightning_mtraining import SparsityConfig

    cfg = SparsityConfig(vertical_topk=256, slash_topk=16)
    layer = ops.make_layer("topk", tokens=tokens, heads=9, kv_heads=3, head_dim=64, tile=128, device="cuda",
                           sparsity=cfg)
    return layer


def test_a_straight_sparse_step_makes_no_synchronising_call_and_keeps_the_budget():
    """SmolLM2's attention shape at 8K tokens, bf16: once warm, a checkpointed layer's training step on the straight
    path (estimate, lists, the Triton/Gluon kernels, the decision copied for the next forward) makes no synchronising
    CUDA call (``set_sync_debug_mode("error")``) and issues at most 60 ATen ops and 20 launches (the CPU test's budget,
    here on the kernels the GPU runs)."""
    from lightning_mtraining.core.op_count import count_ops

    ops = load_script("benchmarks/hot_path_ops.py", "hot_path_ops")
    layer = _layer(ops)
    for seed in range(2):  # compiles, allocations, the decisions the next forward reads
        ops.layer_step(layer, seed=seed, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with count_ops() as counts:
            ops.layer_step(layer, counts, seed=3, dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    phases = ("forward", "recompute", "backward")
    assert layer.cp.schedule._patterns[0].steps is not None  # the sparse kernels ran
    assert counts.total("ops", phases) <= 60 and counts.total("launches", phases) <= 20, counts.as_dict()
    assert counts.total("host_reads", phases) == 0


def test_a_straight_layer_computes_its_pattern():
    """The straight path's output and gradients against ``ring_attention`` with the layer's own pattern (the same
    pairs; bf16: within twice torch's own bf16 error of a float32 reference is not needed, the kernels and lists are
    the same, so the results are close to rounding)."""
    from lightning_mtraining import ring_attention
    from lightning_mtraining.hf.attention import ring_attention_forward

    ops = load_script("benchmarks/hot_path_ops.py", "hot_path_ops")
    layer = _layer(ops)
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(1, h, 8192, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
               for h in (9, 3, 3))
    layer.cp.plan.begin_forward(training=True)
    out = ring_attention_forward(layer.module, q, k, v, None, scaling=0.125)[0].transpose(1, 2)
    run = layer.cp.schedule._patterns[0]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = ring_attention(q, k, v, block_size=128, sparsity=run.estimate.pattern, scale=0.125)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        assert torch.equal(a, b)
