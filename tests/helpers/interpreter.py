"""Run a test file's Triton-interpreter checks in a subprocess (``TRITON_INTERPRET=1`` must be set before triton is
imported, so the checks cannot run in pytest's own process) and collect their verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shim_interpreter() -> None:
    """Triton 3.6's interpreter stores scalars as 1-element arrays and converts them with int(), which numpy >= 2.4
    refuses ("only 0-dimensional arrays..."): loop bounds loaded from memory then fail. Test-only shim."""
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def run_interpreter_checks(path: str, timeout: float) -> dict[str, str]:
    """``{check name: "ok" or the failure}`` printed by ``python path --json`` as a ``RESULTS {...}`` line (the
    subprocess finds ``helpers`` on its path)."""
    path_var = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path_var}
    proc = subprocess.run([sys.executable, path, "--json"], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"interpreter checks crashed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


def collect(checks: dict[str, Callable[[], None]]) -> dict[str, str]:
    """Run every check; ``{name: "ok" or the end of its traceback}`` (each check reports its own failure)."""
    results = {}
    for name, fn in checks.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - every check reports its own failure
            results[name] = traceback.format_exc()[-3000:]
    return results


def script_main(run_checks: Callable[[], dict[str, str]]) -> None:
    """A check file run as a script (``TRITON_INTERPRET=1 python tests/unit/test_x.py [--json]``): the verdicts, as a
    ``RESULTS {...}`` line for :func:`run_interpreter_checks` with ``--json``; exit status 1 if one failed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    res = run_checks()
    if "--json" in sys.argv:
        print("RESULTS " + json.dumps(res))
    else:
        for k_, v_ in res.items():
            print(k_, v_ if v_ != "ok" else "ok")
    sys.exit(0 if all(r == "ok" for r in res.values()) else 1)
