"""Timing helper shared by the benchmarks: the median of a call, CUDA through ``triton.testing.do_bench``."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, device: torch.device, grads=None, min_reps: int = 5) -> float:
    """Median milliseconds of ``fn()``; ``grads``: tensors whose ``.grad`` is reset before every call.

    CUDA: ``triton.testing.do_bench`` (L2 flushed before each call), its warm-up and repetition times sized from
    one timed call so that at least ``min_reps`` calls are timed (do_bench sizes them from 100 ms, which times a
    1-s call once). CPU (the scripts' smoke mode): ``time.perf_counter``, one warm-up, the median of 3.
    """
    def reset():
        for t in grads or []:
            t.grad = None

    if device.type != "cuda":
        reset()
        fn()
        times = []
        for _ in range(3):
            reset()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    import triton

    reset()
    fn()  # compiles, fills caches
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reset()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    return triton.testing.do_bench(fn, warmup=max(25.0, 1.5 * once), rep=max(200.0, (min_reps + 0.5) * once),
                                   grad_to_none=grads, return_mode="median")


def write_results(path: str, info: dict, rows: list, print_table) -> None:
    """The benchmarks' common ending: JSON ``{"info", "rows"}`` to ``path``, then the table, then where it went."""
    import json

    with open(path, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    print_table(rows)
    print(f"wrote {path}")
