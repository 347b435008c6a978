"""Run a test file's Triton-interpreter checks in a subprocess (``TRITON_INTERPRET=1`` must be set before triton is
imported, so the checks cannot run in pytest's own process) and collect their verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_interpreter_checks(path: str, timeout: float) -> dict[str, str]:
    """``{check name: "ok" or the failure}`` printed by ``python path --json`` as a ``RESULTS {...}`` line."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, path, "--json"], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"interpreter checks crashed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULTS "):])
