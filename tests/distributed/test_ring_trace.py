"""Ring instrumentation (``ring_trace.py``, ``trace_callback.py``) on 4 gloo processes, one launch for every case.

What is compared with what:
- enabled vs disabled: out, dq, dk, dv bit for bit (``torch.equal``): the trace only reads clocks and sizes, so
  not even the summation order may change; and the same number of torch ops (a ``TorchDispatchMode`` count).
- disabled: the host clock and the CUDA event factory, patched to count, are never called.
- enabled: exactly two clock reads per timed span (one span per step's block op, per transfer wait and per
  all-reduce), and the bytes per level equal the K/V messages the schedule sends (Note [Ring schedule] in
  ``ring.py``): forward ``Wo (Wi - 1)`` inner and ``Wo - 1`` outer K/V chunks; backward the same K/V plus
  ``Wo Wi`` inner dK/dV (when Wi > 1) and ``Wo`` outer dK/dV (when Wo > 1) in the accumulation dtype; the sparse
  ring's gathered verticals one all-reduce of ``[2, B, Hkv, NV, D]`` each way.
- the callback: a real ``Trainer`` on each rank logs the summary keys.
Cases: hierarchical 2 x 2 (dense and sparse) on all 4 ranks, and a flat ring of 3 ranks (odd W; dense and sparse)
on ranks 0-2. Tiny shapes: the trace's arithmetic does not depend on size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.dist import hierarchical_groups, run_distributed
from lightning_mtraining import ring_attention, ring_trace, shard_sequence
from lightning_mtraining.ring.block_ops import TorchBlockOp
from lightning_mtraining.ring.trace import RingTrace
from lightning_mtraining.sparsity.pattern import VerticalSlashPattern

B, H, HKV, D, T = 1, 4, 2, 8, 16
DT = torch.float32


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, H, n, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, HKV, n, D, generator=g) for _ in range(2))
    vert = torch.tensor([[[0, 3, n - 5], [1, 2 * T + 1, -1]]]).expand(B, HKV, 3)  # per KV group, one padded
    slash = torch.tensor([[[0, 1, T + 2], [0, 2 * T, -1]]]).expand(B, HKV, 3)
    return q, k, v, do, VerticalSlashPattern(vert.contiguous(), slash.contiguous(), tile_size=T)


def _run(rank, w, groups, sparse, seed):
    n = 3 * w * T
    q, k, v, do, pattern = _inputs(n, seed)
    sh = lambda x: shard_sequence(x, 2, rank, w, "striped", T).to(DT)  # noqa: E731
    ql, kl, vl = (sh(t).requires_grad_(True) for t in (q, k, v))
    counter = _CountOps()
    with counter:
        out = ring_attention(ql, kl, vl, layout="striped", block_size=T, sparsity=pattern if sparse else None,
                             op=TorchBlockOp(), **groups)
        out.backward(sh(do))
    nv = int(torch.unique(pattern.vertical_idx[(pattern.vertical_idx >= 0) & (pattern.vertical_idx < n)]).numel())
    return [t.detach().clone() for t in (out, ql.grad, kl.grad, vl.grad)], counter.n, nv, n // w


def _expected_bytes(wo: int, wi: int, s: int, nv: int, sparse: bool) -> dict:
    kv = 2 * B * HKV * s * D * DT.itemsize
    dkv = 2 * B * HKV * s * D * torch.float32.itemsize  # acc_dtype(float32)
    col = 2 * B * HKV * nv * D * DT.itemsize if sparse else 0
    fwd = {"inner": wo * (wi - 1) * kv, "outer": (wo - 1) * kv, "collective": col}
    bwd = {"inner": wo * (wi - 1) * kv + (wo * wi * dkv if wi > 1 else 0),
           "outer": (wo - 1) * kv + (wo * dkv if wo > 1 else 0), "collective": col}
    # number of waits: one per transfer posted (K/V and dK/dV), plus the all-reduces
    waits = {"fwd": wo * (wi - 1) + (wo - 1) + (1 if sparse else 0),
             "bwd": (wo * (wi - 1) + (wo * wi if wi > 1 else 0) + (wo - 1) + (wo if wo > 1 else 0)
                     + (1 if sparse else 0))}
    return {"fwd": fwd, "bwd": bwd, "waits": waits}


class _Logger:
    """A Lightning logger that keeps what it is given."""

    def __init__(self) -> None:
        from lightning.pytorch.loggers import Logger

        class Mem(Logger):
            name, version = "mem", 0
            metrics: list = []

            def log_metrics(self, metrics, step=None):
                self.metrics.append(dict(metrics))

            def log_hyperparams(self, params, *args, **kwargs):
                pass

        self.logger = Mem()


def _callback_case(rank, w):
    import lightning as L

    from lightning_mtraining import RingTraceCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(D, D)

        def training_step(self, batch, idx):
            q, k, v = (shard_sequence(t, 2, rank, w, "striped", T) for t in batch)
            out = ring_attention(self.proj(q), k, v, layout="striped", block_size=T, op=TorchBlockOp())
            return out.square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    n = 2 * w * T
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(B, H, n, D, generator=g)[0], torch.randn(B, HKV, n, D, generator=g)[0],
             torch.randn(B, HKV, n, D, generator=g)[0]) for _ in range(2)]
    mem = _Logger().logger
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=mem, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[RingTraceCallback(log_every_n_steps=1)])
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=1))
    return [sorted(m) for m in mem.metrics]


def worker(rank, w):
    inner, outer = hierarchical_groups(rank, w, 2)
    sub = dist.new_group([0, 1, 2])  # every rank creates it; ranks 0-2 run the flat W = 3 cases
    cases = [("hier2x2", dict(group=dist.group.WORLD, inner_group=inner, outer_group=outer), 4, 2, 2)]
    if rank < 3:
        cases.append(("flat3", dict(group=sub), 3, 1, 3))
    calls = {"clock": 0, "event": 0}

    def counting_clock():
        calls["clock"] += 1
        return float(calls["clock"])

    def counting_event():
        calls["event"] += 1
        raise AssertionError("a CUDA event was created in a CPU run")

    ring_trace._host_clock, ring_trace._cuda_event = counting_clock, counting_event
    results = {}
    for name, groups, ww, wo, wi in cases:
        r = rank if ww == w else dist.get_rank(sub)
        for sparse in (False, True):
            seed = 7 + sparse
            _run(r, ww, groups, sparse, seed)  # warm-up: the first call fills caches (positions, skips) with ops
            calls["clock"] = 0
            off, ops_off, nv, s = _run(r, ww, groups, sparse, seed)
            clock_off = calls["clock"]
            trace = RingTrace()
            with trace:
                on, ops_on, _, _ = _run(r, ww, groups, sparse, seed)
            clock_on = calls["clock"]
            steps = trace.steps()
            results[(name, sparse)] = dict(
                equal=all(torch.equal(a, b) for a, b in zip(off, on)), ops=(ops_off, ops_on),
                clock=(clock_off, clock_on), events=calls["event"], steps=steps, summary=trace.summary(),
                expected=_expected_bytes(wo, wi, s, nv, sparse), ww=ww)
    results["callback"] = _callback_case(rank, w)
    return results


def test_trace_is_exact_free_when_off_and_counts_bytes():
    per_rank = run_distributed(worker, 4)
    seen = 0
    for rank, res in enumerate(per_rank):
        for key, r in res.items():
            if key == "callback":
                continue
            name, sparse = key
            seen += 1
            assert r["equal"], f"rank {rank} {key}: results changed when the trace was enabled"
            assert r["ops"][0] == r["ops"][1] > 0, f"rank {rank} {key}: torch op counts off/on {r['ops']}"
            assert r["clock"][0] == 0 and r["events"] == 0, f"rank {rank} {key}: timers ran while disabled"
            ring = "sparse" if sparse else "dense"
            for phase in ("fwd", "bwd"):
                steps = [s for s in r["steps"] if s.phase == phase]
                assert all(s.ring == ring for s in steps)
                assert [s.index for s in steps] == list(range(r["ww"] + sparse)), (key, phase)
                assert [s.kind for s in steps] == ["ring"] * r["ww"] + ["vertical"] * sparse
                got = {lvl: sum(s.bytes_sent[lvl] for s in steps) for lvl in ring_trace.LEVELS}
                assert got == r["expected"][phase], f"rank {rank} {key} {phase}: bytes {got} != {r['expected'][phase]}"
                assert all(s.compute_ms > 0 for s in steps)  # the counting clock advances by one per read
            n_steps = len(r["steps"])
            n_waits = r["expected"]["waits"]["fwd"] + r["expected"]["waits"]["bwd"]
            assert r["clock"][1] == 2 * (n_steps + n_waits), (key, r["clock"], n_steps, n_waits)
            summ = r["summary"]
            assert summ[f"fwd/{ring}/steps"] == r["ww"] + sparse
            assert summ[f"bwd/{ring}/bytes_outer"] * (r["ww"] + sparse) == r["expected"]["bwd"]["outer"]
    assert seen == 4 * 2 + 3 * 2
    for rank, res in enumerate(per_rank):
        logged = res["callback"]
        keys = set().union(*map(set, logged))
        want = {f"ring/{p}/dense/{x}" for p in ("fwd", "bwd")
                for x in ("steps", "compute_ms", "wait_inner_ms", "wait_outer_ms", "bytes_inner", "bytes_outer",
                          "hidden")}
        assert want <= keys, f"rank {rank}: missing {sorted(want - keys)}"
        assert sum(any(k.startswith("ring/") for k in m) for m in logged) == 2  # both steps measured


def test_traces_do_not_nest():
    with RingTrace():
        try:
            with RingTrace():
                raise AssertionError("unreachable")
        except RuntimeError as e:
            assert "do not nest" in str(e)
    assert ring_trace.active() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA event path needs a GPU")
def test_cuda_events_are_resolved_on_read():
    # One GPU cannot run an NCCL ring (two ranks may not share a device), so the hooks are driven directly: the
    # spans must become CUDA events (no host clock), resolved to positive times only when read.
    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)
    host_reads = []
    saved = ring_trace._host_clock
    ring_trace._host_clock = lambda: host_reads.append(1) or 0.0
    try:
        trace = RingTrace()
        with trace:
            with ring_trace.call("fwd", True, dev):
                for _ in range(3):
                    ring_trace.step()
                    with ring_trace.compute():
                        b = a @ a
                    ring_trace.sent("outer", b)
                    with ring_trace.waiting("outer"):
                        torch.cuda._sleep(1000)  # stands for a stream stalled on a transfer
    finally:
        ring_trace._host_clock = saved
    steps = trace.steps()
    assert not host_reads and len(steps) == 3
    assert all(s.compute_ms > 0 and s.wait_ms["outer"] > 0 and s.bytes_sent["outer"] == b.numel() * 4 for s in steps)
    assert trace.summary()["fwd/sparse/bytes_outer"] == b.numel() * 4
