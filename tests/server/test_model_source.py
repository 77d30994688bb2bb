"""--model takes a local folder or a Hugging Face repo id served from the local cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_a_cached_repo_id_resolves_to_its_snapshot(tiny_model_path: Path, tmp_path: Path):
    # The layout huggingface_hub writes: refs/main names the snapshot folder.
    repo = tmp_path / "models--veloxquant--tiny-test"
    shutil.copytree(tiny_model_path, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    out = _resolve("veloxquant/tiny-test", tmp_path)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == repo / "snapshots" / COMMIT


@pytest.mark.slow
def test_an_uncached_repo_id_says_only_local_paths_load_offline(tmp_path: Path):
    out = _resolve("veloxquant/not-there", tmp_path)
    assert out.returncode != 0
    assert "ModelNotFoundError" in out.stderr
    assert "not in the local Hugging Face cache" in out.stderr


def _serve(args: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOXQUANT_")}
    env.update({"VELOXQUANT_HOME": str(home), "PYTHONPATH": str(REPO),
                "VELOXQUANT_NO_BLAS_PRELOAD": "1"})
    return subprocess.run([sys.executable, "-m", "server", "--port", "0", *args], env=env,
                          capture_output=True, text=True, timeout=120,
                          cwd=home if home.is_dir() else home.parent)


@pytest.mark.slow
def test_a_bad_gguf_stops_start_up_with_one_line_and_writes_nothing(tmp_path: Path):
    from tests.gguf import synth

    good = synth.write_model(tmp_path / "good.gguf", synth.Spec("Q8_0"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    home = tmp_path / "home"
    home.mkdir()
    out = _serve(["--model", str(cut)], home)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(cut) in lines[0] and "truncated" in lines[0], out.stderr
    models = home / "models"
    assert not models.exists() or not any(models.rglob("*"))


def test_a_gguf_file_converts_once_into_the_models_cache(tmp_path: Path, monkeypatch):
    from server.model_loader import resolve_model_path
    from server.settings import ModelSection
    from tests.gguf import synth

    monkeypatch.setenv("VELOXQUANT_HOME", str(tmp_path / "home"))
    gguf = synth.write_model(tmp_path / "m.gguf", synth.Spec("Q4_1"))
    folder = resolve_model_path(ModelSection(path=str(gguf)))
    assert folder.parent == tmp_path / "home" / "models" / "gguf"
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert resolve_model_path(ModelSection(path=str(gguf))) == folder


@pytest.mark.slow
def test_a_missing_gguf_says_so(tmp_path: Path):
    out = _serve(["--model", str(tmp_path / "nope.gguf")], tmp_path)
    assert out.returncode == 2
    assert "nope.gguf" in out.stderr and "does not exist" in out.stderr


@pytest.mark.slow
def test_a_cache_folder_that_cannot_be_made_stops_start_up_with_one_line(tmp_path: Path):
    from tests.gguf import synth

    gguf = synth.write_model(tmp_path / "m.gguf", synth.Spec("Q8_0"))
    home = tmp_path / "a-file"  # VELOXQUANT_HOME names a file: no models folder in it
    home.write_text("")
    for model in ("tiny", str(gguf)):
        out = _serve(["--model", model], home)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"model {model!r} cannot be prepared: Not a directory" in lines[0]
        assert "set VELOXQUANT_HOME to a folder this user can write" in lines[0]


@pytest.mark.slow
def test_a_port_in_use_or_a_bad_host_stops_start_up_before_the_model_loads(tmp_path: Path):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        taken = _serve(["--port", str(port)], tmp_path)  # the default model, not yet converted
    assert taken.returncode == 2, taken.stderr
    assert taken.stderr.strip().splitlines() == [
        f"veloxquant-serve: cannot listen on 127.0.0.1:{port}: Address already in use; stop "
        "what holds the port or pick another with --port"]
    unknown = _serve(["--host", "no-such-host.invalid"], tmp_path)
    assert unknown.returncode == 2
    assert "--host 'no-such-host.invalid' does not resolve" in unknown.stderr
    assert not (tmp_path / "models").exists()  # nothing was built or converted first


@pytest.mark.slow
def test_a_folder_whose_config_is_not_json_is_named(tmp_path: Path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{")
    out = _serve(["--model", str(folder)], tmp_path)
    assert out.returncode == 2
    assert f"'{folder / 'config.json'}' is not valid JSON" in out.stderr.strip().splitlines()[-1]
