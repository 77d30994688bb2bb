"""docs/configuration.md: what scripts/gen_config_doc.py writes today, every setting in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server.cli import build_parser
from server.config_text import env_name
from server.settings import SECRET_ENV, SECTIONS, Settings
from tests.script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


@pytest.fixture(scope="module")
def script():
    return load_script("gen_config_doc")


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def row(page: str, name: str) -> str:
    """The table row of setting (or secret) ``name``; fails when there is none."""
    found = re.findall(rf"^\| `{re.escape(name)}` \|.*$", page, flags=re.MULTILINE)
    assert len(found) == 1, f"{name}: {len(found)} rows in docs/configuration.md"
    return found[0]


def test_page_is_what_the_script_writes(script, page):
    # A new or changed setting, flag, alias or default-config comment needs a rerun.
    assert page == script.render(), "run: python scripts/gen_config_doc.py"


def test_check_flags_a_stale_page(script, tmp_path, monkeypatch):
    stale = tmp_path / "configuration.md"
    stale.write_text(script.render().replace("| `pool.n_blocks` |", "| `pool.blocks` |"))
    monkeypatch.setattr(script, "PAGE", stale)
    monkeypatch.setattr(script, "ROOT", tmp_path)
    assert script.main(["--check"]) == 1
    assert script.main([]) == 0
    assert script.main(["--check"]) == 0


def test_every_setting_has_a_row_with_its_flags_and_variable(page):
    flags: dict[str, list[str]] = {}
    for action in build_parser()._actions:
        flags.setdefault(action.dest, []).extend(action.option_strings)
    for section, model in SECTIONS.items():
        assert f"\n## [{section}]\n" in page
        for key in model.model_fields:
            line = row(page, f"{section}.{key}")
            assert f"`{env_name(f'{section}.{key}')}`" in line
            for flag in flags[f"{section}.{key}"]:
                assert f"`{flag}`" in line, (section, key, flag)


def test_every_field_of_settings_is_covered(page):
    # The sections and the secrets are all of Settings: nothing is left out of the page.
    assert set(Settings.model_fields) == set(SECTIONS) | set(SECRET_ENV)
    for secret, variable in SECRET_ENV.items():
        line = row(page, secret)
        assert f"`{variable}`" in line
        assert f"`--{secret.replace('_', '-')}-file FILE`" in line


def test_aliases_of_other_servers_are_listed(page):
    assert "`--max-model-len`, `-c`, `--ctx-size`" in row(page, "limits.max_context_tokens")
    assert "`--kv-cache-dtype`" in row(page, "kv.format")
    assert "`--max-num-seqs`" in row(page, "batch.max_batch_size")


def test_precedence_and_print_config_are_stated(page):
    assert "--print-config" in page
    order = [page.index(word) for word in
             ("1. the TOML file", "2. the environment", "3. the command line")]
    assert order == sorted(order)
