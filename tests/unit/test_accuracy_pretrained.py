"""``benchmarks/accuracy.py --pretrained --smoke`` on the CPU: the context-extension benchmark's plumbing on the real
SmolLM2 weights (its first 2 layers, 896-token windows in the model's own tokens, RoPE changed by YaRN x2): a top-k
variant trains two steps and the untrained ``base_rope`` baseline is evaluated; both are scored on generated tasks
in the model's tokens, served dense and with the sparse prefill, their patterns measured by layer and document, and
``--report`` merges them. Checks the records' consistency (the plumbing), not the numbers' quality."""

from __future__ import annotations

import json
import math

import pytest

from helpers.real_model import needs_real_model, smollm2_folder
from helpers.scripts import load_script


@needs_real_model
@pytest.mark.slow
def test_context_extension_smoke(tmp_path_factory, tmp_path):
    bench = load_script("benchmarks/accuracy.py", "accuracy_bench")
    folder = str(smollm2_folder(tmp_path_factory))
    out = bench.main(["--smoke", "--pretrained", folder, "--variant", "topk,base_rope", "--out-dir", str(tmp_path),
                      "--run-dir", str(tmp_path / "runs")])
    topk, base = out["topk"], out["base_rope"]
    assert len(topk["train_loss"]) == 2 and all(math.isfinite(x) for x in topk["train_loss"])
    assert base["train_loss"] == [] and base["speed"]["tokens_per_s"] is None and base["rope"] == "yarn:2"
    assert topk["speed"]["steps_done"] == 2 and topk["speed"]["tokens_per_s"] > 0
    att = topk["attention"][-1]
    assert 0.0 < att["attention/density"] < 1.0 and "attention/density/layer_1" in att
    for run in (topk, base):
        by_length = run["final"]["heldout_by_length"]
        assert set(by_length) == {"768", "896"}
        for losses in by_length.values():
            assert math.isfinite(losses["own_attention"]) and math.isfinite(losses["dense_attention"])
        # the baseline attends densely either way: its two held-out losses are the same computation
        if run is base:
            assert all(x["own_attention"] == pytest.approx(x["dense_attention"], rel=1e-6) for x in by_length.values())
        for label in ("dense", "sparse_prefill"):
            tasks = run["tasks"][label]
            assert len(tasks["results"]) == 6 and set(tasks["by_length"]) == {"704", "832"}  # 3 kinds x 2 lengths
            assert tasks["low"] <= tasks["accuracy"] <= tasks["high"]
    # the patterns before extension (the baseline, with the sparse variants' configs) and after (the trained one)
    assert set(base["patterns"]) == {"768", "896"} and "topp_spread" in base["patterns"]["896"]["configs"]
    assert set(topk["patterns"]["896"]["configs"]) == {"topk", "topk_last"}
    assert len(topk["patterns"]["896"]["configs"]["topk"]["layers"]) == 2
    merged = bench.main(["--report", "--out-dir", str(tmp_path)])
    rows = {row["variant"]: row for row in merged["table"]}
    assert set(rows) == {"topk", "base_rope"}
    assert rows["topk"]["tokens_per_s"] > 0 and set(rows["topk"]["heldout_by_length"]) == {"768", "896"}
    assert json.loads((tmp_path / "accuracy.json").read_text())["table"] == merged["table"]
    if _has_matplotlib():
        assert (tmp_path / "accuracy_quality_speed.png").stat().st_size > 0


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None
