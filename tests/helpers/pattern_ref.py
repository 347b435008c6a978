"""Float64 single-device implementation of the estimator's contract (the ``estimation`` module docstring),
written independently of :mod:`lightning_mtraining.sparsity.estimation` with plain loops, for tests to compare against.

Probe rows (``SparsityConfig.probes``): ``"last"``, the last ``last_q`` real positions; ``"spread"``, blocks of
``last_q`` rows ending at evenly spaced positions; ``"documents"``, with packed documents (``doc_start``: for every
position the first position of its document), the last block plus one block at the end of each earlier document
longer than the local window, the longest first, never a row twice. With documents, each probe row's softmax covers
its own document only, and the forced verticals are the first ``sink_tokens`` positions of every document."""

from __future__ import annotations

import math

import torch

from lightning_mtraining.sparsity.config import SparsityConfig


def documents_of(doc_row, length):
    """``[(start, end)]`` (end inclusive) of the documents of one row of ``doc_start`` within its real length."""
    starts = sorted({int(x) for x in doc_row[:length].tolist()})
    ends = [s - 1 for s in starts[1:]] + [length - 1]
    return list(zip(starts, ends))


def probe_rows(config, length, doc_row=None):
    """The probe rows of one sequence of real length ``length`` (ascending, each once)."""
    n = config.last_q
    last = list(range(length - n, length))
    if config.probes == "spread":
        blocks = max(1, min(config.probe_blocks, length // n))
        rows = []
        for p in range(blocks):
            end = (p + 1) * length // blocks - 1
            rows += range(end - n + 1, end + 1)
        return sorted(rows)
    if config.probes == "last" or doc_row is None:
        return last
    docs = documents_of(doc_row, length)
    earlier = [(s, e) for s, e in docs[:-1] if e - s + 1 > config.local_window and s < length - n]
    earlier.sort(key=lambda d: (-(d[1] - d[0] + 1), -d[0]))
    rows = set(last)
    for s, e in earlier[: config.probe_blocks - 1]:
        rows.update(r for r in range(max(s, e - n + 1), e + 1) if r < length - n)
    return sorted(rows)


def reference_scores(q, k, seq_lens, config, scale=None, pattern_heads=None, doc_start=None):
    """Per batch row: (vertical scores [G, N], slash scores [G, N]) in float64, straight from the definitions.
    ``config``: a SparsityConfig, or an int ``last_q`` (the last rows; ``pattern_heads`` then says which heads)."""
    if isinstance(config, int):
        config = SparsityConfig(last_q=config, probes="last", pattern_heads=pattern_heads or "query")
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = []
    for b in range(B):
        L = seq_lens[b]
        doc_row = None if doc_start is None else doc_start[b if doc_start.shape[0] > 1 else 0]
        probes = probe_rows(config, L, doc_row)
        kr = k[b].double().repeat_interleave(H // Hkv, 0)  # [H, N, D]
        s = q[b, :, probes].double() @ kr.transpose(-1, -2) * scale  # [H, r, N]
        visible = torch.zeros(len(probes), N, dtype=torch.bool)
        for i, p in enumerate(probes):
            first = 0 if doc_row is None else int(doc_row[p])
            visible[i, first:p + 1] = True
        a = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        if config.pattern_heads == "kv":
            a = a.view(Hkv, H // Hkv, len(probes), N).sum(1)
        vert = a.sum(1)
        slash = torch.zeros_like(vert)
        for i, p in enumerate(probes):
            for o in range(p + 1):
                slash[:, o] += a[:, i, p - o]
        out.append((vert, slash))
    return out


def _pick(scores, forced, length, budget, top_p):
    """Selected indices of one head: the forced ones, then the rest by (score desc, index asc) under the budget."""
    forced = [j for j in forced if j < length]
    cands = sorted((j for j in range(length) if j not in set(forced)), key=lambda j: (-float(scores[j]), j))
    if top_p is None:
        return sorted(forced + cands[:budget])
    total = float(scores.sum())
    mass = float(sum(scores[j] for j in forced))
    chosen = []
    for j in cands:
        if len(chosen) >= budget or mass >= top_p * total:
            break
        chosen.append(j)
        mass += float(scores[j])
    return sorted(forced + chosen)


def reference_pattern(q, k, config, seq_lens, scale=None, layer_idx=None, doc_start=None):
    """Per batch row and pattern head: (sorted vertical list, sorted slash list)."""
    H, Hkv = q.shape[1], k.shape[1]
    G = H if config.pattern_heads == "query" else Hkv
    vb, sb = config.head_budgets(G, layer_idx)
    result = []
    for b, (vert, slash) in enumerate(reference_scores(q, k, seq_lens, config, scale, doc_start=doc_start)):
        L = seq_lens[b]
        if doc_start is None:
            sinks = list(range(config.sink_tokens))
        else:
            doc_row = doc_start[b if doc_start.shape[0] > 1 else 0]
            sinks = [j for j in range(L) if j - int(doc_row[j]) < config.sink_tokens]
        result.append([
            (_pick(vert[g], sinks, L, vb[g], config.top_p),
             _pick(slash[g], list(range(config.local_window)), L, sb[g], config.top_p))
            for g in range(G)
        ])
    return result


def pattern_lists(pattern):
    """A VerticalSlashPattern as the same nested lists (padding dropped, sorted)."""
    v, s = pattern.vertical_idx, pattern.slash_idx
    return [[(sorted(x for x in v[b, g].tolist() if x >= 0), sorted(x for x in s[b, g].tolist() if x >= 0))
             for g in range(v.shape[1])] for b in range(v.shape[0])]
