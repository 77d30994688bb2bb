"""The example reverse-proxy config in config/nginx.conf is valid and proxies the server.

Skipped where nginx is not installed (``apt-get install nginx-light``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import LiveServer, free_port

CONFIG = Path(__file__).resolve().parents[2] / "config" / "nginx.conf"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed")


def _globals(tmp: Path, daemon: bool = True) -> str:
    extra = "" if daemon else "daemon off; "
    return f"{extra}pid {tmp}/nginx.pid; error_log {tmp}/error.log;"


def _check(conf: Path, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([NGINX, "-t", "-q", "-c", str(conf), "-p", str(tmp),
                           "-g", _globals(tmp)], capture_output=True, text=True, timeout=30)


def test_the_shipped_config_passes_nginx_t(tmp_path):
    out = _check(CONFIG, tmp_path)
    assert out.returncode == 0, out.stderr


def test_a_request_and_a_stream_through_the_proxy(live_server: LiveServer, tmp_path):
    port = free_port()
    upstream = live_server.base_url.removeprefix("http://")
    text = CONFIG.read_text()
    assert "server 127.0.0.1:8000;" in text and "listen 127.0.0.1:8080;" in text
    conf = tmp_path / "nginx.conf"
    conf.write_text(text.replace("server 127.0.0.1:8000;", f"server {upstream};")
                    .replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{port};"))
    assert _check(conf, tmp_path).returncode == 0
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(tmp_path), "-g",
                             _globals(tmp_path, daemon=False)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "nginx did not start"
                time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health", timeout=10).json()["status"] == "ok"
        body = {"prompt": "hi", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
            lines = [line for line in resp.iter_lines() if line]
        assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
    finally:
        proc.terminate()
        proc.wait(10)
