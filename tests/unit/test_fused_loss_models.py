"""The fused loss on real Hugging Face model classes (Note [Fused loss] in lightning_mtraining.hf.fused_loss): the
loss and every parameter gradient equal the model's own loss, for each model type in FUSED_LOSS_MODEL_TYPES."""

from __future__ import annotations

import pytest
import torch
import transformers

from lightning_mtraining.hf.fused_loss import FUSED_LOSS_MODEL_TYPES, FusedLoss, prepare_fused_loss

VOCAB = 257  # odd, so no chunk or vector width divides it


def tiny(model_type: str) -> transformers.PreTrainedModel:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    extra = {
        "gemma": dict(head_dim=8),
        "gemma2": dict(head_dim=8, final_logit_softcapping=3.0, query_pre_attn_scalar=8,
                       layer_types=["full_attention", "full_attention"]),
        "granite": dict(logits_scaling=4.0),
        "cohere": dict(logit_scale=0.25),
        "qwen3": dict(head_dim=8),
    }.get(model_type, {})
    config = transformers.AutoConfig.for_model(model_type, **common, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double()


def loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("model_type", sorted(FUSED_LOSS_MODEL_TYPES))
def test_fused_loss_equals_the_models_own_loss(model_type):
    model = tiny(model_type)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 37))
    labels = ids.clone()
    labels[1, 30:] = -100  # a padded tail
    plain, plain_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    fused = prepare_fused_loss(model)
    assert isinstance(fused, FusedLoss)
    out, grads = loss_and_grads(model, input_ids=ids, labels=labels)
    assert "_mt_make" in out.__dict__  # the logits were not made ...
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)  # ... until read: the model's own ops
    torch.testing.assert_close(out["logits"], plain.logits, rtol=0, atol=0)
    # A float64 model, but Hugging Face's loss upcasts (here: rounds) the logits to float32 while the fused loss
    # keeps float64: the two differ by float32 rounding of the logits (relative 6e-8), so 1e-6 on the loss, and
    # on gradients 1e-5 relative plus 1e-8 absolute for entries near zero
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-6, atol=0, check_dtype=False)
    assert grads.keys() == plain_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-5, atol=1e-8, msg=name)

    # shift_labels and num_items_in_batch (what the context-parallel hook passes) take the same path
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    fused.restore()
    plain2 = model(input_ids=ids, labels=labels, shift_labels=shift, num_items_in_batch=50)
    fused = prepare_fused_loss(model)
    out2 = model(input_ids=ids, labels=labels, shift_labels=shift, num_items_in_batch=50)
    torch.testing.assert_close(out2.loss, plain2.loss, rtol=1e-6, atol=0, check_dtype=False)  # as above

    # no labels: logits as usual
    no_labels = model(input_ids=ids)
    torch.testing.assert_close(no_labels.logits, plain2.logits, rtol=0, atol=0)  # the same plain head
    # some logits asked for (logits_to_keep), a tuple output or a positional call: the model's own path
    for args, kwargs in (((), {"labels": labels, "logits_to_keep": 1}), ((), {"labels": labels, "return_dict": False}),
                         ((ids,), {"labels": labels})):
        assert fused._pre_forward(model, args, kwargs) is None and fused._pending is None
    fused.restore()
    assert "forward" not in model.get_output_embeddings().__dict__


def test_a_failed_forward_leaves_the_head_working():
    model = tiny("llama")
    fused = prepare_fused_loss(model)
    ids = torch.randint(0, VOCAB, (1, 9))
    with pytest.raises(IndexError):  # a token id outside the vocabulary fails in the embedding, before the head
        model(input_ids=ids + VOCAB, labels=ids)
    out = model(input_ids=ids)  # the next call without labels gets real logits
    assert out.logits.shape == (1, 9, VOCAB)
    fused.restore()


def test_unknown_model_types_keep_their_loss():
    config = transformers.AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert prepare_fused_loss(model) is None
    with pytest.raises(ValueError, match="no fused loss for model_type 'gpt2'"):
        FusedLoss(model)


def test_reading_the_logits_adds_their_gradient():
    """``out.loss + f(out.logits)``: the gradient of both terms, as without the fused loss."""
    model = tiny("qwen2")
    ids = torch.randint(0, VOCAB, (2, 21))

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        (out.loss + 0.1 * out.logits.square().mean()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = step()
    fused = prepare_fused_loss(model)
    got = step()
    fused.restore()
    for name in want:  # float32-rounded logits in the plain loss, as in the test above
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-8, msg=name)
