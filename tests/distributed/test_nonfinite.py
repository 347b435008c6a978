"""A NaN or infinite loss stops the run before backward, naming where the forward first stopped being finite
(``nonfinite_check``, :class:`lightning_mtraining.hf.model.NonFiniteWatch`); every rank takes the same decision. CPU."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from helpers.dist import run_distributed
from helpers.training import elastic_env, make_model, make_samples, quiet

SEQ = 67


def _module(poison: str, on_ranks: tuple[int, ...] | None = None):
    """A LightningModule whose model is made non-finite at ``poison`` (on ``on_ranks`` only; None: every rank)."""
    import lightning as L

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model("llama")
            self.losses: list[float] = []

        def on_fit_start(self) -> None:
            if on_ranks is not None and self.global_rank not in on_ranks:
                return
            inner = self.model.model
            with torch.no_grad():
                if poison == "layer1_input":  # layer 1's attention sees NaN hidden states (its input norm)
                    inner.layers[1].input_layernorm.weight.fill_(float("nan"))
                elif poison == "layer1_attention":  # finite input, the attention's own projection overflows
                    inner.layers[1].self_attn.q_proj.weight.fill_(float("inf"))
                elif poison == "final_norm":  # after the last attention layer
                    inner.norm.weight.fill_(float("nan"))

        def training_step(self, batch, batch_idx):
            loss = self.model(**{k: v for k, v in batch.items() if k != "idx"}).loss
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return LM()


def _fit(devices: int, poison: str, on_ranks=None, **strategy_kwargs: Any) -> tuple[Any, Any]:
    """(the module, the exception the fit raised or None)."""
    import lightning as L

    from lightning_mtraining import MTrainingStrategy

    module = _module(poison, on_ranks)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=MTrainingStrategy(**{"sparsity": None, **strategy_kwargs}),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(make_samples(2, SEQ), batch_size=1)
    try:
        trainer.fit(module, loader)
    except FloatingPointError as err:
        return module, err
    return module, None


@pytest.mark.parametrize("poison,expect", [
    ("layer1_input", r"input hidden states of LlamaForCausalLM\.model\.layers\.1\.self_attn \(layer 1\) were already "
                     r"non-finite; every earlier attention layer's input was finite"),
    ("layer1_attention", r"LlamaForCausalLM\.model\.layers\.1\.self_attn \(layer 1\) produced non-finite output from "
                         r"finite input hidden states"),
    ("final_norm", r"every attention layer's input and output were finite: the non-finite value arose after the "
                   r"last attention layer"),
])
def test_one_device_names_where_the_forward_stopped_being_finite(poison, expect):
    quiet()
    module, err = _fit(1, poison)
    assert err is not None, "a NaN loss trained on"
    assert str(err).startswith("non-finite loss: on rank 0 the loss is nan; "), str(err)
    assert re.search(expect, str(err)), str(err)
    assert len(module.losses) == 1 and math.isnan(module.losses[0])  # stopped at the first step, before backward


def test_warn_trains_on_once_warned_and_off_says_nothing():
    quiet()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module, err = _fit(1, "final_norm", nonfinite_check="warn")
    assert err is None and len(module.losses) == 2 and all(math.isnan(v) for v in module.losses)
    said = [str(w.message) for w in caught if "non-finite loss" in str(w.message)]
    assert len(said) == 1 and "after the last attention layer" in said[0], said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module, err = _fit(1, "final_norm", nonfinite_check="off")
    assert err is None and len(module.losses) == 2
    assert not [w for w in caught if "non-finite loss" in str(w.message)]


def test_finite_training_is_untouched_and_bad_options_are_refused():
    quiet()
    module, err = _fit(1, "none")
    assert err is None and len(module.losses) == 2 and all(math.isfinite(v) for v in module.losses)
    from lightning_mtraining import MTrainingStrategy

    with pytest.raises(ValueError, match=r"nonfinite_check=...\) must be one of \('raise', 'warn', 'off'\), got 'yes'"):
        MTrainingStrategy(nonfinite_check="yes")


def _dp_worker(rank: int, world_size: int) -> dict[str, Any]:
    elastic_env(rank, world_size, world_size)
    quiet()
    # two data-parallel replicas (no context parallelism): only rank 1's loss is NaN, yet both stop
    module, err = _fit(world_size, "layer1_input", on_ranks=(1,), context_parallel_size=1)
    return {"error": None if err is None else str(err), "losses": module.losses}


def test_a_nan_on_one_data_parallel_rank_stops_every_rank_naming_its_layer():
    results = run_distributed(_dp_worker, 2, timeout=300)
    assert results[0]["error"] is not None and results[1]["error"] is not None, results  # nobody left waiting
    assert "on rank 1 the loss is nan" in results[1]["error"] and "layers.1.self_attn (layer 1)" in results[1]["error"]
    assert "on rank 0 the loss is finite here; every attention layer's input and output were finite" in \
        results[0]["error"], results[0]["error"]
    assert math.isfinite(results[0]["losses"][0]) and math.isnan(results[1]["losses"][0])


def test_with_activation_checkpointing_the_forward_flags_are_kept():
    """The recompute inside backward does not overwrite the forward's flags (it is skipped); the check still names
    the layer."""
    quiet()
    module, err = _fit(1, "layer1_attention", activation_checkpointing=True)
    assert err is not None and "layers.1.self_attn (layer 1) produced non-finite output" in str(err), err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
def test_half_precision_scores_beyond_float16_range_stay_finite(dtype, sparse):
    """Products q.k up to ~2.6e5, beyond float16's 65504: the attention's scores are formed in float32 (as the GPU
    kernels' accumulators do), so outputs and gradients stay finite, and dense attention matches float64 to a few
    units in the last place of the inputs' dtype (the output is a convex combination of v's rows, each rounded
    once: 4 eps x max|v| bounds it)."""
    from lightning_mtraining import SparsityConfig, ring_attention

    g = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(1, 2, 64, 16, generator=g) * 120).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 64, 16, generator=g).to(dtype).requires_grad_()
    assert (q.double() @ k.double().transpose(-1, -2)).abs().max() > 2 * torch.finfo(torch.float16).max
    sparsity = SparsityConfig(vertical_topk=4, slash_topk=4, last_q=8, tile_size=16) if sparse else None
    out = ring_attention(q, k, v, block_size=16, sparsity=sparsity)
    out.float().square().sum().backward()
    assert torch.isfinite(out).all()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    if not sparse:
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        tol = 4 * torch.finfo(dtype).eps * v.detach().abs().max().item()
        assert (out.double() - ref).abs().max() <= tol


def test_no_query_is_left_without_a_key():
    """By construction: a sink (key 0) or the local window's main diagonal is always kept, so every row of an
    estimated pattern holds a key, whatever the budgets pick; a config that could empty a row is refused."""
    from lightning_mtraining import SparsityConfig, estimate_pattern
    from mtraining_kernels.reference import vertical_slash_mask

    with pytest.raises(ValueError, match=r"sink_tokens=0, local_window=0\) could leave a query with no key"):
        SparsityConfig(sink_tokens=0, local_window=0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 96, 8, generator=g), torch.randn(2, 2, 96, 8, generator=g)
    for sink, local in ((1, 0), (0, 1)):
        cfg = SparsityConfig(vertical_topk=1, slash_topk=1, last_q=8, sink_tokens=sink, local_window=local,
                             tile_size=16)
        p = estimate_pattern(q, k, cfg)
        mask = vertical_slash_mask(p.vertical_idx, p.slash_idx, 96, 16)
        assert mask.any(-1).all(), f"sink_tokens={sink}, local_window={local}: a query row has no key"
