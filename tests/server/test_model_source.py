"""--model takes a local folder or a Hugging Face repo id served from the local cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _resolve(model: str, hub_cache: Path) -> subprocess.CompletedProcess:
    code = ("from server.model_loader import resolve_model_path; "
            "from server.settings import ModelSection; "
            f"print(resolve_model_path(ModelSection(path={model!r})))")
    # Offline mode pins the test to the cache, with or without a network.
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)


def test_a_cached_repo_id_resolves_to_its_snapshot(tiny_model_path: Path, tmp_path: Path):
    # The layout huggingface_hub writes: refs/main names the snapshot folder.
    repo = tmp_path / "models--veloxquant--tiny-test"
    shutil.copytree(tiny_model_path, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    out = _resolve("veloxquant/tiny-test", tmp_path)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == repo / "snapshots" / COMMIT


def test_an_uncached_repo_id_says_only_local_paths_load_offline(tmp_path: Path):
    out = _resolve("veloxquant/not-there", tmp_path)
    assert out.returncode != 0
    assert "ModelNotFoundError" in out.stderr
    assert "not in the local Hugging Face cache" in out.stderr
