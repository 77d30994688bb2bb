"""The offline default model: build, cache, determinism, and loading with mlx-lm."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import mlx_lm
import platformdirs
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from veloxquant_mlx import offline_model
from veloxquant_mlx.offline_model import (
    BUILD_INFO,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TURN_END,
    ensure_model,
    fingerprint,
)
from veloxquant_mlx.paths import models_dir

REPO = Path(__file__).resolve().parents[2]
FILES = {
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", BUILD_INFO,
}


def test_default_root_is_the_models_dir_outside_the_source_tree(tiny_model_path):
    assert tiny_model_path == models_dir() / "tiny"
    assert REPO not in tiny_model_path.parents
    assert Path(offline_model.__file__).parent.parent not in tiny_model_path.parents
    assert FILES <= {p.name for p in tiny_model_path.iterdir()}


def test_models_dir_follows_veloxquant_home(tmp_path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_HOME", str(tmp_path / "home"))
    assert models_dir() == tmp_path / "home" / "models"
    monkeypatch.delenv("VELOXQUANT_HOME")
    assert models_dir() == Path(platformdirs.user_cache_dir("veloxquant-mlx")) / "models"


def test_tiny_config_is_a_small_gqa_llama_in_float32(tiny_model_path, tiny_model):
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["eos_token_id"] == [SPECIAL_TOKENS.index(TURN_END), 1]
    model, _ = tiny_model
    assert len(model.layers) == 4
    weights = mx.load(str(tiny_model_path / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.float32}
    n_params = sum(w.size for w in weights.values())
    assert 500_000 < n_params < 2_000_000
    assert (tiny_model_path / "model.safetensors").stat().st_size < 10 * 2**20


def test_tokenizer_round_trips_text_and_knows_special_tokens(tiny_model):
    _, tokenizer = tiny_model
    text = "def parse(value):\n    Return the value, unchanged. Ünïcödé ok"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merges happened
    assert tokenizer.bos_token == "<|bos|>"
    assert tokenizer.eos_token == TURN_END
    assert tokenizer.eos_token_ids == {SPECIAL_TOKENS.index(TURN_END), 1}


def test_chat_template_renders_turns_and_generation_prompt(tiny_model):
    _, tokenizer = tiny_model
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert no_prompt.endswith("Hi<|im_end|>\n")
    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True)
    assert ids[:2] == [SPECIAL_TOKENS.index("<|bos|>"), SPECIAL_TOKENS.index("<|im_start|>")]
    saved = json.loads((Path(tokenizer.name_or_path) / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == CHAT_TEMPLATE


def test_end_of_turn_token_stops_generation(tiny_model):
    model, tokenizer = tiny_model
    eot = SPECIAL_TOKENS.index(TURN_END)
    steps = []

    def force_eot_at_third_step(tokens, logits):
        steps.append(len(steps))
        if len(steps) == 3:
            bias = mx.zeros(logits.shape).at[..., eot].add(1e9)
            return logits + bias
        return logits

    out = list(
        mlx_lm.stream_generate(
            model, tokenizer, "hello", max_tokens=50,
            logits_processors=[force_eot_at_third_step],
        )
    )
    assert [r.token for r in out][-1] == eot
    assert len(out) == 3
    assert out[-1].finish_reason == "stop"


@pytest.mark.slow
def test_build_is_deterministic_and_seeded(tmp_path, tiny_model_path):
    first = ensure_model("tiny", root=tmp_path / "a")
    assert fingerprint(first) == fingerprint(tiny_model_path)
    other_seed = ensure_model("tiny", root=tmp_path / "b", seed=1)
    assert (other_seed / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    assert (other_seed / "model.safetensors").read_bytes() != (
        first / "model.safetensors"
    ).read_bytes()
    assert not list((tmp_path / "a").glob(".tiny.build-*"))  # staging folder cleaned up


@pytest.mark.slow
def test_existing_current_build_is_reused_and_stale_or_forced_rebuilt(tmp_path):
    folder = ensure_model("tiny", root=tmp_path)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny", root=tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp

    info = json.loads((folder / BUILD_INFO).read_text())
    info["recipe_version"] = -1
    (folder / BUILD_INFO).write_text(json.dumps(info))
    ensure_model("tiny", root=tmp_path)
    assert json.loads((folder / BUILD_INFO).read_text())["recipe_version"] != -1

    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    ensure_model("tiny", root=tmp_path, force=True)
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp


@pytest.mark.slow
def test_concurrent_builders_build_once(tmp_path, monkeypatch):
    builds = []
    real_build = offline_model.build_model

    def counting_build(preset, out_dir, seed=0):
        builds.append(preset)
        return real_build(preset, out_dir, seed)

    monkeypatch.setattr(offline_model, "build_model", counting_build)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_model("tiny", root=tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [tmp_path / "tiny"] * 3
    assert builds == ["tiny"]
    mlx_lm.load(str(tmp_path / "tiny"))


def test_unknown_preset_raises():
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*\['1b', 'small', 'tiny'\]"):
        ensure_model("huge")


def test_small_preset_is_about_57m_parameters():
    preset = offline_model.PRESETS["small"]
    config = offline_model.model_config(preset, preset.vocab_size)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 50e6 < n_params < 100e6


@pytest.mark.slow
def test_cli_prints_the_model_folder(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_model.py"), "--preset", "tiny",
         "--out", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=120,
    )
    assert done.stdout.strip() == str(tmp_path / "tiny")
    assert FILES <= {p.name for p in (tmp_path / "tiny").iterdir()}
