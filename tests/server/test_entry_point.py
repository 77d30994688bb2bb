"""The process entry point: ``run`` ends the process with main's code and skips C++ teardown.

``run`` calls ``os._exit``, so in-process tests replace it with a recorder; the subprocess
tests run ``python -m server`` itself. (The SIGTERM drain ending in exit code 0 with no
abort is in test_drain.py.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import server.__main__ as entry

REPO = Path(__file__).resolve().parents[2]


class _Exited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record os._exit's code (raised as _Exited) and the flushes that must precede it."""
    order: list[str] = []

    def fake_exit(code: int) -> None:
        order.append(f"exit {code}")
        raise _Exited(code)

    monkeypatch.setattr(entry.os, "_exit", fake_exit)
    monkeypatch.setattr(entry.logging, "shutdown", lambda: order.append("logging flushed"))
    return order


def _run() -> int:
    with pytest.raises(_Exited) as ended:
        entry.run()
    return ended.value.code


def test_a_normal_return_flushes_logs_then_exits_with_mains_code(
        exits: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entry, "main", lambda: 0)
    assert _run() == 0
    assert exits == ["logging flushed", "exit 0"]


def test_a_bad_config_still_exits_2(exits: list[str], monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["veloxquant-serve", "--config", "/no/such/file.toml"])
    assert _run() == 2
    assert "bad configuration" in capsys.readouterr().err
    assert entry.main(["--config", "/no/such/file.toml"]) == 2  # main itself still returns it


@pytest.mark.parametrize("raised,code", [
    (KeyboardInterrupt(), 130),  # Ctrl-C: uvicorn stops, then re-raises SIGINT
    (SystemExit(3), 3),          # uvicorn's start-up failure (the model did not load)
    (SystemExit(None), 0),       # --help
    (RuntimeError("bug"), 1),
])
def test_every_ending_goes_through_the_flush_and_os_exit(
        exits: list[str], monkeypatch: pytest.MonkeyPatch, raised: BaseException,
        code: int, capsys: pytest.CaptureFixture[str]) -> None:
    def main() -> int:
        raise raised

    monkeypatch.setattr(entry, "main", main)
    assert _run() == code
    assert exits == ["logging flushed", f"exit {code}"]
    if isinstance(raised, RuntimeError):
        assert "Traceback" in capsys.readouterr().err  # reported, as the interpreter would


def test_system_exit_with_a_message_prints_it_and_exits_1(
        exits: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def main() -> int:
        raise SystemExit("cannot bind")

    monkeypatch.setattr(entry, "main", main)
    assert _run() == 1
    assert "cannot bind" in capsys.readouterr().err


def test_console_script_is_run() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"veloxquant-serve": "server.__main__:run"}


@pytest.mark.slow
def test_python_dash_m_server_exits_with_mains_code() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    bad = subprocess.run([sys.executable, "-m", "server", "--config", "/no/such/file.toml"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "bad configuration" in bad.stderr
    flag = subprocess.run([sys.executable, "-m", "server", "--no-such-flag"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert flag.returncode == 2 and "unrecognized arguments" in flag.stderr
    usage = subprocess.run([sys.executable, "-m", "server", "--help"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: veloxquant-serve")
