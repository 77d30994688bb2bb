"""Server configuration: TOML file -> ``VELOXQUANT_*`` env overrides -> CLI flags.

The result is one frozen :class:`Settings` object handed to
``create_app(settings)``. This is the only module of the server that reads
the process environment, so every knob the server obeys can be found here.

Each section of the TOML file maps to one frozen dataclass below; every
dataclass validates itself in ``__post_init__`` and names the offending key
(``pool.n_blocks``) in its error, so a bad config stops start-up with a
message that says what to fix.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config" / "default.toml"
ENV_PREFIX = "VELOXQUANT_"
# Secrets come from the environment only, never from a file that may be committed.
ADMIN_TOKEN_ENV = "VELOXQUANT_ADMIN_TOKEN"
API_KEY_ENV = "VELOXQUANT_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MODEL_DTYPES = ("auto", "native", "float32", "float16", "bfloat16")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the fix."""


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"config key {key!r}: {message}")


@dataclasses.dataclass(frozen=True, slots=True)
class ServerSection:
    """Where the HTTP server listens and how it logs."""

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    request_log: bool = True
    metrics_require_key: bool = False
    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        _require(bool(self.host), "server.host", "must not be empty")
        _require(0 <= self.port <= 65535, "server.port", f"{self.port} is not in 0..65535")
        _require(self.shutdown_grace_s >= 0, "server.shutdown_grace_s", "must be >= 0")
        _require(
            self.log_level in LOG_LEVELS,
            "server.log_level",
            f"{self.log_level!r} is not one of {', '.join(LOG_LEVELS)}",
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSection:
    """Which model to load and in which compute dtype.

    ``path`` empty means the offline default model (built on first use).
    ``dtype = "auto"`` computes in float32 on CPU for unquantized models and
    keeps quantized models as stored; ``"native"`` keeps every weight as stored.
    """

    path: str = ""
    served_name: str = ""
    dtype: str = "auto"
    preset: str = "tiny"

    def __post_init__(self) -> None:
        _require(
            self.dtype in MODEL_DTYPES,
            "model.dtype",
            f"{self.dtype!r} is not one of {', '.join(MODEL_DTYPES)}",
        )
        _require(bool(self.preset), "model.preset", "must not be empty")


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSection:
    """Sizing of the one shared block pool (see ``veloxquant_mlx.memory.PoolConfig``).

    ``max_blocks = 0`` means no cap on growth (only used with
    ``grow_on_exhaustion``); TOML has no null, so 0 stands in for None.
    """

    block_size: int = 16
    n_blocks: int = 16384
    separate_kv: bool = True
    grow_on_exhaustion: bool = False
    max_blocks: int = 0

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "pool.block_size", f"{self.block_size} must be >= 1")
        _require(self.n_blocks >= 2 if self.separate_kv else self.n_blocks >= 1,
                 "pool.n_blocks",
                 f"{self.n_blocks} is too small (needs >= 2 with separate_kv, else >= 1)")
        _require(
            self.max_blocks == 0 or self.max_blocks >= self.n_blocks,
            "pool.max_blocks",
            f"{self.max_blocks} must be 0 (no cap) or >= pool.n_blocks ({self.n_blocks})",
        )


@dataclasses.dataclass(frozen=True, slots=True)
class LimitsSection:
    """Per-request limits and the admission queue's bounds."""

    default_max_tokens: int = 256
    max_tokens_cap: int = 4096
    max_prompt_tokens: int = 8192
    max_queue: int = 64
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1
    max_stop_sequences: int = 8
    max_stop_length: int = 256
    max_body_bytes: int = 1048576
    stream_stall_timeout_s: float = 30.0
    max_concurrent_per_client: int = 0

    def __post_init__(self) -> None:
        _require(self.max_tokens_cap >= 1, "limits.max_tokens_cap", "must be >= 1")
        _require(
            1 <= self.default_max_tokens <= self.max_tokens_cap,
            "limits.default_max_tokens",
            f"{self.default_max_tokens} must be in 1..limits.max_tokens_cap "
            f"({self.max_tokens_cap})",
        )
        _require(self.max_prompt_tokens >= 1, "limits.max_prompt_tokens", "must be >= 1")
        _require(self.max_queue >= 0, "limits.max_queue", "must be >= 0")
        _require(self.queue_timeout_s > 0, "limits.queue_timeout_s", "must be > 0")
        _require(self.retry_after_s >= 1, "limits.retry_after_s", "must be >= 1")
        _require(self.max_stop_sequences >= 0, "limits.max_stop_sequences", "must be >= 0")
        _require(self.max_stop_length >= 1, "limits.max_stop_length", "must be >= 1")
        _require(self.max_body_bytes >= 1024, "limits.max_body_bytes", "must be >= 1024")
        _require(self.stream_stall_timeout_s > 0, "limits.stream_stall_timeout_s",
                 "must be > 0")
        _require(self.max_concurrent_per_client >= 0, "limits.max_concurrent_per_client",
                 "must be >= 0 (0 = no cap)")


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingSection:
    """Sampling defaults for requests that leave a field out."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        _require(0.0 <= self.temperature <= 2.0, "sampling.temperature", "must be in 0..2")
        _require(0.0 < self.top_p <= 1.0, "sampling.top_p", "must be in (0, 1]")
        _require(self.top_k >= 0, "sampling.top_k", "must be >= 0 (0 disables)")
        _require(0.0 <= self.min_p <= 1.0, "sampling.min_p", "must be in 0..1")


@dataclasses.dataclass(frozen=True, slots=True)
class BatchSection:
    """Continuous batching: how many requests decode together and how prompts are fed in."""

    max_batch_size: int = 32
    prefill_chunk_size: int = 512
    max_prefill_tokens_per_step: int = 2048

    def __post_init__(self) -> None:
        _require(self.max_batch_size >= 1, "batch.max_batch_size", "must be >= 1")
        _require(self.prefill_chunk_size >= 1, "batch.prefill_chunk_size", "must be >= 1")
        _require(self.max_prefill_tokens_per_step >= 1, "batch.max_prefill_tokens_per_step",
                 "must be >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class CpuSection:
    """CPU backend knobs (Linux): preload Debian's OpenBLAS under MLX."""

    optimized_blas: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Every knob of the server, validated and immutable.

    Secrets (``admin_token``, ``api_key``) come only from the environment
    and are excluded from ``repr`` so they never reach a log line.
    """

    server: ServerSection = dataclasses.field(default_factory=ServerSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    pool: PoolSection = dataclasses.field(default_factory=PoolSection)
    limits: LimitsSection = dataclasses.field(default_factory=LimitsSection)
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    batch: BatchSection = dataclasses.field(default_factory=BatchSection)
    cpu: CpuSection = dataclasses.field(default_factory=CpuSection)
    admin_token: str | None = dataclasses.field(default=None, repr=False)
    api_key: str | None = dataclasses.field(default=None, repr=False)

    def replace(self, **sections: Any) -> Settings:
        """Return a copy with whole sections replaced (tests build variants this way)."""
        return dataclasses.replace(self, **sections)


SECTIONS: dict[str, type] = {
    "server": ServerSection,
    "model": ModelSection,
    "pool": PoolSection,
    "limits": LimitsSection,
    "sampling": SamplingSection,
    "batch": BatchSection,
    "cpu": CpuSection,
}


def _field_types(section_cls: type) -> dict[str, type]:
    # Annotations are strings under `from __future__ import annotations`.
    names = {"int": int, "float": float, "bool": bool, "str": str}
    return {f.name: names[str(f.type)] for f in dataclasses.fields(section_cls)}


def _coerce(key: str, value: Any, expected: type) -> Any:
    """Check a TOML value's type; ints are accepted where floats are expected."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, bool):
        raise ConfigError(f"config key {key!r}: expected an integer, got a boolean")
    if not isinstance(value, expected):
        raise ConfigError(
            f"config key {key!r}: expected {expected.__name__}, got "
            f"{type(value).__name__} ({value!r})"
        )
    return value


def _parse_env_value(key: str, raw: str, expected: type) -> Any:
    """Parse an environment string into the knob's type, naming the key on failure."""
    try:
        if expected is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if expected is int:
            return int(raw)
        if expected is float:
            return float(raw)
    except ValueError:
        raise ConfigError(
            f"config key {key!r} (from env {ENV_PREFIX}{key.replace('.', '_').upper()}): "
            f"{raw!r} is not a valid {expected.__name__}"
        ) from None
    return raw


def _merge_file(raw: Mapping[str, Any], merged: dict[str, dict[str, Any]]) -> None:
    for section, table in raw.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"config key {section!r}: unknown section (known: {', '.join(SECTIONS)})"
            )
        if not isinstance(table, Mapping):
            raise ConfigError(f"config key {section!r}: expected a table, got {table!r}")
        types = _field_types(SECTIONS[section])
        for key, value in table.items():
            full = f"{section}.{key}"
            if key not in types:
                raise ConfigError(
                    f"config key {full!r}: unknown key (known in [{section}]: "
                    f"{', '.join(types)})"
                )
            merged[section][key] = _coerce(full, value, types[key])


def _merge_env(env: Mapping[str, str], merged: dict[str, dict[str, Any]]) -> None:
    """Apply ``VELOXQUANT_<SECTION>_<KEY>`` overrides; unknown keys of a known section fail."""
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in (ADMIN_TOKEN_ENV, API_KEY_ENV):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section = next((s for s in SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            continue  # other VELOXQUANT_* variables belong to the library or tools
        key = rest[len(section) + 1:]
        types = _field_types(SECTIONS[section])
        if key not in types:
            raise ConfigError(
                f"config key '{section}.{key}' (from env {name}): unknown key "
                f"(known in [{section}]: {', '.join(types)})"
            )
        merged[section][key] = _parse_env_value(f"{section}.{key}", raw, types[key])


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Build the settings: file, then environment, then explicit overrides (CLI).

    Args:
        config_path: TOML file; ``None`` reads ``config/default.toml``.
        overrides: ``{"server": {"port": 9000}}``-shaped values that win over
            file and environment (the CLI flags).
        env: Environment to read; ``None`` reads ``os.environ``.

    Returns:
        The validated, frozen settings.

    Raises:
        ConfigError: A missing file, unknown key, wrong type or impossible
            value, with the key named in the message.
    """
    env = os.environ if env is None else env
    path = Path(config_path) if config_path is not None else DEFAULT_CONFIG_PATH
    merged: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    _merge_file(raw, merged)
    _merge_env(env, merged)
    for section, values in (overrides or {}).items():
        types = _field_types(SECTIONS[section])
        for key, value in values.items():
            merged[section][key] = _coerce(f"{section}.{key}", value, types[key])
    sections = {name: SECTIONS[name](**values) for name, values in merged.items()}
    return Settings(
        **sections,
        admin_token=env.get(ADMIN_TOKEN_ENV) or None,
        api_key=env.get(API_KEY_ENV) or None,
    )
