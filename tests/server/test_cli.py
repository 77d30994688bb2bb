"""The command line (server/cli.py): a flag for every setting, vLLM's and llama.cpp's names,
--print-config, --version, the secrets' flags and --chat-template.

Everything but the last test runs in-process through the parser and the settings function
(no server); the chat template is checked on a live tiny-model server's /tokenize.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest

import server.__main__ as entry
from server.cli import build_parser, parse_args, settings_from_args
from server.config_text import default_comments
from server.settings import SECTIONS, ConfigError, Settings
from tests.support.servers import run_server

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}|{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(autouse=True)
def _no_settings_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests that read os.environ see only the variables they set."""
    for name in list(os.environ):
        if name.startswith("VELOXQUANT_") and name != "VELOXQUANT_HOME":
            monkeypatch.delenv(name)


def settings(*argv: str, env: dict[str, str] | None = None) -> Settings:
    return settings_from_args(parse_args(list(argv)), env=env or {})


def value(settings_: Settings, dotted: str) -> Any:
    section, _, key = dotted.rpartition(".")
    return getattr(getattr(settings_, section) if section else settings_, key)


def test_help_lists_a_flag_for_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        parse_args(["--help"])
    assert ended.value.code == 0
    shown = capsys.readouterr().out
    expected = [f"--{section}.{key.replace('_', '-')}"
                for section in SECTIONS for key in SECTIONS[section].model_fields]
    expected += [f"--{name.replace('_', '-')}" for name in Settings.model_fields
                 if name not in SECTIONS]  # the secrets
    missing = [flag for flag in expected if flag not in shown]
    assert not missing, f"settings without a flag: {missing}"


def test_every_setting_flag_has_help_from_the_default_config() -> None:
    comments = default_comments()
    for section, model in SECTIONS.items():
        for key in model.model_fields:
            assert comments.get(f"{section}.{key}"), f"{section}.{key}: no comment in default.toml"
    assert comments["server.port"] == "TCP port (0 = pick a free one)"
    assert "8000" in build_parser().format_help()  # the default is shown


@pytest.mark.parametrize("argv,dotted,want", [
    (["--pool.kv-memory", "4GiB"], "pool.kv_memory", "4GiB"),
    (["--limits.max-queue", "3"], "limits.max_queue", 3),
    (["--sampling.temperature", "0"], "sampling.temperature", 0.0),
    (["--no-cache.prefix-caching"], "cache.prefix_caching", False),
    (["--server.cors-allow-origins", "https://a.example", "https://b.example"],
     "server.cors_allow_origins", ["https://a.example", "https://b.example"]),
    (["--server.cors-allow-origins", "https://a.example,https://b.example"],
     "server.cors_allow_origins", ["https://a.example", "https://b.example"]),
    (["--batch.events-at-submit", "false"], "batch.events_at_submit", False),
    (["--batch.events-at-submit", "auto"], "batch.events_at_submit", "auto"),
    (["--kv.format", "q4"], "kv.format", "q4"),
])
def test_the_dotted_flags_set_their_key(argv: list[str], dotted: str, want: Any) -> None:
    assert value(settings(*argv), dotted) == want


def test_a_flag_beats_the_env_and_the_env_the_file(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[server]\nport = 9000\n[limits]\nmax_queue = 5\n")
    env = {"VELOXQUANT_SERVER_PORT": "9001"}
    assert settings("--config", str(config), env=env).server.port == 9001
    got = settings("--config", str(config), "--port", "9002", env=env)
    assert (got.server.port, got.limits.max_queue) == (9002, 5)


# One case per alias: vLLM's, then llama.cpp's.
@pytest.mark.parametrize("argv,dotted,want", [
    (["--served-model-name", "chat", "gpt-4o-mini"], "model.served_name", ["chat", "gpt-4o-mini"]),
    (["--max-model-len", "4096"], "limits.max_context_tokens", 4096),
    (["--max-num-seqs", "8"], "batch.max_batch_size", 8),
    (["--kv-cache-dtype", "auto"], "kv.format", "native"),
    (["--kv-cache-dtype", "fp8"], "kv.format", "q8"),
    (["--kv-cache-dtype", "fp8_e4m3"], "kv.format", "q8"),
    (["--kv-cache-dtype", "fp8_e5m2"], "kv.format", "q8"),
    (["--kv-cache-dtype", "q4"], "kv.format", "q4"),
    (["--no-enable-prefix-caching"], "cache.prefix_caching", False),
    (["--chat-template", TEMPLATE], "model.chat_template", TEMPLATE),
    (["--api-key", "k-123"], "api_key", "k-123"),
    (["-m", "tiny"], "model.path", "tiny"),
    (["-c", "2048"], "limits.max_context_tokens", 2048),
    (["--ctx-size", "1024"], "limits.max_context_tokens", 1024),
    (["-np", "4"], "batch.max_batch_size", 4),
    (["--parallel", "2"], "batch.max_batch_size", 2),
    (["--alias", "chat"], "model.served_name", ["chat"]),
    (["--alias", "chat,gpt-4o-mini"], "model.served_name", ["chat", "gpt-4o-mini"]),
])
def test_an_alias_sets_its_key(argv: list[str], dotted: str, want: Any) -> None:
    assert value(settings(*argv), dotted) == want


def test_enable_prefix_caching_wins_over_the_env() -> None:
    env = {"VELOXQUANT_CACHE_PREFIX_CACHING": "false"}
    assert not settings(env=env).cache.prefix_caching
    assert settings("--enable-prefix-caching", env=env).cache.prefix_caching


@pytest.mark.parametrize("flag,name", [("--api-key-file", "api_key"),
                                       ("--admin-token-file", "admin_token")])
def test_a_secret_file_is_read_and_stripped(tmp_path: Path, flag: str, name: str) -> None:
    secret = tmp_path / "secret"
    secret.write_text("  s3cret-token\n")
    assert value(settings(flag, str(secret)), name) == "s3cret-token"


@pytest.mark.parametrize("argv,start", [
    (["--port", "abc"], "config key 'server.port' (from --port): 'abc': "),
    (["--server.port", "70000"], "config key 'server.port' (from --server.port): "),
    (["--limits.max-queue", "-1"], "config key 'limits.max_queue' (from --limits.max-queue): "),
    (["--pool.kv-memory", "lots"], "config key 'pool.kv_memory' (from --pool.kv-memory): "),
    (["--batch.events-at-submit", "sometimes"],
     "config key 'batch.events_at_submit' (from --batch.events-at-submit): "),
    (["--max-num-seqs", "0"], "config key 'batch.max_batch_size' (from --max-num-seqs): "),
    (["-c", "-1"], "config key 'limits.max_context_tokens' (from -c): "),
    (["--server.cors-allow-origins", "https://a.example/"],
     "config key 'server.cors_allow_origins' (from --server.cors-allow-origins): "),
    (["--chat-template", "no-such-template.jinja"],
     "config key 'model.chat_template' (from --chat-template): no such file"),
])
def test_a_bad_flag_value_names_the_key_and_the_flag(argv: list[str], start: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings(*argv, env={"VELOXQUANT_SERVER_PORT": "8001"})
    assert str(info.value).startswith(start)


def test_an_unknown_kv_cache_dtype_names_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        settings("--kv-cache-dtype", "fp4")
    assert str(info.value) == ("config key 'kv.format' (from --kv-cache-dtype): 'fp4' is not "
                               "one of auto, fp8, fp8_e4m3, fp8_e5m2, native, q8, q4, "
                               "turboquant_mse, polar")


def test_an_unreadable_or_empty_secret_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--api-key-file '/no/such/key': the file cannot be"):
        settings("--api-key-file", "/no/such/key")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=f"--admin-token-file '{empty}' is set but empty"):
        settings("--admin-token-file", str(empty))


def _quiet_main(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """main() up to serving: no MLX environment, no BLAS; returns what it would serve."""
    served: list[Settings] = []
    monkeypatch.setattr(entry, "apply_mlx_env_defaults", lambda: None)
    monkeypatch.setattr(entry, "load_optimized_blas", lambda enabled: None)
    monkeypatch.setattr(entry, "_serve", lambda s: served.append(s) or 0)
    return served


def test_print_config_shows_each_source_and_hides_secrets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    served = _quiet_main(monkeypatch)
    config = tmp_path / "c.toml"
    config.write_text("[pool]\nblock_size = 32\n")
    monkeypatch.setenv("VELOXQUANT_LIMITS_MAX_QUEUE", "7")
    monkeypatch.setenv("VELOXQUANT_ADMIN_TOKEN", "admin-s3cret")
    assert entry.main(["--config", str(config), "--port", "9002", "--api-key", "key-s3cret",
                       "--print-config"]) == 0
    assert served == []  # it stops before any model is loaded
    lines = {line.split("=")[0].strip(): line
             for line in capsys.readouterr().out.splitlines() if " = " in line}
    assert lines["block_size"].split("#")[1].strip() == str(config)
    assert lines["max_queue"].endswith("# env VELOXQUANT_LIMITS_MAX_QUEUE")
    assert lines["port"].startswith("port = 9002 ") and lines["port"].endswith("# --port")
    assert lines["host"].startswith('host = "127.0.0.1"') and lines["host"].endswith("# default")
    assert lines["api_key"].startswith('api_key = "***"')
    assert lines["admin_token"].endswith("# env VELOXQUANT_ADMIN_TOKEN")
    assert all("s3cret" not in line for line in lines.values())


@pytest.mark.slow
def test_python_dash_m_server_prints_the_config_and_exits_0() -> None:
    done = subprocess.run([sys.executable, "-m", "server", "--print-config", "-np", "3"],
                          cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "max_batch_size = 3" in done.stdout and "# -np" in done.stdout


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        parse_args(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out.strip() == f"veloxquant-serve {version('veloxquant-mlx')}"


def test_an_api_key_on_the_command_line_works_and_is_warned_about(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    served = _quiet_main(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="veloxquant.server"):
        assert entry.main(["--model", "tiny", "--api-key", "key-s3cret"]) == 0
    assert served[0].api_key == "key-s3cret"
    warned = [r.getMessage() for r in caplog.records if "--api-key" in r.getMessage()]
    assert len(warned) == 1 and "command line" in warned[0] and "--api-key-file" in warned[0]
    assert "key-s3cret" not in caplog.text
    caplog.clear()
    secret = tmp_path / "key"
    secret.write_text("key-s3cret\n")
    with caplog.at_level(logging.WARNING, logger="veloxquant.server"):
        assert entry.main(["--model", "tiny", "--api-key-file", str(secret)]) == 0
    assert served[1].api_key == "key-s3cret" and "command line" not in caplog.text


@pytest.mark.parametrize("form", ["file", "inline"])
def test_chat_template_changes_what_tokenize_renders(
        form: str, tmp_path: Path, tiny_model_path: Path) -> None:
    template = TEMPLATE
    if form == "file":
        template = str(tmp_path / "chat.jinja")
        Path(template).write_text(TEMPLATE)
    argv = ["--model", str(tiny_model_path), "--chat-template", template,
            "--pool.n-blocks", "512"]
    with run_server(settings_from_args(parse_args(argv), env={})) as server:
        ids = httpx.post(f"{server.base_url}/tokenize", timeout=30, json={
            "messages": [{"role": "user", "content": "hello"}]}).json()["tokens"]
        text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids},
                          timeout=30).json()["prompt"]
    assert text == "[user] hello|[assistant]"
