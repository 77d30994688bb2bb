"""How a setting reads as text, wherever the settings are shown to a person.

A setting's environment variable, a value as TOML writes it, each key's one-line comment in
the packaged default config, and the package's version: the command line's help and
``--print-config`` (:mod:`server.cli`) and the generated configuration reference
(``scripts/gen_config_doc.py``) all word a setting through these, so they agree.
"""

from __future__ import annotations

import json
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from server.settings import DEFAULT_CONFIG_PATH, ENV_PREFIX, SECRET_ENV

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


def env_name(dotted: str) -> str:
    """The environment variable of a setting (``server.port`` -> ``VELOXQUANT_SERVER_PORT``)."""
    return SECRET_ENV.get(dotted) or f"{ENV_PREFIX}{dotted.replace('.', '_')}".upper()


def toml_value(value: Any) -> str:
    """``value`` as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(value if isinstance(value, str) else str(value), ensure_ascii=False)


def default_comments() -> dict[str, str]:
    """Each key's one-line comment in the packaged default config, by dotted name."""
    comments: dict[str, str] = {}
    section = ""
    for line in DEFAULT_CONFIG_PATH.read_text(encoding="utf-8").splitlines():
        header = re.fullmatch(r"\[(\w+)\]\s*", line)
        if header:
            section = header[1]
            continue
        found = _key_comment(line)
        if found is not None and section:
            comments[f"{section}.{found[0]}"] = found[1]
    return comments


def _key_comment(line: str) -> tuple[str, str] | None:
    """``key = value  # comment`` as (key, comment): the comment starts at the first ``#``
    before which the line is whole TOML (a ``#`` inside a string belongs to the value)."""
    match = re.match(r"(\w+)\s*=", line)
    if match is None:
        return None
    for at in (i for i, char in enumerate(line) if char == "#"):
        try:
            tomllib.loads(line[:at])
        except tomllib.TOMLDecodeError:
            continue
        return match[1], line[at + 1:].strip()
    return None


def package_version() -> str:
    """The installed package's version, else the source tree's pyproject.toml's."""
    try:
        return version("veloxquant-mlx")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"
