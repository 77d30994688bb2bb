"""End to end: the converted SmolLM2 answers a question through mlx_lm.generate."""

from __future__ import annotations

import pytest
from mlx_lm import generate

pytestmark = pytest.mark.slow


def test_greedy_answer_names_paris(smollm2_loaded):
    model, tokenizer = smollm2_loaded
    messages = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = generate(model, tokenizer, prompt, max_tokens=20)  # default sampler: greedy
    assert "Paris" in answer, answer
