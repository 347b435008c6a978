"""Hugging Face integration at world size 1: the attention function, the model hook, setup-time validation.

Reference: the same model with eager attention on the same batch (float32). At world size 1 the ring is
one causal attention, so logits agree to float32 rounding of two softmax formulations (~1e-6); we assert
1e-5. Losses on every label path (batch labels, labels built in training_step, user shift_labels, user
num_items_in_batch) agree to 1e-5 for the same reason.
"""

from __future__ import annotations

import pytest
import torch

from helpers.models import make_model
from helpers.training import make_samples
from lightning_mtraining.distributed.plan import ContextParallelPlan
from lightning_mtraining.distributed.sharding import shard_batch
from lightning_mtraining.hf.attention import ATTENTION_NAME, RingAttentionConfig, ring_attention_forward
from lightning_mtraining.hf.model import prepare_model, validate_model


def _batch(n: int = 2, seq_len: int = 11) -> dict:
    samples = make_samples(n, seq_len)
    return {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "attention_mask", "labels")}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_single_rank_matches_eager(family: str):
    model = make_model(family)
    batch = _batch()
    with torch.no_grad():
        want = model(**batch)
    plan = ContextParallelPlan(cp_rank=0, cp_size=1, layout="striped", block_size=4)
    prepared = prepare_model(model, plan)
    assert model.config._attn_implementation == ATTENTION_NAME
    plan.current = shard_batch(batch, cp_rank=0, cp_size=1, layout="striped", block_size=4)
    sharded = plan.current.batch  # padded 11 -> 12
    with torch.no_grad():
        got = model(**sharded)
        real = batch["attention_mask"].bool()  # padded queries see padding differently; they carry no loss
        torch.testing.assert_close(got.logits[:, :11][real], want.logits[real], rtol=0, atol=1e-5)
        assert abs(got.loss.item() - want.loss.item()) < 1e-5
        # Only input_ids + labels: global positions and targets come from the hook.
        assert abs(model(input_ids=sharded["input_ids"], labels=sharded["labels"]).loss.item()
                   - want.loss.item()) < 1e-5
        # Labels built inside training_step (not a batch tensor): shifted through the group (gather path).
        assert abs(model(input_ids=sharded["input_ids"], labels=sharded["labels"].clone()).loss.item()
                   - want.loss.item()) < 1e-5
        # Positional call.
        assert abs(model(sharded["input_ids"], labels=sharded["labels"]).loss.item() - want.loss.item()) < 1e-5
        # User-provided shift_labels: the hook counts targets itself.
        shifted = plan.current.targets["labels"]
        out = model(input_ids=sharded["input_ids"], labels=sharded["labels"], shift_labels=shifted.clone())
        assert abs(out.loss.item() - want.loss.item()) < 1e-5
        # User-provided num_items_in_batch (e.g. a count over accumulated micro-batches) is respected.
        n = plan.current.num_targets["labels"]
        out = model(input_ids=sharded["input_ids"], labels=sharded["labels"], num_items_in_batch=2 * n)
        assert abs(out.loss.item() - want.loss.item() / 2) < 1e-5
    prepared.restore()
    assert model.config._attn_implementation == "eager"
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_hook_errors():
    model = make_model("qwen2")
    plan = ContextParallelPlan(cp_rank=0, cp_size=1, layout="striped", block_size=4)
    prepare_model(model, plan)
    batch = _batch()
    with pytest.raises(RuntimeError, match="before any batch was sharded"):
        model(input_ids=batch["input_ids"])
    plan.current = shard_batch(batch, cp_rank=0, cp_size=1, layout="striped", block_size=4)
    with pytest.raises(ValueError, match="received a sequence of 11 tokens, but this rank's shard .* has 12"):
        model(input_ids=batch["input_ids"])
    ids = plan.current.batch["input_ids"]
    with pytest.raises(ValueError, match="custom attention masks are not supported"):
        model(input_ids=ids, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="without input_ids or inputs_embeds"):
        model(labels=ids)
    # packed documents given to the model but not in the sharded batch: the strategy cannot see the boundaries
    packed = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with pytest.raises(ValueError, match="neither the tokens' global positions .* Put position_ids in the batch"):
        model(input_ids=ids, position_ids=packed)
    model(input_ids=ids, position_ids=torch.arange(12)[None])  # the true positions are fine
    with pytest.raises(ValueError, match="asked for output_attentions: ring attention never materialises"):
        model(input_ids=ids, output_attentions=True)
    from transformers import DynamicCache

    with pytest.raises(ValueError, match=r"a KV cache \(past_key_values\) is not supported"):
        model(input_ids=ids, past_key_values=DynamicCache())


def test_unprepared_module_and_runtime_features():
    q = torch.randn(1, 4, 8, 8)
    k = v = torch.randn(1, 2, 8, 8)
    module = torch.nn.Module()
    with pytest.raises(RuntimeError, match="was not prepared"):
        ring_attention_forward(module, q, k, v, None)
    module._mtraining_ring = RingAttentionConfig(group=None, cp_size=1, layout="striped", block_size=4)
    # a window and a soft-cap are computed (tests/distributed/test_attention_variants.py checks them against float64)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    band = torch.ones(8, 8, dtype=torch.bool).tril() & ~torch.ones(8, 8, dtype=torch.bool).tril(-4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=band)
    torch.testing.assert_close(ring_attention_forward(module, q, k, v, None, sliding_window=4)[0], ref.transpose(1, 2),
                               rtol=0, atol=1e-5)
    s = torch.tanh(q @ kr.transpose(-1, -2) / 8**0.5 / 0.5) * 0.5  # head dim 8, cap 0.5
    ref = torch.softmax(s.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf")), -1) @ vr
    torch.testing.assert_close(ring_attention_forward(module, q, k, v, None, softcap=0.5)[0], ref.transpose(1, 2),
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"Module \(layer \?\): softcap must be a positive float"):
        ring_attention_forward(module, q, k, v, None, softcap=-1.0)
    with pytest.raises(ValueError, match=r"attention dropout \(dropout=0.1\)"):
        ring_attention_forward(module, q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"learned attention sinks \(s_aux"):
        ring_attention_forward(module, q, k, v, None, s_aux=torch.zeros(4))
    from transformers import GPT2Config

    module.config = GPT2Config(attn_pdrop=0.1)  # the error names the field to change
    with pytest.raises(ValueError, match=r"attention dropout \(config.attn_pdrop=0.1\).*set it to 0.0"):
        ring_attention_forward(module, q, k, v, None, dropout=0.1)
    del module.config
    out, weights = ring_attention_forward(module, q, k, v, None, sliding_window=8)  # window covers everything
    assert out.shape == (1, 8, 4, 8) and weights is None
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-5)


def test_unsupported_models_fail_at_setup_naming_model_and_feature():
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    # sliding windows and soft-capping are computed (tests/distributed/test_variant_models.py); other layer types are
    # named
    validate_model(MistralForCausalLM(MistralConfig(**tiny)))
    validate_model(Gemma2ForCausalLM(Gemma2Config(**tiny)))
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM .* layer types \['chunked_attention'\] are in use"):
        validate_model(Gemma2ForCausalLM(Gemma2Config(**tiny, layer_types=["full_attention", "chunked_attention"])))
    from transformers import GptOssConfig, GptOssForCausalLM

    oss = GptOssForCausalLM(GptOssConfig(**tiny, num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(ValueError, match=r"GptOssForCausalLM .* learned attention sinks \(GptOssAttention.sinks"):
        validate_model(oss)
    model = make_model("llama")
    model.model.layers[1].self_attn.is_causal = False
    with pytest.raises(ValueError, match="LlamaForCausalLM .* non-causal attention"):
        validate_model(model)
    with pytest.raises(ValueError, match=r"attention dropout \(config.attention_dropout=0.1\)"):
        validate_model(make_model("qwen2", attention_dropout=0.1))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = dict(n_layer=1, n_embd=32, n_head=4, vocab_size=64, bos_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel .* \(config.attn_pdrop=0.1\). Set config.attn_pdrop to 0"):
        validate_model(GPT2LMHeadModel(GPT2Config(**gpt2)))
    validate_model(GPT2LMHeadModel(GPT2Config(**gpt2, attn_pdrop=0.0)))  # residual/embedding dropout are fine
    model = make_model("qwen2")
    model._supports_attention_backend = False
    with pytest.raises(ValueError, match="Qwen2ForCausalLM .* unknown attention"):
        validate_model(model)
