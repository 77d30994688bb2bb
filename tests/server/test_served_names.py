"""The names a model is served under: a Hugging Face id as asked, aliases from
``model.served_name`` / ``--served-model-name``, each accepted in a request's ``model``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.__main__ import parse_args, settings_from_args
from server.model_loader import served_names
from server.settings import ConfigError, ModelSection, load_settings
from tests.support.servers import make_settings, run_server

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_ID = "mlx-community/SmolLM2-135M-Instruct-4bit"


@pytest.mark.parametrize(("source", "path", "want"), [
    (HUB_ID, f"/hub/models--mlx-community--SmolLM2-135M-Instruct-4bit/snapshots/{COMMIT}",
     HUB_ID),
    ("/models/my-llama", "/models/my-llama", "my-llama"),
    ("/models/q4.gguf", f"/cache/gguf-{COMMIT}", "q4"),
    ("smollm2", f"/cache/gguf-{COMMIT}", "SmolLM2-135M-Instruct"),
])
def test_the_default_name_is_what_the_operator_asked_for(source, path, want):
    assert served_names(ModelSection(path=source), Path(path)) == (want,)


def test_a_local_folder_shaped_like_a_repo_id_keeps_its_folder_name(tmp_path, monkeypatch):
    # --model tries a local folder before the hub, and the name follows what was served.
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert served_names(ModelSection(path="org/name"), tmp_path / "org" / "name") == ("name",)


def test_aliases_replace_the_default_name_the_first_is_primary():
    section = ModelSection(path=HUB_ID, served_name=["chat", "gpt-4o-mini"])
    assert served_names(section, Path("/snapshot")) == ("chat", "gpt-4o-mini")


@pytest.mark.slow
def test_a_cached_hub_id_is_served_under_that_id(tiny_model_path: Path, tmp_path: Path):
    # The layout huggingface_hub writes: refs/main names the snapshot folder by commit.
    repo = tmp_path / "models--veloxquant--tiny-test"
    shutil.copytree(tiny_model_path, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    code = ("from server.model_loader import resolve_model_path, served_names; "
            "from server.settings import ModelSection; "
            "s = ModelSection(path='veloxquant/tiny-test'); p = resolve_model_path(s); "
            "print(p.name); print(served_names(s, p))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [COMMIT, "('veloxquant/tiny-test',)"]


@pytest.mark.parametrize(("toml", "env", "want"), [
    ('[model]\nserved_name = "chat"\n', {}, ["chat"]),
    ('[model]\nserved_name = ["chat", "gpt-4o-mini"]\n', {}, ["chat", "gpt-4o-mini"]),
    ('[model]\nserved_name = ""\n', {}, []),
    ("", {"VELOXQUANT_MODEL_SERVED_NAME": "chat, gpt-4o-mini"}, ["chat", "gpt-4o-mini"]),
    ("", {"VELOXQUANT_MODEL_SERVED_NAME": '["chat", "gpt-4o-mini"]'}, ["chat", "gpt-4o-mini"]),
    ("", {"VELOXQUANT_MODEL_SERVED_NAME": "chat"}, ["chat"]),
])
def test_served_name_takes_one_name_or_a_list(tmp_path, toml, env, want):
    config = tmp_path / "c.toml"
    config.write_text(toml)
    assert load_settings(config, env=env).model.served_name == want


@pytest.mark.parametrize("names", [[""], ["chat", " "], ["chat", "chat"]])
def test_blank_or_repeated_names_are_refused(names):
    with pytest.raises(ConfigError, match="model.served_name"):
        load_settings(overrides={"model": {"served_name": names}}, env={})


def test_the_cli_flag_takes_one_or_more_names_and_wins_over_the_env(monkeypatch):
    args = parse_args(["--served-model-name", "chat", "gpt-4o-mini"])
    monkeypatch.setenv("VELOXQUANT_MODEL_SERVED_NAME", "from-env")
    assert settings_from_args(args).model.served_name == ["chat", "gpt-4o-mini"]
    assert settings_from_args(parse_args([])).model.served_name == ["from-env"]


@pytest.fixture(scope="module")
def aliased(tiny_model_path: Path):
    settings = make_settings(model={"path": str(tiny_model_path),
                                    "served_name": ["tiny-chat", "gpt-4o-mini"]})
    with run_server(settings) as server:
        yield server


def test_models_lists_every_name_primary_first(aliased):
    listed = httpx.get(aliased.base_url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == ["tiny-chat", "gpt-4o-mini"]
    one = httpx.get(aliased.base_url + "/v1/models/gpt-4o-mini", timeout=10)
    assert one.status_code == 200 and one.json()["id"] == "gpt-4o-mini"
    assert httpx.get(aliased.base_url + "/v1/models/tiny", timeout=10).status_code == 404


@pytest.mark.parametrize("name", ["tiny-chat", "gpt-4o-mini", "default", None])
def test_a_request_by_any_name_is_answered_by_the_primary(aliased, name):
    body = {"prompt": "hi", "max_tokens": 2, **({"model": name} if name else {})}
    answer = httpx.post(aliased.base_url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "tiny-chat"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **({"model": name} if name else {})}
    assert httpx.post(aliased.base_url + "/v1/chat/completions", json=chat,
                      timeout=60).status_code == 200


def test_an_unknown_name_is_404_naming_the_served_ones(aliased):
    answer = httpx.post(aliased.base_url + "/v1/completions",
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'tiny-chat'" in error["message"] and "'gpt-4o-mini'" in error["message"]
