"""Sparse prefill for ``generate`` (``lightning_mtraining.hf.prefill``) on tiny Qwen2 / Llama models built from a
config.

Reference: the same model with ``attn_implementation="sdpa"``, in float64. With a pattern that covers every causal
pair the sparse path computes the same softmax over the same keys as SDPA, only in another order of operations
(the torch path masks a float64 score matrix; SDPA's math kernel does its own reduction): float64 rounding of a
two-layer model, ~1e-14 on logits of magnitude ~1; we assert 1e-10. Decode steps and a continued prefill run
transformers' own SDPA function, so they are asserted *equal* (bit for bit) to the SDPA model on the same cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

import lightning_mtraining as lmt
from lightning_mtraining.hf.prefill import register_sparse_prefill

PROMPT = 203  # not a multiple of the tile: the last tile is ragged
TILE = 16


def _model(family: str, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls_cfg, cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = cls_cfg(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation=attn, dtype=torch.float64).eval()


def _full(last_q: int = 16) -> lmt.SparsityConfig:
    # budgets >= the prompt: every key column and diagonal is kept, so the pattern covers every causal pair
    return lmt.SparsityConfig(vertical_topk=512, slash_topk=512, last_q=last_q, local_window=TILE, tile_size=TILE)


def _partial() -> lmt.SparsityConfig:
    return lmt.SparsityConfig(vertical_topk=2, slash_topk=1, last_q=16, sink_tokens=2, local_window=TILE,
                              tile_size=TILE, pattern_heads="kv")


def _prompt(batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_full_pattern_equals_dense(family: str):
    seen = []
    name = register_sparse_prefill(_full(), f"test_prefill_full_{family}",
                                   on_pattern=lambda layer, p, n: seen.append((layer, float(p.density(n).min()))))
    dense, sparse = _model(family), _model(family, attn=name)  # from_config(attn_implementation=name) works
    assert sparse.config._attn_implementation == name
    x = _prompt()
    with torch.no_grad():
        want, got = dense(x).logits, sparse(x).logits
        assert [layer for layer, _ in seen] == [0, 1] and all(d == 1.0 for _, d in seen)  # sparse path, full pattern
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        gen = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        ref, out = dense.generate(x, **gen), sparse.generate(x, **gen)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):  # generate returns float32 logits: 1e-5 is float32 rounding
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_partial_pattern_differs_and_decode_is_dense():
    seen = []
    name = register_sparse_prefill(_partial(), "test_prefill_partial",
                                   on_pattern=lambda layer, p, n: seen.append(float(p.density(n).max())))
    model = _model("qwen2")
    x = _prompt()
    with torch.no_grad():
        want = model(x).logits
        model.set_attn_implementation(name)
        out = model(x, use_cache=True)
        assert len(seen) == 2 and max(seen) < 0.6  # both layers ran sparse, on a partial pattern
        assert torch.isfinite(out.logits).all()
        assert (out.logits - want).abs().max() > 1e-3  # dropped pairs change the logits
        # one decode step on copies of the sparse prefill's cache: the sparse name runs SDPA itself
        step = torch.tensor([[5]])
        cache = out.past_key_values
        got = model(step, past_key_values=copy.deepcopy(cache), use_cache=True).logits
        model.set_attn_implementation("sdpa")
        ref = model(step, past_key_values=copy.deepcopy(cache), use_cache=True).logits
        assert torch.equal(got, ref)
        assert len(seen) == 2  # no estimate at decode


def test_continued_prefill_and_short_prompt_are_dense():
    seen = []
    name = register_sparse_prefill(_full(last_q=64), "test_prefill_chunks", on_pattern=lambda *a: seen.append(a))
    dense, sparse = _model("qwen2"), _model("qwen2", attn=name)
    x = _prompt()
    with torch.no_grad():
        want = dense(x).logits
        first = sparse(x[:, :150], use_cache=True)  # sparse (full pattern)
        second = sparse(x[:, 150:], past_key_values=first.past_key_values, use_cache=True)  # 53 tokens over a cache
        assert len(seen) == 2  # the continued chunk ran dense SDPA with the model's mask, no estimate
        torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), want, rtol=0, atol=1e-10)
        short = x[:, :40]  # shorter than last_q=64: nothing to estimate from, dense (the training rule)
        assert torch.equal(sparse(short).logits, dense(short).logits)
        assert len(seen) == 2


def test_unsupported_inputs_raise():
    name = register_sparse_prefill(_full(), "test_prefill_errors")
    model = _model("qwen2", attn=name)
    x = _prompt(batch=2)
    mask = torch.ones_like(x)
    mask[1, :7] = 0  # left padding: a batch of prompts of different lengths
    with torch.no_grad(), pytest.raises(ValueError, match="padded batches are not supported"):
        model(x, attention_mask=mask)
    with torch.no_grad():  # an all-ones mask is no padding: a batch of equal-length prompts runs sparse, exact
        want = _model("qwen2")(x).logits
        torch.testing.assert_close(model(x, attention_mask=torch.ones_like(x)).logits, want, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="contains 'flash'"):
        register_sparse_prefill(_full(), "my_flash_prefill")
    with pytest.raises(ValueError, match="built-in or reserved"):
        register_sparse_prefill(_full(), "sdpa")
    with pytest.raises(TypeError, match="SparsityConfig"):
        register_sparse_prefill({"top_p": 0.9})  # type: ignore[arg-type]


def test_prefill_benchmark_smoke(tmp_path):
    """``benchmarks/prefill.py --smoke``: both configs timed against SDPA, with density and recall in range."""
    import importlib.util
    import pathlib
    import sys

    bench_dir = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    spec = importlib.util.spec_from_file_location("prefill_bench", bench_dir / "prefill.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(bench_dir))
    try:
        spec.loader.exec_module(module)
        _, rows = module.main(["--smoke", "--out", str(tmp_path / "prefill.json")])
    finally:
        sys.path.remove(str(bench_dir))
    assert [r["N"] for r in rows] == [512, 512] and (tmp_path / "prefill.json").exists()
    for r in rows:
        assert r["sdpa_ms"] > 0 and r["sparse_ms"] > 0 and 0 < r["density"] <= 1 and 0.5 < r["recall"] <= 1.0
    assert rows[1]["config"].startswith("top-k") and rows[1]["density"] < 0.9  # 2 slashes of 32-token tiles, 16 columns
