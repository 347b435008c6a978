"""``benchmarks/accuracy.py --smoke`` end to end on the CPU: a dense and a top-k variant train a tiny Qwen2 for two
steps on the embedded corpus and generated tasks, are evaluated (held-out losses by window, position and document,
with their own, dense and other-probe attention; the patterns by layer and document) and scored on tasks served
dense and with the sparse prefill, and ``--report`` merges them. Checks the plumbing and the records' consistency,
not the numbers' quality; and that a run cut into pieces (``--max-units``) resumes to exactly the uninterrupted
run's numbers."""

import json
import math

import pytest

from helpers.scripts import load_script


def _bench():
    return load_script("benchmarks/accuracy.py", "accuracy_bench")


@pytest.mark.slow
def test_accuracy_smoke(tmp_path):
    bench = _bench()
    runs = str(tmp_path / "runs")
    out = bench.main(["--smoke", "--variant", "dense,topk", "--out-dir", str(tmp_path), "--run-dir", runs])
    dense, topk = out["dense"], out["topk"]
    assert dense["complete"] and topk["complete"]
    # the same data, seed and initial weights: step 0's loss differs only by the attention (top-k keeps ~20%)
    assert len(dense["train_loss"]) == len(topk["train_loss"]) == 2
    assert abs(dense["train_loss"][0] - topk["train_loss"][0]) < 0.05
    assert all(math.isfinite(x) for x in dense["train_loss"] + topk["train_loss"])
    assert [e["step"] for e in topk["evals"]] == [0, 1]
    assert dense["attention"] == [] and len(topk["attention"]) == 2
    att = topk["attention"][-1]
    assert 0.0 < att["attention/density"] < 0.5 and 0.0 < att["attention/recall"] <= 1.0
    assert {"attention/recall/layer_0", "attention/recall/layer_1"} <= set(att)
    # held-out: own, dense and the other probe placement (the smoke trains with spread probes) per window, split
    assert set(topk["heldout"]) == {"own", "dense", "own_last"} and set(dense["heldout"]) == {"dense"}
    window = topk["heldout"]["own"]["1024"][0]
    assert set(window) == {"loss", "buckets", "documents"} and len(window["buckets"]) >= 3
    assert sum(d["tokens"] for d in window["documents"]) == 1023  # every target in one document
    by_length = topk["final"]["heldout_by_length"]["1024"]
    assert by_length["own_attention"] == pytest.approx(window["loss"]) and "own_last" in by_length
    # patterns: the own config and the other placement, every layer, recall per document
    configs = topk["patterns"]["1024"]["configs"]
    assert set(configs) == {"topk", "topk_last"} and [x["layer"] for x in configs["topk"]["layers"]] == [0, 1]
    layer = configs["topk"]["layers"][0]
    assert 0 < layer["density"] <= 1 and 0 < layer["recall"] <= 1
    assert len(layer["recall_by_document"]) == len(topk["patterns"]["1024"]["documents"])
    assert set(dense["patterns"]["1024"]["configs"]) == {"topp_spread", "topp_last", "topk_spread", "topk_last"}
    for run in (dense, topk):
        for label in ("dense", "sparse_prefill"):
            tasks = run["tasks"][label]
            assert len(tasks["results"]) == 3 and set(tasks["by_length"]) == {"900"}  # 3 kinds, one length
            assert 0.0 <= tasks["accuracy"] <= 1.0 and 0.0 <= tasks["low"] <= tasks["accuracy"] <= tasks["high"]
    merged = bench.main(["--report", "--out-dir", str(tmp_path)])
    assert [row["variant"] for row in merged["table"]] == ["dense", "topk"]
    assert merged["table"][0]["vs_dense"] == 0.0
    assert len(merged["table"][1]["tasks_dense_vs_dense"]) == 3  # the paired difference and its interval
    assert json.loads((tmp_path / "accuracy.json").read_text())["table"] == merged["table"]


@pytest.mark.slow
def test_a_run_in_pieces_resumes_to_the_same_numbers(tmp_path):
    """The top-k smoke run cut after every 2 units of work (a training step, a held-out window, a pattern
    analysis, a task chunk), each piece a new call that resumes from the run folder, against the same run in one
    call: the same training losses, held-out losses and task results, bit for bit (one CPU process: every piece
    restores the weights and the optimizer exactly and draws the same data)."""
    bench = _bench()
    whole = bench.main(["--smoke", "--variant", "topk", "--out-dir", str(tmp_path / "whole"),
                        "--run-dir", str(tmp_path / "runs_whole"), "--task-chunk", "1"])["topk"]
    args = ["--smoke", "--variant", "topk", "--out-dir", str(tmp_path / "pieces"), "--run-dir",
            str(tmp_path / "runs_pieces"), "--task-chunk", "1", "--max-units", "2"]
    pieces = []
    for _ in range(20):
        pieces.append(bench.main(args)["topk"])
        if pieces[-1]["complete"]:
            break
    cut = pieces[-1]
    assert cut["complete"] and len(pieces) >= 4
    first = pieces[0]
    assert not first["complete"] and len(first["train_loss"]) == 2
    assert sum(len(ws) for per in first["heldout"].values() for ws in per.values()) == 0
    assert len(cut["speed"]["pieces"]) == len(pieces)
    assert cut["train_loss"] == whole["train_loss"]
    assert cut["evals"] == [dict(e, train_s=x["train_s"]) for e, x in zip(whole["evals"], cut["evals"])]
    for label, per in whole["heldout"].items():
        assert cut["heldout"][label] == per, label
    assert cut["patterns"] == whole["patterns"]
    for label in ("dense", "sparse_prefill"):
        assert cut["tasks"][label]["results"] == whole["tasks"][label]["results"]
    # the report reads the most advanced record among the pieces' folders
    merged = bench.main(["--report", "--out-dir", str(tmp_path / "report"), "--report-dirs", str(tmp_path / "pieces")])
    assert merged["table"][0]["steps"] == 2 and merged["table"][0]["pieces"] == len(pieces)
