"""GPU checks of the sparse strategy's hot path (skipped without CUDA): the fused dense kernel on a rank's own chunk
(cuDNN with log-sum-exp) inside a ring, its one-time self-check, and a checkpointed bf16 training step with a head
exactly at ``dense_above`` (the forward under a bf16 default dtype, the recompute under float32)."""

import pytest
import torch

from helpers.dense_decision import checkpointed_step_at_threshold
from helpers.references import dense_reference
from lightning_mtraining.core.layouts import shard_sequence, unshard_sequence
from lightning_mtraining.ring.block_ops import FlexBlockOp
from lightning_mtraining.ring.fused_dense import FusedDenseOp
from lightning_mtraining.ring.simulated import SimulatedRing

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("H, Hkv, D", [(16, 2, 128), (9, 3, 64)])
def test_cudnn_serves_the_own_chunk(H, Hkv, D):
    q = torch.randn(1, H, 1024, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, 1024, D, device="cuda", dtype=torch.bfloat16)
    assert FusedDenseOp(FlexBlockOp()).fused_kernel(q, k) == "cudnn"


@pytest.mark.parametrize("w, H, Hkv, D", [(4, 16, 2, 128), (3, 9, 3, 64)])
def test_fused_ring_bf16_close_to_torch_bf16(w, H, Hkv, D):
    """Forward and backward of a simulated striped ring whose own-chunk steps run cuDNN: against float64 truth, at most
    twice plain torch attention's own bf16 error (flash-attention's rule; the 1e-3 floor is a quarter of a bf16
    rounding step at 1.0, so a near-zero torch error cannot make the bound meaningless)."""
    torch._dynamo.config.cache_size_limit = 256
    n = w * 128 * 6
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v, do = (torch.randn(1, h, n, D, device="cuda", generator=g) for h in (H, Hkv, Hkv, H))
    qb, kb, vb, dob = (t.bfloat16() for t in (q, k, v, do))
    qr, kr, vr = (t.double().cpu().requires_grad_(True) for t in (qb, kb, vb))
    truth = dense_reference(qr, kr, vr)
    truths = [truth, *torch.autograd.grad(truth, (qr, kr, vr), dob.double().cpu())]
    qt, kt, vt = (t.detach().clone().requires_grad_(True) for t in (qb, kb, vb))
    same = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    sames = [same, *torch.autograd.grad(same, (qt, kt, vt), dob)]  # torch's own bf16 attention and its error
    op = FusedDenseOp(FlexBlockOp())
    sim = SimulatedRing(w, "striped", 128, op=op)
    outs = sim.forward(qb, kb, vb)
    grads = sim.backward([shard_sequence(dob, 2, r, w, "striped", 128) for r in range(w)])
    got = [unshard_sequence(outs, 2, "striped", 128), *(unshard_sequence(x, 2, "striped", 128) for x in grads)]
    assert op.fused_kernel(qb, kb) == "cudnn"
    for name, a, s, t in zip(("out", "dq", "dk", "dv"), got, sames, truths):
        err = (a.double().cpu() - t).abs().max().item()
        err_torch = (s.double().cpu() - t).abs().max().item()
        assert err <= 2 * err_torch + 1e-3, (name, err, err_torch)


def test_checkpointed_bf16_step_at_the_threshold_on_cuda(monkeypatch):
    # head dim 16 (the Triton kernels take 16..256): hidden 64 over 4 heads
    checkpointed_step_at_threshold("qwen2", torch.device("cuda"), monkeypatch, hidden_size=64, intermediate_size=128)
