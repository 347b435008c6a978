"""Float64 single-device implementation of the estimator's contract (the ``sparsity.estimation`` module docstring:
the last queries scored against every key, per-column and per-diagonal sums, top-k or top-p with caps, sinks and the
local window always kept), written independently of :mod:`lightning_mtraining.sparsity.estimation` with plain loops, for
tests to compare against."""

from __future__ import annotations

import math

import torch


def reference_scores(q, k, seq_lens, last_q, scale=None, pattern_heads="query"):
    """Per batch row: (vertical scores [G, N], slash scores [G, N]) in float64, straight from the definitions."""
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = []
    for b in range(B):
        L = seq_lens[b]
        probes = list(range(L - last_q, L))
        kr = k[b].double().repeat_interleave(H // Hkv, 0)  # [H, N, D]
        s = q[b, :, L - last_q:L].double() @ kr.transpose(-1, -2) * scale  # [H, n, N]
        pos = torch.arange(N)
        visible = pos[None, :] <= torch.tensor(probes)[:, None]  # [n, N]
        a = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        if pattern_heads == "kv":
            a = a.view(Hkv, H // Hkv, last_q, N).sum(1)
        vert = a.sum(1)
        slash = torch.zeros_like(vert)
        for i, p in enumerate(probes):
            for o in range(p + 1):
                slash[:, o] += a[:, i, p - o]
        out.append((vert, slash))
    return out


def _pick(scores, forced_count, length, budget, top_p):
    """Selected indices of one head: forced ones, then the rest by (score desc, index asc) under the budget."""
    forced = list(range(min(forced_count, length)))
    cands = sorted(range(forced_count, length), key=lambda j: (-float(scores[j]), j))
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


def reference_pattern(q, k, config, seq_lens, scale=None, layer_idx=None):
    """Per batch row and pattern head: (sorted vertical list, sorted slash list)."""
    H, Hkv = q.shape[1], k.shape[1]
    G = H if config.pattern_heads == "query" else Hkv
    vb, sb = config.head_budgets(G, layer_idx)
    result = []
    for b, (vert, slash) in enumerate(reference_scores(q, k, seq_lens, config.last_q, scale, config.pattern_heads)):
        L = seq_lens[b]
        result.append([
            (_pick(vert[g], config.sink_tokens, L, vb[g], config.top_p),
             _pick(slash[g], config.local_window, L, sb[g], config.top_p))
            for g in range(G)
        ])
    return result


def pattern_lists(pattern):
    """A VerticalSlashPattern as the same nested lists (padding dropped, sorted)."""
    v, s = pattern.vertical_idx, pattern.slash_idx
    return [[(sorted(x for x in v[b, g].tolist() if x >= 0), sorted(x for x in s[b, g].tolist() if x >= 0))
             for g in range(v.shape[1])] for b in range(v.shape[0])]
