"""The Gluon (warp-specialised Hopper) forward, dq and dk/dv kernels, on CPU: the column gather they feed TMA
with, the dispatch rules of ``KernelConfig.forward`` / ``.dq`` / ``.dkdv``, and an offline sm_90 compile of the
kernels (no GPU needed: Triton's ptxas compiles for a target given by hand). Their numbers on the GPU are checked in
``tests/gpu/test_kernels_gpu.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mtraining_kernels.indexing import COL_CHUNK, expand_pattern, pattern_tile_lists
from mtraining_kernels.vertical_slash import KernelConfig, block_backward, block_forward

gluon_common = pytest.importorskip("mtraining_kernels.gluon_common")
from mtraining_kernels import gluon_backward  # noqa: E402

needs_gluon = pytest.mark.skipif(not gluon_common.HAS_GLUON, reason="this Triton has no Gluon")


def _tiles(B, H, Hkv, S, seed):
    g = torch.Generator().manual_seed(seed)
    vi = torch.randint(0, S, (B, Hkv, 40), generator=g)
    vi[:, 1:, -5:] = -1  # ragged budgets per KV group
    si = torch.tensor([0, 3, 257]).expand(B, Hkv, -1).clone()
    return pattern_tile_lists(expand_pattern(vi, H, Hkv), expand_pattern(si, H, Hkv), S, 128, 128)


@pytest.mark.parametrize("B,H,Hkv,S", [(2, 6, 3, 1000), (1, 4, 1, 777)])
def test_gather_columns_copies_the_selected_keys(B, H, Hkv, S):
    D = 16
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    k_pos = torch.arange(S, dtype=torch.int32) * 3 + 5  # any global positions: the gather must copy them
    tiles = _tiles(B, H, Hkv, S, seed=S)
    kc, vc, cpos, steps = gluon_common.gather_columns(k, v, k_pos, tiles, H)
    ci = tiles.col_idx.long().expand(B, H, -1)
    NC = ci.shape[-1]
    assert kc.shape == (B, H, kc.shape[2], D) and kc.shape[2] % 128 == 0 and kc.shape[2] >= NC
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)  # GQA: the KV head of query head h
            assert torch.equal(kc[b, h, :NC], k[b, g, ci[b, h]])
            assert torch.equal(vc[b, h, :NC], v[b, g, ci[b, h]])
            assert torch.equal(cpos[b, h, :NC], k_pos[ci[b, h]])
    assert (kc[:, :, NC:] == 0).all() and (vc[:, :, NC:] == 0).all()
    assert (cpos[:, :, NC:] == gluon_common.POS_MAX_INT).all()  # padding slots: never visible to any query
    # steps: 128-column chunks a query tile walks = up to (and including) the chunk of its last set bit word
    bits = tiles.col_bits.expand(B, H, -1, -1)
    for b in range(B):
        for h in range(H):
            for t in range(bits.shape[2]):
                nz = torch.nonzero(bits[b, h, t]).flatten()
                want = 0 if nz.numel() == 0 else (int(nz[-1]) * COL_CHUNK) // 128 + 1
                assert int(steps[b, h, t]) == want, (b, h, t)


def test_kernel_config_kernel_choices_are_validated():
    with pytest.raises(ValueError, match="forward='cuda'"):
        KernelConfig(forward="cuda")
    with pytest.raises(ValueError, match="dq='fast'"):
        KernelConfig(dq="fast")
    with pytest.raises(ValueError, match="dkdv='cuda'"):
        KernelConfig(dkdv="cuda")
    with pytest.raises(ValueError, match="dkdv_cols='gpu'"):
        KernelConfig(dkdv_cols="gpu")
    with pytest.raises(ValueError, match="item_order='random'"):
        KernelConfig(item_order="random")


def test_item_order_auto_snakes_only_the_dk_dv_kernel():
    # on an H200 the snake order made the dk/dv kernel 5% faster and dq 6-8% slower at 128K
    # (benchmarks/journal/kernels-2026-12-04.md, "snake item order for dk/dv"), so "auto" (the default) takes it
    # for dk/dv only; an explicit order applies to all four kernels
    kernels = ("forward", "dq", "dkdv", "dkdv_cols")
    assert [KernelConfig().order_of(n) for n in kernels] == ["strided", "strided", "snake", "strided"]
    for order in ("snake", "strided"):
        assert {KernelConfig(item_order=order).order_of(n) for n in kernels} == {order}
    with pytest.raises(ValueError, match="kernel='fwd'"):
        KernelConfig().order_of("fwd")


def _items(total: int, pid: int, nprog: int, snake: bool) -> list[int]:
    """The work items program ``pid`` runs: a mirror of ``gluon_common._n_items`` / ``_item`` (Gluon functions
    cannot run on a CPU; tests/gpu/test_kernels_gpu.py checks the kernels themselves give identical results)."""
    if not snake:
        return list(range(pid, total, nprog))
    full = total // nprog
    slot = pid + (full % 2) * (nprog - 1 - 2 * pid)
    n = full + int(slot < total % nprog)
    return [i * nprog + pid + (i % 2) * (nprog - 1 - 2 * pid) for i in range(n)]


@pytest.mark.parametrize("snake", [True, False])
def test_persistent_item_orders_run_every_item_once(snake):
    for total in [*range(1, 70), 2048, 16384]:
        for nprog in (1, 2, 3, 7, 132):
            got = sorted(w for p in range(min(nprog, total)) for w in _items(total, p, nprog, snake))
            assert got == list(range(total)), (total, nprog)


def test_snake_order_levels_the_dk_dv_programs():
    # the dk/dv kernel's items (key tile ascending, then KV head) carry every query head's query tiles of the key
    # tile: under causality the first are the heaviest. With 132 programs the strided order gives one program the
    # heaviest item of every wave; the snake order pairs it with the next wave's lightest
    S, H, Hkv, P = 65536, 16, 2, 132
    g = torch.Generator().manual_seed(0)
    M = S // 128
    si = torch.cat([torch.arange(256), (5 + torch.randperm(M - 5, generator=g)[:100]) * 128])[None, None]
    vi = torch.arange(64)[None, None]
    tiles = pattern_tile_lists(expand_pattern(vi.expand(1, Hkv, -1), H, Hkv),
                               expand_pattern(si.expand(1, Hkv, -1), H, Hkv), S, 128, 128)
    steps = tiles.bwd_cnt[0].view(Hkv, H // Hkv, -1).sum(1)  # [Hkv, key tiles]: query tiles per item
    weight = steps.t().reshape(-1).tolist()  # item w = key tile w // Hkv, KV head w % Hkv
    spread = {}
    for snake in (False, True):
        loads = [sum(weight[w] for w in _items(len(weight), p, P, snake)) for p in range(P)]
        spread[snake] = max(loads) / (sum(loads) / P)
    assert spread[False] > 1.04 and spread[True] < 1.01, spread


@pytest.mark.parametrize("B,H,Hkv,S", [(2, 6, 3, 1000), (1, 4, 1, 777), (1, 2, 2, 5000)])
def test_column_query_lists_hold_the_tiles_that_select_a_chunk_pair(B, H, Hkv, S):
    # the Gluon column dk/dv kernel walks, per 128-slot chunk pair of a head's gathered columns, exactly the query
    # tiles with a bit in either 64-slot word, ascending; padding entries follow the valid ones
    tiles = _tiles(B, H, Hkv, S, seed=S + 1)
    bits = tiles.col_bits
    J = bits.shape[-1]
    n_pairs = -(-J // 2)
    lists, counts = gluon_backward.column_query_lists(tiles, n_pairs)
    assert lists.dtype == counts.dtype == torch.int32
    assert lists.is_contiguous()  # the kernel reads each list with unit stride
    assert lists.shape == (*bits.shape[:2], n_pairs, bits.shape[2]) and counts.shape == lists.shape[:3]
    for b in range(bits.shape[0]):
        for h in range(bits.shape[1]):
            for p in range(n_pairs):
                words = bits[b, h, :, 2 * p:2 * p + 2]
                want = torch.nonzero((words != 0).any(-1)).flatten().to(torch.int32)
                assert int(counts[b, h, p]) == want.numel()
                assert torch.equal(lists[b, h, p, :want.numel()], want), (b, h, p)
    assert int(counts.sum()) > 0  # the pattern does select columns


def test_gluon_where_it_cannot_run_says_why():
    # CPU tensors: no sm_90 device, so 'gluon' must refuse with the reason (before anything is launched)
    B, H, Hkv, S, D = 1, 2, 1, 200, 16
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    pos = torch.arange(S)
    assert not gluon_common.gluon_supported(q)
    with pytest.raises(ValueError, match="forward='gluon'.*needs an sm_90 GPU"):
        block_forward(q, k, v, pos, pos, 0.25, block_m=128, block_n=128, config=KernelConfig(forward="gluon"))
    with pytest.raises(ValueError, match="dq='gluon'.*needs an sm_90 GPU"):
        block_backward(q, k, v, q, torch.zeros(B, H, S), q, pos, pos, 0.25, block_m=128, block_n=128,
                       config=KernelConfig(dq="gluon"))
    with pytest.raises(ValueError, match="dkdv='gluon'.*needs an sm_90 GPU"):
        block_backward(q, k, v, q, torch.zeros(B, H, S), q, pos, pos, 0.25, block_m=128, block_n=128,
                       config=KernelConfig(dkdv="gluon"))
    tiles = pattern_tile_lists(torch.tensor([[[0, 150]]]), torch.tensor([[[0]]]), S, 128, 128)
    assert tiles.col_idx is not None  # the columns' kernel is chosen only when there are columns
    with pytest.raises(ValueError, match="dkdv_cols='gluon'.*needs an sm_90 GPU"):
        block_backward(q, k, v, q, torch.zeros(B, H, S), q, pos, pos, 0.25, tiles=tiles,
                       config=KernelConfig(dkdv_cols="gluon"))


@needs_gluon
@pytest.mark.slow
@pytest.mark.parametrize("kernel,head_dim,has_cols,has_prev",
                         [("forward", 128, True, True), ("forward", 64, False, False), ("dq", 128, True, False),
                          ("dq", 64, False, False), ("dkdv", 128, True, False), ("dkdv", 64, True, False),
                          ("dkdv_cols", 128, True, False), ("dkdv_cols", 64, True, False)])
def test_offline_sm90_compile_fits_the_budget(kernel, head_dim, has_cols, has_prev):
    # The compile runs in a subprocess: the offline target replaces Triton's driver for the whole process.
    code = (
        "import json, sys\n"
        "from mtraining_kernels.testing import gluon as g\n"
        "g.install_offline_sm90_target()\n"
        f"print(json.dumps(g.compile_report({head_dim}, {has_cols}, {has_prev}, kernel={kernel!r})))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    # warp specialisation: the producer gives its registers to the two consumer warpgroups (24 / 240 per thread)
    assert 24 in rep["setmaxnreg"] and 240 in rep["setmaxnreg"], rep
    assert rep["wgmma"] > 0, rep  # tensor cores through wgmma, not mma.sync
    assert rep["shared"] <= 232448, rep  # sm_90's 227 KB of shared memory per block
    # a few bytes of stack are ptxas's call frame or a spilled register or two (dk/dv: 24 B); the 184-296 bytes
    # seen before the forward's key positions moved to shared memory were spills on the critical path
    assert rep["stack"] is not None and rep["stack"] <= 64, rep
    # every wgmma waited for as soon as it is issued: what ptxas does when an in-flight accumulator is copied or
    # the registers run out (the D=128 dq kernel was so until fixed, which made it 7.6% faster at 128K/20% on an
    # H200: benchmarks/journal/kernels-2026-12-04.md, "dq no longer serialised")
    assert rep["wgmma_serialized"] is None, rep
