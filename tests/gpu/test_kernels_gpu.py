"""Vertical-slash Triton kernels on a CUDA GPU at real sizes in bfloat16 and float16 (skipped without a GPU).

Rule (flash-attention's; :mod:`mtraining_kernels.reference`, shared with ``benchmarks/kernel_precision.py``): the
kernel's error against a float32 reference must be at most twice the error of the same computation done by torch
at the kernel's precision (:func:`attention_chunked_ref` with dtype=bfloat16 or float16, float32 accumulation
inside matmuls), plus a floor for outputs whose torch error is itself ~0 (1e-3 in bfloat16, scaled by the ratio of
the dtypes' machine epsilons for float16: 1.25e-4). Backward is rerun 50 times and must be bit-identical (the
kernels use no floating-point atomics).
"""

from __future__ import annotations

import pytest
import torch

from mtraining_kernels.testing import (
    HALF_PRECISION_CASES,
    half_precision_case,
    kernel_config,
    max_abs_errors,
    random_pattern,
)

pytestmark = pytest.mark.gpu


def _pattern(B, G, S, n_vertical, slashes, seed):
    return random_pattern(B, G, S, n_vertical, slashes, seed, device="cuda")


@pytest.mark.parametrize(
    "S,D,block",
    [(8192, 128, 64), (8191, 64, 64), (32768, 128, 64), (8192, 128, 128), (8191, 128, (128, 64)), (32767, 128, 128)],
)
def test_bf16_matches_fp32_reference(S, D, block):
    _check_half(S, D, block)


@pytest.mark.parametrize("softcap", [None, 20.0, 2.0])
def test_softcap_bf16_matches_fp32_reference(softcap):
    """Gemma 2's attention soft-cap (50.0 there; 20 and 2 here bend more of these scores) in the Triton kernels on
    the GPU ("auto" leaves the Gluon ones, which have no cap): the half-precision rule, 128 x 128 tiles, ragged."""
    _check_half(8191, 128, 128, softcap=softcap, q_gain=4.0)


def _needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is for sm_90 (Hopper) only")


@pytest.mark.parametrize("config", ["forward=triton,dq=triton,dkdv=triton",
                                    "q_rows=64,fwd_warps=4,dq_warps=4,sub_n=64,forward=triton,dq=triton,dkdv=triton",
                                    "q_rows=32,sub_n=64,heavy_first=0,forward=triton,dq=triton,dkdv=triton"])
def test_bf16_launch_settings_match_fp32_reference(config):
    # the Triton kernels at 128 x 128 tiles (where 'auto' would pick Gluon) and their other launch settings (query
    # tiles split over several programs, 4-warp programs, the other launch order): same pairs, same rule, ragged
    _check_half(8191, 128, 128, kernel_config(config))


@pytest.mark.parametrize("S,D,spec", [(8191, 128, "forward=gluon"), (32767, 128, "forward=gluon,dq=gluon"),
                                      (8191, 64, "forward=gluon,dq=gluon"), (8191, 128, "dq=gluon"),
                                      (8191, 128, "dkdv=gluon"), (8191, 64, "dkdv=gluon"),
                                      (32767, 128, "forward=gluon,dq=gluon,dkdv=gluon"),
                                      (8191, 64, "forward=gluon,dq=gluon,k_stages=3"),
                                      (32767, 128, "forward=gluon,dq=gluon,dkdv=gluon,k_stages=3"),
                                      (8191, 128, "dkdv_cols=gluon"), (8191, 64, "dkdv_cols=gluon,col_split=3"),
                                      (32767, 128, "dkdv_cols=gluon,col_split=1"), (8191, 128, "dkdv_cols=triton"),
                                      (32767, 128, "item_order=strided"), (8191, 64, "item_order=strided"),
                                      (32767, 128, "item_order=snake"), (8191, 64, "item_order=snake")])
def test_bf16_gluon_kernels_match_fp32_reference(S, D, spec):
    # the warp-specialised Gluon forward, dq, dk/dv and column dk/dv kernels, the others Triton's: same rule,
    # ragged lengths (the column kernel with 1 and 3 query-range parts per chunk pair and the default)
    _needs_sm90()
    _check_half(S, D, 128, kernel_config(spec))


@pytest.mark.parametrize("D", [64, 128])
def test_gluon_k_ring_depth_changes_no_bit(D):
    # KernelConfig.k_stages only changes how far ahead K is loaded: the forward and dq must be bit-identical with a
    # 2- and a 3-buffer K ring (ragged length, GQA, gathered columns, masked and unmasked steps), and a fwd+bwd
    # through the autograd path (with its per-call cache of gathered columns) must equal the direct calls
    _needs_sm90()
    from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists
    from mtraining_kernels.vertical_slash import KernelConfig, block_backward, block_forward, vertical_slash_attention

    torch.manual_seed(3)
    B, H, Hkv, S = 1, 8, 2, 8191
    q, k, v, dout = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv, H))
    vi, si = _pattern(B, Hkv, S, 400, [0, 1, 2, 1500], seed=6)
    tiles = pattern_tile_lists(expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv), S, 128, 128)
    pos = torch.arange(S, device="cuda")
    res = []
    for ks in (2, 3):
        cfg = KernelConfig(k_stages=ks)
        out, lse = block_forward(q, k, v, pos, pos, D**-0.5, tiles=tiles, config=cfg)
        res.append((out, lse, *block_backward(q, k, v, out, lse, dout, pos, pos, D**-0.5, tiles=tiles, config=cfg,
                                              grad_dtype=torch.bfloat16)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *res):
        assert torch.equal(a, b), f"{name} differs between k_stages=2 and 3"
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = vertical_slash_attention(qg, kg, vg, tiles, scale=D**-0.5)
    out.backward(dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, qg.grad, kg.grad, vg.grad), (res[0][0], *res[0][2:])):
        assert torch.equal(a, b), f"autograd {name} differs from the direct calls"


@pytest.mark.parametrize("S,D", [(32767, 128), (8191, 64)])
def test_gather_columns_kernel_matches_torch_gather(S, D):
    # the one-launch column gather feeding the Gluon kernels against its torch version: a copy, so exact (bf16,
    # GQA 16/2, per-head budgets, B = 2 with lists shared over the batch, key positions not 0..S-1)
    from mtraining_kernels.gluon_common import gather_columns
    from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists

    vi, si = _pattern(1, 2, S, 700, [0, 1, 2, 300], seed=S)
    tiles = pattern_tile_lists(expand_pattern(vi, 16, 2), expand_pattern(si, 16, 2), S, 128, 128)
    k, v = (torch.randn(2, 2, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_pos = torch.arange(S, device="cuda", dtype=torch.int32) + 1000
    got = gather_columns(k, v, k_pos, tiles, 16, use_kernel=True)
    want = gather_columns(k, v, k_pos, tiles, 16, use_kernel=False)
    for name, a, b in zip(("k", "v", "positions", "steps"), got, want):
        assert a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", ["pattern", "shifted dense"])
def test_gluon_forward_merges_a_running_result(D, case):
    # ring use: merge into a running (out, lse) in place. "shifted dense": keys 700 positions later than the queries
    # (dense causal lists by position), so the first 700 query rows have no pair in this block and must keep the
    # running result bit for bit. The rest: the flash-attention rule against a float32 reference of the merged
    # result, with the Triton forward as "the same computation" (the two round P to bf16 under different running
    # maxima, so they differ at bf16 level, not float32 level); lse from float32 scores of exact bf16 products
    # summed in float32 (relative noise ~1e-6 on values below ~20): 1e-3 absolute is a wide margin
    _needs_sm90()
    from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists
    from mtraining_kernels.reference import attention_ref
    from mtraining_kernels.testing import tile_lists_mask
    from mtraining_kernels.vertical_slash import KernelConfig, block_forward

    torch.manual_seed(2)
    B, H, Hkv, S = 2, 8, 2, 5000
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
    q_pos = torch.arange(S, device="cuda")
    if case == "pattern":
        vi, si = _pattern(B, Hkv, S, 200, [0, 1, 130, 2500], seed=4)
        tiles, k_pos = pattern_tile_lists(expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv), S, 128, 128), q_pos
    else:
        tiles, k_pos = None, q_pos + 700
    prev_out = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    prev_lse = torch.randn(B, H, S, device="cuda")
    results = []
    for fwd in ("triton", "gluon"):
        out, lse = prev_out.clone(), prev_lse.clone()
        block_forward(q, k, v, q_pos, k_pos, D**-0.5, tiles=tiles, out=out, lse=lse, block_m=128, block_n=128,
                      config=KernelConfig(forward=fwd))
        results.append((out, lse))
    (o_t, l_t), (o_g, l_g) = results
    assert not torch.equal(o_g, prev_out), "the running result was not updated in place"
    if case != "pattern":
        assert torch.equal(o_g[:, :, :700], prev_out[:, :, :700]) and torch.equal(l_g[:, :, :700], prev_lse[:, :, :700])
    if tiles is None:
        from mtraining_kernels.indexing import dense_tile_lists

        tiles = dense_tile_lists(q_pos, k_pos, 128, 128)
    mask = tile_lists_mask(tiles, q_pos, k_pos)
    for b in range(B):  # the float32 reference, one batch row at a time (memory)
        m_b = mask[b:b + 1] if mask.shape[0] > 1 else mask
        o_b, l_b = attention_ref(q[b:b + 1].float(), k[b:b + 1].float(), v[b:b + 1].float(), m_b, D**-0.5)
        mx = torch.maximum(prev_lse[b:b + 1], l_b)
        w_p, w_n = torch.exp(prev_lse[b:b + 1] - mx), torch.exp(l_b - mx)
        o_ref = (prev_out[b:b + 1].float() * w_p[..., None] + o_b * w_n[..., None]) / (w_p + w_n)[..., None]
        l_ref = mx + torch.log(w_p + w_n)
        e_g = (o_g[b:b + 1].float() - o_ref).abs().max().item()
        e_t = (o_t[b:b + 1].float() - o_ref).abs().max().item()
        assert e_g <= 2 * e_t + 1e-3, f"batch {b}: gluon error {e_g:.3e} > 2 x triton error {e_t:.3e}"
        assert (l_g[b:b + 1] - l_ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("S,D,block,spec", HALF_PRECISION_CASES)
def test_fp16_matches_fp32_reference(S, D, block, spec):
    # float16 inputs through the default kernels (Gluon on sm_90 at 128 x 128 tiles, Triton at 64 x 64 and on
    # other GPUs): the same rule against torch in float16. float16 keeps 3 more mantissa bits than bfloat16, so
    # both errors shrink ~8x; the floor shrinks with them (module docstring), so it still only covers outputs ~0
    _check_half(S, D, block, kernel_config(spec) if spec else None, dtype=torch.float16)


def _check_half(S, D, block, config=None, dtype=torch.bfloat16, softcap=None, q_gain=1.0):
    """One fwd+bwd held to the rule (:func:`mtraining_kernels.testing.half_precision_case`); with no ``config``
    and no ``softcap`` through the public ``sparse_attention``, else ``vertical_slash_attention``."""
    if config is not None or softcap is not None:
        return half_precision_case(S, D, block, config, dtype=dtype, softcap=softcap, q_gain=q_gain)
    from lightning_mtraining.sparsity.attention import sparse_attention

    def public_api(q, k, v, vertical_idx, slash_idx, block):
        return sparse_attention(q, k, v, vertical_idx, slash_idx, block_size=block)

    return half_precision_case(S, D, block, dtype=dtype, q_gain=q_gain, attention=public_api)


@pytest.mark.parametrize("block", [64, (128, 64), 128])
def test_backward_deterministic_50_runs(block):
    from mtraining_kernels.indexing import pattern_tile_lists
    from mtraining_kernels.vertical_slash import block_backward, block_forward

    torch.manual_seed(1)
    B, H, Hkv, S, D = 2, 8, 2, 8191, 128  # ragged
    bm, bn = (block, block) if isinstance(block, int) else block
    q, k, v, dout = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv, H))
    vi, si = _pattern(B, H, S, 500, [0, 64, 200, 2000], seed=3)
    tiles = pattern_tile_lists(vi, si, S, bm, bn)
    pos = torch.arange(S, device="cuda")
    out, lse = block_forward(q, k, v, pos, pos, 0.1, tiles=tiles)
    first = block_backward(q, k, v, out, lse, dout, pos, pos, 0.1, tiles=tiles)
    for _ in range(50):
        again = block_backward(q, k, v, out, lse, dout, pos, pos, 0.1, tiles=tiles)
        assert all(torch.equal(a, b) for a, b in zip(again, first)), "backward differs between runs"


@pytest.mark.parametrize("block", [128, 64])
def test_fwd_bwd_captured_in_a_cuda_graph_equals_eager(block):
    # short calls are host-bound (benchmarks/RESULTS.md, Kernels: 32K/2% eager against its CUDA-graph replay); a
    # CUDA graph removes the launch cost, so the default path (Gluon on sm_90 at 128 x 128, Triton at 64 x 64)
    # must be capturable: no host sync, no allocation outside the graph's pool, no host-side state that a replay
    # would miss. The replay recomputes the same kernels on the same inputs and the kernels are deterministic,
    # hence bit equality with eager.
    from mtraining_kernels.indexing import pattern_tile_lists
    from mtraining_kernels.vertical_slash import vertical_slash_attention

    torch.manual_seed(2)
    B, H, Hkv, S, D = 1, 8, 2, 8191, 128  # ragged, GQA, gathered columns
    vi, si = _pattern(B, H, S, 400, [0, 1, 2, 900], seed=5)
    tiles = pattern_tile_lists(vi, si, S, block, block)
    q, k, v, dout = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv, H))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def step():
        qg.grad = kg.grad = vg.grad = None
        out = vertical_slash_attention(qg, kg, vg, tiles)
        out.backward(dout)
        return out

    want = [step().detach().clone()] + [t.grad.clone() for t in (qg, kg, vg)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    qg.grad = kg.grad = vg.grad = None
    with torch.cuda.graph(graph):
        out = vertical_slash_attention(qg, kg, vg, tiles)
        out.backward(dout)
    got = [out] + [t.grad for t in (qg, kg, vg)]  # the graph's own output tensors
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"{name} replayed from a CUDA graph differs from eager"
        for t in got:  # so the second replay must write every element again to pass
            t.zero_()


@pytest.mark.parametrize("S,block", [(131072, 128), (131071, (128, 64)), (65536, 64)])
def test_triton_list_builder_matches_torch_builder(S, block):
    # integer lists: exact equality of every valid entry, count and column bit at real sizes (16 heads, ~1000
    # verticals with duplicates, a window, random slashes up to S and padding)
    from mtraining_kernels.indexing import pattern_tile_lists

    bm, bn = (block, block) if isinstance(block, int) else block
    g = torch.Generator().manual_seed(S)
    vi = torch.randint(-2, S, (1, 16, 1100), generator=g)
    si = torch.cat([torch.arange(256).expand(1, 16, -1), torch.randint(-2, S, (1, 16, 300), generator=g)], -1)
    vi, si = vi.cuda(), si.cuda()
    a = pattern_tile_lists(vi, si, S, bm, bn, backend="torch")
    b = pattern_tile_lists(vi, si, S, bm, bn, backend="triton")
    for n in ("fwd_idx", "fwd_cnt", "fwd_nmask", "bwd_cnt", "bwd_nmask", "col_idx", "col_bits"):
        assert torch.equal(getattr(a, n), getattr(b, n)), n
    valid = torch.arange(a.bwd_idx.shape[-1], device="cuda") < a.bwd_cnt[..., None]
    assert torch.equal(a.bwd_idx[valid], b.bwd_idx[valid]), "bwd_idx"


def test_dense_block_ops_striped_positions():
    from mtraining_kernels.testing import attention_chunked_ref
    from mtraining_kernels.vertical_slash import block_backward, block_forward

    torch.manual_seed(2)
    B, H, Hkv, D, W, T = 1, 16, 2, 128, 3, 128
    S = 3 * 128 * 20  # global length, striped over W=3 ranks in 128-token blocks
    blocks = torch.arange(S, device="cuda").view(-1, T)
    q_pos = blocks[1::W].reshape(-1)  # rank 1's queries
    k_pos = blocks[2::W].reshape(-1)  # rank 2's keys
    q, dout = (torch.randn(B, H, q_pos.numel(), D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, Hkv, k_pos.numel(), D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = block_forward(q, k, v, q_pos, k_pos, D**-0.5)
    dq, dk, dv = block_backward(q, k, v, out, lse, dout, q_pos, k_pos, D**-0.5)
    causal = k_pos[None, :] <= q_pos[:, None]

    def mask_rows(r0, r1):
        return causal[r0:r1]

    ref = attention_chunked_ref(q, k, v, dout, mask_rows, D**-0.5, torch.float32)
    same = attention_chunked_ref(q, k, v, dout, mask_rows, D**-0.5, torch.bfloat16)
    fin = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - ref[1][fin]).abs().max().item() < 1e-2
    err = max_abs_errors((out, dq, dk, dv), (ref[0], *ref[2:]))
    err_torch = max_abs_errors((same[0], *same[2:]), (ref[0], *ref[2:]))
    for n, e, et in zip(("out", "dq", "dk", "dv"), err, err_torch):
        assert e <= 2 * et + 1e-3, f"{n}: kernel error {e:.3e} > 2 x torch bf16 error {et:.3e}"


@pytest.mark.parametrize("D", [128, 64])
def test_gluon_column_dkdv_matches_triton_column_kernel(D):
    # the two column dk/dv kernels compute the same pairs: dk/dv agree to float32 summation-order noise (the
    # partial sums are split differently), dq is untouched, and the Gluon one is bit-identical when rerun and
    # through the autograd path (which hands it the forward's gathered rows)
    _needs_sm90()
    from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists
    from mtraining_kernels.vertical_slash import KernelConfig, block_backward, block_forward, vertical_slash_attention

    torch.manual_seed(4)
    B, H, Hkv, S = 2, 8, 2, 8191
    q, k, v, dout = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv, H))
    vi, si = _pattern(B, Hkv, S, 700, [0, 1, 2, 3000], seed=8)
    tiles = pattern_tile_lists(expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv), S, 128, 128)
    pos = torch.arange(S, device="cuda")
    out, lse = block_forward(q, k, v, pos, pos, D**-0.5, tiles=tiles)
    got = {}
    for name in ("triton", "gluon"):
        cfg = KernelConfig(dkdv_cols=name)
        got[name] = block_backward(q, k, v, out, lse, dout, pos, pos, D**-0.5, tiles=tiles, config=cfg)
    assert torch.equal(got["triton"][0], got["gluon"][0])  # dq: the same kernel
    for i, name in ((1, "dk"), (2, "dv")):
        a, b = got["triton"][i], got["gluon"][i]
        # float32 sums of up to ~64 query tiles x 128 rows in a different split: relative noise ~1e-6 of the
        # largest entry, far below a wrong or missing pair (a bf16 input element, ~1e-2 relative)
        assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item(), name
    again = block_backward(q, k, v, out, lse, dout, pos, pos, D**-0.5, tiles=tiles,
                           config=KernelConfig(dkdv_cols="gluon"))
    assert all(torch.equal(x, y) for x, y in zip(again, got["gluon"]))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    vertical_slash_attention(qg, kg, vg, tiles, scale=D**-0.5, config=KernelConfig(dkdv_cols="gluon")).backward(dout)
    for name, a, b in (("dk", kg.grad, got["gluon"][1]), ("dv", vg.grad, got["gluon"][2])):
        assert torch.equal(a, b.to(a.dtype)), f"autograd {name} differs from the direct call"


@pytest.mark.parametrize("D", [128, 64])
def test_item_orders_give_bit_identical_results(D):
    # KernelConfig(item_order=...) only changes which program runs which work item of the persistent Gluon kernels;
    # every item is computed the same way, so forward, dq, dk/dv and the columns' dk/dv are bit-identical. 7
    # programs (many waves, a partial last one, odd) and the default one per SM
    _needs_sm90()
    from mtraining_kernels.gluon_backward import gluon_block_dkdv, gluon_block_dkdv_cols, gluon_block_dq
    from mtraining_kernels.gluon_forward import gluon_block_forward
    from mtraining_kernels.indexing import expand_pattern, pattern_tile_lists

    torch.manual_seed(7)
    B, H, Hkv, S = 2, 8, 2, 8191  # ragged, GQA, batch 2, gathered columns
    q, k, v, dout = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv, H))
    vi, si = _pattern(B, Hkv, S, 700, [0, 1, 2, 40, 3000], seed=10)
    tiles = pattern_tile_lists(expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv), S, 128, 128)
    pos = torch.arange(S, device="cuda")
    scale = D**-0.5
    got = {}
    for programs in (7, None):
        for order in ("strided", "snake"):
            kw = dict(programs=programs, item_order=order)
            out, lse = gluon_block_forward(q, k, v, pos, pos, scale, tiles, **kw)
            lse2 = torch.where(torch.isinf(lse), float("inf"), lse * 1.4426950408889634).contiguous()
            delta = (dout.float() * out.float()).sum(-1).contiguous()
            a = (q, k, v, dout, lse2, delta, pos, pos, scale, tiles)
            got[programs, order] = (out, lse, gluon_block_dq(*a, **kw), *gluon_block_dkdv(*a, **kw),
                                    gluon_block_dkdv_cols(*a, 3, **kw))
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "column dk/dv"), got[programs, "strided"],
                              got[programs, "snake"]):
            assert torch.equal(x, y), f"{name} differs between item orders ({programs} programs)"
