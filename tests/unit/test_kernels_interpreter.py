"""Triton vertical-slash kernels in the Triton interpreter (CPU), against float64 dense-masked references.

The checks run in ONE subprocess with ``TRITON_INTERPRET=1`` set before triton is imported (the variable must not
leak into other test modules, which may import triton compiled), and report one result per check as JSON; each
pytest test asserts its own entry. Run this file directly to see the checks' output:
``TRITON_INTERPRET=1 python tests/unit/test_kernels_interpreter.py``.

Tolerances: the interpreter's ``tl.dot`` is exact float32 (numpy), so float32 kernels agree with a float64
reference to float32 rounding of a softmax over <= a few hundred keys: 1e-5 absolute on O(1) values is ample
(seen ~1e-6). float16 inputs: the kernel rounds P and dS to float16 before the second matmul (as on the GPU);
we hold it to twice the error of the same computation done in torch in float16 (flash-attention's rule), plus
a small floor for near-zero errors.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers.interpreter import run_interpreter_checks

pytestmark = pytest.mark.slow  # a Triton-interpreter subprocess: minutes on 2 cores

CHECKS = [
    "pattern_fp32_gqa_ragged_per_head",
    "pattern_per_group_d64",
    "pattern_empty",
    "pattern_full_equals_dense_causal",
    "dense_lists_merge_two_blocks",
    "columns_not_counted_twice",
    "fp16_d128",
    "backward_deterministic",
    "triton_block_op_matches_torch_block_op",
    "rectangular_tiles_and_dkdv_subtiles",
    "triton_list_builder_matches_torch",
    "gluon_auto_falls_back_to_triton",
    "gather_columns_kernel_matches_torch",
    "softcap_pattern_columns_and_merge",
]


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_checks(__file__, timeout=600)


@pytest.mark.parametrize("name", CHECKS)
def test_interpreter(interpreter_results, name):
    assert interpreter_results.get(name) == "ok", interpreter_results.get(name, "missing")


# ---------------------------------------------------------------------------------------------------------------
# The checks (run only in the subprocess, with TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------------------------


def _run_checks() -> dict[str, str]:
    import traceback

    import torch

    from helpers.interpreter import shim_interpreter

    shim_interpreter()
    from mtraining_kernels.indexing import COL_CHUNK, dense_tile_lists, expand_pattern, pattern_tile_lists
    from mtraining_kernels.reference import attention_ref, vertical_slash_mask
    from mtraining_kernels.testing import tile_lists_mask
    from mtraining_kernels.vertical_slash import KernelConfig, block_backward, block_forward


    def ref_grads(q, k, v, mask, scale, dout, softcap=None):
        qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        out, lse = attention_ref(qd, kd, vd, mask, scale, softcap)
        out.backward(dout.double())
        return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad

    def close(name, got, want, atol, rtol=0.0):
        got, want = got.double(), want.double()
        if not got.numel():
            return
        err = (got - want).abs().max().item()
        if not (torch.isfinite(got).all() and err <= atol + rtol * want.abs().max().item()):
            raise AssertionError(f"{name}: max abs err {err:.3e} > {atol:.1e} (+{rtol} rel)")

    def check_pattern(B, H, Hkv, S, D, T, vi, si, dtype=torch.float32, atol=1e-5, TN=None, config=None,
                      backend="torch", softcap=None, q_gain=1.0):
        q, k, v = torch.randn(B, H, S, D) * q_gain, torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
        dout = torch.randn(B, H, S, D)
        q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
        vi_h, si_h = expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv)
        tiles = pattern_tile_lists(vi_h, si_h, S, T, TN, backend=backend)
        pos = torch.arange(S)
        mask = vertical_slash_mask(vi_h, si_h, S, T, block_n=TN)
        assert torch.equal(mask, tile_lists_mask(tiles, pos, pos)), "lists != definition"
        scale = D**-0.5
        out, lse = block_forward(q, k, v, pos, pos, scale, tiles=tiles, config=config, softcap=softcap)
        r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, k, v, mask, scale, dout, softcap)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse)), "rows without keys differ"
        fin = torch.isfinite(r_lse)
        close("lse", lse[fin], r_lse[fin], atol)
        close("out", out, r_out, atol)
        dq, dk, dv = block_backward(q, k, v, out, lse, dout, pos, pos, scale, tiles=tiles, config=config,
                                    softcap=softcap)
        for n, g, r in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
            close(n, g, r, atol)
        return q, k, v, dout, mask, tiles, (out, lse, dq, dk, dv)

    def pattern_fp32_gqa_ragged_per_head():
        B, H, Hkv, S, D, T = 2, 4, 2, 150, 32, 16  # ragged: 150 = 9*16 + 6
        vi = torch.randint(0, S, (B, H, 24))
        si = torch.randint(0, S, (B, H, 5))
        si[..., 0] = 0
        # per-head budgets: pad some heads with -1
        vi[0, 1, 10:] = -1
        vi[1, 3, :] = -1
        si[1, 2, 2:] = -1
        si[0, 3, :] = -1  # no slash at all: only gathered columns (no diagonal tile either)
        check_pattern(B, H, Hkv, S, D, T, vi, si)
        check_pattern(B, H, Hkv, S, D, T, vi, si, backend="triton")  # the kernels on the Triton-built lists

    def pattern_per_group_d64():
        B, H, Hkv, S, D, T = 1, 6, 2, 97, 64, 32
        vi = torch.randint(-1, S, (B, Hkv, 9))
        si = torch.tensor([[[0, 40, -1], [3, 64, 90]]])
        check_pattern(B, H, Hkv, S, D, T, vi, si)

    def pattern_empty():
        B, H, Hkv, S, D, T = 1, 2, 1, 70, 16, 16
        vi = torch.full((B, H, 3), -1)
        si = torch.full((B, H, 2), -1)
        *_, (out, lse, dq, dk, dv) = check_pattern(B, H, Hkv, S, D, T, vi, si)
        assert torch.isneginf(lse).all() and (out == 0).all(), "empty pattern must give out 0, lse -inf"
        assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()

    def pattern_full_equals_dense_causal():
        B, H, Hkv, S, D, T = 1, 2, 1, 83, 32, 16
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        for vi, si in (
            (torch.arange(S).view(1, 1, S), torch.full((1, 1, 1), -1)),  # every key as a vertical
            (torch.full((1, 1, 1), -1), torch.arange(0, S, T).view(1, 1, -1)),  # every tile diagonal
            (torch.arange(S).view(1, 1, S), torch.arange(S).view(1, 1, S)),  # both (verticals all covered)
        ):
            _, _, _, _, mask, _, _ = check_pattern(B, H, Hkv, S, D, T, vi, si)
            assert torch.equal(mask[0, 0], causal), "a covering pattern must be dense causal"

    def dense_lists_merge_two_blocks():
        # ring-like: queries at striped global positions against two K/V chunks of other lengths/positions
        B, H, Hkv, D = 2, 3, 1, 32
        q_pos = torch.tensor([i for i in range(200) if (i // 16) % 3 == 1])[:37]
        k_pos1 = torch.tensor([i for i in range(20, 200) if (i // 16) % 3 == 0])[:45]  # queries 16..19 see nothing
        k_pos2 = torch.tensor([i for i in range(200) if (i // 16) % 3 == 2])[:29]
        q = torch.randn(B, H, len(q_pos), D)
        k1, v1 = torch.randn(B, Hkv, len(k_pos1), D), torch.randn(B, Hkv, len(k_pos1), D)
        k2, v2 = torch.randn(B, Hkv, len(k_pos2), D), torch.randn(B, Hkv, len(k_pos2), D)
        dout = torch.randn_like(q)
        scale = 0.3
        t1, t2 = dense_tile_lists(q_pos, k_pos1, 16, 16), dense_tile_lists(q_pos, k_pos2, 16, 32)
        out, lse = block_forward(q, k1, v1, q_pos, k_pos1, scale, tiles=t1)
        out, lse = block_forward(q, k2, v2, q_pos, k_pos2, scale, tiles=t2, out=out, lse=lse)
        out0, _ = block_forward(q, k1, v1, q_pos, k_pos1, scale)  # tiles=None: dense by positions
        kc, vc, kp = torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), torch.cat([k_pos1, k_pos2])
        mask = kp[None, :] <= q_pos[:, None]
        r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, kc, vc, mask, scale, dout)
        fin = torch.isfinite(r_lse)
        assert (~fin).any() and torch.equal(torch.isneginf(lse), ~fin), "rows with no key must have lse -inf"
        close("merged out", out, r_out, 1e-5)
        close("merged lse", lse[fin], r_lse[fin], 1e-5)
        r_out1, _ = attention_ref(q.double(), k1.double(), v1.double(), k_pos1[None, :] <= q_pos[:, None], scale)
        close("dense tiles=None", out0, r_out1, 1e-5)
        dq1, dk1, dv1 = block_backward(q, k1, v1, out, lse, dout, q_pos, k_pos1, scale, tiles=t1)
        dq2, dk2, dv2 = block_backward(q, k2, v2, out, lse, dout, q_pos, k_pos2, scale, tiles=t2)
        close("dq", dq1 + dq2, r_dq, 1e-5)
        close("dk", torch.cat([dk1, dk2], 2), r_dk, 1e-5)
        close("dv", torch.cat([dv1, dv2], 2), r_dv, 1e-5)

    def columns_not_counted_twice():
        # verticals inside computed tiles (the local window) must not be gathered again
        S, T = 128, 16
        vi = torch.arange(0, S, 3).view(1, 1, -1)
        si = torch.tensor([[[0, 20]]])
        tiles = pattern_tile_lists(vi, si, S, T)
        Mq = tiles.num_q_tiles
        bits = (tiles.col_bits[..., None] >> torch.arange(COL_CHUNK)) & 1
        bits = bits.reshape(Mq, -1).bool()
        cols = tiles.col_idx.reshape(-1).long()
        for m in range(Mq):
            live = set(tiles.fwd_idx[0, 0, m, : tiles.fwd_cnt[0, 0, m]].tolist())
            gathered = cols[bits[m]]
            assert not any(int(c) // T in live for c in gathered), f"tile {m} gathers a covered column"
            assert len(set(gathered.tolist())) == len(gathered), "duplicate gathered column"
        check_pattern(1, 2, 1, S, 32, T, vi, si)

    def fp16_d128():
        B, H, Hkv, S, D, T = 1, 2, 1, 90, 128, 32
        vi = torch.randint(0, S, (B, Hkv, 7))
        si = torch.tensor([[[0, 33]]])
        q, k, v = (torch.randn(B, h, S, D) for h in (H, Hkv, Hkv))
        dout = torch.randn(B, H, S, D)
        vi_h, si_h = expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv)
        tiles = pattern_tile_lists(vi_h, si_h, S, T)
        mask = vertical_slash_mask(vi_h, si_h, S, T)
        pos = torch.arange(S)
        scale = D**-0.5
        h16 = [t.half() for t in (q, k, v, dout)]
        out, lse = block_forward(*h16[:3], pos, pos, scale, tiles=tiles)
        grads = block_backward(*h16[:3], out, lse, h16[3], pos, pos, scale, tiles=tiles)
        ref = ref_grads(*h16[:3], mask, scale, h16[3])  # float64 of the float16-rounded inputs
        # torch in float32 on float16 inputs with float16 outputs/grads: the "same precision" computation
        qt, kt, vt = (t.float().requires_grad_(True) for t in h16[:3])
        o_t, _ = attention_ref(qt, kt, vt, mask, scale)
        o_t.half().float().backward(h16[3].float())
        torch_res = [o_t.detach().half(), qt.grad.half(), kt.grad.half(), vt.grad.half()]
        for n, got, want, tor in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:]), torch_res):
            tol = 2 * (tor.double() - want).abs().max().item() + 2e-3
            close(f"fp16 {n}", got, want, tol)
        # grad_dtype: the kernels write float16 gradients straight from their float32 accumulators (with columns:
        # dk/dv after the float32 column adds), which must be bit-identical to the float32 result cast afterwards
        empty = pattern_tile_lists(vi_h[..., :0], si_h, S, T)  # no verticals: dk/dv written in float16 directly
        for tl_ in (tiles, empty):
            g32 = block_backward(*h16[:3], out, lse, h16[3], pos, pos, scale, tiles=tl_)
            g16 = block_backward(*h16[:3], out, lse, h16[3], pos, pos, scale, tiles=tl_, grad_dtype=torch.float16)
            for n, a, b in zip(("dq", "dk", "dv"), g16, g32):
                assert a.dtype == torch.float16 and torch.equal(a, b.half()), f"grad_dtype {n}"

    def backward_deterministic():
        B, H, Hkv, S, D, T = 1, 4, 1, 64, 16, 16
        vi = torch.randint(0, S, (B, H, 20))
        si = torch.tensor([[[0], [16], [0], [40]]])
        q, k, v, dout, mask, tiles, (out, lse, dq, dk, dv) = check_pattern(B, H, Hkv, S, D, T, vi, si)
        pos = torch.arange(S)
        for _ in range(2):
            again = block_backward(q, k, v, out, lse, dout, pos, pos, D**-0.5, tiles=tiles)
            assert all(torch.equal(a, b) for a, b in zip(again, (dq, dk, dv))), "backward not bit-identical"

    def triton_block_op_matches_torch_block_op():
        # the ring's op protocol (lightning_mtraining.ring.block_ops): same outputs, dtypes and gradients
        from lightning_mtraining.ring.block_ops import TorchBlockOp
        from mtraining_kernels.vertical_slash import TritonBlockOp

        B, H, Hkv, D = 1, 4, 2, 32
        q_pos = torch.arange(40, 95)
        k_pos = torch.arange(0, 81)
        q = torch.randn(B, H, len(q_pos), D)
        k, v = torch.randn(B, Hkv, len(k_pos), D), torch.randn(B, Hkv, len(k_pos), D)
        dout = torch.randn_like(q)
        tri, ref = TritonBlockOp(16, 16), TorchBlockOp()
        assert tri.supports_softcap and not getattr(tri, "supports_window", False)
        for kw in ({}, {"softcap": 1.5}):  # the protocol's softcap= keyword (scores ~ N(0, 2.6): capped hard)
            (o1, l1), (o2, l2) = tri.forward(q, k, v, q_pos, k_pos, 0.2, **kw), ref.forward(q, k, v, q_pos, k_pos,
                                                                                             0.2, **kw)
            assert o1.dtype == o2.dtype and l1.dtype == l2.dtype == torch.float32
            close(f"op out {kw}", o1, o2, 1e-5)
            close(f"op lse {kw}", l1, l2, 1e-5)
            g1 = tri.backward(q, k, v, o2, l2, dout, q_pos, k_pos, 0.2, **kw)
            g2 = ref.backward(q, k, v, o2, l2, dout, q_pos, k_pos, 0.2, **kw)
            for n, a, b in zip(("dq", "dk", "dv"), g1, g2):
                assert a.dtype == b.dtype == torch.float32, n
                close(f"op {n} {kw}", a, b, 1e-5)
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            o3 = tri.differentiable(qg, kg, vg, q_pos, k_pos, 0.2, **kw)
            o3.backward(dout)
            close(f"differentiable out {kw}", o3.detach(), o2, 1e-5)
            for n, a, b in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), g2):
                close(f"differentiable {n} {kw}", a, b, 1e-5)

    def rectangular_tiles_and_dkdv_subtiles():
        # 32 x 16 and 64 x 16 tiles (block_m = r * block_n), the dk/dv kernels walking query tiles in 16-row steps
        B, H, Hkv, S, D = 1, 4, 2, 150, 16
        vi = torch.randint(-1, S, (B, H, 12))
        si = torch.tensor([[[0, 17, -1], [5, 40, 100], [-1, -1, -1], [33, 0, 1]]])
        for cfg in (None, KernelConfig(sub_m=16, fwd_stages=1, bwd_stages=1)):
            check_pattern(B, H, Hkv, S, D, 32, vi, si, TN=16, config=cfg)
            check_pattern(B, H, Hkv, S, D, 64, vi, si, TN=16, config=cfg)
        # square 32 x 32 tiles walked in 16-row and 16-key steps (forward, dq and dk/dv kernels), and the column
        # dk/dv kernel splitting each chunk's query-tile range into parts (3 parts of <= 5 tiles: uneven, some
        # parts empty), walking it 16 rows at a time (col_sub_m) or whole
        check_pattern(B, H, Hkv, S, D, 32, vi, si, config=KernelConfig(sub_m=16, sub_n=16, col_split=3))
        check_pattern(B, H, Hkv, S, D, 32, vi, si, config=KernelConfig(col_sub_m=16, col_split=2))
        check_pattern(B, H, Hkv, S, D, 16, vi, si, config=KernelConfig(col_split=4))
        check_pattern(B, H, Hkv, S, D, 16, vi, si, config=KernelConfig(col_split=20))  # more parts than tiles
        # forward / dq programs of 16 rows on 32- and 64-row query tiles (slices of a ragged last tile past Sq),
        # in both launch orders
        check_pattern(B, H, Hkv, S, D, 32, vi, si, config=KernelConfig(q_rows=16, heavy_first=False))
        check_pattern(B, H, Hkv, S, D, 64, vi, si, TN=16, config=KernelConfig(q_rows=16, dq_warps=2))
        # many columns (3 chunks of 64 slots: odd) taken 64, 128 and 256 slots at a time in every kernel;
        # the second head has fewer columns (a chunk of pure padding) and no slash
        vi2 = torch.randint(0, 300, (1, 2, 280))
        vi2[0, 1, 100:] = -1
        si2 = torch.tensor([[[0, 70], [-1, -1]]])
        for cb in (64, 128, 256):
            check_pattern(1, 2, 1, 300, 16, 32, vi2, si2, config=KernelConfig(col_step=cb, col_block=cb, col_split=2))

    def triton_list_builder_matches_torch():
        # list_builder's five kernels against the torch builder: every valid list entry, count and column bit
        # equal (integers: exact), over ragged lengths, square and BM = r * BN tiles, padding (< 0), out-of-range
        # values (>= S, ignored), duplicates, empty patterns, and lists longer than one kernel chunk (L > 64
        # offsets, > 1024 tile offsets, > 1024 verticals)
        g = torch.Generator().manual_seed(1)
        cases = [(1000, 64, 64, 2, 3, 70, 9), (333, 32, 16, 1, 3, 0, 5), (517, 64, 16, 2, 2, 200, 40),
                 (64, 64, 64, 1, 2, 7, 0), (1, 16, 16, 1, 1, 3, 2), (700, 128, 32, 1, 2, 0, 0),
                 (4100, 16, 16, 1, 2, 300, 200), (20000, 32, 16, 1, 1, 1500, 300)]
        for S, BM, BN, B, H, nv, ns in cases:
            vi = torch.randint(-3, S + 2, (B, H, nv), generator=g)
            si = torch.randint(-3, S + 2, (B, H, ns), generator=g)
            if ns:
                si[..., 0] = 0
            if nv > 4:
                vi[..., 1] = vi[..., 2]
            a = pattern_tile_lists(vi, si, S, BM, BN, backend="torch")
            b = pattern_tile_lists(vi.int(), si, S, BM, BN, backend="triton")
            where = f"S={S} {BM}x{BN} nv={nv} ns={ns}"
            for n in ("fwd_idx", "fwd_cnt", "fwd_nmask", "bwd_cnt", "bwd_nmask", "col_idx", "col_bits"):
                x, y = getattr(a, n), getattr(b, n)
                assert (x is None) == (y is None), f"{where}: {n} present in one builder only"
                assert x is None or (x.shape == y.shape and torch.equal(x, y)), f"{where}: {n} differs"
            valid = torch.arange(a.bwd_idx.shape[-1]) < a.bwd_cnt[..., None]  # padding beyond the count: unused
            assert a.bwd_idx.shape == b.bwd_idx.shape, where
            assert torch.equal(a.bwd_idx[valid], b.bwd_idx[valid]), f"{where}: bwd_idx differs"

    def gluon_auto_falls_back_to_triton():
        # KernelConfig(forward/dq/dkdv='auto') off Hopper (here: CPU): the Triton kernels, bit for bit the results
        # of forward/dq/dkdv='triton' (the explicit choice: 'auto' is also the default), and right against the
        # reference
        q, k, v, dout = torch.randn(1, 2, 200, 16), torch.randn(1, 1, 200, 16), torch.randn(1, 1, 200, 16), \
            torch.randn(1, 2, 200, 16)
        pos = torch.arange(200)
        kw = dict(block_m=128, block_n=128)
        auto = KernelConfig(forward="auto", dq="auto", dkdv="auto")
        triton_only = KernelConfig(forward="triton", dq="triton", dkdv="triton")
        out, lse = block_forward(q, k, v, pos, pos, 0.25, config=auto, **kw)
        ref_out, ref_lse = block_forward(q, k, v, pos, pos, 0.25, config=triton_only, **kw)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        close("auto out", out, attention_ref(q, k, v, tile_lists_mask(dense_tile_lists(pos, pos, 128, 128), pos,
                                                                      pos), 0.25)[0], 1e-5)  # fp32 vs fp32
        got = block_backward(q, k, v, out, lse, dout, pos, pos, 0.25, config=auto, **kw)
        want = block_backward(q, k, v, out, lse, dout, pos, pos, 0.25, config=triton_only, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want))

    def gather_columns_kernel_matches_torch():
        # The Gluon path's one-launch column gather (a plain Triton kernel) against its torch version (itself
        # checked against direct indexing in test_gluon_kernels.py): a copy, so exact. GQA, ragged budgets per
        # KV group, broadcast lists over the batch (B' = 1 < B), global key positions that are not 0..S-1, and
        # NC not a multiple of the 128-row block (past-the-end slots) nor of the 32-slot program block.
        from mtraining_kernels.gluon_common import gather_columns

        g = torch.Generator().manual_seed(3)
        for B, H, Hkv, S, nv, D in [(2, 6, 3, 1000, 40, 16), (1, 4, 1, 777, 150, 32), (3, 2, 2, 300, 7, 16)]:
            vi = torch.randint(0, S, (1, Hkv, nv), generator=g)
            vi[:, 1:, -5:] = -1
            si = torch.tensor([0, 3, 257]).expand(1, Hkv, -1).clone()
            tiles = pattern_tile_lists(expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv), S, 128, 128)
            k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
            k_pos = torch.arange(S, dtype=torch.int32) * 3 + 5
            got = gather_columns(k, v, k_pos, tiles, H, use_kernel=True)
            want = gather_columns(k, v, k_pos, tiles, H, use_kernel=False)
            for n, a, b in zip(("kc", "vc", "cpos", "steps"), got, want):
                assert a.shape == b.shape and torch.equal(a, b), f"B={B} H={H}/{Hkv} S={S} nv={nv}: {n} differs"

    def softcap_pattern_columns_and_merge():
        # Gemma 2-style soft-cap in every kernel: scores ~ N(0, 9) (q x 3) against caps of 2 and 5, so most scores
        # are bent by the tanh; tiles, gathered columns (with a split column dk/dv), 16-row sub-steps, and two
        # blocks merged by lse, all against a float64 reference with the same cap; 1e-5 as for uncapped float32
        B, H, Hkv, S, D = 1, 4, 2, 150, 16
        vi = torch.randint(-1, S, (B, H, 12))
        si = torch.tensor([[[0, 17, -1], [5, 40, 100], [-1, -1, -1], [33, 0, 1]]])
        for cap in (2.0, 5.0):
            check_pattern(B, H, Hkv, S, D, 16, vi, si, softcap=cap, q_gain=3.0)
            check_pattern(B, H, Hkv, S, D, 32, vi, si, TN=16, softcap=cap, q_gain=3.0,
                          config=KernelConfig(sub_m=16, col_split=3))
        q_pos = torch.arange(0, 90, 2)
        k1, k2 = torch.arange(1, 90, 2), torch.arange(0, 90, 2)  # odd and even keys: two ring blocks
        q = torch.randn(1, 2, len(q_pos), 16) * 3
        kk = [torch.randn(1, 1, len(p), 16) for p in (k1, k2)]
        vv = [torch.randn(1, 1, len(p), 16) for p in (k1, k2)]
        dout = torch.randn_like(q)
        t1, t2 = dense_tile_lists(q_pos, k1, 16, 16), dense_tile_lists(q_pos, k2, 16, 16)
        out, lse = block_forward(q, kk[0], vv[0], q_pos, k1, 0.25, tiles=t1, softcap=3.0)
        out, lse = block_forward(q, kk[1], vv[1], q_pos, k2, 0.25, tiles=t2, out=out, lse=lse, softcap=3.0)
        kp = torch.cat([k1, k2])
        r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, torch.cat(kk, 2), torch.cat(vv, 2),
                                                   kp[None, :] <= q_pos[:, None], 0.25, dout, 3.0)
        close("capped merged out", out, r_out, 1e-5)
        close("capped merged lse", lse, r_lse, 1e-5)
        g1 = block_backward(q, kk[0], vv[0], out, lse, dout, q_pos, k1, 0.25, tiles=t1, softcap=3.0)
        g2 = block_backward(q, kk[1], vv[1], out, lse, dout, q_pos, k2, 0.25, tiles=t2, softcap=3.0)
        close("capped dq", g1[0] + g2[0], r_dq, 1e-5)
        close("capped dk", torch.cat([g1[1], g2[1]], 2), r_dk, 1e-5)
        close("capped dv", torch.cat([g1[2], g2[2]], 2), r_dv, 1e-5)
        # the cap changes the result (the check above would not notice a kernel that ignored it otherwise)
        plain, _ = block_forward(q, kk[0], vv[0], q_pos, k1, 0.25, tiles=t1)
        capped, _ = block_forward(q, kk[0], vv[0], q_pos, k1, 0.25, tiles=t1, softcap=3.0)
        assert (plain - capped).abs().max() > 1e-2, "softcap=3 on N(0, 9)-scale scores must change the output"
        for bad in (0.0, -1.0, True):
            try:
                block_forward(q, kk[0], vv[0], q_pos, k1, 0.25, tiles=t1, softcap=bad)
            except ValueError as e:
                assert "softcap must be a positive float" in str(e)
            else:
                raise AssertionError(f"softcap={bad!r} was accepted")

    results = {}
    only = os.environ.get("MT_CHECKS")  # comma-separated subset, for a quick local run
    for name in (only.split(",") if only else CHECKS):
        torch.manual_seed(0)
        try:
            locals()[name]()
            results[name] = "ok"
        except Exception:  # report, do not stop: each check has its own pytest test
            results[name] = traceback.format_exc(limit=4)
        print(name, "ok" if results[name] == "ok" else results[name], flush=True)
    return results


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    res = _run_checks()
    if "--json" in sys.argv:
        print("RESULTS " + json.dumps(res))
    sys.exit(0 if all(r == "ok" for r in res.values()) else 1)
