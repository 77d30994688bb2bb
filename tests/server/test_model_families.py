"""Each mlx-lm family the server is checked against answers as mlx-lm does, or is refused.

Every family of :mod:`veloxquant_mlx.family_models` gets its small random-weight
model in a tmp folder. A served family's two prompts (past its stated window,
of two lengths, batched) give the same greedy tokens through the engine's parts
as through mlx-lm's ``generate_step``, with log-probabilities within
``TOLERANCE`` at every step (``benchmark_scripts/model_family_parity.py``, which
writes the same comparison to ``figures/model_families.json``). A refused family
stops the engine's start-up with one line naming what the KV pool cannot hold.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.engine.engine import Engine
from server.metrics import ServerMetrics
from server.model_loader import load_model
from server.settings import ModelSection
from tests.support.servers import make_settings
from veloxquant_mlx.family_models import FAMILIES, WINDOW, build_family_model

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmark_scripts"))
import model_family_parity as parity  # noqa: E402

SERVED = ("llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral")
# Family -> model type and what the refusal names.
REFUSED = {
    "mistral_layer_types": ("mistral", f"sliding-window attention (window {WINDOW} in 2 of "
                                       "4 layers)"),
    "gemma3_text": ("gemma3_text", f"sliding-window attention (window {WINDOW} in 4 of 6 "
                                   "layers)"),
    "gemma2": ("gemma2", "grouped-query attention that lines a batch's per-row masks up "
                         "with its KV heads"),
}


def _refusal(family: str) -> str:
    model_type, feature = REFUSED[family]
    return f"model type {model_type} uses {feature}"


def test_every_family_is_either_served_or_refused():
    assert set(SERVED) | set(REFUSED) == set(FAMILIES)
    assert not set(SERVED) & set(REFUSED)


@pytest.mark.parametrize("family", SERVED)
def test_a_served_family_answers_as_mlx_lm_does(family: str, tmp_path: Path):
    result = parity.compare(family, tmp_path)
    assert result.status == "served", result
    assert result.greedy_tokens_equal, result
    assert result.max_logprob_diff <= parity.TOLERANCE, result


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_refused_family_stops_the_engine_with_one_line(family: str, tmp_path: Path):
    folder = build_family_model(family, tmp_path / family)
    engine = Engine(make_settings(model={"path": str(folder)}), ServerMetrics())
    engine.start()
    try:
        assert not engine.wait_ready(120)
    finally:
        engine.stop()
    error = engine.load_error
    assert error.startswith(f"UnsupportedModelError: {_refusal(family)}"), error
    assert "which the KV pool does not serve yet" in error and "\n" not in error


def test_a_refused_family_would_answer_other_than_mlx_lm(tmp_path: Path):
    """What the refusal prevents: the same prompts through the runner, no check, differ."""
    result = parity.compare("gemma3_text", tmp_path)
    assert result.status == "refused" and result.reason.startswith(_refusal("gemma3_text"))
    assert not result.unchecked_tokens_equal, result


def test_a_window_mlx_lm_does_not_apply_is_named_at_load(tmp_path: Path, caplog):
    folder = build_family_model("mistral", tmp_path / "mistral")
    with caplog.at_level(logging.WARNING, logger="veloxquant.server"):
        load_model(ModelSection(path=str(folder)))
    assert any(f"states a sliding window of {WINDOW} tokens that mlx-lm does not apply" in m
               for m in caplog.messages), caplog.messages


def test_a_window_switched_off_is_not_named(tmp_path: Path, caplog):
    folder = build_family_model("qwen2", tmp_path / "qwen2")  # use_sliding_window: false
    with caplog.at_level(logging.WARNING, logger="veloxquant.server"):
        load_model(ModelSection(path=str(folder)))
    assert not any("sliding window" in m for m in caplog.messages), caplog.messages


@pytest.mark.slow
def test_a_refused_family_stops_the_server_process_with_exit_code_2(tmp_path: Path):
    folder = build_family_model("gemma3_text", tmp_path / "gemma3_text")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOXQUANT_")}
    env.update({"VELOXQUANT_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO),
                "VELOXQUANT_NO_BLAS_PRELOAD": "1"})
    out = subprocess.run([sys.executable, "-m", "server", "--port", "0", "--model", str(folder)],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("veloxquant-serve: model failed to load: UnsupportedModelError: "
                           + _refusal("gemma3_text")), out.stderr
