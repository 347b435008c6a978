"""Property-based tests (hypothesis): the ring over drawn shapes, lengths, layouts, world sizes, hierarchies,
windows, soft-caps and sparse patterns equals its float64 reference, or refuses with a clear ValueError.

The ring runs in :class:`~lightning_mtraining.ring.simulated.SimulatedRing` (the real ring's step functions, in one
process, so a hundred cases take seconds); ``tests/distributed/test_ring.py`` and ``tests/test_simulated*`` tie it to
the real ring over gloo.
"""

from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lightning_mtraining import VerticalSlashPattern, unshard_sequence  # noqa: E402
from lightning_mtraining.core.layouts import LAYOUTS, layout_unit, shard_sequence  # noqa: E402
from lightning_mtraining.ring.block_ops import TorchBlockOp  # noqa: E402
from lightning_mtraining.ring.simulated import SimulatedRing  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(q, k, v, do, window=None, softcap=None, mask=None):
    """(out, dq, dk, dv) of masked causal attention in float64, K/V repeated over their query heads."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    n = q.shape[2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(torch.isfinite(lse), torch.exp(s - lse), torch.zeros_like(s))
    out = p @ v.repeat_interleave(g, 1)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), do.double())]


@st.composite
def ring_cases(draw, sparse: bool = False):
    w = draw(st.sampled_from([1, 2, 3, 4, 5, 6]))
    inner = draw(st.sampled_from([d for d in range(1, w + 1) if w % d == 0]))
    layout = "striped" if sparse else draw(st.sampled_from(LAYOUTS))
    block = 16 if sparse else draw(st.sampled_from([1, 2, 3, 4, 8]))
    units = draw(st.integers(1, 3))
    hkv = draw(st.sampled_from([1, 2]))
    heads = hkv * draw(st.sampled_from([1, 2, 3]))
    return dict(w=w, inner=inner, layout=layout, block=block, n=units * layout_unit(layout, w, block), hkv=hkv,
                heads=heads, batch=draw(st.integers(1, 2)), d=draw(st.sampled_from([4, 8, 16])),
                seed=draw(st.integers(0, 2**16)))


def _run(case, dtype, **ring_kwargs):
    g = torch.Generator().manual_seed(case["seed"])
    B, H, Hkv, n, D = case["batch"], case["heads"], case["hkv"], case["n"], case["d"]
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, Hkv, n, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, Hkv, n, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    w, layout, block = case["w"], case["layout"], case["block"]
    ring = SimulatedRing(w, layout, block, inner_size=case["inner"], op=TorchBlockOp(max_rows=5), **ring_kwargs)
    outs = ring.forward(q.to(dtype), k.to(dtype), v.to(dtype))
    grads = ring.backward([shard_sequence(do.to(dtype), 2, r, w, layout, block) for r in range(w)])
    got = [unshard_sequence(outs, 2, layout, block)] + [unshard_sequence(x, 2, layout, block) for x in grads]
    return got, (q, k, v, do)


def _error(got, ref):
    # relative to max(|ref|, 1): relative for O(1) values, absolute where a reference vanishes (window 1: dq = 0)
    return max(((a.double() - b).abs().max() / b.abs().max().clamp_min(1.0)).item() for a, b in zip(got, ref))


# float64: every op in float64, a few ulps times reductions of < 300 keys: 1e-12. float32: inputs rounded to
# float32 (6e-8) and float32 accumulation over < 300 keys: ~1e-6; 3e-5 leaves room for exp's amplification of
# scores up to ~60 (inputs * 2), far below a wrong mask or merge (O(1)).
TOL = {torch.float64: 1e-12, torch.float32: 3e-5}


@SETTINGS
@given(case=ring_cases(), dtype=st.sampled_from([torch.float64, torch.float32]),
       window=st.one_of(st.none(), st.integers(1, 400)), softcap=st.one_of(st.none(), st.floats(0.5, 20.0)))
def test_dense_ring_equals_reference(case, dtype, window, softcap):
    got, (q, k, v, do) = _run(case, dtype, window=window, softcap=softcap)
    err = _error(got, reference(q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype), window, softcap))
    assert err < TOL[dtype], (case, dtype, window, softcap, err)


@SETTINGS
@given(case=ring_cases(sparse=True), data=st.data())
@pytest.mark.slow
def test_sparse_ring_equals_its_pattern(case, data):
    """A drawn vertical-slash pattern (duplicates, padding, out-of-range-free) through the simulated sparse ring
    equals masked attention over exactly the pattern's pairs (its tile rule from ``mtraining_kernels.reference``)."""
    from mtraining_kernels.indexing import expand_pattern
    from mtraining_kernels.reference import vertical_slash_mask

    n, B, G = case["n"], case["batch"], data.draw(st.sampled_from(["query", "kv"]))
    heads = case["heads"] if G == "query" else case["hkv"]
    nv, ns = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    vert = torch.tensor(data.draw(st.lists(st.integers(-1, n - 1), min_size=B * heads * nv,
                                           max_size=B * heads * nv))).view(B, heads, nv)
    slash = torch.tensor(data.draw(st.lists(st.integers(-1, n - 1), min_size=B * heads * ns,
                                            max_size=B * heads * ns))).view(B, heads, ns)
    softcap = data.draw(st.one_of(st.none(), st.floats(0.5, 20.0)))
    pattern = VerticalSlashPattern(vert, slash, tile_size=16)
    got, (q, k, v, do) = _run(case, torch.float64, pattern=pattern, softcap=softcap,
                              verticals=data.draw(st.sampled_from(["gathered", "arrival"])))
    H, Hkv = case["heads"], case["hkv"]
    mask = vertical_slash_mask(expand_pattern(vert, H, Hkv), expand_pattern(slash, H, Hkv), n, 16)
    err = _error(got, reference(q, k, v, do, softcap=softcap, mask=mask))
    assert err < TOL[torch.float64], (case, err)


@SETTINGS
@given(window=st.one_of(st.integers(-3, 0), st.floats(0.5, 3.0), st.just(True)),
       softcap=st.one_of(st.floats(-3.0, 0.0), st.just("2")))
def test_bad_variants_are_clear_errors(window, softcap):
    q = torch.randn(1, 2, 8, 4)
    for kwargs, field in ((dict(window=window), "window"), (dict(softcap=softcap), "softcap")):
        with pytest.raises(ValueError, match=f"{field} must be a positive"):
            SimulatedRing(2, "striped", 2, op=TorchBlockOp(), **kwargs).forward(q, q[:, :1], q[:, :1])
