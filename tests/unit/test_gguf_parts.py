"""``scripts/gguf_parts.sh``: a file split into parts here and joined there, one part per transfer, comes back
byte-identical; a damaged part is refused. Run on a 3 MiB random file with 1 MiB parts (the real GGUF is split
into two 47 MiB parts the same way)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gguf_parts.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PART_MIB": "1"})


def test_split_and_join_one_part_per_transfer(tmp_path):
    original = tmp_path / "model.gguf"
    original.write_bytes(os.urandom(3 * 1024 * 1024 + 12345))
    parts = tmp_path / "parts"
    done = _run("split", str(original), str(parts))
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in parts.glob("part.*"))
    assert names == ["part.00", "part.01", "part.02", "part.03"]
    manifest = (parts / "manifest.txt").read_text()
    assert f"sha256 {hashlib.sha256(original.read_bytes()).hexdigest()}" in manifest
    store = tmp_path / "store"
    for i, name in enumerate(names):  # each transfer brings the manifest and one part
        transfer = tmp_path / f"transfer{i}"
        transfer.mkdir()
        shutil.copy(parts / "manifest.txt", transfer)
        shutil.copy(parts / name, transfer)
        joined = _run("join", str(transfer), str(store))
        assert joined.returncode == 0, joined.stderr
        if i < len(names) - 1:
            assert f"still missing: {' '.join(names[i + 1:])}" in joined.stdout
    assert joined.stdout.strip() == f"gguf: {store / 'model.gguf'}"
    assert (store / "model.gguf").read_bytes() == original.read_bytes()
    # a part damaged on the way is refused and dropped from the store
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(parts / "manifest.txt", bad)
    (bad / "part.01").write_bytes(b"x" + (parts / "part.01").read_bytes()[1:])
    store2 = tmp_path / "store2"
    refused = _run("join", str(bad), str(store2))
    assert refused.returncode == 1 and "part.01 has SHA-256" in refused.stderr
    assert not (store2 / "part.01").exists()
