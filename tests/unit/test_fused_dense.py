"""The fused dense block op (:class:`~lightning_mtraining.ring.fused_dense.FusedDenseOp`) on CPU: a rank's own chunk
(``q_pos is k_pos``, plain causal) on ATen's flash kernel, everything else on the fallback op, and a ring of one rank
(the dense layers of the sparse strategy at W = 1) on ``scaled_dot_product_attention``, the call Hugging Face's "sdpa"
attention makes. Compared in float64 with the chunked torch op (1e-12: both are exact float64 computations of the
same pairs, differing only in summation order)."""

from __future__ import annotations

import pytest
import torch

from helpers.models import VOCAB, make_model
from lightning_mtraining.ring.block_ops import TorchBlockOp, default_block_op
from lightning_mtraining.ring.fused_dense import FusedDenseOp


def _qkv(S=300, H=6, Hkv=2, D=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, S, D, generator=g, dtype=dtype) for h in (H, Hkv, Hkv, H)]


def test_the_default_dense_op_is_fused():
    op = default_block_op(torch.device("cpu"))
    assert isinstance(op, FusedDenseOp) and isinstance(op.fallback, TorchBlockOp)
    assert op.supports_window and op.supports_softcap and op.supports_documents


@pytest.mark.parametrize("groups", [1, 3])
def test_own_chunk_forward_and_backward_equal_the_torch_op(groups):
    q, k, v, dout = _qkv(H=2 * groups, Hkv=2)
    pos = torch.arange(q.shape[2]) * 3 + 1  # global positions of a shard: increasing, not contiguous
    fused, torch_op = FusedDenseOp(TorchBlockOp()), TorchBlockOp()
    assert fused.fused_kernel(q, k) == "cpu_flash"
    out, lse = fused.forward(q, k, v, pos, pos, 0.3)
    ref_out, ref_lse = torch_op.forward(q, k, v, pos, pos, 0.3)
    assert lse.dtype == torch.float64
    assert (out - ref_out).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12
    # the backward with a merged (out, lse) that is not this block's own: the flash backward's contract
    out2, lse2 = out.to(torch.float64) * 0.7, lse + 0.25
    got = fused.backward(q, k, v, out2, lse2, dout, pos, pos, 0.3)
    ref = torch_op.backward(q, k, v, out2, lse2, dout, pos, pos, 0.3)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-12


def test_other_blocks_and_variants_go_to_the_fallback():
    q, k, v, _ = _qkv()
    pos = torch.arange(q.shape[2])
    calls = []

    class Spy(TorchBlockOp):
        def forward(self, *args, **kwargs):
            calls.append(kwargs)
            return super().forward(*args, **kwargs)

    op = FusedDenseOp(Spy())
    op.forward(q, k, v, pos, pos.clone(), 0.3)  # another rank's chunk (not the same positions tensor)
    op.forward(q, k, v, pos, pos, 0.3, window=64)
    op.forward(q, k, v, pos, pos, 0.3, softcap=20.0)
    op.forward(q, k, v, pos, pos, 0.3)  # own chunk: fused, no fallback call
    assert calls == [{}, {"window": 64}, {"softcap": 20.0}]
    assert FusedDenseOp(Spy(), kernel="fallback").fused_kernel(q, k) is None


def test_one_rank_runs_sdpa_with_its_own_autograd(monkeypatch):
    q, k, v, dout = _qkv()
    pos = torch.arange(q.shape[2])
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    qr, kr, vr = (t.requires_grad_(True) for t in (q, k, v))
    out = FusedDenseOp(TorchBlockOp()).differentiable(qr, kr, vr, pos, pos, 0.3)
    assert seen == [{"is_causal": True, "scale": 0.3, "enable_gqa": True}]
    grads = torch.autograd.grad(out, (qr, kr, vr), dout)
    ref_out, ref_lse = TorchBlockOp().forward(q, k, v, pos, pos, 0.3)
    ref = TorchBlockOp().backward(q, k, v, ref_out, ref_lse, dout, pos, pos, 0.3)
    assert (out - ref_out).abs().max() < 1e-12
    for a, b in zip(grads, ref):
        assert (a - b).abs().max() < 1e-12
    # a masked variant: the fallback has no autograd of its own, so the ring's function runs it (None here)
    assert FusedDenseOp(TorchBlockOp()).differentiable(q, k, v, pos, pos, 0.3, window=16) is None


def test_dense_layers_of_the_sparse_strategy_at_one_rank_call_sdpa(monkeypatch):
    """A layer that runs dense under sparse attention (a dense layer, or every head above dense_above, from the
    forward after the one that decided it) makes the SDPA call strategy='mtraining_dense' keeps at one rank, and gives
    its result."""
    from lightning_mtraining import SparsityConfig, apply_context_parallel

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return real(*args, **kwargs)

    x = torch.randint(1, VOCAB, (1, 256), generator=torch.Generator().manual_seed(3))
    cfg = SparsityConfig(vertical_topk=4, slash_topk=2, last_q=8, sink_tokens=2, local_window=16, tile_size=16,
                         dense_above=0.0)  # every head "too dense": every layer runs dense
    model = make_model("qwen2", seed=0).double()
    handle = apply_context_parallel(model, block_size=16, sparsity=cfg, fused_loss=False)
    model(**handle.shard({"input_ids": x}))  # decides: every head dense from the next forward on
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got = model(**handle.shard({"input_ids": x})).logits
    assert calls == [True] * model.config.num_hidden_layers
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real)
    ref = make_model("qwen2", seed=0, attn_implementation="sdpa").double()(input_ids=x).logits
    assert (got - ref).abs().max() < 1e-10


def test_the_cudnn_self_check_accepts_a_right_kernel_and_refuses_a_wrong_one(monkeypatch):
    """``_cudnn_works`` (run once per device, dtype and head shape before cuDNN serves a ring step) on CPU, with ATen's
    flash kernel standing in for cuDNN: right results pass; a log-sum-exp in the wrong base or a wrong gradient
    fails (the op then falls back to FlexAttention, warned)."""
    import lightning_mtraining.ring.fused_dense as fd

    def forward(q, k, v, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=None,
                                                                               scale=scale)
        return out, lse[..., None], None, None  # cuDNN's lse carries a trailing dimension of 1

    def backward(dout, q, k, v, out, lse, philox, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse[..., 0].contiguous(), 0.0, True, attn_mask=None, scale=scale)

    cases = {"right": (forward, backward),
             "lse in base 2": (lambda *a: (lambda r: (r[0], r[1] / 0.6931471805599453, *r[2:]))(forward(*a)), backward),
             "dk off": (forward, lambda *a: (lambda g: (g[0], g[1] * 1.1, g[2]))(backward(*a)))}
    for name, (fwd, bwd) in cases.items():
        monkeypatch.setattr(fd, "_cudnn_forward", fwd)
        monkeypatch.setattr(fd, "_cudnn_backward", bwd)
        monkeypatch.setattr(fd, "_CUDNN_CHECKED", {})
        with __import__("warnings").catch_warnings(record=True):
            found = fd._cudnn_works(torch.device("cpu"), torch.float32, 6, 2, 32)
        assert (found is not None) == (name == "right"), name
