"""Server configuration: TOML file < ``VELOXQUANT_*`` env vars < CLI flags.

The result is one frozen :class:`Settings` object handed to
``create_app(settings)``. This is the only module of the server that reads
the process environment, so every knob the server obeys can be found here.

:func:`load_settings` builds the settings with pydantic-settings from three
sources, highest precedence first: the CLI overrides (init kwargs), the
environment (``VELOXQUANT_<SECTION>_<KEY>``, e.g. ``VELOXQUANT_POOL_N_BLOCKS``)
and the TOML file (``--config``, else the packaged default). Each TOML section
maps to one frozen, strict model below; a bad value becomes a
:class:`ConfigError` that names the dotted key (``pool.n_blocks``), so a bad
config stops start-up with a message that says what to fix.
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from server.env_names import NON_SETTING_ENV, EnvError, clean_secret, unknown_variable

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

# Package data, so an installed wheel finds it without the source tree;
# config/default.toml is the documented copy (a test keeps the two identical).
DEFAULT_CONFIG_PATH: Traversable = files("server") / "default_config" / "default.toml"
ENV_PREFIX = "VELOXQUANT_"
# Secrets come from the environment only, never from a file that may be committed.
SECRET_ENV = {"admin_token": "VELOXQUANT_ADMIN_TOKEN", "api_key": "VELOXQUANT_API_KEY"}

LogLevel = Literal["critical", "error", "warning", "info", "debug"]
ModelDtype = Literal["auto", "native", "float32", "float16", "bfloat16"]
ModelPreset = Literal["smollm2", "tiny", "small"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
MODEL_DTYPES: tuple[str, ...] = get_args(ModelDtype)
MODEL_PRESETS: tuple[str, ...] = get_args(ModelPreset)


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the fix."""


class _FieldProblem(ValueError):
    """A check spanning several fields failed; ``field`` is the one to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Section(BaseModel):
    # strict: a TOML `1` is not a bool and `"8"` is not an int (env strings are
    # parsed by the env source before validation); ints still pass as floats.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ServerSection(_Section):
    """Where the HTTP server listens and how it logs."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: LogLevel = "info"
    request_log: bool = True
    metrics_require_key: bool = False
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    docs: bool = True
    header_timeout_s: float = Field(default=10.0, gt=0)
    keep_alive_timeout_s: float = Field(default=5.0, gt=0)
    max_connections: int = Field(default=1000, ge=1)


class ModelSection(_Section):
    """Which model to load and in which compute dtype.

    ``path`` empty means the default model named by ``preset``: ``smollm2``
    (the real SmolLM2-135M-Instruct) or the offline random test models
    ``tiny`` and ``small``. ``dtype = "auto"`` computes in float32 on CPU;
    ``"native"`` keeps every weight as stored. On CPU with ``auto``, quantized
    weights are dequantized to float32 when that copy fits in
    ``max_dequantized_bytes`` (0 = half the machine's memory).
    """

    path: str = ""
    served_name: str = ""
    dtype: ModelDtype = "auto"
    max_dequantized_bytes: int = Field(default=0, ge=0)
    preset: ModelPreset = "smollm2"


DEFAULT_N_BLOCKS = 16384
_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2,
               "mb": 1000**2, "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
               "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(value: str | int) -> int:
    """``"4GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``4096`` as a positive byte count.

    Raises:
        ValueError: Not a size, an unknown unit, or not positive.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    try:
        size = int(float(number) * _BYTE_UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"{value!r} is not a size (examples: \"4GiB\", \"512MiB\", "
                         "1073741824)") from None
    if size < 1:
        raise ValueError(f"{value!r} must be more than 0 bytes")
    return size


class PoolSection(_Section):
    """Sizing of the one shared block pool (see ``veloxquant_mlx.memory.PoolConfig``).

    ``max_blocks = 0`` means no cap on growth (only used with
    ``grow_on_exhaustion``); TOML has no null, so 0 stands in for None.
    ``kv_memory`` sizes the pool in bytes instead of blocks (``"4GiB"``,
    ``"512MiB"`` or a byte count; empty = use ``n_blocks``): the engine turns
    it into ``n_blocks`` once the model's layout is known. Give one of the
    two: a ``kv_memory`` beside an ``n_blocks`` other than its default is refused.
    """

    block_size: int = Field(default=16, ge=1)
    n_blocks: int = DEFAULT_N_BLOCKS
    kv_memory: str | int = ""
    separate_kv: bool = True
    grow_on_exhaustion: bool = False
    max_blocks: int = Field(default=0, ge=0)

    @property
    def kv_memory_bytes(self) -> int | None:
        """``kv_memory`` in bytes, or None when the pool is sized by ``n_blocks``."""
        return parse_bytes(self.kv_memory) if self.kv_memory not in ("", 0) else None

    @model_validator(mode="after")
    def _check_kv_memory(self) -> PoolSection:
        try:
            kv = self.kv_memory_bytes
        except ValueError as exc:
            raise _FieldProblem("kv_memory", str(exc)) from None
        if kv is not None and self.n_blocks != DEFAULT_N_BLOCKS:
            raise _FieldProblem("kv_memory", f"{self.kv_memory!r} and pool.n_blocks = "
                                f"{self.n_blocks} both size the pool; set only one")
        return self

    @model_validator(mode="after")
    def _check_sizes(self) -> PoolSection:
        if self.n_blocks < (2 if self.separate_kv else 1):
            raise _FieldProblem("n_blocks", f"{self.n_blocks} is too small "
                                "(needs >= 2 with separate_kv, else >= 1)")
        if self.max_blocks and self.max_blocks < self.n_blocks:
            raise _FieldProblem("max_blocks", f"{self.max_blocks} must be 0 (no cap) or "
                                f">= pool.n_blocks ({self.n_blocks})")
        return self


class LimitsSection(_Section):
    """Per-request limits and the admission queue's bounds."""

    default_max_tokens: int = 256
    max_tokens_cap: int = Field(default=4096, ge=1)
    max_prompt_tokens: int = Field(default=8192, ge=1)
    max_queue: int = Field(default=64, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)
    max_stop_sequences: int = Field(default=8, ge=0)
    max_stop_length: int = Field(default=256, ge=1)
    max_body_bytes: int = Field(default=1048576, ge=1024)
    stream_stall_timeout_s: float = Field(default=30.0, gt=0)
    max_concurrent_per_client: int = Field(default=0, ge=0)  # 0 = no cap

    @model_validator(mode="after")
    def _check_default_fits_cap(self) -> LimitsSection:
        if not 1 <= self.default_max_tokens <= self.max_tokens_cap:
            raise _FieldProblem("default_max_tokens", f"{self.default_max_tokens} must be in "
                                f"1..limits.max_tokens_cap ({self.max_tokens_cap})")
        return self


class SamplingSection(_Section):
    """Sampling defaults for requests that leave a field out (0 disables top_k)."""

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)


class BatchSection(_Section):
    """Continuous batching: how many requests decode together and how prompts are fed in."""

    max_batch_size: int = Field(default=32, ge=1)
    prefill_chunk_size: int = Field(default=512, ge=1)
    max_prefill_tokens_per_step: int = Field(default=2048, ge=1)


class CpuSection(_Section):
    """CPU backend knobs (Linux): preload Debian's OpenBLAS under MLX."""

    optimized_blas: bool = True


@dataclass(frozen=True)
class _LoadRequest:
    path: Path | Traversable
    env: Mapping[str, str]


# Set only while load_settings runs: a bare Settings() reads nothing, so it
# is exactly the documented defaults whatever the process environment holds.
_LOADING: contextvars.ContextVar[_LoadRequest | None] = contextvars.ContextVar(
    "veloxquant_settings_load", default=None
)


class Settings(BaseSettings):
    """Every knob of the server, validated and immutable.

    Secrets (``admin_token``, ``api_key``) come only from the environment
    and are excluded from ``repr`` so they never reach a log line.
    """

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    server: ServerSection = Field(default_factory=ServerSection)
    model: ModelSection = Field(default_factory=ModelSection)
    pool: PoolSection = Field(default_factory=PoolSection)
    limits: LimitsSection = Field(default_factory=LimitsSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    batch: BatchSection = Field(default_factory=BatchSection)
    cpu: CpuSection = Field(default_factory=CpuSection)
    admin_token: str | None = Field(default=None, repr=False)
    api_key: str | None = Field(default=None, repr=False)

    def replace(self, **sections: Any) -> Settings:
        """Return a validated copy with whole sections replaced (tests build variants this way).

        Raises:
            ConfigError: A replaced section is invalid.
        """
        try:
            return type(self).model_validate({**dict(self), **sections})
        except ValidationError as exc:
            raise _config_error(exc) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """CLI overrides > ``VELOXQUANT_*`` env > TOML file (first wins)."""
        request = _LOADING.get()
        if request is None:
            return (init_settings,)
        return (
            init_settings,
            SectionEnvSource(settings_cls, request.env),
            SectionTomlSource(settings_cls, request.path),
        )


SECTIONS: dict[str, type[_Section]] = {
    name: field.annotation
    for name, field in Settings.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, _Section)
}


class SectionTomlSource(TomlConfigSettingsSource):
    """The TOML file; only ``[section]`` tables are allowed at the top level."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path | Traversable) -> None:
        super().__init__(settings_cls, toml_file=path)
        for key in self.toml_data:
            if key in SECRET_ENV:
                raise ConfigError(f"config key {key!r}: secrets are read from the environment "
                                  f"only ({SECRET_ENV[key]}), never from a file")
            if key not in SECTIONS:
                raise ConfigError(
                    f"config key {key!r}: unknown section (known: {', '.join(SECTIONS)})"
                )


class SectionEnvSource(PydanticBaseSettingsSource):
    """``VELOXQUANT_<SECTION>_<KEY>`` variables, plus the two secrets.

    A single underscore joins section and key (the names the server has
    always read), so the section is found by prefix rather than by a nested
    delimiter. Values are parsed to the key's type here because the section
    models are strict.
    """

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.env = env

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """Unused: :meth:`__call__` maps the whole environment at once."""
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        """The environment's values as ``{section: {key: value}}`` and secrets."""
        out: dict[str, Any] = {}
        for secret, env_name in SECRET_ENV.items():
            value = self.env.get(env_name)
            if value is not None:
                try:
                    out[secret] = clean_secret(env_name, value)
                except EnvError as exc:
                    raise ConfigError(str(exc)) from None
        for name, raw in self.env.items():
            if name in NON_SETTING_ENV or name in SECRET_ENV.values():
                continue
            found = self._section_key(name)
            if found is not None:
                section, key = found
                out.setdefault(section, {})[key] = self._parse(name, section, key, raw)
            elif name.startswith(ENV_PREFIX):
                raise ConfigError(str(unknown_variable(name, _valid_env_names())))
        return out

    @staticmethod
    def _section_key(name: str) -> tuple[str, str] | None:
        if not name.startswith(ENV_PREFIX):
            return None
        rest = name[len(ENV_PREFIX):].lower()
        section = next((s for s in SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            return None  # a typo, unless it is one of NON_SETTING_ENV
        return section, rest[len(section) + 1:]

    @staticmethod
    def _parse(name: str, section: str, key: str, raw: str) -> Any:
        fields = SECTIONS[section].model_fields
        if key not in fields:
            raise ConfigError(
                f"config key '{section}.{key}' (from env {name}): unknown key "
                f"(known in [{section}]: {', '.join(fields)}); "
                f"{unknown_variable(name, _valid_env_names())}"
            )
        try:
            return TypeAdapter(fields[key].annotation).validate_python(raw, strict=False)
        except ValidationError as exc:
            raise ConfigError(
                f"config key '{section}.{key}' (from env {name}): {raw!r}: "
                f"{exc.errors()[0]['msg']}"
            ) from None


def _valid_env_names() -> list[str]:
    """Every ``VELOXQUANT_*`` name the project reads: settings, secrets, the others."""
    names = [f"{ENV_PREFIX}{section}_{key}".upper()
             for section, model in SECTIONS.items() for key in model.model_fields]
    return [*names, *SECRET_ENV.values(), *NON_SETTING_ENV]


def _describe(error: Mapping[str, Any]) -> str:
    """One pydantic error as ``config key 'pool.n_blocks': what is wrong``."""
    loc = [str(part) for part in error["loc"]]
    problem = error.get("ctx", {}).get("error")
    if isinstance(problem, _FieldProblem):
        return f"config key {'.'.join([*loc, problem.field])!r}: {problem}"
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        if len(loc) == 1:
            return f"config key {key!r}: unknown section (known: {', '.join(SECTIONS)})"
        known = ", ".join(SECTIONS[loc[0]].model_fields)
        return f"config key {key!r}: unknown key (known in [{loc[0]}]: {known})"
    return f"config key {key!r}: {error['msg']} (got {error['input']!r})"


def _config_error(exc: ValidationError) -> ConfigError:
    return ConfigError("; ".join(_describe(error) for error in exc.errors()))


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Build the settings: file, then environment, then explicit overrides (CLI).

    Args:
        config_path: TOML file; ``None`` reads the packaged default
            (:data:`DEFAULT_CONFIG_PATH`, same as ``config/default.toml``).
        overrides: ``{"server": {"port": 9000}}``-shaped values that win over
            file and environment (the CLI flags).
        env: Environment to read; ``None`` reads ``os.environ``.

    Returns:
        The validated, frozen settings.

    Raises:
        ConfigError: A missing file, unknown key, wrong type or impossible
            value, with the key named in the message.
    """
    path = Path(config_path) if config_path is not None else DEFAULT_CONFIG_PATH
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    token = _LOADING.set(_LoadRequest(path, os.environ if env is None else env))
    try:
        return Settings(**{name: dict(values) for name, values in (overrides or {}).items()})
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except ValidationError as exc:
        raise _config_error(exc) from None
    finally:
        _LOADING.reset(token)
