"""Which torch ``scripts/setup.sh`` installs (``scripts/torch_install.py``): an admitted torch already there is kept
whatever its build, else the CPU index's build when that index answers, else the default index's; the range comes
from ``pyproject.toml``; the index probe gives up within its timeout. No network: the probe is a stand-in, or a
local HTTP server, or a closed local port."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from helpers.scripts import ROOT, load_script

torch_install = load_script("scripts/torch_install.py", "torch_install")
SPEC = ">=2.11,<2.14"


def _probe(answer: bool, calls: list[int]):
    def probe() -> bool:
        calls.append(1)
        return answer
    return probe


@pytest.mark.parametrize("installed", ["2.13.0+cpu", "2.11.0+cu130", "2.12.1+rocm6.4", "2.13.0"])
def test_an_admitted_torch_is_kept_whatever_its_build(installed):
    calls: list[int] = []
    assert torch_install.torch_install_args(installed, SPEC, _probe(True, calls)) == []
    assert calls == []  # no network asked when nothing is installed


@pytest.mark.parametrize("installed", [None, "2.10.0+cu128", "2.14.1", "2.15.0"])
def test_otherwise_the_cpu_index_when_it_answers_else_the_default_index(installed):
    pin = f"torch=={torch_install.TORCH_PIN}"
    assert torch_install.torch_install_args(installed, SPEC, _probe(True, [])) == [
        pin, "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert torch_install.torch_install_args(installed, SPEC, _probe(False, [])) == [pin]
    assert torch_install.admits(torch_install.TORCH_PIN, SPEC)  # the pin itself is admitted (rule 1 keeps it)


def test_a_new_venv_keeps_the_base_pythons_torch_but_not_another_venvs():
    assert torch_install.venv_would_see("2.11.0+cu130", SPEC, "/usr", "/usr")  # a GPU image's system Python
    assert not torch_install.venv_would_see("2.11.0+cu130", SPEC, "/work/.venv", "/usr")  # a venv's Python
    assert not torch_install.venv_would_see("2.5.0", SPEC, "/usr", "/usr")
    assert not torch_install.venv_would_see(None, SPEC, "/usr", "/usr")


def test_the_range_is_pyproject_tomls_and_versions_compare_by_release():
    assert torch_install.torch_spec(ROOT / "pyproject.toml") == SPEC
    assert torch_install.release("2.13.0+cpu") == (2, 13, 0) and torch_install.release("2.14.0rc1") == (2, 14, 0)
    assert torch_install.admits("2.11", SPEC) and not torch_install.admits("2.14.0", SPEC)
    assert torch_install.admits("2.13.9.post1", SPEC) and not torch_install.admits("2.10.99", SPEC)
    with pytest.raises(ValueError, match="unsupported version clause '~=2.11'"):
        torch_install.admits("2.13.0", "~=2.11")


class _Index(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_probe_answers_for_a_live_index_and_gives_up_on_a_dead_one():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert torch_install.index_answers(f"http://127.0.0.1:{server.server_port}/whl/cpu", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    start = time.perf_counter()
    assert not torch_install.index_answers(f"http://127.0.0.1:{closed}/whl/cpu", timeout=2)
    assert time.perf_counter() - start < 2.5


def test_the_script_prints_one_argument_a_line_and_nothing_when_the_torch_is_kept(monkeypatch, capsys):
    """``setup.sh`` reads the output with ``mapfile``: an empty line would become an empty pip argument."""
    monkeypatch.setattr(torch_install, "installed_torch", lambda: "2.13.0+cpu")
    assert torch_install.main([]) == 0 and capsys.readouterr().out == ""
    monkeypatch.setattr(torch_install, "installed_torch", lambda: None)
    monkeypatch.setattr(torch_install, "index_answers", lambda *a, **k: False)
    assert torch_install.main([]) == 0 and capsys.readouterr().out == f"torch=={torch_install.TORCH_PIN}\n"
