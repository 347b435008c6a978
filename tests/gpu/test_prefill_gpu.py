"""Sparse prefill on a CUDA GPU (Triton kernels, bfloat16): a covering pattern is as close to the float64 model as
SDPA is (skipped without a GPU).

Reference: the same weights in float64 on the CPU with SDPA. Rule (the kernels' precision rule, as in
``test_kernels_gpu.py``): the sparse prefill's logits in bfloat16 may be at most twice as far from the float64 logits
as SDPA's in bfloat16 are, plus 1e-2 for the bfloat16 rounding of logits of magnitude ~1-10.
"""

from __future__ import annotations

import pytest
import torch

import lightning_mtraining as lmt

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("prompt", [4096, 5000])  # whole tiles, and a ragged last tile
def test_full_pattern_matches_sdpa_bf16(prompt: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=264, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    ref_model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64).eval()
    x = torch.randint(0, 264, (1, prompt), generator=torch.Generator().manual_seed(1))
    seen = []
    name = lmt.register_sparse_prefill(lmt.SparsityConfig(vertical_topk=8192, slash_topk=8192), "test_prefill_gpu",
                                       on_pattern=lambda layer, p, n: seen.append(float(p.density(n).min())))
    with torch.no_grad():
        want = ref_model(x).logits
        model = ref_model.to(device="cuda", dtype=torch.bfloat16)
        sdpa = model(x.cuda()).logits.double().cpu()
        model.set_attn_implementation(name)
        got = model(x.cuda()).logits.double().cpu()
        assert seen == [1.0, 1.0]  # both layers ran the sparse kernels, on a pattern covering every pair
        err, sdpa_err = (got - want).abs().max().item(), (sdpa - want).abs().max().item()
        assert err <= 2 * sdpa_err + 1e-2, (err, sdpa_err)
        # generate: the prefill sparse, decode steps dense; finite and the requested length
        out = model.generate(x.cuda(), max_new_tokens=4, do_sample=False)
        assert out.shape == (1, prompt + 4)
