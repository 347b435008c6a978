"""``benchmarks/train_throughput.py``'s time split on synthetic profiler events (its CUDA branch cannot run here):
each kernel counts for the innermost ``mtraining::`` range around the CPU call that launched it, else for an
attention op around it, else for ``rest``; the ranges' own GPU spans count nothing."""

from types import SimpleNamespace as NS

from helpers.scripts import load_script


def _time_split():
    return load_script("benchmarks/train_throughput.py", "train_throughput").time_split


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


def test_rest_utilisation_counts_the_weights_matmuls():
    tt = load_script("benchmarks/train_throughput.py", "train_throughput")
    # the Qwen2.5-3B shape with 8 layers: hidden 2048 (16 heads of 128, 2 KV heads), MLP 11008, vocabulary 151936
    cfg = NS(hidden_size=2048, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=2, vocab_size=151936)
    flops = tt.rest_flops_per_token(cfg)
    per_layer = 2048 * 2048 + 2 * 2048 * 256 + 2048 * 2048 + 3 * 2048 * 11008
    assert flops["model"] == 6 * (8 * per_layer + 2048 * 151936)
    assert flops["hardware"] == flops["model"] + 2 * 8 * per_layer  # the recomputed forward of the layers
    # 131072 tokens whose rest took 2.468 s on a 989 TFLOP/s card (the 8-layer shape's dense step at 128K, H100)
    row = {"N": 131072, "split_ms": {"rest": 2468.0}}
    got = tt.rest_utilisation(row, flops, tt.peak_tflops("NVIDIA H100 80GB HBM3"))
    assert abs(got["rest_mfu"] - flops["model"] * 131072 / 2.468 / 989e12) < 1e-12
    assert 0.2 < got["rest_mfu"] < got["rest_hfu"] < 1.0
    assert tt.rest_utilisation(row, flops, tt.peak_tflops("cpu")) == {}  # no known peak: no figure
    assert tt.rest_utilisation({"N": 1}, flops, 989.0) == {}  # no split: no figure
