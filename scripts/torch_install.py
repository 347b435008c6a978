"""Which torch ``scripts/setup.sh`` installs: the CPU build where PyTorch's CPU index answers, any torch the
environment already has when ``pyproject.toml`` admits its version, the default index otherwise.

    python scripts/torch_install.py           # the pip arguments that install torch, one a line; none: keep it
    python scripts/torch_install.py --check   # exit 0 when the torch installed here is one pyproject.toml admits
    python scripts/torch_install.py --check --inherit   # ... and a new venv made from this Python would see it

Rules, in order (:func:`torch_install_args`, tested in ``tests/unit/test_setup.py``):

1. A torch whose version ``pyproject.toml`` admits is installed already (any build: CPU, CUDA, ROCm; for a venv made
   with ``--system-site-packages``, the base Python's counts): keep it. ``setup.sh`` makes the venv that way when
   the Python it starts from has such a torch (a GPU image, a conda environment).
2. PyTorch's CPU wheel index answers within :data:`PROBE_TIMEOUT_S`: the pinned release from it (a CPU build of
   about 200 MB; the default index's build of the same release is the CUDA one, several GB, on x86-64 Linux).
3. Otherwise (no route to that index, or a private mirror only): the pinned release from pip's configured indexes,
   whatever build they hold; accepted, since rule 1 accepts any build.

Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "2.13.0"  # the release CI tests (its CPU wheel)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 5.0
_COMPARE = {
    ">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b,
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}


def release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: the release numbers, without local (``+cu130``) or pre-release parts."""
    numbers = re.match(r"\d+(?:\.\d+)*", version.strip())
    if numbers is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(n) for n in numbers.group(0).split("."))


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


def admits(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec``, a comma-separated list such as ``">=2.11,<2.14"`` (release numbers
    compared, local parts ignored)."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        found = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*([\w.+]+)", clause)
        if found is None:
            raise ValueError(f"unsupported version clause {clause!r} in {spec!r}")
        op, bound = found.groups()
        if not _COMPARE[op](*_padded(release(version), release(bound))):
            return False
    return True


def torch_spec(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The version range of ``torch`` among ``pyproject.toml``'s dependencies, e.g. ``">=2.11,<2.14"``."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    for requirement in dependencies:
        found = re.fullmatch(r"torch\s*([<>=!][^;]*)?", requirement.strip())
        if found:
            return (found.group(1) or "").strip()
    raise ValueError(f"{pyproject} lists no torch dependency")


def installed_torch() -> str | None:
    """The installed torch's version (from its metadata, without importing it), or None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def index_answers(url: str = CPU_INDEX, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``url`` (a package index) answers an HTTP request within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout) as response:
            return response.status < 400
    except urllib.error.HTTPError as error:  # it answered; a server that refuses HEAD still serves pip's GET
        return error.code == 405
    except (urllib.error.URLError, OSError, ValueError):
        return False


def venv_would_see(installed: str | None, spec: str, prefix: str, base_prefix: str) -> bool:
    """Whether a venv made with ``--system-site-packages`` from this Python sees an admitted torch: only when the
    torch is installed and this Python is not itself a venv's (``prefix == base_prefix``; a new venv sees its base
    installation's packages, not another venv's)."""
    return installed is not None and admits(installed, spec) and prefix == base_prefix


def torch_install_args(installed: str | None, spec: str, cpu_index_answers: Callable[[], bool]) -> list[str]:
    """The ``pip install`` arguments for torch, or ``[]`` to keep the installed one (the module docstring's rules).

    Args:
        installed: the installed torch's version (``"2.11.0+cu130"``), or None.
        spec: the versions ``pyproject.toml`` admits (:func:`torch_spec`).
        cpu_index_answers: asked only when something must be installed: whether PyTorch's CPU index answers.
    """
    if installed is not None and admits(installed, spec):
        return []
    if cpu_index_answers():
        return [f"torch=={TORCH_PIN}", "--index-url", CPU_INDEX]
    return [f"torch=={TORCH_PIN}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 0 when the installed torch is one pyproject.toml admits, 1 otherwise")
    parser.add_argument("--inherit", action="store_true",
                        help="with --check: also require that a venv made from this Python would see that torch")
    args = parser.parse_args(argv)
    spec, installed = torch_spec(), installed_torch()
    if args.check:
        admitted = installed is not None and admits(installed, spec)
        ok = venv_would_see(installed, spec, sys.prefix, sys.base_prefix) if args.inherit else admitted
        where = " (in a venv: a new venv would not see it)" if admitted and not ok else ""
        print(f"torch {installed or '(none)'}: {'admitted' if admitted else 'not admitted'} by pyproject.toml "
              f"({spec}){where}")
        return 0 if ok else 1
    for arg in torch_install_args(installed, spec, index_answers):  # nothing at all when the torch is kept
        print(arg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
