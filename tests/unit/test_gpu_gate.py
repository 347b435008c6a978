"""``benchmarks/gpu_gate.py``'s arithmetic on rows as ``train_throughput.py`` writes them (its runs need a GPU)."""

from helpers.scripts import load_script


def _gate():
    return load_script("benchmarks/gpu_gate.py", "gpu_gate")


ROWS = [
    {"variant": "mtraining_dense", "N": 32768, "step_s": 0.635, "split_total_ms": 624.0, "syncs_per_step": 3},
    {"variant": "sparse_topk 1024/32", "N": 32768, "step_s": 0.479, "split_total_ms": 359.0, "syncs_per_step": 33},
    {"variant": "sparse_topp", "N": 32768, "step_s": 0.641, "split_total_ms": 518.0, "syncs_per_step": 62},
    {"variant": "mtraining_dense", "N": 65536, "step_s": 1.997, "split_total_ms": 1985.0},
    {"variant": "sparse_topp", "N": 65536, "step_s": 1.170, "split_total_ms": 999.0},
]


def test_idle_per_layer_is_the_worst_sparse_rows_idle_beyond_dense():
    gate = _gate()
    # idle: 32K dense 11 ms, top-k 120, top-p 123; 64K dense 12, top-p 171: the worst is 64K top-p, (171 - 12) / 30
    assert abs(gate._idle_per_layer(ROWS, 30) - (171 - 12) / 30) < 1e-9
    assert gate._idle_per_layer([r for r in ROWS if r["variant"] != "mtraining_dense"], 30) != \
        gate._idle_per_layer([r for r in ROWS if r["variant"] != "mtraining_dense"], 30)  # no dense row: nan


def test_verdicts_compare_each_goal_with_its_target():
    gate = _gate()
    found = {"phases_run": ["smollm2"], "smollm2_32k_topk_vs_dense": 2.1, "smollm2_32k_topp_vs_dense": 0.99,
             "idle_ms_per_layer": 0.4, "syncs_per_layer": gate._syncs_per_layer(ROWS, 30)}
    verdict = {v["goal"]: v["pass"] for v in gate.verdicts(found)}
    assert verdict["smollm2_32k_topk_vs_dense"] and not verdict["smollm2_32k_topp_vs_dense"]
    assert verdict["idle_ms_per_layer"] and not verdict["syncs_per_layer"]  # 62 / 30 syncs a layer
    assert not verdict["smollm2_64k_topp_vs_dense"]  # not measured (nan): fails
    assert "qwen_128k_paper_vs_dense" not in verdict  # its phase did not run


def test_the_extra_phases_read_what_their_runs_write(tmp_path, monkeypatch):
    """The soak and memory phases on the files their commands would write (the commands need a GPU)."""
    import json

    gate = _gate()

    def fake_run(cmd, log, timeout):
        out = cmd[cmd.index("--out") + 1]
        if "soak.py" in cmd[1]:
            data = {"ok": True, "flat": True, "finite": True, "falling": True, "loss_first": 9.1, "loss_last": 2.0}
        else:
            tiled = "--tiled-mlp" in cmd
            slope = 0.22 if tiled else 0.30  # GiB per 1024 tokens
            data = {"info": {"device": "NVIDIA H100 80GB HBM3", "args": {"tiled_mlp": 8192 if tiled else 0}},
                    "rows": [{"variant": "sparse_topk 1024/32", "N": n, "status": "ok", "tiled_mlp": 8192 if tiled
                              else 0, "peak_gib": 20 + n / 1024 * slope} for n in (32768, 65536, 131072)]}
        with open(out, "w") as f:
            json.dump(data, f)
        return 0, ""

    monkeypatch.setattr(gate, "run", fake_run)
    args = gate.argparse.Namespace(out_dir=str(tmp_path), soak_steps=200, soak_timeout=540, memory_timeout=540,
                                   tiled_mlp=8192)
    soak = gate.phase_soak(args)
    assert soak["soak_ok"] == 1.0
    memory = gate.phase_memory(args)
    assert memory["tiled_mlp_fit"]["tiled_mlp"] == 8192
    assert abs(memory["tiled_mlp_fit"]["saving_bytes_per_token"] - 0.08 * 2**20) < 1e-3
    verdict = {v["goal"]: v["pass"] for v in gate.verdicts({"phases_run": ["soak", "memory"], **soak, **memory})}
    assert verdict == {"soak_ok": True, "tiled_mlp_fit_residual": True}


def test_the_straight_and_general_rows_are_told_apart():
    """``--paths straight general`` labels the general path's rows; the goals read the straight path's, the idle
    goal ignores the general rows, and the A/B ratio is the general step over the straight one."""
    gate = _gate()
    rows = [dict(r, status="ok") for r in ROWS[:2]] + [
        {"variant": "sparse_topk 1024/32 general", "N": 32768, "status": "ok", "step_s": 0.882, "split_total_ms": 353.0,
         "ops_per_step": 17000, "launches_per_step": 11500, "host_attention_ms_per_layer": 12.0}]
    assert gate._row(rows, "sparse_topk", 32768)["step_s"] == 0.479
    assert gate._row(rows, "sparse_topk", 32768, general=True)["step_s"] == 0.882
    assert abs(gate._straight_vs_general(rows, "sparse_topk", 32768) - 0.882 / 0.479) < 1e-12
    assert abs(gate._idle_per_layer(rows, 30) - (120 - 11) / 30) < 1e-9  # the general row's 529 ms not counted
    per = {r["variant"]: r for r in gate._per_variant(rows, 30)}
    assert per["sparse_topk 1024/32 general"]["launches_per_step"] == 11500
    assert abs(per["sparse_topk 1024/32 general"]["idle_ms_per_layer"] - (882 - 353) / 30) < 1e-9


def test_the_compiled_phase_reads_what_its_runs_write(tmp_path, monkeypatch):
    import json

    gate = _gate()

    def fake_run(cmd, log, timeout):
        out = cmd[cmd.index("--out") + 1]
        if "--pretrained" in cmd:
            rows = [{"variant": "mtraining_dense", "N": 32768, "status": "ok", "step_s": 0.64},
                    {"variant": "mtraining_dense compiled", "N": 32768, "status": "ok", "step_s": 0.53},
                    {"variant": "sparse_topk 1024/32", "N": 32768, "status": "ok", "step_s": 0.40},
                    {"variant": "sparse_topk 1024/32 compiled", "N": 32768, "status": "ok", "step_s": 0.25}]
        else:
            rows = [{"variant": "mtraining_dense compiled", "N": 131072, "status": "ok", "step_s": 6.0},
                    {"variant": "sparse_topk 1024/32 compiled", "N": 131072, "status": "ok", "step_s": 1.5}]
        with open(out, "w") as f:
            json.dump({"rows": rows}, f)
        return 0, ""

    monkeypatch.setattr(gate, "run", fake_run)
    args = gate.argparse.Namespace(out_dir=str(tmp_path), gguf="smollm2.gguf", compiled_timeout=560)
    found = gate.phase_compiled(args)
    assert abs(found["smollm2_32k_compiled_topk_vs_dense"] - 0.53 / 0.25) < 1e-12
    assert abs(found["compiled_vs_eager_topk"] - 0.40 / 0.25) < 1e-12
    assert found["qwen_128k_compiled_topk_vs_dense"] == 4.0
    verdict = {v["goal"]: v["pass"] for v in gate.verdicts({"phases_run": ["compiled"], **found})}
    assert verdict == {"smollm2_32k_compiled_topk_vs_dense": True, "qwen_128k_compiled_topk_vs_dense": True,
                       "compiled_vs_eager_topk": True}
