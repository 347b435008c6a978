"""Packed documents cost their checks once a batch, not once a layer: ``check_doc_start``'s verdict (one host sync)
and the estimator's document bookkeeping (an all-gather of the start flags on several ranks, and one host sync for the
probes) are kept per ``doc_start`` tensor, which every layer of a forward shares; a modified or new tensor is checked
again, and the patterns are the ones a fresh computation gives."""

from __future__ import annotations

import gc

import pytest
import torch

import lightning_mtraining.core.layouts as layouts
import lightning_mtraining.sparsity.estimation as estimation
from lightning_mtraining import SparsityConfig, estimate_pattern
from lightning_mtraining.core.layouts import check_doc_start

N, H, HKV, D = 512, 4, 2, 16


def _doc_start(lengths=(100, 250)):
    starts, pos = [], 0
    for n in lengths:
        starts += [pos] * n
        pos += n
    starts += [pos] * (N - pos)
    return torch.tensor(starts)[None]


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_the_check_runs_once_per_tensor_and_positions(monkeypatch):
    checks = _counting(monkeypatch, layouts, "_check_doc_start")
    q = torch.randn(1, H, N, D)
    pos = torch.arange(N)
    doc = _doc_start()
    first = check_doc_start(doc, q, pos)
    for _ in range(5):  # five more layers
        assert check_doc_start(doc, q, pos) is first
    assert len(checks) == 1
    assert check_doc_start(doc, q, pos, drop_single=False) is first and len(checks) == 2  # another question
    assert check_doc_start(doc, q, torch.arange(N)) is first and len(checks) == 3  # other positions: checked
    doc[0, -1] = N  # modified in place: a token's document after it, refused as before
    with pytest.raises(ValueError, match="outside"):
        check_doc_start(doc, q, pos)
    # a row with one document: nothing to mask (None), remembered as such
    single = torch.zeros(1, N, dtype=torch.int64)
    assert check_doc_start(single, q, pos) is None and check_doc_start(single, q, pos) is None
    assert len(checks) == 5


def test_the_memo_does_not_keep_a_batch_alive():
    q = torch.randn(1, H, N, D)
    doc = _doc_start()
    check_doc_start(doc, q, torch.arange(N))
    before = len(layouts._CHECKED)
    del doc
    gc.collect()
    assert len(layouts._CHECKED) == before - 1


@pytest.mark.parametrize("probes", ["documents", "spread", "last"])
def test_the_estimator_builds_the_documents_once_per_batch(monkeypatch, probes):
    builds = _counting(monkeypatch, estimation, "_Documents")
    g = torch.Generator().manual_seed(0)
    cfg = SparsityConfig(vertical_topk=16, slash_topk=8, last_q=16, local_window=32, tile_size=16, probes=probes)
    doc = _doc_start()
    layers = [(torch.randn(1, H, N, D, generator=g), torch.randn(1, HKV, N, D, generator=g)) for _ in range(3)]
    got = [estimate_pattern(q, k, cfg, block_size=16, doc_start=doc) for q, k in layers]
    assert len(builds) == 1  # three layers, one batch
    estimation._DOCUMENTS.clear()
    again = doc.clone()
    fresh = [estimate_pattern(q, k, cfg, block_size=16, doc_start=again) for q, k in layers]
    for a, b in zip(got, fresh):
        assert torch.equal(a.vertical_idx, b.vertical_idx) and torch.equal(a.slash_idx, b.slash_idx)
    assert len(builds) == 2  # a new tensor: built again
    # another probe setting on the same batch has its own entry
    other = SparsityConfig(vertical_topk=16, slash_topk=8, last_q=16, local_window=32, tile_size=16, sink_tokens=2,
                           probes=probes)
    estimate_pattern(*layers[0], other, block_size=16, doc_start=doc)
    assert len(builds) == 3


def test_the_document_skips_are_read_once_per_batch(monkeypatch):
    import lightning_mtraining.ring.steps as steps
    from lightning_mtraining.core.layouts import global_positions

    reads = []
    real_stack = torch.stack

    def stack(tensors, *args, **kwargs):
        out = real_stack(tensors, *args, **kwargs)
        reads.append(1)
        return out

    positions = tuple(global_positions(N, r, 4, "striped", 16) for r in range(4))
    # rank 0's queries, one document per row
    doc = torch.full((1, N // 4), 0, dtype=torch.int64)
    monkeypatch.setattr(torch, "stack", stack)
    first = steps.document_skips(positions, 0, doc)
    again = steps.document_skips(positions, 0, doc)
    monkeypatch.setattr(torch, "stack", real_stack)
    assert first == again and len(reads) == 1
    again[1] = "changed"  # a caller's copy: the kept answer stays
    assert steps.document_skips(positions, 0, doc) == first
    assert first == {0: False, 1: False, 2: False, 3: False}  # one document: every chunk holds keys of it
    # the answer itself: every block of 16 its own document, so each rank's queries see only its own chunk
    own = (positions[0] // 16 * 16)[None]
    assert steps.document_skips(positions, 0, own) == {0: False, 1: True, 2: True, 3: True}
