"""Run a test file's Triton-interpreter checks in a subprocess (``TRITON_INTERPRET=1`` must be set before triton is
imported, so the checks cannot run in pytest's own process) and collect their verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

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


# The check files' subprocesses started ahead of their tests (by path): the process and its output files.
_STARTED: dict[str, tuple[subprocess.Popen, Any, Any]] = {}


def start_interpreter_checks(path: str, background: bool = False) -> None:
    """Start ``python path --json`` under the interpreter unless it already runs. ``background``: at the lowest CPU
    priority, for a session that starts the check files at its beginning (``conftest.py``) so that they use the CPU
    time the multi-process tests leave idle, slowing those tests as little as the scheduler allows."""
    path = os.path.realpath(path)
    if path in _STARTED:
        return
    path_var = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path_var}
    out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")  # files: no pipe fills up
    proc = subprocess.Popen([sys.executable, path, "--json"], env=env, stdout=out, stderr=err, text=True,
                            preexec_fn=(lambda: os.nice(19)) if background and hasattr(os, "nice") else None)
    _STARTED[path] = (proc, out, err)


def stop_interpreter_checks() -> None:
    """Kill the started check processes nobody waited for (a session ended early, or deselected their tests)."""
    for proc, out, err in _STARTED.values():
        proc.kill()
        proc.wait()
        out.close()
        err.close()
    _STARTED.clear()


def run_interpreter_checks(path: str, timeout: float) -> dict[str, str]:
    """``{check name: "ok" or the failure}`` printed by ``python path --json`` as a ``RESULTS {...}`` line (the
    subprocess finds ``helpers`` on its path), from the process :func:`start_interpreter_checks` started, or one
    started now; ``timeout`` seconds from now."""
    start_interpreter_checks(path)
    proc, out, err = _STARTED.pop(os.path.realpath(path))
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with out, err:
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"interpreter checks crashed or timed out (rc {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


def collect(checks: dict[str, Callable[[], None]]) -> dict[str, str]:
    """Run every check; ``{name: "ok" or the end of its traceback}`` (each check reports its own failure). With
    ``MTRAINING_CHECK_TIMES=1`` each check's time goes to stderr."""
    results = {}
    for name, fn in checks.items():
        start = time.perf_counter()
        try:
            fn()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - every check reports its own failure
            results[name] = traceback.format_exc()[-3000:]
        if os.environ.get("MTRAINING_CHECK_TIMES") == "1":
            print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
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
