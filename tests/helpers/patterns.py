"""Sequences of vertical-slash patterns whose sizes vary the way an online estimator's do, for the tests that check
what follows the pattern's sizes (launch keys, list widths)."""

from __future__ import annotations

import torch


def varying_patterns(B: int, H: int, S: int, widths, seed: int, device=None):
    """Patterns ``(vertical_idx, slash_idx)`` [B, H, n] int64, one per ``(verticals, slashes)`` width (slashes >= 1),
    alternately top-k-like (every head full, distinct entries) and top-p-like (a random count per head, -1 padding,
    one head empty). Offset 0 (the local window) is always a slash of a non-empty head."""
    g = torch.Generator().manual_seed(seed)
    for i, (n_v, n_s) in enumerate(widths):
        vi = torch.stack([torch.randperm(S, generator=g)[:n_v] for _ in range(B * H)]).view(B, H, n_v)
        si = torch.stack([torch.randperm(S, generator=g)[:n_s] for _ in range(B * H)]).view(B, H, n_s)
        si[..., 0] = 0
        if i % 2:
            cnt_v = torch.randint(0, n_v + 1, (B, H, 1), generator=g)
            cnt_s = torch.randint(1, n_s + 1, (B, H, 1), generator=g)
            vi = torch.where(torch.arange(n_v) < cnt_v, vi, -1)
            si = torch.where(torch.arange(n_s) < cnt_s, si, -1)
            vi[0, i % H], si[0, i % H] = -1, -1
        yield vi.to(device), si.to(device)
