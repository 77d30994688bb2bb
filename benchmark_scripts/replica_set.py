"""``scripts/run_replicas.sh`` as a child process: N replicas behind nginx, their URLs and pids.

Used by ``benchmark_replicas.py`` and ``tests/e2e/test_replicas.py``. The script
prints one line per replica, one for the balancer, then ``ready``; a reader thread
keeps every line it prints afterwards (a replica's exit status, the stop messages),
so callers can wait for one with a deadline instead of blocking on the pipe.
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "run_replicas.sh"
_REPLICA = re.compile(r"^replica (\d+): (http://\S+) \(pid (\d+), log (.+)\)$")
_BALANCER = re.compile(r"^balancer: (http://\S+) \(pid (\d+);")


@dataclass(slots=True)
class Replica:
    """One started replica: 1-based index, its own base URL, pid and log file."""

    index: int
    url: str
    pid: int
    log: Path


def free_port_block(count: int, attempts: int = 50) -> int:
    """The first of ``count`` consecutive loopback ports that are free right now."""
    for _ in range(attempts):
        base = random.randint(20000, 60000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def default_signals() -> None:
    """``preexec_fn``: SIGINT and SIGQUIT at their defaults in the child.

    A caller started as a background job (``make test &``) has both ignored, and
    its children inherit that: bash cannot trap them then, and Python raises no
    KeyboardInterrupt, so a Ctrl-C stop would never happen.
    """
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


class ReplicaSet:
    """Start and stop ``run_replicas.sh N``.

    Args:
        n: Replicas.
        log_dir: The script's ``--log-dir`` (replica logs, nginx.conf, nginx-error.log).
        model: ``--model`` for every replica.
        env: Extra environment. The parent's ``VELOXQUANT_*`` variables are dropped
            first, so the replicas see only these; ``PYTHON`` is this interpreter.
        startup_timeout_s: Longest wait for the script's ``ready``.
    """

    def __init__(self, n: int, log_dir: Path, model: str = "tiny",
                 env: dict[str, str] | None = None, startup_timeout_s: float = 180.0) -> None:
        self.n = n
        self.log_dir = Path(log_dir)
        self.model = model
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("VELOXQUANT_")}
        self.env.update(env or {})
        self.env["PYTHON"] = sys.executable
        self.env["STARTUP_TIMEOUT_S"] = str(int(startup_timeout_s))
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.replicas: list[Replica] = []
        self.balancer_url = ""
        self.balancer_pid = 0
        self.output: list[str] = []           # every line the script printed so far
        self._lines: queue.Queue[str | None] = queue.Queue()   # None: the script ended
        self._ended = False

    def start(self) -> ReplicaSet:
        """Run the script and wait for ``ready``; raises RuntimeError with its output if not."""
        base = free_port_block(self.n + 1)
        cmd = ["bash", str(SCRIPT), str(self.n), "--model", self.model, "--base-port",
               str(base), "--lb-port", str(base + self.n), "--log-dir", str(self.log_dir)]
        # Its own session: a signal meant for it (SIGINT as a terminal's Ctrl-C) reaches
        # its process group only, never the caller's.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, preexec_fn=default_signals)
        threading.Thread(target=self._read, name="run_replicas-output", daemon=True).start()
        self.wait_for_line("ready", self.startup_timeout_s)
        for line in self.output:
            if m := _REPLICA.match(line):
                self.replicas.append(Replica(int(m[1]), m[2], int(m[3]), Path(m[4])))
            elif m := _BALANCER.match(line):
                self.balancer_url, self.balancer_pid = m[1], int(m[2])
        if len(self.replicas) != self.n or not self.balancer_url:
            raise RuntimeError("unexpected run_replicas.sh output:\n" + "\n".join(self.output))
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for_line(self, pattern: str, timeout: float) -> str:
        """The first line (already printed or to come) matching ``pattern`` (a regex).

        Raises:
            RuntimeError: No such line within ``timeout``, or the script ended first.
        """
        for line in self.output:
            if re.search(pattern, line):
                return line
        deadline = time.monotonic() + timeout
        while not self._ended and (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self._ended = True
                break
            self.output.append(line)
            if re.search(pattern, line):
                return line
        raise RuntimeError(f"run_replicas.sh printed no line matching {pattern!r} "
                           "in time, or ended:\n" + "\n".join(self.output))

    def collect(self) -> list[str]:
        """Every line printed so far, without waiting."""
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return self.output
            if line is None:
                self._ended = True
            else:
                self.output.append(line)

    def signal_script(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the script's process group (SIGINT: what Ctrl-C does)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM to the script (it drains the replicas), wait; returns its exit status.

        Past ``timeout`` the script and the pids it started are killed, one by one, and
        None is returned.
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal_script(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Only pids the script has not reported gone: a reaped pid may be reused.
            gone = " ".join(self.collect())
            for pid in [r.pid for r in self.replicas] + [self.balancer_pid]:
                if pid and f"(pid {pid}) exited" not in gone:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self.proc.kill()
            self.proc.wait(10)
            return None
        finally:
            time.sleep(0.05)  # let the reader thread queue the script's last lines
            self.collect()

    def __enter__(self) -> ReplicaSet:
        try:
            return self.start()
        except BaseException:
            self.stop(timeout=30)
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
