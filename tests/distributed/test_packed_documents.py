"""Packed documents: sequences that hold several documents (``position_ids`` restarting at 0) attend only within
each document, in the block op, the dense and the sparse ring and the pattern estimator, and a packed batch trains
a Hugging Face model exactly as its documents one by one.

References are written from the definitions: float64 masked softmax attention with the mask
``doc_start[q] <= k <= q`` (intersected with a given pattern's pairs), the estimator's float64 contract with each
probe row's scores restricted to its document, and the unchanged model run on each document alone.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from helpers.dist import hierarchical_groups, run_distributed
from helpers.models import VOCAB, make_model
from helpers.ops import CountingOp
from lightning_mtraining import (
    SparsityConfig,
    VerticalSlashPattern,
    estimate_pattern,
    global_positions,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from lightning_mtraining.core.layouts import LAYOUTS, check_doc_start, document_starts, layout_unit
from lightning_mtraining.ring.block_ops import TorchBlockOp
from lightning_mtraining.ring.setup import documents_op
from lightning_mtraining.ring.steps import document_skips

B, H, HKV, D, BS = 2, 4, 2, 8, 16

# float64 everywhere: a few ulps times the reduction length (< 200 keys): 1e-12. float32 inputs and accumulation
# over < 200 keys: ~1e-6 relative; 2e-5 leaves room for exp's amplification, far below a document leak (O(0.1)).
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def doc_starts_for(n: int, lengths_per_row: list[list[int]]) -> torch.Tensor:
    """``[B, n]`` each token's document start, documents of the given lengths (the last one runs to n)."""
    rows = []
    for lengths in lengths_per_row:
        starts, pos = [], 0
        for i, length in enumerate(lengths):
            size = length if i < len(lengths) - 1 else n - pos
            starts += [pos] * size
            pos += size
        rows.append(torch.tensor(starts[:n]))
    return torch.stack(rows)


def reference(q, k, v, doc, mask=None, q_pos=None, k_pos=None):
    """Float64 masked softmax attention, K/V heads repeated: query i (at ``q_pos[i]``, default i) sees key j (at
    ``k_pos[j]``) when ``doc[:, i] <= k_pos[j] <= q_pos[i]``, and ``mask [B, H, Sq, Sk]`` (optional) allows it."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    qp = torch.arange(q.shape[2], device=q.device) if q_pos is None else q_pos
    kp = torch.arange(k.shape[2], device=q.device) if k_pos is None else k_pos
    allowed = (kp[None, None, :] <= qp[None, :, None]) & (kp[None, None, :] >= doc[:, :, None])  # [B, Sq, Sk]
    allowed = allowed[:, None]
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    return torch.where(torch.isfinite(lse), torch.exp(s - lse), torch.zeros_like(s)) @ v


def make_inputs(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV))
    do = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype)


def grads(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), do)]


def rel(got, ref):
    """Largest max error relative to max(|reference|, 1) (see test_attention_variants)."""
    return max(((g.double() - r).abs().max() / r.abs().max().clamp_min(1.0)).item() for g, r in zip(got, ref))


# --- boundaries ------------------------------------------------------------------------------------------------


def test_document_starts_follow_transformers_rule():
    from transformers.masking_utils import find_packed_sequence_indices

    pid = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [5, 6, 7, 8, 9, 10, 0, 1, 2, 3]])
    got = document_starts(pid)
    assert got.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5, 5, 9], [0, 0, 0, 0, 0, 0, 6, 6, 6, 6]]
    seq = find_packed_sequence_indices(pid)
    # the same grouping: two tokens share a document exactly when transformers gives them the same sequence index
    for b in range(2):
        assert torch.equal(got[b][:, None] == got[b][None, :], seq[b][:, None] == seq[b][None, :])
    assert document_starts(torch.arange(7)[None].expand(3, 7)) is None  # one document per row
    assert document_starts(torch.arange(3, 10)[None]) is None  # an offset continuation is still one document
    with pytest.raises(ValueError, match="integer \\[batch, seq\\]"):
        document_starts(torch.zeros(2, 3))


def test_doc_start_is_validated_clearly():
    q = torch.zeros(2, 1, 4, 8)
    pos = torch.tensor([0, 1, 2, 3])
    assert check_doc_start(torch.zeros(1, 4, dtype=torch.int64), q, pos) is None  # all documents start at 0
    with pytest.raises(ValueError, match=r"\[2 or 1, 4\]"):
        check_doc_start(torch.zeros(2, 5, dtype=torch.int64), q, pos)
    with pytest.raises(ValueError, match=r"doc_start\[0, 1\] = 2 is outside \[0, 1\]"):
        check_doc_start(torch.tensor([[0, 2, 2, 2]]), q, pos)


# --- the block op and the ring -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_op_with_documents_matches_reference(fused, dtype):
    """Striped W=3 blocks, two batch rows with different documents (one of a single token, one crossing every
    rank); the op's own gradients against the reference restricted to the block's keys."""
    n, w = 3 * layout_unit("striped", 3, BS), 3
    doc = doc_starts_for(n, [[5, 1, 30, 20], [41, 31]])
    q, k, v, do = make_inputs(n, 3, dtype)
    op = TorchBlockOp(fused=fused, max_rows=5)  # 5-row chunks: document edges fall inside and between chunks
    for r, src in ((1, 0), (0, 2), (2, 2), (2, 1)):
        qp, kp = global_positions(n, r, w, "striped", BS), global_positions(n, src, w, "striped", BS)
        ql, kl, vl, dol, dl = q[:, :, qp], k[:, :, kp], v[:, :, kp], do[:, :, qp], doc[:, qp]
        want = grads(lambda a, b, c: reference(a, b, c, dl, q_pos=qp, k_pos=kp), ql, kl, vl, dol)
        out, lse = op.forward(ql, kl, vl, qp, kp, 1 / math.sqrt(D), doc_start=dl)
        dq, dk, dv = op.backward(ql, kl, vl, out, lse, dol, qp, kp, 1 / math.sqrt(D), doc_start=dl)
        assert rel([out, dq, dk, dv], want) < TOL[dtype], (r, src)
        # rows that see no key of this block report lse -inf (the merge protocol)
        seen = ((kp[None, None, :] <= qp[None, :, None]) & (kp[None, None, :] >= dl[:, :, None])).any(-1)
        assert torch.equal(torch.isfinite(lse), seen[:, None, :].expand_as(lse)), (r, src)


def _pattern(n, seed):
    g = torch.Generator().manual_seed(seed)
    vert = torch.randint(-1, n, (B, H, 5), generator=g)
    slash = torch.cat([torch.zeros(B, H, 1, dtype=torch.int64), torch.randint(1, 3 * BS, (B, H, 3), generator=g),
                       torch.full((B, H, 1), n - BS - 3)], dim=-1)
    return VerticalSlashPattern(vert, slash, tile_size=BS)


def _cases():
    """(layout, sparse, dtype); documents (:func:`_doc`): row 0 three (one of a single token), row 1 two."""
    out = [(layout, sparse, torch.float64) for layout in LAYOUTS for sparse in (False, True)]
    return out + [("striped", False, torch.float32), ("zigzag", True, torch.float32)]


def _seq_len(layout, w):
    return 4 * max(layout_unit(layout, w, BS), 2 * w * BS if layout == "zigzag" else w * BS)


def _doc(n):
    return doc_starts_for(n, [[n // 3, 1, n // 4], [n // 2 + 3]])


def _ring_worker(rank, w, cases, inner=None):
    import torch.distributed as dist

    groups = {}
    if inner is not None:
        inner_group, outer_group = hierarchical_groups(rank, w, inner)
        groups = dict(group=dist.group.WORLD, inner_group=inner_group, outer_group=outer_group)
    results = {}
    for i, (layout, sparse, dtype) in enumerate(cases):
        n = _seq_len(layout, w)
        q, k, v, do = make_inputs(n, seed=20 + i, dtype=dtype)
        sh = lambda x: shard_sequence(x, 2, rank, w, layout, BS)  # noqa: E731
        ql, kl, vl = (sh(t).requires_grad_(True) for t in (q, k, v))
        doc = shard_sequence(_doc(n), 1, rank, w, layout, BS)
        out = ring_attention(ql, kl, vl, layout=layout, block_size=BS, sparsity=_pattern(n, i) if sparse else None,
                             op=TorchBlockOp(max_rows=7), doc_start=doc, **groups)
        out.backward(sh(do))
        results[i] = [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]
    return results


def _check(per_rank, w, cases):
    for i, (layout, sparse, dtype) in enumerate(cases):
        n = _seq_len(layout, w)
        q, k, v, do = make_inputs(n, seed=20 + i, dtype=dtype)
        mask = _pattern(n, i).mask(n) if sparse else None
        want = grads(lambda a, b, c: reference(a, b, c, _doc(n), mask), q, k, v, do)
        got = [unshard_sequence([per_rank[r][i][j] for r in range(w)], 2, layout, BS) for j in range(4)]
        assert rel(got, want) < TOL[dtype], (w, cases[i])
        if sparse:  # the documents matter here: the same pattern without them is far from this reference
            plain = grads(lambda a, b, c: reference(a, b, c, torch.zeros_like(_doc(n)), mask), q, k, v, do)
            assert rel(plain, want) > 1e-2


@pytest.mark.parametrize("w", [1, 3])
def test_ring_with_documents_matches_reference(w):
    cases = _cases()
    per_rank = run_distributed(_ring_worker, w, cases) if w > 1 else [_ring_worker(0, 1, cases)]
    _check(per_rank, w, cases)


def test_hierarchical_ring_with_documents():
    cases = [c for c in _cases() if c[0] == "striped"]
    _check(run_distributed(_ring_worker, 4, cases, inner=2), 4, cases)


def test_steps_with_no_key_in_any_document_are_skipped():
    """Contiguous, 3 ranks of 16 tokens; documents [0, 20) and [20, 48): rank 2's queries (32..47) lie in the
    second document, which holds no key of rank 0 (0..15), so that step is skipped; rank 1 holds both documents'
    tokens and needs every earlier chunk."""
    n, w = 48, 3
    pos = tuple(global_positions(n, r, w, "contiguous", BS) for r in range(w))
    doc = doc_starts_for(n, [[20, 28]])
    skips = [document_skips(pos, r, doc[:, pos[r]]) for r in range(w)]
    assert skips[2] == {0: True, 1: False, 2: False}
    assert skips[1] == {0: False, 1: False, 2: True}  # rank 2's keys: later than every query (causality)
    assert skips[0] == {0: False, 1: True, 2: True}
    per_rank = run_distributed(_counting_worker, w, n)
    # rank 0's tokens all lie in the first document: nothing to mask there, it runs the plain causal ring (whose
    # steps against later chunks call the op, which computes nothing); ranks 1 and 2 skip as computed above
    assert [c for _, c in per_rank] == [3, 2, 2]
    q, k, v, do = make_inputs(n, seed=5)
    want = grads(lambda a, b, c: reference(a, b, c, doc.expand(B, n)), q, k, v, do)
    got = [unshard_sequence([per_rank[r][0][j] for r in range(w)], 2, "contiguous", BS) for j in range(4)]
    assert rel(got, want) < TOL[torch.float64]


def _counting_worker(rank, w, n):
    q, k, v, do = make_inputs(n, seed=5)
    sh = lambda x: shard_sequence(x, 2, rank, w, "contiguous", BS).requires_grad_(True)  # noqa: E731
    ql, kl, vl = sh(q), sh(k), sh(v)
    op = CountingOp()
    doc = shard_sequence(doc_starts_for(n, [[20, 28]]), 1, rank, w, "contiguous", BS)
    out = ring_attention(ql, kl, vl, layout="contiguous", block_size=BS, op=op, doc_start=doc)
    out.backward(shard_sequence(do, 2, rank, w, "contiguous", BS))
    return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)], op.calls["forward"]


class NoDocumentsOp(TorchBlockOp):
    supports_documents = False

    def __repr__(self):
        return "NoDocumentsOp()"


def test_ops_without_documents():
    """A user's op that cannot mask documents is a clear error; a default op that cannot (FlexAttention, the
    Triton kernels on CUDA) is replaced by the torch op, with one warning per op type."""
    n = 16
    q, k, v, _ = make_inputs(n, 1)
    with pytest.raises(ValueError, match="NoDocumentsOp\\(\\) does not compute it"):
        ring_attention(q, k, v, block_size=BS, op=NoDocumentsOp(), doc_start=doc_starts_for(n, [[5, 11], [9, 7]]))
    with pytest.warns(UserWarning, match="NoDocumentsOp has no per-document mask"):
        assert type(documents_op(NoDocumentsOp(), given=False)) is TorchBlockOp
    assert type(documents_op(NoDocumentsOp(), given=False)) is TorchBlockOp  # warned once: no second warning


# --- the estimator ------------------------------------------------------------------------------------------------


def reference_pattern_with_documents(q, k, doc, config):
    """The estimator's contract in float64 with each probe row's scores over its own document only, forced
    verticals the first ``sink_tokens`` positions of every document; top-k (score desc, index asc)."""
    Bq, Hq, n, _ = q.shape
    kr = k.double().repeat_interleave(Hq // k.shape[1], 1)
    probes = torch.arange(n - config.last_q, n)
    s = q[:, :, probes].double() @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, m, n]
    kpos = torch.arange(n)
    visible = (kpos[None, None, :] <= probes[None, :, None]) & (kpos[None, None, :] >= doc[:, probes][:, :, None])
    a = torch.softmax(s.masked_fill(~visible[:, None], float("-inf")), -1)
    out = []
    for b in range(Bq):
        forced_v = [j for j in range(n) if j - int(doc[b, j]) < config.sink_tokens]
        row = []
        for h in range(Hq):
            vert = a[b, h].sum(0)
            slash = torch.zeros(n, dtype=torch.float64)
            for i, p in enumerate(probes.tolist()):
                for o in range(p + 1):
                    slash[o] += a[b, h, i, p - o]

            def pick(scores, forced, budget):
                rest = sorted((j for j in range(n) if j not in forced), key=lambda j: (-float(scores[j]), j))
                return sorted(forced + rest[:budget])

            row.append((pick(vert, forced_v, config.vertical_topk),
                        pick(slash, list(range(config.local_window)), config.slash_topk)))
        out.append(row)
    return out


def _lists(pattern):
    v, s = pattern.vertical_idx, pattern.slash_idx
    return [[(sorted(x for x in v[b, g].tolist() if x >= 0), sorted(x for x in s[b, g].tolist() if x >= 0))
             for g in range(v.shape[1])] for b in range(v.shape[0])]


CONFIG = SparsityConfig(vertical_topk=4, slash_topk=3, last_q=6, tile_size=BS, sink_tokens=2, local_window=2,
                        probes="last")


def _estimate_worker(rank, w, n):
    import torch.distributed as dist

    q, k, _, _ = make_inputs(n, seed=11)
    sh = lambda x, d=2: shard_sequence(x, d, rank, w, "striped", BS)  # noqa: E731
    group = dist.group.WORLD if w > 1 else None
    return _lists(estimate_pattern(sh(q), sh(k), CONFIG, group=group, layout="striped", block_size=BS,
                                   doc_start=sh(_doc(n), 1)))


def test_estimate_pattern_with_documents_follows_the_contract_on_any_world_size():
    n = 3 * layout_unit("striped", 3, BS) * 2
    q, k, _, _ = make_inputs(n, seed=11)
    want = reference_pattern_with_documents(q, k, _doc(n), CONFIG)
    assert _estimate_worker(0, 1, n) == want
    for got in run_distributed(_estimate_worker, 3, n):
        assert got == want
    # every document's sinks are forced (row 0: three documents, one of a single token)
    starts = sorted(set(_doc(n)[0].tolist()))
    assert len(starts) == 3
    for verts, _ in want[0]:
        assert all(s + j in verts for s in starts for j in range(CONFIG.sink_tokens) if s + j < n)
    # the documents matter: the same inputs estimated as one document per row give another pattern
    plain = estimate_pattern(q, k, CONFIG, layout="striped", block_size=BS)
    assert _lists(plain) != want


# Probe blocks per document (``probes="documents"``) and spread (``"spread"``) against the independent float64
# reference (tests/helpers/pattern_ref.py). Documents (n = 288): row 0 holds a 5-token document (longer than the local
# window 3, shorter than last_q 8: a partial block), a single token (no block: the window covers it), 100, 4, 60
# tokens and the rest; row 1 a long document whose end lies inside the last block (its block stops where the last
# one begins: no row twice) and a last document of 6 tokens, shorter than last_q.
DOC_CONFIGS = {
    "documents-topk": SparsityConfig(vertical_topk=4, slash_topk=3, last_q=8, tile_size=BS, sink_tokens=2,
                                     local_window=3, probes="documents", probe_blocks=16),
    "documents-topk-cap": SparsityConfig(vertical_topk=4, slash_topk=3, last_q=8, tile_size=BS, sink_tokens=2,
                                         local_window=3, probes="documents", probe_blocks=3),
    "documents-topp-kv": SparsityConfig(top_p=0.7, max_vertical=30, max_slash=20, last_q=8, tile_size=BS,
                                        sink_tokens=1, local_window=3, probes="documents", pattern_heads="kv"),
    "spread-topk": SparsityConfig(vertical_topk=4, slash_topk=3, last_q=8, tile_size=BS, sink_tokens=2,
                                  local_window=3, probes="spread", probe_blocks=5),
}


def _doc_blocks(n):
    return doc_starts_for(n, [[5, 1, 100, 4, 60, 0], [n - 6, 0]])  # the last length: the rest of the row


def _documents_worker(rank, w, n, layout):
    import torch.distributed as dist

    q, k, _, _ = make_inputs(n, seed=17)
    sh = lambda x, d=2: shard_sequence(x, d, rank, w, layout, BS)  # noqa: E731
    group = dist.group.WORLD if w > 1 else None
    out = {}
    for name, cfg in DOC_CONFIGS.items():
        for lens in ([n, n], [n, n - 40]):
            pattern = estimate_pattern(sh(q), sh(k), cfg, group=group, layout=layout, block_size=BS, seq_len=lens,
                                       doc_start=sh(_doc_blocks(n), 1))
            out[(name, tuple(lens))] = _lists(pattern)
    return out


@pytest.mark.parametrize("w, layout", [(1, "striped"), (3, "striped"), (2, "zigzag")])
def test_probe_blocks_per_document_follow_the_reference(w, layout):
    from helpers.pattern_ref import probe_rows, reference_pattern

    n = 288
    q, k, _, _ = make_inputs(n, seed=17)
    doc = _doc_blocks(n)
    per_rank = run_distributed(_documents_worker, w, n, layout) if w > 1 else [_documents_worker(0, 1, n, layout)]
    for key, got in per_rank[0].items():
        name, lens = key
        assert got == reference_pattern(q, k, DOC_CONFIGS[name], list(lens), doc_start=doc), key
        for other in per_rank[1:]:
            assert other[key] == got, key
    # the blocks are what the docstring says: row 0 probes its 5-, 100-, 4- and 60-token documents besides the last
    # block (the cap of 3 keeps the two longest), row 1 the long document's rows before the last block
    rows = probe_rows(DOC_CONFIGS["documents-topk"], n, doc[0])
    assert [r for r in rows if r < 5] == [0, 1, 2, 3, 4] and 5 not in rows  # partial block; the single token: none
    assert len(rows) == 5 + 8 + 4 + 8 + 8
    capped = probe_rows(DOC_CONFIGS["documents-topk-cap"], n, doc[0])
    assert len(capped) == 3 * 8 and min(capped) == 6 + 100 - 8
    # row 1: the long document ends at n - 7, inside the last block [n - 8, n): its block keeps [n - 14, n - 8)
    assert probe_rows(DOC_CONFIGS["documents-topk"], n, doc[1]) == list(range(n - 14, n))
    # blocks per document change the pattern against the paper's last block on the same inputs
    last = dataclasses.replace(DOC_CONFIGS["documents-topk"], probes="last")
    assert reference_pattern(q, k, last, [n, n], doc_start=doc) != reference_pattern(
        q, k, DOC_CONFIGS["documents-topk"], [n, n], doc_start=doc)


def test_the_two_references_agree_on_the_last_block():
    """The reference above (this file) and the general one (helpers/pattern_ref.py) on the paper's probes."""
    from helpers.pattern_ref import reference_pattern

    n = 3 * layout_unit("striped", 3, BS) * 2
    q, k, _, _ = make_inputs(n, seed=11)
    assert reference_pattern(q, k, CONFIG, [n, n], doc_start=_doc(n)) == reference_pattern_with_documents(
        q, k, _doc(n), CONFIG)


# --- a Hugging Face model ------------------------------------------------------------------------------------------

DOCS = [[37, 25, 28], [50, 40]]  # two rows of 90 tokens: three and two documents


def make_qwen():
    return make_model("qwen2", max_position_embeddings=256)


def packed_batch(labels: bool = True) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (len(DOCS), sum(DOCS[0])), generator=torch.Generator().manual_seed(2))
    pid = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    batch = {"input_ids": ids, "position_ids": pid}
    return {**batch, "labels": ids.clone()} if labels else batch


def one_by_one() -> tuple[float, dict[str, torch.Tensor]]:
    """The unchanged model on each document alone: the mean token loss over all documents' targets, its grads."""
    model = make_qwen()
    ids = packed_batch()["input_ids"]
    total = sum(n - 1 for row in DOCS for n in row)
    loss = 0.0
    for b, row in enumerate(DOCS):
        start = 0
        for n in row:
            x = ids[b:b + 1, start:start + n]
            part = model(input_ids=x, labels=x).loss * (n - 1) / total
            part.backward()
            loss += float(part.detach())
            start += n
    return loss, {k: p.grad.clone() for k, p in model.named_parameters()}


def _model_worker(rank: int, world_size: int, sparsity, labels_in_step: bool, layout: str = "striped"):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mtraining import apply_context_parallel

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp")) if world_size > 1 else None
    model = make_qwen()
    handle = apply_context_parallel(model, mesh, block_size=16, layout=layout, sparsity=sparsity)
    batch = handle.shard(packed_batch(labels=not labels_in_step))
    if labels_in_step:  # labels built in training_step from the sharded batch: shifted over the group
        batch = {**batch, "labels": batch["input_ids"]}
    loss = model(**batch).loss
    loss.backward()
    if world_size > 1:  # each rank's loss is C / N x its token-loss sum: the mean of the gradients over the group
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world_size
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


def _small_sparsity():
    # small budgets: at 96 tokens (6 tiles of 16) the patterns are really sparse
    return SparsityConfig(vertical_topk=3, slash_topk=2, last_q=8, tile_size=16, sink_tokens=1, local_window=1)


def _full_cover():
    # every offset a slash: the pattern covers every causal pair, so sparse attention is dense attention
    return SparsityConfig(vertical_topk=1, slash_topk=96, last_q=8, tile_size=16, sink_tokens=1, local_window=1)


def _assert_same(got, want):
    loss, grads_ = got
    # float32, the sharded ring and the CP sums against one device, in another summation order: ~1e-6 relative
    # (the tolerances of test_parallel.py); a leak across documents changes the loss by > 1e-3 (asserted below)
    assert abs(loss - want[0]) < 2e-5, (loss, want[0])
    for name, g in want[1].items():
        torch.testing.assert_close(grads_[name], g, rtol=0, atol=5e-5, msg=lambda m: f"{name}: {m}")


# every layout is covered at the ring level above; here the striped default and the contiguous layout (whose rank 0
# holds only the first document: no documents to mask there, the estimator's collectives still run on every rank)
@pytest.mark.parametrize("world_size, sparsity, labels_in_step, layout", [
    (1, None, False, "striped"), (1, None, True, "striped"), (3, None, True, "striped"),
    (3, "full", False, "contiguous"), (3, "full", True, "striped"),
])
def test_packed_batch_trains_like_its_documents_one_by_one(world_size, sparsity, labels_in_step, layout):
    want = one_by_one()
    cfg = _full_cover() if sparsity == "full" else None
    if world_size == 1:
        got = _model_worker(0, 1, cfg, labels_in_step, layout)
    else:
        results = run_distributed(_model_worker, world_size, cfg, labels_in_step, layout, timeout=240)
        got = results[0]
        for other in results[1:]:
            assert other[0] == got[0]
    _assert_same(got, want)


def test_documents_matter_for_the_model():
    """Without document handling (the unchanged model on the packed rows, transformers' default use_cache=True,
    so it ignores the restarts) the loss is far from the documents' own: the tests above can fail."""
    model = make_qwen()
    with torch.no_grad():
        loss = float(model(**packed_batch()).loss)
    assert abs(loss - one_by_one()[0]) > 1e-3


@pytest.mark.parametrize("world_size", [3])
def test_sparse_packed_batch_is_the_same_on_any_world_size(world_size):
    want = _model_worker(0, 1, _small_sparsity(), False)
    results = run_distributed(_model_worker, world_size, _small_sparsity(), False, timeout=240)
    for got in results:
        _assert_same(got, want)
    dense = one_by_one()
    assert abs(want[0] - dense[0]) > 1e-4  # the patterns are really sparse: sparse is not dense here


def _bad_position_ids_worker(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mtraining import apply_context_parallel

    model = make_qwen()
    apply = apply_context_parallel(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)), block_size=16)
    batch = apply.shard(packed_batch())
    messages = []
    for bad in ({"position_ids": torch.arange(batch["input_ids"].shape[1])[None]}, {"use_cache": True}):
        try:
            model(**{**batch, **bad})
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_position_ids_other_than_the_batch_and_a_cache_are_clear_errors():
    """Under context parallelism, position_ids other than the batch's fail; so does use_cache=True with packed
    documents, with the error one device gives (the ring honours the documents either way, but the same input must
    not train on two ranks and fail on one)."""
    from lightning_mtraining import apply_context_parallel

    model = make_qwen()
    apply_context_parallel(model, None)
    with pytest.raises(ValueError) as one_device:
        model(**packed_batch(), use_cache=True)
    for position_msg, cache_msg in run_distributed(_bad_position_ids_worker, 2):
        assert position_msg is not None and "neither the tokens' global positions nor the sharded batch's own" in \
            position_msg
        assert cache_msg == str(one_device.value) and "use_cache=True" in cache_msg


def test_one_device_packed_inputs_that_transformers_would_ignore_are_clear_errors():
    from lightning_mtraining import apply_context_parallel

    model = make_qwen()
    apply_context_parallel(model, None)
    batch = packed_batch()
    with pytest.raises(ValueError, match="attention_mask that is not all ones"):
        model(**batch, attention_mask=torch.ones(2, 90, dtype=torch.long).index_fill(1, torch.tensor([89]), 0))
    with pytest.raises(ValueError, match="use_cache=True"):
        model(**batch, use_cache=True)
    # an all-ones mask is dropped (transformers would otherwise ignore the documents): the documents' own loss
    with torch.no_grad():
        loss = float(model(**batch, attention_mask=torch.ones(2, 90, dtype=torch.long)).loss)
    assert abs(loss - one_by_one()[0]) < 2e-5


# --- FlexAttention (the dense ring's op on CUDA) ------------------------------------------------------------------


def _flex_cases(n, dev, dtype):
    doc = doc_starts_for(n, [[5, 1, 30, 20], [41, 31]]).to(dev)
    q, k, v, do = (t.to(dev) for t in make_inputs(n, 3, dtype))
    return doc, q, k, v, do


# the eager path is what runs FlexAttention on CPU (it warns so); return_lse is what torch 2.11's API takes
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile", "ignore:return_lse is deprecated")
def test_flex_block_op_documents_forward_cpu():
    """FlexAttention's eager path runs on CPU (forward only: it has no CPU backward): the BlockMask's tile classes
    and mask_mod with documents, per batch row and shared by the rows, against the float64 reference."""
    from lightning_mtraining.ring.block_ops import FlexBlockOp

    n, w = 3 * 48, 3
    doc, q, k, v, _ = _flex_cases(n, "cpu", torch.float32)
    op = FlexBlockOp(tile=16, compile=False)  # 16-token tiles: documents start inside and at the edge of tiles
    for r, src in ((1, 0), (0, 2), (2, 2), (2, 1)):
        qp, kp = global_positions(n, r, w, "striped", BS), global_positions(n, src, w, "striped", BS)
        for d in (doc[:, qp], doc[:1, qp]):
            want = reference(q[:, :, qp], k[:, :, kp], v[:, :, kp], d.expand(B, -1), q_pos=qp, k_pos=kp)
            out, _ = op.forward(q[:, :, qp], k[:, :, kp], v[:, :, kp], qp, kp, 1 / math.sqrt(D), doc_start=d)
            assert rel([out], [want]) < TOL[torch.float32], (r, src, d.shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_documents_gpu(dtype):
    """The dense ring's default op on CUDA (compiled FlexAttention) with packed documents at 6144 tokens: one GPU
    end to end (FlexAttention's own autograd), and the blocks of a W=3 striped ring merged by log-sum-exp with each
    block's backward given the merged (out, lse) (the ring's protocol), forward and backward."""
    from lightning_mtraining.ring.block_ops import FlexBlockOp, merge_attention

    n, w, bs, d = 6144, 3, 128, 64
    g = torch.Generator().manual_seed(0)
    doc = doc_starts_for(n, [[1000, 1, 2500, 700], [3000, 3144]]).cuda()
    q, k, v, do = (torch.randn(B, h, n, d, generator=g).cuda() for h in (H, HKV, HKV, H))
    want = grads(lambda a, b, c: reference(a, b, c, doc), q, k, v, do)
    qd, kd, vd, dod = (t.to(dtype) for t in (q, k, v, do))
    # bf16 inputs and outputs (8 mantissa bits): 3e-2 relative to the O(1) values; float32 in and out with
    # FlexAttention's float32 accumulation over up to 3000 keys: 1e-4
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    got = grads(lambda a, b, c: ring_attention(a, b, c, block_size=bs, doc_start=doc), qd, kd, vd, dod)
    assert rel(got, want) < tol
    op, scale = FlexBlockOp(), 1 / math.sqrt(d)
    pos = [global_positions(n, r, w, "striped", bs, device="cuda") for r in range(w)]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(w):
        qp = pos[r]
        ql, dl = qd[:, :, qp], doc[:, qp]
        o = lse = None
        for src in range(w):
            o2, l2 = op.forward(ql, kd[:, :, pos[src]], vd[:, :, pos[src]], qp, pos[src], scale, doc_start=dl)
            o, lse = (o2.float(), l2) if o is None else merge_attention(o, lse, o2.float(), l2)
        assert rel([o], [want[0][:, :, qp]]) < tol, r
        dq = torch.zeros_like(ql, dtype=torch.float32)
        for src in range(w):
            kp = pos[src]
            gq, gk, gv = op.backward(ql, kd[:, :, kp], vd[:, :, kp], o.to(dtype), lse, dod[:, :, qp], qp, kp, scale,
                                     doc_start=dl)
            dq += gq
            dk[:, :, kp] += gk
            dv[:, :, kp] += gv
        assert rel([dq], [want[1][:, :, qp]]) < tol, r
    assert rel([dk, dv], want[2:]) < tol


def _own_loss_worker(rank: int, world_size: int, labels_from: str):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mtraining import apply_context_parallel, causal_lm_loss

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)) if world_size > 1 else None
    model = make_qwen()
    handle = apply_context_parallel(model, mesh, block_size=16)
    batch = handle.shard(packed_batch())
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch if labels_from == "batch" else batch["input_ids"]
    return float(causal_lm_loss(logits, labels).detach())


@pytest.mark.parametrize("world_size, labels_from", [(1, "batch"), (3, "batch"), (3, "tensor")])
def test_a_loss_computed_from_the_logits_stays_within_documents(world_size, labels_from):
    """A module computing its own loss (``causal_lm_loss``) from the logits of a packed batch: the documents' own
    loss. Under context parallelism labels built in the step (a tensor of the sharded batch) work too; on one
    device the batch must be given (a bare tensor carries no document boundaries)."""
    want = one_by_one()[0]
    got = _own_loss_worker(0, 1, labels_from) if world_size == 1 else \
        run_distributed(_own_loss_worker, world_size, labels_from)
    for loss in ([got] if world_size == 1 else got):
        assert abs(loss - want) < 2e-5  # float32 against one device, as above
