"""``benchmarks/accuracy.py --smoke`` end to end on the CPU: a dense and a top-k variant train a tiny Qwen2 for two
steps on the embedded corpus and generated tasks, are scored on tasks served dense and with the sparse prefill, and
``--report`` merges them. Checks the plumbing and the records' consistency, not the numbers' quality."""

import json
import math

import pytest

from helpers.scripts import load_script


def _bench():
    return load_script("benchmarks/accuracy.py", "accuracy_bench")


@pytest.mark.slow
def test_accuracy_smoke(tmp_path):
    bench = _bench()
    out = bench.main(["--smoke", "--variant", "dense,topk", "--out-dir", str(tmp_path)])
    dense, topk = out["dense"], out["topk"]
    # the same data, seed and initial weights: step 0's loss differs only by the attention (top-k keeps ~20%)
    assert len(dense["train_loss"]) == len(topk["train_loss"]) == 2
    assert abs(dense["train_loss"][0] - topk["train_loss"][0]) < 0.05
    assert all(math.isfinite(x) for x in dense["train_loss"] + topk["train_loss"])
    assert [e["step"] for e in topk["evals"]] == [0, 1]
    assert dense["attention"] == [] and len(topk["attention"]) == 2
    att = topk["attention"][-1]
    assert 0.0 < att["attention/density"] < 0.5 and 0.0 < att["attention/recall"] <= 1.0
    assert {"attention/recall/layer_0", "attention/recall/layer_1"} <= set(att)
    for run in (dense, topk):
        for label in ("dense", "sparse_prefill"):
            tasks = run["tasks"][label]
            assert len(tasks["results"]) == 3 and set(tasks["by_length"]) == {"900"}  # 3 kinds, one length
            assert 0.0 <= tasks["accuracy"] <= 1.0
    merged = bench.main(["--report", "--out-dir", str(tmp_path)])
    assert [row["variant"] for row in merged["table"]] == ["dense", "topk"]
    assert merged["table"][0]["vs_dense"] == 0.0
    assert json.loads((tmp_path / "accuracy.json").read_text())["table"] == merged["table"]
