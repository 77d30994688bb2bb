"""Think tags of the served model: which they are, and whether a prompt leaves one open.

Reasoning models write their thinking between tags (``<think>`` ... ``</think>``
for Qwen3, DeepSeek-R1, QwQ, ...) and then the answer. mlx-lm finds the tags
in the vocabulary (``TokenizerWrapper.think_start`` / ``think_end``); a
tokenizer without such tokens whose chat template writes ``<think>`` and
``</think>`` has them as text.

Some templates open the block in the generation prompt themselves
(DeepSeek-R1, Qwen3's thinking releases): the answer then starts inside it.
Others close it there when thinking is off (Qwen3 with ``enable_thinking:
false``). Which a request gets is read from the generation prompt the
template writes for a one-message probe with the request's template
variables (``chat_template_kwargs``), kept per tokenizer and variables.
"""

from __future__ import annotations

import json
from typing import Any

from server.protocol import ThinkTags

# The tags a template written for reasoning models uses when the vocabulary has none.
TEXT_TAGS = ("<think>", "</think>")
_PROBE = ({"role": "user", "content": "Hi"},)
# Answers kept per tokenizer, by the variables' JSON; past this many they start over.
_CACHE_ENTRIES = 64
_CACHE_KEY_CHARS = 4096


def think_tags(tokenizer: Any) -> ThinkTags | None:
    """The model's think tags: mlx-lm's from the vocabulary, else ``<think>`` and
    ``</think>`` when the chat template writes both; None for a model without."""
    start = getattr(tokenizer, "think_start", None)
    end = getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str):
        return ThinkTags(start, end)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and all(tag in template for tag in TEXT_TAGS):
        return ThinkTags(*TEXT_TAGS)
    return None


def opens_thinking(tokenizer: Any, tags: ThinkTags,
                   template_kwargs: tuple[tuple[str, Any], ...] = ()) -> bool:
    """Whether the generation prompt leaves a think block open, so the answer starts in it.

    A template that fails on the probe counts as not opening one (the request's own
    render reports what is wrong).
    """
    key = _cache_key(template_kwargs)
    cache = _cache(tokenizer)
    if key is not None and key in cache:
        return cache[key]
    try:
        prompt = _generation_prompt(tokenizer, dict(template_kwargs))
    except Exception:
        return False
    opened = prompt.rfind(tags.start) > prompt.rfind(tags.end)
    if key is not None:
        if len(cache) >= _CACHE_ENTRIES:
            cache.clear()
        cache[key] = opened
    return opened


def _generation_prompt(tokenizer: Any, kwargs: dict[str, Any]) -> str:
    """The text the template adds for the assistant's turn, after the probe conversation."""
    def render(generation: bool) -> str:
        return tokenizer.apply_chat_template(list(_PROBE), add_generation_prompt=generation,
                                             tokenize=False, **kwargs)

    whole, bare = render(True), render(False)
    return whole[len(bare):] if whole.startswith(bare) else whole


def _cache_key(template_kwargs: tuple[tuple[str, Any], ...]) -> str | None:
    """The variables as a cache key; None for ones too large (or odd) to keep."""
    try:
        key = json.dumps(template_kwargs, sort_keys=True)
    except (TypeError, ValueError):
        return None
    return key if len(key) <= _CACHE_KEY_CHARS else None


def _cache(tokenizer: Any) -> dict[str, bool]:
    """The tokenizer's own answers (a fresh dict when it takes no attributes)."""
    cache = getattr(tokenizer, "_veloxquant_opens_thinking", None)
    if cache is None:
        cache = {}
        try:
            tokenizer._veloxquant_opens_thinking = cache
        except AttributeError:  # a tokenizer that takes no attributes: ask again next time
            pass
    return cache
