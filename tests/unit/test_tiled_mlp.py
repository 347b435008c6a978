"""The sequence-tiled MLP (``tiled_mlp``, Note [Tiled MLP]): the same losses and gradients as the MLP it tiles, and
no ``[B, S, intermediate]`` activation kept for backward.

One process, tiny float64 Llama and Qwen2 models (``helpers.models``): float64 so that the only difference, the
rounding of smaller matrix products and of weight gradients summed over chunks, stays near 1e-13 (tolerance 1e-10).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from helpers.models import VOCAB, make_model

SEQ = 37  # chunks of 8: four whole and one of 5


def _loss_and_grads(family, tiled_mlp=None, checkpointing=False):
    from lightning_mtraining import apply_context_parallel

    model = make_model(family, seed=0).double()
    handle = apply_context_parallel(model, sparsity=None, fused_loss=False, tiled_mlp=tiled_mlp,
                                    activation_checkpointing=checkpointing)
    x = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    loss = model(**handle.shard({"input_ids": x, "labels": x})).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, model, handle


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_matches_the_mlp(family, checkpointing):
    want_loss, want_grads, _, _ = _loss_and_grads(family)
    loss, grads, model, handle = _loss_and_grads(family, tiled_mlp=8, checkpointing=checkpointing)
    assert len(handle.tiled.mlps) == 2  # both decoder layers' MLPs
    assert abs(loss - want_loss) < 1e-10
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=0, atol=1e-10, msg=lambda s: f"{name}: {s}")
    handle.restore()
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)


def _live_activations(tiled_mlp):
    """How many of the MLPs' ``act_fn`` outputs (``[B, chunk or S, intermediate]``) are still alive after the forward,
    before backward: those autograd keeps for backward."""
    from lightning_mtraining import apply_context_parallel

    model = make_model("llama", seed=0).double()
    apply_context_parallel(model, sparsity=None, fused_loss=False, tiled_mlp=tiled_mlp)
    outputs = []
    for layer in model.model.layers:
        layer.mlp.act_fn.register_forward_hook(lambda m, i, out: outputs.append(weakref.ref(out)))
    x = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(4))
    loss = model(input_ids=x, labels=x).loss
    gc.collect()
    alive = sum(ref() is not None for ref in outputs)
    loss.backward()  # the recomputed chunks run their act_fn again in backward
    return alive, len(outputs)


def test_tiled_mlp_keeps_no_intermediate_for_backward():
    alive, calls = _live_activations(None)
    assert (alive, calls) == (2, 2)  # one [1, 37, 64] per layer, saved for the product's backward
    alive, calls = _live_activations(8)
    assert alive == 0  # each chunk's intermediates are dropped and recomputed in backward
    assert calls == 2 * 5 * 2  # 2 layers x 5 chunks, forward and recompute


def test_tiled_mlp_without_grad_and_errors():
    from lightning_mtraining import apply_context_parallel

    model = make_model("qwen2", seed=0).double()
    x = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(input_ids=x).logits
        apply_context_parallel(model, sparsity=None, tiled_mlp=5)
        torch.testing.assert_close(model(input_ids=x).logits, want, rtol=0, atol=1e-10)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="tiled_mlp must be None or a positive int"):
            apply_context_parallel(make_model("qwen2"), sparsity=None, tiled_mlp=bad)
    with pytest.raises(ValueError, match="no decoder layer of .* has an `mlp` module"):
        apply_context_parallel(model, sparsity=None, tiled_mlp=5)  # tiled already


def test_tiled_mlp_inside_compiled_decoder_layers():
    """``compile=True`` compiles each decoder layer with the tiled MLP in it (``fullgraph=True``: the chunk loop and
    its checkpoints trace); float32 loss and an MLP weight's gradient as eager's untiled (1e-5: float32 rounding of
    the compiled, chunked products)."""
    from lightning_mtraining import apply_context_parallel
    from lightning_mtraining.hf.compile import compile_decoder_layers

    def run(tiled_mlp, compiled):
        model = make_model("llama", seed=0)
        apply_context_parallel(model, sparsity=None, fused_loss=False, tiled_mlp=tiled_mlp)
        if compiled:
            compile_decoder_layers(model, fullgraph=True)
        x = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        return float(loss.detach()), model.model.layers[0].mlp.up_proj.weight.grad.clone()

    want_loss, want_grad = run(None, False)
    try:
        loss, grad = run(8, True)
    finally:
        torch._dynamo.reset()  # leave no compiled code or raised limits to the tests after this one
    assert abs(loss - want_loss) < 1e-5
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-5)
