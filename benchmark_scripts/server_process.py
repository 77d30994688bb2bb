"""A real ``python -m server`` child process on a free loopback port.

Used by the soak benchmark and by tests that need a whole process: signal
handling (SIGTERM drain), resident memory, captured logs. The child's stdout
and stderr go to one log file the caller can read afterwards.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, in bytes (Linux /proc, else ``ps``)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip()) * 1024


class ServerProcess:
    """Start, watch and stop one server process.

    Args:
        log_path: File receiving the child's stdout and stderr.
        args: Extra command-line flags (``--config``, ``--model`` ...).
        env: Extra environment variables. The parent's ``VELOXQUANT_*``
            variables are dropped first so the child sees only these.
        startup_timeout_s: Longest wait for ``GET /health`` to answer 200.
        preexec_fn: Run in the child before it execs (e.g. lower its file limit).
    """

    def __init__(self, log_path: Path, args: list[str] | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 120.0,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.args = list(args or [])
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("VELOXQUANT_")}
        self.env.update(env or {})
        self.env["PYTHONUNBUFFERED"] = "1"  # log lines reach the file as they happen
        self.startup_timeout_s = startup_timeout_s
        self.preexec_fn = preexec_fn  # runs in the child before exec (e.g. setrlimit)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """The child's pid."""
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> ServerProcess:
        """Launch the child and wait until it is healthy.

        Raises:
            RuntimeError: It exited or stayed unhealthy past the start-up timeout;
                the message carries the end of its log.
        """
        cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"server not healthy after {self.startup_timeout_s}s:\n{self.log()}")

    def terminate(self) -> None:
        """Send SIGTERM (the graceful, draining stop)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """Wait for the child to exit; returns its exit code (raises on timeout)."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Kill the child (only this pid) if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then kill if needed; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        """Everything the child wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def rss(self) -> int:
        """The child's resident set size in bytes."""
        return rss_bytes(self.pid)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
