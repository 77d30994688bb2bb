"""Reasoning apart from the answer, and template variables reaching the template.

A model with think tags answers its thinking as ``reasoning_content`` (vLLM's
field) and the rest as ``content``. The model used here is a copy of the
offline tiny model whose last two vocabulary entries are ``<think>`` and
``</think>`` (added tokens, as in Qwen3's vocabulary) and whose chat template
opens a think block in the generation prompt, DeepSeek-R1 style, unless
``enable_thinking`` is false (then it writes an empty, closed block, as Qwen3's
does); it also writes ``reasoning_effort`` into a system line when given.

The splitter's cases run over whole texts and every way of cutting them into
streamed pieces. Scripted answers (``SCRIPT:``, 3 characters per token, so
tags arrive split) run through real uvicorn and the ``openai`` client with the
copy's real tokenizer; the real model runs end to end, its reasoning checked
against its own token log-probabilities (the raw text).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from server.http.routes.reasoning import ReasoningSplit, Thinking
from server.protocol import ChatPrompt
from server.text.chat_render import render_ids
from server.text.think_tags import (
    ThinkTags,
    opens_thinking,
    think_tags,
)
from tests.support.fakes import FakeEngine
from tests.support.servers import LiveServer, make_settings, run_server

THINK_TEMPLATE = (
    "{{ bos_token }}"
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning effort: "
    "{{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
THINK_ID, END_THINK_ID = 4094, 4095  # the tiny vocabulary's last entries, renamed
TAGS = ThinkTags("<think>", "</think>")
NO_EOS = {"1": -100, "3": -100}
HELLO = [{"role": "user", "content": "Hello"}]


def think_model(tiny: Path, folder: Path) -> Path:
    """A copy of the tiny model with ``<think>`` / ``</think>`` tokens and THINK_TEMPLATE."""
    shutil.copytree(tiny, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    bpe = tokenizer["model"]
    for tag, token_id in (("<think>", THINK_ID), ("</think>", END_THINK_ID)):
        old = next(text for text, i in bpe["vocab"].items() if i == token_id)
        del bpe["vocab"][old]
        bpe["vocab"][tag] = token_id
        bpe["merges"] = [m for m in bpe["merges"] if "".join(m) != old]
        tokenizer["added_tokens"].append({"id": token_id, "content": tag, "special": False,
                                          "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": THINK_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def think_path(tiny_model_path: Path, tmp_path_factory) -> Path:
    return think_model(tiny_model_path, tmp_path_factory.mktemp("think") / "think-tiny")


@pytest.fixture(scope="module")
def think_tokenizer(think_path: Path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(think_path)


# -- the splitter ------------------------------------------------------------------------

# (answer starts inside a block, text, reasoning, content)
SPLITS = [
    (True, "Let me see.</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    (False, "\n<think>\nHmm.</think>It is 4.", "Hmm.", "It is 4."),
    (False, "It is 4.", "", "It is 4."),
    (False, "Tags such as <think> are text mid-answer.", "",
     "Tags such as <think> are text mid-answer."),
    (True, "No end in sight", "No end in sight", ""),
    (True, "cut short at </thi", "cut short at </thi", ""),
    (True, "a</think>b<think>c</think>", "a", "b<think>c</think>"),
    (False, "<thinking>", "", "<thinking>"),
    (False, "  ", "", "  "),
    (True, "\n\n</think>\n\nAnswer", "", "Answer"),
]


def streamed(inside: bool, pieces: list[str]) -> tuple[str, str]:
    split = ReasoningSplit(TAGS, inside)
    out = [split.feed(piece) for piece in pieces[:-1]] + [split.finish(pieces[-1])]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("inside,text,reasoning,content", SPLITS)
def test_the_split_is_the_same_whole_and_in_any_pieces(inside, text, reasoning, content):
    assert Thinking(TAGS, inside).split(text) == (reasoning, content)
    assert streamed(inside, list(text)) == (reasoning, content)  # a character a token
    assert streamed(inside, [text[i:i + 3] for i in range(0, len(text), 3)] or [""]) == \
        (reasoning, content)
    for cut in range(len(text) + 1):
        assert streamed(inside, [text[:cut], text[cut:]]) == (reasoning, content), cut


def test_a_partial_tag_is_held_until_it_is_whole():
    split = ReasoningSplit(TAGS, inside=True)
    assert split.feed("so </th") == ("so ", "")
    assert split.feed("ink>Yes") == ("", "Yes")


# -- the tokenizer and its template -------------------------------------------------------

def test_think_tags_come_from_the_vocabulary_or_the_template(think_tokenizer, tiny_model_path):
    from mlx_lm.utils import load_tokenizer

    assert think_tags(think_tokenizer) == TAGS  # mlx-lm's, from the added tokens
    assert think_tags(load_tokenizer(tiny_model_path)) is None
    assert think_tags(SimpleNamespace(chat_template=THINK_TEMPLATE)) == TAGS  # as text


def test_whether_the_generation_prompt_opens_a_block_follows_the_variables(think_tokenizer):
    assert opens_thinking(think_tokenizer, TAGS)
    assert not opens_thinking(think_tokenizer, TAGS, (("enable_thinking", False),))
    assert opens_thinking(think_tokenizer, TAGS, (("enable_thinking", True),))


def test_template_kwargs_reach_the_template(think_tokenizer):
    plain = render_ids(think_tokenizer, ChatPrompt(tuple(HELLO)))
    high = render_ids(think_tokenizer, ChatPrompt(tuple(HELLO),
                                                  template_kwargs=(("reasoning_effort", "high"),)))
    assert "Reasoning effort: high" in think_tokenizer.decode(high)
    assert "Reasoning effort" not in think_tokenizer.decode(plain)


# -- scripted answers through the HTTP stack ----------------------------------------------

class ThinkingFake(FakeEngine):
    """The scripted engine with the think model's tokenizer (its tags and template)."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.loaded = SimpleNamespace(tokenizer=tokenizer)


@pytest.fixture(scope="module")
def scripted(think_tokenizer):
    with run_server(make_settings(), ThinkingFake(think_tokenizer)) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


def script(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "SCRIPT:" + text}]


def streamed_parts(chunks) -> tuple[str, str, list[dict]]:
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return ("".join(d.model_extra.get("reasoning_content") or "" for d in deltas),
            "".join(d.content or "" for d in deltas), deltas)


def test_scripted_reasoning_is_apart_whole_and_streamed(scripted):
    text = "Two and two.</think>\n\nIt is 4."
    answer = scripted.chat.completions.create(model="default", messages=script(text))
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == "Two and two."
    assert message.content == "It is 4." and answer.choices[0].finish_reason == "stop"
    reasoning, content, deltas = streamed_parts(scripted.chat.completions.create(
        model="default", messages=script(text), stream=True))
    assert (reasoning, content) == ("Two and two.", "It is 4.")
    assert not any("think>" in (d.content or "") + (d.model_extra.get("reasoning_content")
                                                    or "") for d in deltas)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


def test_calls_are_read_from_the_answer_not_the_reasoning(scripted):
    call = '<tool_call>{{"name": "get_weather", "arguments": {{"city": "{}"}}}}</tool_call>'
    text = f"Maybe {call.format('Rome')}?</think>Checking. {call.format('Paris')}"
    for stream in (False, True):
        out = scripted.chat.completions.create(model="default", messages=script(text),
                                               tools=[WEATHER], stream=stream)
        if stream:
            chunks = list(out)
            reasoning, content, deltas = streamed_parts(chunks)
            calls = [t for d in deltas for t in d.tool_calls or ()]
            finish = chunks[-1].choices[0].finish_reason
        else:
            message = out.choices[0].message
            reasoning, content = message.model_extra["reasoning_content"], message.content
            calls, finish = message.tool_calls, out.choices[0].finish_reason
        assert "Rome" in reasoning and "Rome" not in content
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]
        assert content.strip() == "Checking." and finish == "tool_calls"


def test_reasoning_parser_none_leaves_the_text_whole(think_tokenizer):
    settings = make_settings(server={"reasoning_parser": "none"})
    with run_server(settings, ThinkingFake(think_tokenizer)) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        message = client.chat.completions.create(
            model="default", messages=script("Hmm.</think>Yes.")).choices[0].message
    assert message.content == "Hmm.</think>Yes."
    assert "reasoning_content" not in (message.model_extra or {})


def test_a_model_without_think_tags_is_untouched(live_server: LiveServer):
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused")
    message = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3,
                                             temperature=0).choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})


# -- the real model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def think_server(think_path: Path):
    settings = make_settings(model={"path": str(think_path)}, pool={"n_blocks": 1024})
    with run_server(settings) as server:
        yield server


@pytest.fixture(scope="module")
def think_client(think_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=think_server.base_url + "/v1", api_key="unused")


def raw_text(choice) -> str:
    """What the model wrote, tags included: its tokens' texts joined."""
    return "".join(entry.token for entry in choice.logprobs.content)


def reasoning_of(client: openai.OpenAI, **fields) -> tuple[str | None, str, str]:
    """(reasoning_content, content, raw text) of a greedy answer, then checks that the
    stream of the same request splits the same way."""
    request = {"model": "default", "messages": HELLO, "max_tokens": 8, "temperature": 0,
               "logprobs": True, **fields}
    choice = client.chat.completions.create(**request).choices[0]
    reasoning = choice.message.model_extra["reasoning_content"]
    reasoning_streamed, content_streamed, _ = streamed_parts(
        client.chat.completions.create(**request, stream=True))
    assert (reasoning_streamed, content_streamed) == (reasoning or "", choice.message.content)
    return reasoning, choice.message.content, raw_text(choice)


def test_the_real_model_thinks_inside_the_block_its_prompt_opened(think_client):
    reasoning, content, raw = reasoning_of(think_client, logit_bias=NO_EOS)
    assert raw and "</think>" not in raw
    assert (reasoning, content) == (raw.lstrip("\n"), "")  # no closing tag: all reasoning


def test_a_closing_tag_the_real_model_writes_ends_the_reasoning(think_client):
    # Both tokens biased alike; the penalty then makes them take turns.
    reasoning, content, raw = reasoning_of(
        think_client, logit_bias={**NO_EOS, "500": 100, str(END_THINK_ID): 100},
        frequency_penalty=2.0)
    assert "</think>" in raw and "pre" in raw
    assert (reasoning or "", content) == Thinking(TAGS, inside=True).split(raw)


@pytest.mark.parametrize("fields", [{"extra_body": {"enable_thinking": False}},
                                    {"extra_body": {"chat_template_kwargs":
                                                    {"enable_thinking": False}}}])
def test_thinking_off_answers_in_content(think_client, fields):
    reasoning, content, raw = reasoning_of(think_client, logit_bias=NO_EOS, **fields)
    assert reasoning is None and content == raw


def test_reasoning_effort_and_template_kwargs_change_the_prompt(think_client, think_server):
    def prompt_tokens(**fields) -> int:
        return think_client.chat.completions.create(
            model="default", messages=HELLO, max_tokens=1, **fields).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(reasoning_effort="high") > plain  # OpenAI's own field
    assert prompt_tokens(extra_body={"chat_template_kwargs":
                                     {"reasoning_effort": "high"}}) > plain

    def count(**fields) -> int:
        resp = httpx.post(think_server.base_url + "/tokenize", timeout=60,
                          json={"messages": HELLO, **fields})
        assert resp.status_code == 200, resp.text
        return resp.json()["count"]

    assert count() == plain
    assert count(chat_template_kwargs={"reasoning_effort": "high"}) > plain
    assert count(chat_template_kwargs={"enable_thinking": False}) > plain  # a closed block
