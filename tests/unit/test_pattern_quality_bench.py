"""``benchmarks/pattern_quality.py``'s two sparse forwards agree: the pattern applied as a dense mask through SDPA
(``masked_forward_loss``, what the CPU run uses for speed) and ``apply_context_parallel``'s sparse attention
(``sparse_forward_loss``), each layer estimating its pattern from its own Q and K. Tiny Llama (``_models.py``),
float32, one process: the two differ only in summation order (one masked softmax against the sparse op's
blockwise one), ~1e-7 on a loss of ~4; 1e-5 leaves room. The sparse loss must differ from the dense one (by
~1e-2 here), so the agreement is not that of two dense forwards."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from helpers.models import VOCAB, make_model

pytest.importorskip("litdata")  # the benchmark module imports lightning_mtraining.data.corpus


def _bench():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "pattern_quality.py"
    spec = importlib.util.spec_from_file_location("pattern_quality_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_masked_sparse_forward_equals_the_sparse_attention_forward():
    from lightning_mtraining import SparsityConfig

    bench = _bench()
    model = make_model("llama").eval()
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(3))
    cfg = SparsityConfig(vertical_topk=8, slash_topk=2, last_q=16, sink_tokens=2, local_window=16, tile_size=16)
    with torch.no_grad():
        dense = float(model(input_ids=ids, labels=ids).loss)
    kernel = bench.sparse_forward_loss(model, ids, cfg)
    masked = bench.masked_forward_loss(model, ids, cfg)
    masked_rows = _masked_in_row_chunks(bench, model, ids, cfg)
    assert abs(masked - kernel) < 1e-5, (masked, kernel)
    assert abs(masked_rows - masked) < 1e-5, (masked_rows, masked)
    assert abs(kernel - dense) > 1e-3, (kernel, dense)
    assert model.config._attn_implementation == "eager"  # both forwards put the model's attention back


def _masked_in_row_chunks(bench, model, ids, cfg) -> float:
    """The masked forward with 40-row chunks (not a multiple of the 16-token tile; the run uses 4096-row chunks)."""
    from transformers import AttentionInterface

    AttentionInterface.register("pattern_quality_masked_rows", bench.MaskedSparseAttention(cfg, rows=40))
    model.set_attn_implementation("pattern_quality_masked_rows")
    try:
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids).loss)
    finally:
        model.set_attn_implementation("eager")


@pytest.mark.parametrize("probes", ["last", "documents"])
def test_masked_forward_with_documents_equals_the_sparse_attention_forward(probes):
    """Packed documents (positions restarting, attention inside each): the masked forward's per-token losses, boundary
    targets left out, average to ``apply_context_parallel``'s loss with the same ``position_ids`` (which leaves those
    targets out too), for the paper's probes and per-document probe blocks; and the dense masked forward's to the
    model's own loss on each document alone."""
    from lightning_mtraining import SparsityConfig

    bench = _bench()
    model = make_model("llama").eval()
    ids = torch.randint(1, VOCAB, (1, 200), generator=torch.Generator().manual_seed(4))
    spans = [(0, 30), (30, 95), (95, 101), (101, 200)]
    cfg = SparsityConfig(vertical_topk=6, slash_topk=2, last_q=16, sink_tokens=2, local_window=16, tile_size=16,
                         probes=probes)
    _, position_ids = bench.document_inputs(spans, 200)
    kernel = bench.sparse_forward_loss(model, ids, cfg, position_ids)
    masked = bench.masked_forward_losses(model, ids, cfg, spans)
    assert int(masked.isnan().sum()) == len(spans) - 1
    assert abs(float(masked.nanmean()) - kernel) < 1e-5, (float(masked.nanmean()), kernel)
    dense = bench.masked_forward_losses(model, ids, None, spans)
    with torch.no_grad():
        alone = [model(input_ids=ids[:, a:b], labels=ids[:, a:b]).loss for a, b in spans if b - a > 1]
    per_doc = bench.per_document(dense, torch.arange(1, 200), spans)
    for got, want in zip([x for x, (a, b) in zip(per_doc, spans) if b - a > 1], alone):
        assert abs(got - float(want)) < 1e-5, (got, float(want))
    assert abs(float(dense.nanmean()) - kernel) > 1e-4  # the pattern matters here
    assert model.config._attn_implementation == "eager"
