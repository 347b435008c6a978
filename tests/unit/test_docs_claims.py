"""What the README and docs say, checked against the repository where a claim is checkable: the results rows live in
one place (``docs/results.md``; the README's table is a part of it), and the host-work row says what the counting
benchmark's recorded run says."""

from __future__ import annotations

import json

from helpers.scripts import ROOT


def _table_rows(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith(("| What", "|---"))]


def test_the_readme_results_rows_are_rows_of_docs_results():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = _table_rows(section)
    assert rows, "the README's results table is gone"
    results = (ROOT / "docs" / "results.md").read_text()
    for row in rows:
        assert row in results, row  # one place holds the rows: the README shows some of them, word for word
    for row in rows:  # every row says where (a card, or how it was counted) and when
        assert "2026-" in row or "exact counts" in row, row


def test_the_host_work_row_is_the_recorded_count():
    """The README's host-work figures are those of ``benchmarks/data/hot_path_ops_cpu_*.json`` (the newest)."""
    newest = sorted((ROOT / "benchmarks" / "data").glob("hot_path_ops_cpu_*.json"))[-1]
    data = json.loads(newest.read_text())["variants"]
    phases = ("forward", "recompute", "backward")

    def totals(name: str) -> tuple[int, int]:
        c = data[name]
        return sum(c["ops"].get(p, 0) for p in phases), sum(c["launches"].get(p, 0) for p in phases)

    ops, launches = totals("topk")
    dense_ops, dense_launches = totals("dense")
    readme = (ROOT / "README.md").read_text()
    assert f"{ops} ATen ops, {launches} kernel launches, no host read (dense SDPA: {dense_ops} and {dense_launches})" \
        in readme
    assert totals("topp") == (ops, launches)
