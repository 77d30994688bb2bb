"""``POST /tokenize`` and ``POST /detokenize`` on live servers (tiny model).

The count a client gets must be the prompt_tokens a generation with the same
prompt is charged, for text, for a conversation and for one with tools.
"""

from __future__ import annotations

import httpx
import pytest

from tests.http.test_security import assert_openai_error
from tests.support.servers import LiveServer, make_settings, run_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def post(server: LiveServer, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60, **kw)


def test_text_count_is_what_a_completion_is_charged(live_server: LiveServer):
    prompt = "The quick brown fox jumps over the lazy dog, twice."
    out = post(live_server, "/tokenize", {"prompt": prompt}).json()
    assert out["count"] == len(out["tokens"]) > 5
    assert out["max_prompt_tokens"] == live_server.app.state.settings.limits.max_prompt_tokens
    ran = post(live_server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert ran["usage"]["prompt_tokens"] == out["count"]
    # The same ids sent as the prompt are charged the same.
    again = post(live_server, "/v1/completions", {"prompt": out["tokens"], "max_tokens": 1})
    assert again.json()["usage"]["prompt_tokens"] == out["count"]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_count_is_what_a_chat_is_charged(live_server: LiveServer, tools):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]}]
    body = {"messages": messages} | ({"tools": tools} if tools else {})
    out = post(live_server, "/tokenize", body).json()
    ran = post(live_server, "/v1/chat/completions", {**body, "max_tokens": 1}).json()
    assert ran["usage"]["prompt_tokens"] == out["count"] == len(out["tokens"])
    if tools:  # the tools are rendered into the prompt, so they cost tokens
        plain = post(live_server, "/tokenize", {"messages": messages}).json()
        assert out["count"] > plain["count"]


def test_detokenize_gives_back_the_text(live_server: LiveServer):
    text = "Hello there, world: 42 + 1!"
    ids = post(live_server, "/tokenize", {"prompt": text}).json()["tokens"]
    back = post(live_server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert back.endswith(text)  # a tokenizer may put a start token first
    assert post(live_server, "/detokenize", {"tokens": []}).json() == {"prompt": "",
                                                                         "content": ""}


def test_llama_cpp_clients_get_llama_cpp_answers(live_server: LiveServer):
    """llama-server's names: content in, {id, piece} with with_pieces, content back."""
    text = "Hi \U0001F389 <|im_start|>x"  # the emoji is split into partial-byte tokens
    ids = post(live_server, "/tokenize", {"prompt": text}).json()["tokens"]
    plain = post(live_server, "/tokenize", {"content": text}).json()
    assert plain["tokens"] == ids  # the tiny tokenizer adds no BOS, so the defaults agree
    pieces = post(live_server, "/tokenize", {"content": text, "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == ids
    raw = [p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
           for p in pieces["tokens"]]
    assert b"".join(raw) == text.encode()  # pieces join to the text, byte for byte
    assert any(isinstance(p["piece"], list) for p in pieces["tokens"])  # part of the emoji
    assert {"id": 2, "piece": "<|im_start|>"} in pieces["tokens"]
    back = post(live_server, "/detokenize", {"tokens": ids}).json()
    assert back["content"] == back["prompt"] == text


def test_parse_special_false_reads_special_text_as_characters(live_server: LiveServer):
    text = "<|im_start|>user"
    special = post(live_server, "/tokenize", {"content": text}).json()["tokens"]
    literal = post(live_server, "/tokenize", {"content": text, "parse_special": False}).json()
    assert special[0] == 2 and 2 not in literal["tokens"]
    assert post(live_server, "/detokenize", {"tokens": literal["tokens"]}).json()["content"] \
        == text


def test_vllm_add_generation_prompt_false_leaves_out_the_assistant_opening(
        live_server: LiveServer):
    messages = [{"role": "user", "content": "Hi"}]
    full = post(live_server, "/tokenize", {"messages": messages}).json()["tokens"]
    bare = post(live_server, "/tokenize", {"messages": messages,
                                           "add_generation_prompt": False}).json()["tokens"]
    assert full[:len(bare)] == bare and len(full) > len(bare)
    opening = post(live_server, "/detokenize", {"tokens": full[len(bare):]}).json()["content"]
    assert "assistant" in opening  # the template's <|im_start|>assistant


def test_vllm_token_strs_are_the_vocabulary_strings(live_server: LiveServer):
    out = post(live_server, "/tokenize", {"prompt": "Hello world",
                                          "return_token_strs": True}).json()
    assert len(out["token_strs"]) == out["count"]
    assert out["token_strs"][-2:] == ["\u0120w", "orld"]  # byte-level BPE: a space is "Ġ"
    assert "token_strs" not in post(live_server, "/tokenize", {"prompt": "Hello"}).json()


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, None),
    ("/tokenize", {"prompt": "x", "tools": TOOLS}, 400, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]},
     400, "tools[0]"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "content": "x"}, 400, None),
    ("/tokenize", {"content": "x", "add_special": True, "add_special_tokens": True}, 400, None),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special": True},
     400, None),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "parse_special": False},
     400, None),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, 400, "with_pieces"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, 400, None),
    ("/detokenize", {"tokens": [1, 4096]}, 400, "tokens"),  # the tiny vocabulary is 4096
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_input_is_a_typed_client_error(live_server: LiveServer, path, body, status, param):
    err = assert_openai_error(post(live_server, path, body), status)
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("field", ["prompt", "content"])
def test_lone_surrogate_is_refused(live_server: LiveServer, field):
    body = b'{"%s": "a\\ud800"}' % field.encode()
    resp = httpx.post(live_server.base_url + "/tokenize", content=body,
                      headers={"content-type": "application/json"}, timeout=30)
    error = assert_openai_error(resp, 400, "invalid_prompt")
    assert error["param"] == field
    # Said plainly, as /v1/completions says it, not in the tokenizer's words.
    assert "not valid Unicode: a lone surrogate (U+D800)" in error["message"]
    assert error["message"].startswith("the prompt" if field == "prompt" else "content")


def test_a_too_long_prompt_is_counted_not_refused(tiny_model_path):
    """The count is how a client learns a prompt is over the limit before sending it."""
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 256},
                             limits={"max_prompt_tokens": 16},
                             env={"VELOXQUANT_API_KEY": "sk-tok"})
    auth = {"Authorization": "Bearer sk-tok"}
    with run_server(settings) as server:
        assert_openai_error(post(server, "/tokenize", {"prompt": "x"}), 401, "invalid_api_key")
        out = post(server, "/tokenize", {"prompt": "word " * 40}, headers=auth).json()
        assert out["count"] > out["max_prompt_tokens"] == 16
        ran = post(server, "/v1/completions", {"prompt": "word " * 40}, headers=auth)
        assert_openai_error(ran, 400)
        assert str(out["count"]) in ran.json()["error"]["message"]


def test_tool_choice_shapes_the_count_as_in_chat(live_server: LiveServer):
    """tool_choice "none" offers no tool, so the tools cost nothing, as on chat."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "none"}
    out = post(live_server, "/tokenize", body).json()
    ran = post(live_server, "/v1/chat/completions", {**body, "max_tokens": 1}).json()
    assert out["count"] == ran["usage"]["prompt_tokens"]
    assert out["count"] == post(live_server, "/tokenize", {"messages": messages}).json()["count"]
