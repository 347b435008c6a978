"""``benchmarks/train_throughput.py``'s time split on synthetic profiler events (its CUDA branch cannot run here):
each kernel counts for the innermost ``mtraining::`` range around the CPU call that launched it, else for an
attention op around it, else for ``rest``; the ranges' own GPU spans count nothing."""

import importlib.util
import pathlib
from types import SimpleNamespace as NS


def _time_split():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "train_throughput.py"
    spec = importlib.util.spec_from_file_location("train_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.time_split


CPU, CUDA = NS(name="CPU"), NS(name="CUDA")


def ev(id, name, parent=None, dev=CPU, link=0, dur=0.0, user_annotation=False):
    return NS(id=id, name=name, cpu_parent=parent, device_type=dev, is_async=False, linked_correlation_id=link,
              time_range=NS(start=0.0, end=dur), is_user_annotation=user_annotation, self_cpu_time_total=0.0)


def test_cuda_kernels_are_attributed_at_their_launch():
    bwd = ev(1, "autograd::engine::evaluate_function: MmBackward0")
    est = ev(2, "mtraining::estimate", bwd)  # an estimate recomputed inside a backward node (checkpointing)
    topk = ev(3, "aten::topk", est)
    sdpa = ev(4, "aten::_scaled_dot_product_flash_attention")
    lists = ev(5, "mtraining::lists")
    mm = ev(6, "aten::mm")
    launches = [ev(900, "cudaLaunchKernel", topk, link=3), ev(901, "cuLaunchKernel", est, link=1),  # Triton
                ev(902, "cudaLaunchKernel", sdpa, link=4), ev(903, "cuLaunchKernel", lists, link=0),
                ev(904, "cudaLaunchKernel", mm, link=6)]
    kernels = [ev(900, "topk_kernel", dev=CUDA, link=3, dur=10), ev(901, "_scores_kernel", dev=CUDA, link=1, dur=20),
               ev(902, "flash_fwd", dev=CUDA, link=4, dur=30), ev(903, "_step_lists_kernel", dev=CUDA, dur=5),
               ev(904, "sm90_gemm", dev=CUDA, link=6, dur=40), ev(905, "_mark_kernel", dev=CUDA, dur=1),
               ev(906, "mtraining::estimate", dev=CUDA, dur=99, user_annotation=True)]
    out = _time_split()([bwd, est, topk, sdpa, lists, mm, *launches, *kernels], cuda=True)
    # estimation: topk 10 + scores 20; attention: flash 30; lists: 5 + the unlaunched _mark_kernel 1 (by name);
    # rest: the gemm 40; the range's own 99 us GPU span is not a kernel
    assert out == {"attention": 30, "estimation": 30, "lists": 6, "rest": 40}, out
