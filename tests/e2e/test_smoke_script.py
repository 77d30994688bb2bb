"""scripts/smoke.sh against a live server (curl), and its failure exit code."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.servers import ADMIN_TOKEN, LiveServer, free_port

SMOKE = Path(__file__).resolve().parents[2] / "scripts" / "smoke.sh"

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")


def run_smoke(base_url: str, token: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VELOXQUANT_ADMIN_TOKEN"}
    if token:
        env["VELOXQUANT_ADMIN_TOKEN"] = token
    return subprocess.run(["bash", str(SMOKE), base_url], env=env, capture_output=True,
                          text=True, timeout=120)


def test_smoke_script_passes_against_live_server(live_server: LiveServer):
    proc = run_smoke(live_server.base_url, ADMIN_TOKEN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checks passed" in proc.stdout
    assert "ok   admin shrink" in proc.stdout


def test_smoke_script_fails_on_wrong_token_and_dead_server(live_server: LiveServer):
    proc = run_smoke(live_server.base_url, None)  # server has a token: admin says 401, not 403
    assert proc.returncode != 0 and "FAIL" in proc.stderr
    proc = run_smoke(f"http://127.0.0.1:{free_port()}", ADMIN_TOKEN)
    assert proc.returncode != 0 and "could not reach" in proc.stderr
