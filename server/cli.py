"""The command line of ``veloxquant-serve``: a flag for every setting, the names vLLM and
llama.cpp users type, and a view of the merged configuration.

Every key of the settings model is a flag named after it, ``--<section>.<key>`` with
dashes for underscores (``--pool.kv-memory``, ``--limits.max-queue``); a boolean also has
its ``--no-`` form (``--no-cache.prefix-caching``) and a list takes several values or a
comma list, as its environment variable does. The flags are generated from the model, so
a new setting has one without a line here; its help is the key's one-line comment in the
packaged default config. The names other servers use are aliases of the same flag
(:data:`ALIASES`). How a setting is worded (its environment variable, its value as TOML,
its comment) is :mod:`server.config_text`'s, shared with the generated configuration page.

A flag's text is parsed and validated as the key's environment variable would be
(:func:`server.settings.parse_text`), and a bad value names the key and the flag as typed:
``config key 'limits.max_context_tokens' (from --max-model-len): ...``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args, get_origin

from pydantic.fields import FieldInfo

from server.config_text import default_comments, env_name, package_version, toml_value
from server.env_names import EnvError, clean_secret
from server.settings import (
    SECRET_ENV,
    SECTIONS,
    ConfigError,
    Settings,
    load_settings,
    parse_text,
)
from server.settings_sections import KV_FORMAT_NAMES
from veloxquant_mlx.memory.pool_config import PER_REQUEST_METHODS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

log = logging.getLogger("veloxquant.server")

PROG = "veloxquant-serve"

# The names vLLM's and llama.cpp's servers give the same settings, beside --<section>.<key>
# (the first few are this server's own short names).
ALIASES: dict[str, tuple[str, ...]] = {
    "server.host": ("--host",),
    "server.port": ("--port",),
    "server.log_level": ("--log-level",),
    "model.path": ("--model", "-m"),
    "model.served_name": ("--served-model-name", "--alias"),
    "model.chat_template": ("--chat-template",),
    "limits.max_context_tokens": ("--max-model-len", "-c", "--ctx-size"),
    "batch.max_batch_size": ("--max-num-seqs", "-np", "--parallel"),
    "kv.format": ("--kv-cache-dtype",),
    "cache.prefix_caching": ("--enable-prefix-caching",),
    "distributed.ranks": ("--distributed",),
}

# vLLM's --kv-cache-dtype values as the pool's KV formats: "auto" keeps the model's dtype,
# as vLLM's does; its fp8 kinds store a byte a value, which here are affine 8-bit codes.
# The library's compression methods pass through, for the settings to say why not.
KV_CACHE_DTYPES: dict[str, str] = {
    "auto": "native", "fp8": "q8", "fp8_e4m3": "q8", "fp8_e5m2": "q8",
    **{name: name for name in (*KV_FORMAT_NAMES, *PER_REQUEST_METHODS)},
}
# Flags whose values are another server's names for the key's values.
VALUE_MAPS: dict[str, dict[str, str]] = {"--kv-cache-dtype": KV_CACHE_DTYPES}

# The secrets: the value itself (warned about: any user of the machine can read a command
# line) or a file holding it, like the environment variable the better choices.
SECRET_FLAGS: dict[str, tuple[str, str]] = {
    "api_key": ("--api-key", "--api-key-file"),
    "admin_token": ("--admin-token", "--admin-token-file"),
}

_NOTES = {
    "kv.format": "--kv-cache-dtype takes vLLM's names: auto (= native), fp8, fp8_e4m3, "
                 "fp8_e5m2 (= q8: 8-bit codes)",
    "limits.max_context_tokens": "-c/--ctx-size (llama.cpp) bound each request, not a "
                                 "context shared by the slots",
}


class FlagValue(NamedTuple):
    """A setting's value as given on the command line."""

    flag: str  # the option string typed: named in errors and by --print-config
    value: Any  # its text, its texts (a list setting), or True/False (a boolean's two forms)


class _Store(argparse.Action):
    """Keeps a flag's text with the option string typed, for the settings to parse."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, FlagValue(option_string or self.dest, values))


class _Switch(argparse.BooleanOptionalAction):
    """``--key`` / ``--no-key``, keeping which one was typed."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string in self.option_strings:
            setattr(namespace, self.dest,
                    FlagValue(option_string, not option_string.startswith("--no-")))


class _Formatter(argparse.HelpFormatter):
    """Names a flag's aliases, then its value once: ``--server.port, --port N``."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {value}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``sys.argv[1:]`` when None); --help and --version exit here."""
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The parser: --config, --print-config, --version, then a group per section."""
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=_Formatter,
        allow_abbrev=False,  # with dozens of flags a prefix would easily pick the wrong one
        usage="%(prog)s [--model MODEL] [--config FILE] [--print-config] [options]",
        description="OpenAI-compatible MLX inference server on one shared KV block pool. "
                    "Every setting of the config file is a flag, --<section>.<key>; "
                    "precedence: config file < VELOXQUANT_<SECTION>_<KEY> env < flags.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument("--config", metavar="FILE", help="TOML config file; values it leaves "
                        "out keep the built-in defaults (a packaged copy of "
                        "config/default.toml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the merged settings, each with where its value came from "
                        "(default, the config file, an env variable, a flag), secrets as "
                        "***, and exit without loading the model")
    comments = default_comments()
    for section, model in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]", _summary(model.__doc__))
        for key, field in model.model_fields.items():
            _add_setting(group, section, key, field, comments.get(f"{section}.{key}", ""))
    _add_secrets(parser.add_argument_group(
        "secrets", "never in the config file; a file or the environment keeps them out of "
        "the process list"))
    return parser


def _add_setting(group: argparse._ArgumentGroup, section: str, key: str, field: FieldInfo,
                 comment: str) -> None:
    """The flag of setting ``section.key``, with its aliases."""
    dotted = f"{section}.{key}"
    names = (f"--{section}.{key.replace('_', '-')}", *ALIASES.get(dotted, ()))
    text = _help(dotted, field, comment)
    if field.annotation is bool:
        group.add_argument(*names, dest=dotted, action=_Switch, default=None, help=text)
        return
    many = get_origin(field.annotation) is list
    group.add_argument(*names, dest=dotted, action=_Store, default=None,
                       nargs="+" if many else None, metavar=_metavar(field), help=text)


def _add_secrets(group: argparse._ArgumentGroup) -> None:
    """``--api-key``, ``--api-key-file`` and the admin token's two."""
    for name, (value_flag, file_flag) in SECRET_FLAGS.items():
        env_name = SECRET_ENV[name]
        group.add_argument(value_flag, dest=name, action=_Store, default=None,
                           metavar="TEXT", help=f"{name} itself (start-up warns: the "
                           f"process list shows it); prefer {file_flag} or env {env_name}")
        group.add_argument(file_flag, dest=name, action=_Store, default=None, metavar="FILE",
                           help=f"read {name} from FILE (surrounding whitespace dropped)")


def _help(dotted: str, field: FieldInfo, comment: str) -> str:
    """A flag's help: what the key does, its default and its environment variable."""
    what = field.description or comment
    facts = [f"default: {toml_value(field.get_default(call_default_factory=True))}"]
    if env_name(dotted) not in what:
        facts.append(f"env {env_name(dotted)}")
    if dotted in _NOTES:
        facts.append(_NOTES[dotted])
    return _escape(f"{what} ({'; '.join(facts)})".strip())


def _summary(doc: str | None) -> str | None:
    """A section's description: the first paragraph of its docstring."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return _escape(" ".join(paragraph.replace("``", "").split())) or None


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help text with %


def _metavar(field: FieldInfo) -> str:
    """What a flag's value looks like: its choices, or a word for its type."""
    choices = _choices(field.annotation)
    if choices:
        return "{" + ",".join(choices) + "}"
    if get_origin(field.annotation) is list:
        return "ITEM"
    return {int: "N", float: "X", str: "TEXT"}.get(field.annotation, "VALUE")


def _choices(annotation: Any) -> list[str]:
    """The values a Literal, or a union of Literals and bool, allows; else none."""
    if get_origin(annotation) is Literal:
        return [str(choice) for choice in get_args(annotation)]
    if annotation is bool:
        return ["true", "false"]
    if get_origin(annotation) is list:
        return []
    parts = [_choices(part) for part in get_args(annotation)]
    return [choice for part in parts for choice in part] if parts and all(parts) else []


def given_flags(args: argparse.Namespace) -> dict[str, FlagValue]:
    """The settings the command line sets, by dotted name (secrets by their own)."""
    return {dest: value for dest, value in vars(args).items() if isinstance(value, FlagValue)}


def settings_from_args(args: argparse.Namespace,
                       env: Mapping[str, str] | None = None) -> Settings:
    """Merge file, env (``os.environ`` when None) and flags into the settings.

    Raises:
        ConfigError: A bad value anywhere; one from a flag names the key and the flag.
    """
    overrides: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for dotted, given in given_flags(args).items():
        if dotted in SECRET_ENV:
            overrides[dotted] = _secret(given)
            continue
        section, key = dotted.split(".")
        overrides.setdefault(section, {})[key] = _flag_value(section, key, given)
        origins[dotted] = given.flag
    settings = load_settings(args.config, overrides=overrides, env=env, origins=origins)
    if settings.distributed.ranks > 1 and settings.cache.prefix_caching:
        # A cache hit changes what one rank computes (server.distributed).
        settings = settings.replace(cache=settings.cache.model_copy(
            update={"prefix_caching": False}))
    return settings


def _flag_value(section: str, key: str, given: FlagValue) -> Any:
    """A flag's value for setting ``section.key``, typed as the key wants it."""
    if isinstance(given.value, bool):
        return given.value
    names = VALUE_MAPS.get(given.flag)
    if names is None:
        return parse_text(section, key, given.value, given.flag)
    if given.value not in names:
        offered = [name for name, value in names.items() if value not in PER_REQUEST_METHODS]
        raise ConfigError(f"config key '{section}.{key}' (from {given.flag}): "
                          f"{given.value!r} is not one of {', '.join(offered)}")
    return names[given.value]


def _secret(given: FlagValue) -> str:
    """A secret from its flag: the text itself, or the file it names."""
    file_flag = given.flag.endswith("-file")
    where = f"{given.flag} {given.value!r}" if file_flag else given.flag
    try:
        text = _read_secret_file(given.value) if file_flag else given.value
        return clean_secret(where, text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: the file cannot be read: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    except EnvError as exc:
        raise ConfigError(str(exc)) from None


def _read_secret_file(path: str) -> str:
    return Path(path).expanduser().read_text(encoding="utf-8")


def warn_secret_flags(args: argparse.Namespace) -> None:
    """Warn of each secret given as text on the command line (``ps`` shows it to anyone)."""
    for name, given in given_flags(args).items():
        if name in SECRET_FLAGS and given.flag == SECRET_FLAGS[name][0]:
            log.warning("%s puts the %s on the command line, where any user of this machine "
                        "can read it (ps, /proc/PID/cmdline); pass %s FILE or set %s instead",
                        given.flag, name, SECRET_FLAGS[name][1], SECRET_ENV[name])


def render_config(args: argparse.Namespace, settings: Settings,
                  env: Mapping[str, str] | None = None) -> str:
    """The merged settings as TOML-like lines, each value followed by its source.

    A source is ``default``, the config file's path, ``env NAME`` or the flag typed;
    secrets show as ``"***"`` when set.
    """
    env = os.environ if env is None else env
    flags = given_flags(args)
    in_file = _file_keys(args.config)

    def source(dotted: str) -> str:
        if dotted in flags:
            return flags[dotted].flag
        if env_name(dotted) in env:
            return f"env {env_name(dotted)}"
        return args.config if dotted in in_file else "default"

    lines = [f"# {PROG} {package_version()}: the merged settings; after each value, its source"]
    for name in SECRET_ENV:
        if getattr(settings, name) is None:
            unset = f"unset ({SECRET_FLAGS[name][1]} FILE or env {SECRET_ENV[name]} sets it)"
            lines.append(_config_line(name, '""', unset))
        else:
            lines.append(_config_line(name, '"***"', source(name)))
    for section, model in SECTIONS.items():
        lines += ["", f"[{section}]"]
        for key in model.model_fields:
            value = toml_value(getattr(getattr(settings, section), key))
            lines.append(_config_line(key, value, source(f"{section}.{key}")))
    if settings.distributed.ranks > 1:
        lines.append("# cache.prefix_caching is off while distributed.ranks > 1")
    return "\n".join(lines)


def _config_line(key: str, value: str, source: str) -> str:
    return f"{f'{key} = {value}':<30}  # {source}"


def _file_keys(config: str | None) -> set[str]:
    """The dotted keys the ``--config`` file sets (none: the packaged defaults)."""
    if config is None:
        return set()
    data = tomllib.loads(Path(config).read_text(encoding="utf-8"))
    return {f"{section}.{key}" for section, table in data.items() if isinstance(table, dict)
            for key in table}
