"""Server configuration: TOML file < ``VELOXQUANT_*`` env vars < CLI flags.

The result is one frozen :class:`Settings` object handed to
``create_app(settings)``. This is the only module of the server that reads
the process environment, so every knob the server obeys can be found here.

:func:`load_settings` builds the settings with pydantic-settings from three
sources, highest precedence first: the CLI overrides (init kwargs), the
environment (``VELOXQUANT_<SECTION>_<KEY>``, e.g. ``VELOXQUANT_POOL_N_BLOCKS``)
and the TOML file (``--config``, else the packaged default). Each TOML section
maps to one frozen, strict model (:mod:`server.settings_sections`); a bad
value becomes a :class:`ConfigError` that names the dotted key
(``pool.n_blocks``), so a bad config stops start-up with a message that says
what to fix.
"""

from __future__ import annotations

import contextvars
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_origin

from pydantic import Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from server.env_names import NON_SETTING_ENV, EnvError, clean_secret, unknown_variable
from server.settings_sections import (  # noqa: F401  (re-exported: the settings API)
    DEFAULT_N_BLOCKS,
    LOG_LEVELS,
    MODEL_DTYPES,
    MODEL_PRESETS,
    BatchSection,
    CacheSection,
    ConfigError,
    CpuSection,
    DistributedSection,
    KVSection,
    LimitsSection,
    MetricsSection,
    ModelSection,
    PoolSection,
    SamplingSection,
    ServerSection,
    _FieldProblem,
    _Section,
    parse_bytes,
)

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
# Secrets come from the environment or a flag (server.cli), never from the config file,
# which may be committed.
SECRET_ENV = {"admin_token": "VELOXQUANT_ADMIN_TOKEN", "api_key": "VELOXQUANT_API_KEY"}


@dataclass(frozen=True)
class _LoadRequest:
    path: Path | Traversable
    env: Mapping[str, str]
    origins: Mapping[str, str]  # "server.port" -> "--port": where an override came from


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
    cache: CacheSection = Field(default_factory=CacheSection)
    kv: KVSection = Field(default_factory=KVSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
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
        for key, value in self.toml_data.items():
            # A secret at the top level or in a section ([server] api_key is the likely one).
            inner = [k for k in value if k in SECRET_ENV] if isinstance(value, dict) else []
            if key in SECRET_ENV or inner:
                name = key if key in SECRET_ENV else f"{key}.{inner[0]}"
                raise ConfigError(f"config key {name!r}: secrets are read from the environment "
                                  f"only ({SECRET_ENV[name.rpartition('.')[2]]}), never from "
                                  "a file")
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
        return parse_text(section, key, raw, f"env {name}")


def parse_text(section: str, key: str, raw: str | list[str], origin: str) -> Any:
    """Setting ``section.key`` from text: an environment variable's value or a flag's.

    A list setting takes a JSON array or comma-separated items (several flag values are
    each read so); any other is parsed to its key's type as pydantic's lax mode does
    (``"8"`` -> 8, ``"true"`` -> True), since the sections themselves are strict.

    Args:
        origin: Where the text came from, named in the error: ``"env NAME"``, ``"--port"``.

    Raises:
        ConfigError: The text is no value of the key's type; names the key and ``origin``.
    """
    annotation = SECTIONS[section].model_fields[key].annotation
    texts = [raw] if isinstance(raw, str) else raw
    try:
        value: Any = ([item for text in texts for item in _env_list(text)]
                      if get_origin(annotation) is list else raw)
        return TypeAdapter(annotation).validate_python(value, strict=False)
    except (ValidationError, ValueError) as exc:
        problem = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        raise ConfigError(
            f"config key '{section}.{key}' (from {origin}): {raw!r}: {problem}"
        ) from None


def _env_list(raw: str) -> list[Any]:
    """A list from one variable: a JSON array, or comma-separated items (blanks dropped).

    ``VELOXQUANT_SERVER_CORS_ALLOW_ORIGINS='https://a.example,https://b.example'`` and
    ``'["https://a.example"]'`` give the same list; an empty value gives ``[]``.

    Raises:
        ValueError: It starts like a JSON array but is not valid JSON.
    """
    text = raw.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON array ({exc}); or use comma-separated items") from None
        if not isinstance(value, list):
            raise ValueError("not a JSON array")
        return value
    return [item.strip() for item in text.split(",") if item.strip()]


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
        field = [*loc, problem.field]
        return f"config key {'.'.join(field)!r}{_source(field)}: {problem}"
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        if len(loc) == 1:
            return f"config key {key!r}: unknown section (known: {', '.join(SECTIONS)})"
        known = ", ".join(SECTIONS[loc[0]].model_fields)
        return f"config key {key!r}: unknown key (known in [{loc[0]}]: {known})"
    problem = error["msg"].removeprefix("Value error, ")  # pydantic's wording for a ValueError
    return f"config key {key!r}{_source(loc)}: {problem} (got {error['input']!r})"


def _source(loc: list[str]) -> str:
    """`` (from --port)`` or `` (from env NAME)`` when the value of config key ``loc``
    came from a named override (the CLI's flags win) or from the environment."""
    request = _LOADING.get()
    if request is None or len(loc) != 2:
        return ""
    origin = request.origins.get(".".join(loc))
    if origin is not None:
        return f" (from {origin})"
    name = f"{ENV_PREFIX}{loc[0]}_{loc[1]}".upper()
    return f" (from env {name})" if name in request.env else ""


def _config_error(exc: ValidationError) -> ConfigError:
    return ConfigError("; ".join(_describe(error) for error in exc.errors()))


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Mapping[str, Any] | str] | None = None,
    env: Mapping[str, str] | None = None,
    origins: Mapping[str, str] | None = None,
) -> Settings:
    """Build the settings: file, then environment, then explicit overrides (CLI).

    Args:
        config_path: TOML file; ``None`` reads the packaged default
            (:data:`DEFAULT_CONFIG_PATH`, same as ``config/default.toml``).
        overrides: ``{"server": {"port": 9000}}``-shaped values that win over
            file and environment (the CLI flags).
        env: Environment to read; ``None`` reads ``os.environ``.
        origins: Where overrides came from, named in errors: ``{"server.port":
            "--port"}`` makes a bad value "config key 'server.port' (from --port)".

    Returns:
        The validated, frozen settings.

    Raises:
        ConfigError: A missing file, unknown key, wrong type or impossible
            value, with the key named in the message.
    """
    path = Path(config_path) if config_path is not None else DEFAULT_CONFIG_PATH
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    token = _LOADING.set(_LoadRequest(path, os.environ if env is None else env,
                                      dict(origins or {})))
    try:
        return Settings(**{name: values if name in SECRET_ENV else dict(values)
                           for name, values in (overrides or {}).items()})
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte "
                          f"{exc.start}: {exc.object[exc.start:exc.start + 1]!r})") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: "
                          f"{exc.strerror or exc}") from None
    except ValidationError as exc:
        raise _config_error(exc) from None
    finally:
        _LOADING.reset(token)
