"""GPU checks of the FlexAttention block op inside the ring (skipped without CUDA).

The op's backward recomputes the block forward and pushes (w * dout, w * rowsum(dout*(out_blk - out))) through
FlexAttention's own autograd; here it must agree with the float64 reference like the torch op does.
"""

import pytest
import torch

from helpers.references import dense_reference
from lightning_mtraining.core.layouts import shard_sequence, unshard_sequence
from lightning_mtraining.ring.block_ops import FlexBlockOp, TorchBlockOp
from lightning_mtraining.ring.simulated import SimulatedRing

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout, w, n",
                         [("striped", 4, 4 * 128 * 3), ("zigzag", 3, 6 * 100), ("contiguous", 3, 3 * 200)])
def test_flex_ring_matches_reference_fp32(layout, w, n):
    torch._dynamo.config.cache_size_limit = 256
    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(2, 6, n, 64, device="cuda", generator=g)
    k = torch.randn(2, 2, n, 64, device="cuda", generator=g)
    v = torch.randn(2, 2, n, 64, device="cuda", generator=g)
    do = torch.randn(2, 6, n, 64, device="cuda", generator=g)
    qr, kr, vr = (t.double().cpu().requires_grad_(True) for t in (q, k, v))
    ref = dense_reference(qr, kr, vr)
    refs = [ref, *torch.autograd.grad(ref, (qr, kr, vr), do.double().cpu())]
    for op in (FlexBlockOp(), TorchBlockOp()):
        sim = SimulatedRing(w, layout, 128, op=op)
        outs = sim.forward(q, k, v)
        grads = sim.backward([shard_sequence(do, 2, r, w, layout, 128) for r in range(w)])
        got = [unshard_sequence(outs, 2, layout, 128), *(unshard_sequence(g_, 2, layout, 128) for g_ in grads)]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, refs):
            rel = ((a.double().cpu() - b).abs().max() / b.abs().max()).item()
            # FlexAttention computes fp32 inputs with tf32-free fp32 math on H100/H200 (~1e-6); 1e-4 catches any
            # mask or lse error (those are O(1)) while tolerating reduction-order differences.
            assert rel < 1e-4, (repr(op), name, rel)


def test_flex_ring_bf16_close_to_torch_bf16():
    """bf16: the ring's error against fp32 truth is at most 2x that of plain torch attention in bf16."""
    torch._dynamo.config.cache_size_limit = 256
    n, w = 8192, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, h, n, 128, device="cuda", generator=g) for h in (16, 2, 2, 16))
    truth = dense_reference(q, k, v).float()
    sim = SimulatedRing(w, "striped", 128, op=FlexBlockOp())
    out = unshard_sequence(sim.forward(*(t.bfloat16() for t in (q, k, v))), 2, "striped", 128).float()
    torch_bf16 = dense_reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float()).bfloat16().float()
    err_ring = (out - truth).abs().max().item()
    err_torch = (torch_bf16 - truth).abs().max().item()
    # flash-attention's rule (at most 2x torch's own bf16 error); the 1e-3 floor is a quarter of one bf16 rounding
    # step at 1.0 (2^-8), there only so that a near-zero torch error cannot make the bound meaningless.
    assert err_ring <= 2 * err_torch + 1e-3, (err_ring, err_torch)
