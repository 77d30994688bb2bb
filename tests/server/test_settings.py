"""Configuration: file -> env -> CLI, validation naming the key, frozen result."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.__main__ import parse_args, settings_from_args
from server.env_names import NON_SETTING_ENV
from server.settings import (
    DEFAULT_CONFIG_PATH,
    MODEL_PRESETS,
    SECTIONS,
    ConfigError,
    Settings,
    _valid_env_names,
    load_settings,
)

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_default_file_has_every_knob_and_loads_to_defaults():
    settings = load_settings(env={})
    assert settings == Settings()  # the file documents exactly the model defaults
    text = DEFAULT_CONFIG_PATH.read_text()
    for section in ("server", "model", "pool", "limits", "sampling", "batch", "cpu"):
        for name in SECTIONS[section].model_fields:
            assert f"\n{name} =" in text, f"{section}.{name} missing from default.toml"


def test_packaged_default_is_the_documented_copy():
    documented = (REPO / "config" / "default.toml").read_bytes()
    assert DEFAULT_CONFIG_PATH.read_bytes() == documented
    assert "server" in Path(str(DEFAULT_CONFIG_PATH)).parts  # package data, not the repo

@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[pool]\nn_blokcs = 3\n", "pool.n_blokcs"),
        ("[poool]\nn_blocks = 3\n", "poool"),
        ("[pool]\nn_blocks = \"many\"\n", "pool.n_blocks"),
        ("[pool]\nseparate_kv = 1\n", "pool.separate_kv"),
        ("[pool]\nn_blocks = 0\n", "pool.n_blocks"),
        ("[pool]\nn_blocks = 100\nmax_blocks = 50\n", "pool.max_blocks"),
        ("[limits]\ndefault_max_tokens = 5000\nmax_tokens_cap = 10\n", "limits.default_max_tokens"),
        ("[server]\nport = 70000\n", "server.port"),
        ("[server]\nlog_level = \"loud\"\n", "server.log_level"),
        ("[sampling]\ntop_p = 0\n", "sampling.top_p"),
        ("[model]\ndtype = \"int3\"\n", "model.dtype"),
        ("[limits]\nqueue_timeout_s = 0\n", "limits.queue_timeout_s"),
        ("[model]\nmax_dequantized_bytes = -1\n", "model.max_dequantized_bytes"),
        ("[model]\npreset = \"huge\"\n", "model.preset"),
        ("api_key = \"in-a-file\"\n", "api_key"),  # secrets come from the env only
        ("[server]\napi_key = \"in-a-file\"\n", "server.api_key"),
        ("[server]\nadmin_token = \"in-a-file\"\n", "server.admin_token"),
    ],
)
def test_bad_config_names_the_key(tmp_path, toml, key):
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, toml), env={})
    assert repr(key) in str(info.value)
    if key.endswith(("api_key", "admin_token")):  # where the secret goes instead
        assert "from the environment only (VELOXQUANT_" in str(info.value)


def test_env_overrides_file_and_cli_overrides_env(tmp_path):
    path = write(tmp_path, "[server]\nport = 9001\n[pool]\nblock_size = 8\n")
    env = {"VELOXQUANT_SERVER_PORT": "9002", "VELOXQUANT_POOL_SEPARATE_KV": "false",
           "VELOXQUANT_LIMITS_QUEUE_TIMEOUT_S": "2.5"}
    settings = load_settings(path, env=env)
    assert settings.server.port == 9002
    assert settings.pool.block_size == 8
    assert settings.pool.separate_kv is False
    assert settings.limits.queue_timeout_s == 2.5
    settings = load_settings(path, env=env, overrides={"server": {"port": 9003}})
    assert settings.server.port == 9003


@pytest.mark.parametrize(
    ("env", "key"),
    [({"VELOXQUANT_POOL_N_BLOCKS": "lots"}, "pool.n_blocks"),
     ({"VELOXQUANT_POOL_BLOCKSIZE": "8"}, "pool.blocksize"),
     ({"VELOXQUANT_CPU_OPTIMIZED_BLAS": "maybe"}, "cpu.optimized_blas")],
)
def test_bad_env_names_the_key(env, key):
    with pytest.raises(ConfigError) as info:
        load_settings(env=env)
    assert key in str(info.value)


def test_an_impossible_env_value_names_its_variable():
    """A value that parses but a check refuses still says it came from the environment."""
    with pytest.raises(ConfigError) as info:
        load_settings(env={"VELOXQUANT_KV_GROUP_SIZE": "48"})
    message = str(info.value)
    assert message.startswith("config key 'kv.group_size' (from env VELOXQUANT_KV_GROUP_SIZE):")
    assert "Value error" not in message


def test_every_key_reads_its_single_underscore_env_name():
    env = {"VELOXQUANT_MODEL_MAX_DEQUANTIZED_BYTES": "1048576", "VELOXQUANT_MODEL_PRESET": "tiny",
           "VELOXQUANT_POOL_N_BLOCKS": "100", "VELOXQUANT_SERVER_LOG_LEVEL": "debug",
           "VELOXQUANT_SAMPLING_TOP_P": "0.5", "VELOXQUANT_SERVER_REQUEST_LOG": "off"}
    settings = load_settings(env=env)
    assert (settings.model.max_dequantized_bytes, settings.model.preset) == (1048576, "tiny")
    assert (settings.pool.n_blocks, settings.server.log_level) == (100, "debug")
    assert (settings.sampling.top_p, settings.server.request_log) == (0.5, False)


def test_sources_merge_per_key(tmp_path):
    """A section set in several places keeps each key from its highest source."""
    path = write(tmp_path, "[pool]\nblock_size = 8\nn_blocks = 10\nseparate_kv = true\n")
    settings = load_settings(path, env={"VELOXQUANT_POOL_N_BLOCKS": "20"},
                             overrides={"pool": {"separate_kv": False}})
    assert (settings.pool.block_size, settings.pool.n_blocks, settings.pool.separate_kv) == (
        8, 20, False)


def test_process_env_is_read_only_by_load_settings(monkeypatch):
    monkeypatch.setenv("VELOXQUANT_SERVER_PORT", "9100")
    assert load_settings().server.port == 9100
    assert Settings().server.port == 8000  # a bare Settings() is the documented defaults


def test_presets_and_new_model_keys():
    assert MODEL_PRESETS == ("smollm2", "tiny", "small")
    assert Settings().model.preset == "smollm2"
    assert Settings().model.max_dequantized_bytes == 0
    for preset in MODEL_PRESETS:
        assert load_settings(env={}, overrides={"model": {"preset": preset}}).model.preset == preset


def test_replace_validates_and_names_the_key():
    settings = Settings().replace(pool={"n_blocks": 64})
    assert settings.pool.n_blocks == 64 and settings.server == Settings().server
    with pytest.raises(ConfigError, match="'pool.max_blocks'"):
        Settings().replace(pool={"n_blocks": 64, "max_blocks": 8})


def test_non_setting_project_env_vars_are_accepted():
    env = {name: "1" for name in NON_SETTING_ENV} | {"PATH": "/bin", "OTHER_TOOL_X": "1"}
    assert load_settings(env=env) == Settings()


@pytest.mark.parametrize("name,closest", [
    ("VELOXQUANT_LIMIT_MAX_QUEUE", "VELOXQUANT_LIMITS_MAX_QUEUE"),  # section misspelt
    ("VELOXQUANT_POOL_NBLOCKS", "VELOXQUANT_POOL_N_BLOCKS"),  # key misspelt
    ("VELOXQUANT_NO_BLAS", "VELOXQUANT_NO_BLAS_PRELOAD"),  # a non-setting one misspelt
    ("VELOXQUANT_API_KYE", "VELOXQUANT_API_KEY"),
])
def test_env_typos_stop_start_up_naming_the_closest_name(name, closest):
    with pytest.raises(ConfigError) as info:
        load_settings(env={name: "0"})
    assert name in str(info.value) and f"did you mean {closest}?" in str(info.value)


def test_every_veloxquant_env_name_in_the_code_is_known():
    """A new VELOXQUANT_* variable read anywhere must be a setting or in NON_SETTING_ENV."""
    valid = set(_valid_env_names())
    found = set()
    for folder in ("server", "veloxquant_mlx", "scripts", "benchmark_scripts"):
        for path in (REPO / folder).rglob("*.py"):
            found |= set(re.findall(r"VELOXQUANT_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    found |= set(re.findall(r"VELOXQUANT_[A-Z0-9_]*[A-Z0-9]", (REPO / "setup.py").read_text()))
    placeholders = {"VELOXQUANT_SECTION_KEY"}
    assert found - valid - placeholders == set()


@pytest.mark.slow
def test_the_typo_stops_a_real_start_up():
    proc = _serve(env_extra={"VELOXQUANT_LIMIT_MAX_QUEUE": "0"})
    assert proc.returncode == 2
    assert "VELOXQUANT_LIMIT_MAX_QUEUE" in proc.stderr
    assert "VELOXQUANT_LIMITS_MAX_QUEUE" in proc.stderr


def test_secrets_are_stripped_and_must_be_printable_ascii():
    settings = load_settings(env={"VELOXQUANT_API_KEY": "k3y\n",
                                  "VELOXQUANT_ADMIN_TOKEN": "  adm1n\t"})
    assert (settings.api_key, settings.admin_token) == ("k3y", "adm1n")
    for name in ("VELOXQUANT_API_KEY", "VELOXQUANT_ADMIN_TOKEN"):
        for bad in ("", " \n", "t\u00f6ken", "a\x00b"):
            with pytest.raises(ConfigError, match=name):
                load_settings(env={name: bad})


def test_secrets_come_from_env_and_stay_out_of_repr():
    settings = load_settings(env={"VELOXQUANT_ADMIN_TOKEN": "s3cret", "VELOXQUANT_API_KEY": "k"})
    assert settings.admin_token == "s3cret" and settings.api_key == "k"
    assert "s3cret" not in repr(settings)
    with pytest.raises(ValidationError, match="frozen"):
        settings.admin_token = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        settings.pool.n_blocks = 1  # type: ignore[misc]


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(write(tmp_path, "[pool\n"), env={})
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"\xff\xfe[pool]\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0: b'\\xff'\)"):
        load_settings(latin1, env={})
    with pytest.raises(ConfigError, match="is a directory"):
        load_settings(tmp_path, env={})


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_infinite_or_nan_floats_are_refused(value):
    """An infinite queue timeout would switch the bound off without a word."""
    with pytest.raises(ConfigError, match="limits.queue_timeout_s"):
        load_settings(env={"VELOXQUANT_LIMITS_QUEUE_TIMEOUT_S": value})


def test_cli_flags(monkeypatch):
    monkeypatch.delenv("VELOXQUANT_SERVER_PORT", raising=False)
    args = parse_args(["--host", "0.0.0.0", "--port", "1234", "--model", "/m", "--log-level",
                       "debug"])
    settings = settings_from_args(args)
    assert (settings.server.host, settings.server.port, settings.model.path,
            settings.server.log_level) == ("0.0.0.0", 1234, "/m", "debug")


@pytest.mark.parametrize("argv,start", [
    (["--port", "70000"], "config key 'server.port' (from --port): "),
    (["--distributed", "0"], "config key 'distributed.ranks' (from --distributed): "),
    (["--host", ""], "config key 'server.host' (from --host): "),
])
def test_a_bad_flag_value_names_its_flag(monkeypatch, argv, start):
    """The flag wins over the env, so the error names the flag even when both are set."""
    monkeypatch.setenv("VELOXQUANT_SERVER_PORT", "8001")
    with pytest.raises(ConfigError) as info:
        settings_from_args(parse_args(argv))
    assert str(info.value).startswith(start)


def _serve(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "VELOXQUANT_NO_BLAS_PRELOAD": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "server", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_start_up_stops_on_bad_config(tmp_path):
    proc = _serve("--config", str(write(tmp_path, "[pool]\nn_blocks = -1\n")))
    assert proc.returncode == 2
    assert "'pool.n_blocks'" in proc.stderr


@pytest.mark.slow
def test_hub_ids_are_refused_offline():
    proc = _serve("--model", "mlx-community/Llama-3.2-1B-Instruct-4bit")
    assert proc.returncode == 2
    assert "only local paths load offline" in proc.stderr.lower()


@pytest.mark.parametrize("env", [{"VELOXQUANT_ADMIN_TOKEN": "t\u00f6ken"},
                                 {"VELOXQUANT_API_KEY": " \n"}])
@pytest.mark.slow
def test_a_bad_secret_stops_a_real_start_up_naming_the_variable(env):
    proc = _serve(env_extra=env)
    assert proc.returncode == 2
    assert next(iter(env)) in proc.stderr
