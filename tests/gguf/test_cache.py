"""The cache: content-addressed folders, reused on the second start."""

from __future__ import annotations

import hashlib
import json

from tests.gguf import synth
from veloxquant_mlx.gguf import convert_gguf
from veloxquant_mlx.gguf.convert import CONVERTER_VERSION


def _snapshot(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_second_convert_reuses_folder(synthetic_files, tmp_path):
    path = synthetic_files["Q4_0"]
    first = convert_gguf(path, tmp_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert first == tmp_path / "gguf" / f"{digest[:16]}-v{CONVERTER_VERSION}"
    assert json.loads((first / "gguf_source.json").read_text())["sha256"] == digest
    expected_files = {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "generation_config.json", "special_tokens_map.json", "gguf_source.json",
    }  # fmt: skip
    assert set(_snapshot(first)) == expected_files
    before = _snapshot(first)
    second = convert_gguf(str(path), str(tmp_path))
    assert second == first and _snapshot(second) == before  # no file was written again
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [first.name]  # no temp leftovers


def test_same_content_elsewhere_shares_folder(synthetic_files, tmp_path):
    copy = tmp_path / "renamed-copy.gguf"
    copy.write_bytes(synthetic_files["Q4_1"].read_bytes())
    root = tmp_path / "cache"
    assert convert_gguf(copy, root) == convert_gguf(synthetic_files["Q4_1"], root)


def test_different_content_gets_another_folder(tmp_path):
    a = synth.write_model(tmp_path / "a.gguf", synth.Spec("Q8_0"), seed=1)
    b = synth.write_model(tmp_path / "b.gguf", synth.Spec("Q8_0"), seed=2)
    assert convert_gguf(a, tmp_path / "cache") != convert_gguf(b, tmp_path / "cache")


def test_smollm2_second_start_is_fast(smollm2_path, smollm2_folder):
    before = _snapshot(smollm2_folder)
    again = convert_gguf(smollm2_path, smollm2_folder.parent.parent)
    assert again == smollm2_folder
    assert _snapshot(again) == before  # only the sha256 of the 98 MB file: nothing rewritten
