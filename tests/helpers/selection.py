"""The estimator's selection two ways, on the same scores: the torch functions of ``sparsity.estimation``,
``indexing`` and ``balance`` (the reference), and the fused kernels of ``mtraining_kernels.pattern_select`` (in the
Triton interpreter on CPU, or on a GPU). Shared by ``tests/unit/test_straight_path.py`` and
``tests/gpu/test_straight_gpu.py``."""

from __future__ import annotations

import torch


def random_scores(B: int, G: int, N: int, lens: list[int], seed: int, device="cpu"):
    """``(vert, slash)`` ``[B, G, N]`` float32 scores >= 0 with a long tail (powers of uniforms, so top-p keeps a
    varying number per head), zero beyond each row's real length."""
    g = torch.Generator().manual_seed(seed)
    vert = torch.rand(B, G, N, generator=g) ** 8
    slash = torch.rand(B, G, N, generator=g) ** 8
    for b, length in enumerate(lens):
        vert[b, :, length:] = 0
        slash[b, :, length:] = 0
    return vert.to(device), slash.to(device)


def _pad(x: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    if x.shape[-1] >= width:
        return x[..., :width]
    return torch.cat([x, x.new_full((*x.shape[:-1], width - x.shape[-1]), fill)], -1)


def reference(vert, slash, lens, H, T, sink, window, vb, sb, top_p, dense_above, dense=None):
    """The torch selection (one rank): ``(vertical_idx, slash_idx, offsets, verticals, allowed, decided)`` with
    the fused kernel's widths (pattern: sink + max budget and window + max budget; tiles: bounded)."""
    import lightning_mtraining.sparsity.estimation as est
    from lightning_mtraining.sparsity.pattern import (
        VerticalSlashPattern,
        decide_dense_heads,
        head_pairs,
        with_dense_heads,
    )
    from mtraining_kernels.indexing import prepare_pattern_tiles

    vert, slash = vert.cpu(), slash.cpu()
    B, G, N = vert.shape
    pos = torch.arange(N)
    lens_b = torch.tensor(lens)[:, None, None]
    v_forced = pos[None, None, :] < sink
    s_forced = pos[None, None, :] < window
    v_sel = est._select(vert, pos[None], ~v_forced & (pos < lens_b), v_forced.expand_as(vert), vb, top_p, None, 1)
    s_sel = est._select(slash, pos[None], ~s_forced & (pos < lens_b), s_forced.expand_as(slash), sb, top_p, None, 1)
    vi = est._sorted_indices(est._forced(sink, lens, (B, G), "cpu").expand(B, G, -1), v_sel)
    si = est._sorted_indices(est._forced(window, lens, (B, G), "cpu"), s_sel)
    pattern = VerticalSlashPattern(vi, si, T)
    full = pattern.expand(H, G)
    if dense is not None:
        full = with_dense_heads(full, dense.bool().repeat_interleave(H // G, 1), N)
    pt = prepare_pattern_tiles(full.vertical_idx, full.slash_idx, N, T, widths="bounded")
    allowed, causal = head_pairs(pattern, lens)
    decided = decide_dense_heads(allowed, causal, dense_above) if dense_above is not None else None
    return (_pad(vi, sink + max(vb), -1), _pad(si, window + max(sb), -1), pt.offsets, pt.verticals, allowed, decided)


def fused(vert, slash, lens, H, T, sink, window, vb, sb, top_p, dense_above, dense=None, L=None, NV=None):
    """The fused kernels on the same scores (their device), widths as :func:`reference`'s (``L`` / ``NV``: the
    tiles' widths, default the bounded ones of the pattern's widths)."""
    from mtraining_kernels.lists import list_width_bounds
    from mtraining_kernels.pattern_select import finish_pattern, select_keys

    dev = vert.device
    B, G, N = vert.shape
    NT = N // T
    lens_t = torch.tensor(lens, device=dev)
    keys, mass = select_keys(vert, slash, torch.arange(N, device=dev), 0, lens_t, sink, window)
    top = torch.topk(keys, min(max(max(vb), max(sb)), N), dim=-1).values
    nv, ns = sink + max(vb), window + max(sb)
    bl, bnv = list_width_bounds(ns, nv, N, T, T)
    L = L or (NT if dense is not None else bl)
    NV = NV or bnv
    out = (torch.full((B, G, nv), 7, dtype=torch.int64, device=dev),
           torch.full((B, G, ns), 7, dtype=torch.int64, device=dev),
           torch.full((B, H, L), 7, dtype=torch.int64, device=dev),
           torch.full((B, H, NV), 7, dtype=torch.int64, device=dev),
           torch.full((2, B * H), 7, dtype=torch.int32, device=dev),
           torch.full((B, G), 7, dtype=torch.int64, device=dev),
           torch.full((B, G), 7, dtype=torch.int8, device=dev))
    scratch = (torch.zeros(B * H, N, dtype=torch.int8, device=dev), torch.zeros(B * H, N, dtype=torch.int8, device=dev),
               torch.zeros(B * H, NT + 1, dtype=torch.int8, device=dev),
               torch.zeros(B * H, NT, dtype=torch.int32, device=dev))
    budgets = torch.tensor([vb, sb], dtype=torch.int32, device=dev)
    params = torch.tensor([top_p or 0.0, dense_above or 0.0], dtype=torch.float64, device=dev)
    finish_pattern(top, mass, budgets, params, lens_t, num_heads=H, seq_len=N, tile=T, sink_tokens=sink,
                   local_window=window, top_p=top_p is not None, decide=dense_above is not None,
                   dense=None if dense is None else dense.to(dev, torch.int8), scratch=scratch, out=out)
    assert all(int(s.abs().sum()) == 0 for s in scratch[:3]), "the scratch flags were not left zeroed"
    return out


def compare(got, ref, seq_len: int) -> None:
    """Every output of :func:`fused` equals :func:`reference`'s; the counts equal the tiles' real entries (those
    below the padding ``seq_len + 1``)."""
    names = ("vertical_idx", "slash_idx", "offsets", "verticals")
    for name, a, b in zip(names, got[:4], ref[:4]):
        a = a.cpu()
        assert a.shape == b.shape and torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"
    offsets, verticals, counts = ref[2], ref[3], got[4].cpu()
    big = seq_len + 1
    assert torch.equal(counts[0], (offsets < big).sum(-1).reshape(-1).to(torch.int32))
    assert torch.equal(counts[1], (verticals < big).sum(-1).reshape(-1).to(torch.int32))
    assert torch.equal(got[5].cpu(), ref[4]), f"allowed {got[5].tolist()} != {ref[4].tolist()}"
    if ref[5] is not None:
        assert torch.equal(got[6].cpu().bool(), ref[5]), f"decided {got[6].tolist()} != {ref[5].tolist()}"
