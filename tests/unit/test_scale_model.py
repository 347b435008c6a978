"""``benchmarks/scale_model.py``: its pure functions against hand-computed values, monotonicity, the check against the
MTraining paper's figures (``PAPER`` in the script) held to the agreement bands written below with their reasons, and
the planner's choice where activation offload is involved.

Hand values use round link speeds (1 GB/s = 1 ms per MB, no latency) so every term can be checked on paper.
"""

from __future__ import annotations

import importlib.util
import pathlib
import random
import sys

import pytest


def _load():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "scale_model.py"
    spec = importlib.util.spec_from_file_location("scale_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_model"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


sm = _load()
MB = 1e6


def test_links_hand_values():
    assert sm.transfer_s(0, 1.0, 50.0) == 0.0  # nothing sent, nothing waited (not even latency)
    assert sm.transfer_s(2 * MB, 1.0, 0.0) == pytest.approx(2e-3)
    assert sm.transfer_s(2 * MB, 1.0, 10.0, efficiency=0.5) == pytest.approx(10e-6 + 4e-3)
    # ring all-reduce over 4 GPUs: 6 hops of a quarter each
    assert sm.allreduce_s(4 * MB, 4, 1.0, 0.0) == pytest.approx(6 * 1e-3)
    assert sm.allreduce_s(4 * MB, 1, 1.0, 0.0) == 0.0


def test_two_node_hierarchical_case_by_hand():
    # 2 nodes x 2 GPUs. kv = 1 MB, dkv = 2 MB; inner link 1 GB/s (kv 1 ms, dkv 2 ms), outer 0.1 GB/s (kv 10 ms,
    # dkv 20 ms, kv + dkv 30 ms). Compute: 1 ms a forward step, 2 ms a backward step.
    kw = dict(kv_bytes=1 * MB, dkv_bytes=2 * MB, link_inner=(1.0, 0.0), link_outer=(0.1, 0.0))
    t = sm.ring_layer_time([1.0] * 4, [2.0] * 4, 2, **kw)
    # forward: outer step 0 = max(inner ring max(1, 1) + 1, outer kv 10) = 10; outer step 1 = 2 (nothing to wait)
    assert t["fwd_s"] == pytest.approx(12e-3)
    # backward: an inner ring = max(2, kv 1) + max(2, dkv 2) + the last dkv hop 2 = 6;
    # outer step 0 = max(6, kv 10) = 10, outer step 1 = max(6, dkv 20) = 20, then the last outer dkv hop 20
    assert t["bwd_s"] == pytest.approx(50e-3)
    assert t["fwd_compute_s"] == pytest.approx(4e-3) and t["fwd_exposed_comm_s"] == pytest.approx(8e-3)
    # the same 4 GPUs as one flat ring over the slow link: every step but the last waits 10 ms
    flat = sm.ring_layer_time([1.0] * 4, [2.0] * 4, 4, kv_bytes=1 * MB, dkv_bytes=2 * MB, link_inner=(0.1, 0.0),
                              link_outer=(0.1, 0.0))
    assert flat["fwd_s"] == pytest.approx(3 * 10e-3 + 1e-3)
    # a gathered vertical step adds its compute and its all-reduces
    v = sm.ring_layer_time([1.0] * 4, [2.0] * 4, 2, vertical={"fwd_ms": 0.5, "bwd_ms": 1.5, "allreduce_fwd_s": 1e-3,
                                                                "allreduce_bwd_s": 2e-3}, **kw)
    assert v["fwd_s"] == pytest.approx(12e-3 + 1.5e-3) and v["bwd_s"] == pytest.approx(50e-3 + 3.5e-3)
    with pytest.raises(ValueError, match="divisible"):
        sm.ring_layer_time([1.0] * 4, [2.0] * 4, 3, **kw)


def test_schedule_only_with_the_papers_step_times():
    r = sm.schedule_only(0.51, 0.98, 0.13, 4, 8)
    assert r["flat_ms"] == pytest.approx(31 * 0.98 + 0.51)
    assert r["hier_ms"] == pytest.approx(3 * 8 * 0.51 + 8 * 0.51)  # the inner ring (4.08 ms) hides the 0.98 ms


def test_monotone_in_bandwidth_and_compute():
    rng = random.Random(0)
    for _ in range(50):
        w, inner = rng.choice([(4, 2), (8, 4), (8, 8), (16, 8)])
        fwd = [rng.uniform(0.1, 3) for _ in range(w)]
        bwd = [rng.uniform(0.1, 6) for _ in range(w)]
        kv, dkv = rng.uniform(0.1, 20) * MB, rng.uniform(0.1, 40) * MB
        base = sm.ring_layer_time(fwd, bwd, inner, kv, dkv, (rng.uniform(10, 500), 5.0), (rng.uniform(1, 50), 10.0))
        faster = sm.ring_layer_time(fwd, bwd, inner, kv, dkv, (600.0, 5.0), (60.0, 10.0))
        slower = sm.ring_layer_time([x * 1.5 for x in fwd], [x * 1.5 for x in bwd], inner, kv, dkv, (5.0, 5.0),
                                    (0.5, 10.0))
        for ph in ("fwd_s", "bwd_s"):
            assert faster[ph] <= base[ph] + 1e-15 <= slower[ph] + 2e-15
            assert base[ph] >= base[ph.replace("_s", "_compute_s")] - 1e-15  # never faster than its compute


def test_fit_recovers_a_line_and_respects_the_kernel_rate():
    pts = [(p * 1e8, 0.7 + 2.0 * p * 1e8 / 1e9) for p in range(1, 7)]
    t0, c = sm.fit_step_cost(pts, c_min=0.0)
    assert t0 == pytest.approx(0.7) and c == pytest.approx(2.0)
    t0, c = sm.fit_step_cost(pts, c_min=3.0)  # slope clamped: the intercept is the mean residual
    assert c == 3.0 and t0 == pytest.approx(sum(t - 3.0 * p / 1e9 for p, t in pts) / len(pts))
    with pytest.raises(ValueError, match="two"):
        sm.fit_step_cost(pts[:1], 0.0)


def test_memory_and_params():
    ref = sm.REFERENCE
    assert 3.0e9 < ref.params() < 3.2e9  # Qwen2.5-3B: 3.09B (tied embeddings)
    rest = {"act_bytes_per_token": 300_000.0}
    one = sm.memory_gib(ref, 131072, 1, rest, bytes_per_param=2.0)
    assert one["activations_gib"] == pytest.approx(131072 * 300_000.0 / 2**30)  # the measured slope, unscaled
    many = sm.memory_gib(ref, 131072, 8, rest, bytes_per_param=16.0, fsdp=True)
    assert many["states_gib"] == pytest.approx(16.0 * ref.params() / 8 / 2**30)
    assert many["activations_gib"] == pytest.approx(one["activations_gib"] / 8)


def test_measured_inputs_and_the_paper_check_bands():
    costs, rest = sm.measured_step_costs(), sm.measured_rest()
    # (a) the fitted step costs: a fixed cost per step well above zero (host-bound steps) and a per-pair slope at
    # least the kernel's own; the rest of the step ~50 us a token (RESULTS "Training throughput")
    assert 0.3 < costs["sparse"].t0_fwd < 1.2 and 0.3 < costs["sparse"].t0_bwd < 1.2
    assert costs["sparse"].c_fwd >= costs["c_single_ms_per_gpair"] / 3.5 - 1e-12
    assert 45e-6 < rest["rest_s_per_token"] < 56e-6
    res = sm.paper_check(costs, rest)
    paper = sm.PAPER
    # links at nominal speed are faster than the paper measured: it achieved ~68% of HDR and ~43% of NVLink 3 on a
    # 16.8 MB K/V message (bands: the model at nominal bandwidth is 1.3-1.5x and 1.8-2.2x faster)
    assert res["kv_bytes"] == 2 * 2 * 16384 * 128 * 2
    assert 1.3 < paper["inter_ms"] / res["inter_ms"] < 1.5
    assert 1.8 < paper["intra_ms"] / res["intra_ms"] < 2.2
    # the schedule fed the paper's own per-step times: within 20% under the paper's forward times (ours omit
    # launch gaps and the diagonal step's masking), and the hierarchical/flat ratio within 0.05 of 19.5 / 34.1
    sched = res["schedule_with_paper_steps"]
    assert -0.12 < sched["flat_ms"] / paper["fwd_flat_ms"] - 1 < 0
    assert -0.20 < sched["hier_ms"] / paper["fwd_hier_ms"] - 1 < 0
    assert abs(sched["hier_over_flat"] - paper["fwd_hier_ms"] / paper["fwd_flat_ms"]) < 0.05
    # where it disagrees: our per-step compute (H100-fitted, scaled to A100) is 2-3.2x the paper's 0.51 ms, so the
    # inter-node transfer hides behind compute even on a flat ring and the hierarchy buys (almost) nothing
    assert 2.0 < res["compute_ms_model"] / paper["compute_ms"] < 3.2
    assert abs(res["fwd_ms_model"]["hier"] / res["fwd_ms_model"]["flat"] - 1) < 0.05
    # training throughput against the dense ring: the paper's "up to 6x"; the model says 6-9x at this setting
    assert 6.0 < res["train_speedup_hier_vs_dense"] < 9.0
    assert 0.05 < res["density_512k"] < 0.08  # the synthetic pattern's density at 512K (paper: 93.7% sparsity)


def test_plan_picks_a_valid_configuration():
    costs, rest = sm.measured_step_costs(), sm.measured_rest()
    hw = sm.PRESETS["h100-ndr"]
    p = sm.plan(sm.REFERENCE, hw, 16384, 2, 4, costs, rest, cp_sizes=[4, 8])
    seen = {(c["cp"], c["inner"], c["layout"]) for c in p["candidates"]}
    assert seen == {(cp, inner, layout) for layout in ("striped", "zigzag", "contiguous")
                    for cp, inner in ((4, 2), (4, 4), (8, 2), (8, 4), (8, 8))}
    assert all(c["dp"] * c["cp"] == 8 for c in p["candidates"])
    rate = [c["tokens_per_s"] for c in p["candidates"] if c["fits"]]
    assert rate == sorted(rate, reverse=True) and p["best"] is p["candidates"][0]
    assert p["dense"]["cp"] in (4, 8) and p["dense"]["method"] == "dense"  # the dense baseline, its best CP size
    text = sm._fmt_plan(p, "Qwen/Qwen2.5-3B", hw, 16384, 2, 4)
    assert "inner_ring_size=" in text and "memory per GPU" in text
    with pytest.raises(ValueError, match="multiple"):
        sm.plan(sm.REFERENCE, hw, 16384 + 128, 2, 4, costs, rest, cp_sizes=[8])


def test_offloads_host_copies_are_in_the_step_and_a_faster_offload_row_is_named_not_picked():
    """At 512K on 4 x 8 H100s, CP 4 fits only by offloading 10 layers' checkpointed inputs; its step includes their
    host-device copies (out and back: 2 x bytes / host_gbs) and still predicts more tokens/s than CP 8, which fits
    without offload. The plan picks CP 8 and says which row looked faster and why it was not chosen."""
    costs, rest = sm.measured_step_costs(), sm.measured_rest()
    hw = sm.PRESETS["h100-ndr"]
    p = sm.plan(sm.REFERENCE, hw, 524288, 4, 8, costs, rest, cp_sizes=[4, 8])
    best = p["best"]
    assert (best["cp"], best["fits"], best["offload"], best["offload_s"]) == (8, True, False, 0.0)
    row = next(c for c in p["candidates"] if c["cp"] == 4 and c["layout"] == "striped" and c["inner"] == 4)
    moved = 131072 * 2 * 10 * sm.REFERENCE.hidden  # tokens a GPU x bf16 x 10 layers x hidden
    assert row["offload"] == 10 and row["offload_s"] == pytest.approx(2 * moved / (hw.host_gbs * 1e9))
    free = sm.plan(sm.REFERENCE, sm.dataclasses.replace(hw, host_gbs=1e12), 524288, 4, 8, costs, rest, cp_sizes=[4])
    same = next(c for c in free["candidates"] if c["layout"] == "striped" and c["inner"] == 4)
    assert row["step_s"] == pytest.approx(same["step_s"] + row["offload_s"], rel=1e-6)
    assert row["tokens_per_s"] > best["tokens_per_s"]  # faster on paper, yet not picked
    text = sm._fmt_plan(p, "Qwen/Qwen2.5-3B", hw, 524288, 4, 8)
    assert "best despite faster-looking rows: context_parallel_size=4 (striped, inner_ring_size=4)" in text, text
    assert "host-device copies are a rule (25 GB/s per GPU each way), not a measurement" in text
    assert "(offload 10 layers: 0.43 s of host copies in the step, at 25 GB/s, a rule)" in text


def _memory_file(path, device, chunk, peaks_gib):
    import json

    rows = [{"variant": "sparse_topk 1024/32", "N": n, "tiled_mlp": chunk, "status": "ok", "peak_gib": g}
            for n, g in peaks_gib.items()]
    path.write_text(json.dumps({"info": {"device": device, "args": {"tiled_mlp": chunk}}, "rows": rows}))


def test_the_tiled_mlps_saving_is_fitted_to_measured_peaks(tmp_path):
    assert sm.measured_tiled_mlp(tmp_path) is None  # nothing measured: nothing assumed
    lengths = (32768, 65536, 131072)
    # lines with known slopes: 0.30 MiB a token untiled, 0.22 tiled, 20 GiB of model states either way
    plain = {n: 20 + n * 0.30 / 1024 for n in lengths}
    tiled = {n: 20 + n * 0.22 / 1024 for n in lengths}
    _memory_file(tmp_path / "train_throughput_memory_plain.json", "H100", 0, plain)
    assert sm.measured_tiled_mlp(tmp_path) is None  # only one side measured
    _memory_file(tmp_path / "train_throughput_memory_tiled.json", "H100", 8192, dict(list(tiled.items())[:2]))
    assert sm.measured_tiled_mlp(tmp_path) is None  # two lengths are not enough for the line
    _memory_file(tmp_path / "train_throughput_memory_tiled.json", "H100", 8192, tiled)
    found = sm.measured_tiled_mlp(tmp_path)
    assert found["tiled_mlp"] == 8192 and found["lengths"] == list(lengths)
    assert found["saving_bytes_per_token"] == pytest.approx(0.08 * 2**20)
    assert found["max_rel_residual"] < 1e-9
    # on the reference shape the activations shrink by the saving, per token; a narrower MLP saves in proportion
    rest = {"act_bytes_per_token": 300_000.0, "tiled_mlp": found}
    one = sm.memory_gib(sm.REFERENCE, 131072, 1, rest)
    both = sm.memory_gib(sm.REFERENCE, 131072, 1, rest, tiled_mlp=True)
    assert one["activations_gib"] - both["activations_gib"] == pytest.approx(131072 * 0.08 / 1024)
    narrow = sm.dataclasses.replace(sm.REFERENCE, ffn=sm.REFERENCE.ffn // 2)
    saved = (sm.memory_gib(narrow, 131072, 1, rest)["activations_gib"]
             - sm.memory_gib(narrow, 131072, 1, rest, tiled_mlp=True)["activations_gib"])
    assert saved == pytest.approx(131072 * 0.04 / 1024)
    with pytest.raises(ValueError, match="not measured yet"):
        sm.memory_gib(sm.REFERENCE, 131072, 1, {"act_bytes_per_token": 300_000.0, "tiled_mlp": None}, tiled_mlp=True)
    _memory_file(tmp_path / "train_throughput_memory_other.json", "H200", 0, plain)
    with pytest.raises(ValueError, match="several cards"):
        sm.measured_tiled_mlp(tmp_path)


def test_a_tiled_plan_fits_where_the_plain_one_needs_offload_and_its_config_says_so():
    costs, rest = sm.measured_step_costs(), sm.measured_rest()
    hw = sm.PRESETS["h100-ndr"]
    # a saving as large as the whole non-checkpointed part, so tiling decides whether 512K fits 8 GPUs unoffloaded
    ckpt = 2.0 * sm.REFERENCE.layers * sm.REFERENCE.hidden
    rest = dict(rest, tiled_mlp={"tiled_mlp": 8192, "saving_bytes_per_token": rest["act_bytes_per_token"] - ckpt})
    plain = sm.plan(sm.REFERENCE, hw, 1048576, 1, 8, costs, rest, cp_sizes=[8])
    tiled = sm.plan(sm.REFERENCE, hw, 1048576, 1, 8, costs, rest, cp_sizes=[8], tiled_mlp=True)
    assert tiled["memory"]["activations_gib"] < plain["memory"]["activations_gib"]
    assert tiled["tiled_mlp"] == 8192 and plain["tiled_mlp"] is None
    config = sm.plan_config(tiled, "Qwen/Qwen2.5-3B", sm.REFERENCE, 1048576, 1, 8)
    assert config["trainer"]["strategy"]["init_args"]["tiled_mlp"] == 8192
    assert "tiled_mlp" not in sm.plan_config(plain, "Qwen/Qwen2.5-3B", sm.REFERENCE, 1048576, 1, 8)["trainer"][
        "strategy"]["init_args"]
    assert "tiled MLP of 8192 tokens" in sm._fmt_plan(tiled, "Qwen/Qwen2.5-3B", hw, 1048576, 1, 8)


def test_the_planner_refuses_an_unmeasured_tiled_mlp(capsys):
    if sm.measured_rest()["tiled_mlp"] is not None:
        pytest.skip("the tiled MLP is measured in benchmarks/data")
    with pytest.raises(SystemExit, match="not measured yet"):
        sm.main(["plan", "--tokens", "131072", "--nodes", "1", "--tiled-mlp"])
