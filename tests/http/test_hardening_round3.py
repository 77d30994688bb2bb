"""More hostile-client cases: what a request can make the server hold or trip over.

- Compiled grammars are cached up to ``limits.grammar_cache_bytes``, not a count: a
  40,000-value enum is charged megabytes, many distinct large enums keep the cache's
  estimated bytes under the bound (least recently used first out, one larger than the
  bound used but not kept), and ``/metrics`` shows the cache's bytes and entries.
- A schema nested past the depth limit (``response_format``, a tool's ``parameters``,
  ``/v1/responses`` ``text.format``) is a 400 naming the field, not a RecursionError's 500.
- A lone UTF-16 surrogate in a field ``/v1/responses`` echoes back (``metadata``,
  ``prompt_cache_key``, ``user``, ``safety_identifier``) is a 400 naming the field,
  streamed or not, before anything is generated.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.schema_depth import MAX_SCHEMA_DEPTH
from server.text.schemas import (
    GrammarCache,
    compile_json_schema,
)
from tests.http.test_security import assert_openai_error
from tests.support.servers import LiveServer, make_settings, run_server

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
HI = [{"role": "user", "content": "hi"}]


def _enum(tag: str, values: int = 40_000) -> dict:
    """A schema of one of ``values`` strings (what a client's big lookup table compiles to)."""
    return {"enum": [f"{tag}-{i}" for i in range(values)]}


def _nested(levels: int) -> dict:
    """An object schema ``levels`` objects deep (two JSON containers per level)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _still_answers(server: LiveServer) -> None:
    resp = httpx.post(server.base_url + CHAT, json={"messages": HI, "max_tokens": 2},
                      timeout=60)
    assert resp.status_code == 200, resp.text


# -- the grammar cache is bounded by bytes ---------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return tiny_model[1]


def test_a_large_schema_is_charged_megabytes(tokenizer):
    cache = GrammarCache(1 << 30)
    compile_json_schema({"type": "string"}, tokenizer, cache=cache)
    small = cache.bytes
    compile_json_schema(_enum("big"), tokenizer, cache=cache)
    assert small < 1 << 20
    assert cache.bytes - small >= 14_000_000  # what llguidance was measured to hold for it


def test_distinct_large_schemas_stay_under_the_byte_bound_lru_first(tokenizer):
    def compiled(tag: str):
        return compile_json_schema(_enum(tag, 10_000), tokenizer, cache=cache)

    cache = GrammarCache(1 << 30)
    compiled("sx")  # the same size as each below (tags of two characters)
    one = cache.bytes
    cache = GrammarCache(3 * one + one // 2)  # room for three
    s0, s1, s2 = compiled("s0"), compiled("s1"), compiled("s2")
    assert (cache.entries, cache.bytes) == (3, 3 * one)
    assert compiled("s0") is s0  # a hit: s0 is now the most recently used, s1 the least
    compiled("s3")
    assert (cache.entries, cache.bytes) == (3, 3 * one)
    assert compiled("s0") is s0 and compiled("s2") is s2  # kept
    assert compiled("s1") is not s1  # evicted, so compiled anew (and s3 went for it)
    for i in range(4, 10):  # many more: the total never passes the bound
        compiled(f"s{i}")
        assert cache.bytes <= cache.max_bytes and cache.entries == 3


def test_a_schema_larger_than_the_bound_is_used_but_not_kept(tokenizer):
    cache = GrammarCache(1 << 20)
    small = compile_json_schema({"type": "string"}, tokenizer, cache=cache)
    kept = cache.bytes
    huge = compile_json_schema(_enum("huge", 5_000), tokenizer, cache=cache)
    assert huge.nbytes > cache.max_bytes
    assert huge.first_mask().any()  # compiled and usable
    assert (cache.entries, cache.bytes) == (1, kept)  # not kept, and nothing evicted for it
    assert compile_json_schema({"type": "string"}, tokenizer, cache=cache) is small


@pytest.fixture(scope="module")
def small_cache_server(tiny_model_path):
    """A grammar cache of 2 MiB: a few 500-value enums fill it."""
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 512},
                             limits={"grammar_cache_bytes": "2MiB"})
    with run_server(settings) as server:
        yield server


def test_metrics_show_the_grammar_cache_within_its_bound(small_cache_server: LiveServer):
    url = small_cache_server.base_url
    for i in range(12):
        fmt = {"type": "json_schema",
               "json_schema": {"name": "pick", "schema": _enum(f"m{i}", 500)}}
        resp = httpx.post(url + CHAT, json={"messages": HI, "max_tokens": 1,
                                            "response_format": fmt}, timeout=60)
        assert resp.status_code == 200, resp.text
    m = small_cache_server.metrics()
    assert 0 < m["veloxquant_grammar_cache_bytes"] <= 2 << 20
    assert 1 <= m["veloxquant_grammar_cache_entries"] < 12


# -- deep schemas are refused before compiling ---------------------------------------------

DEEP = _nested(200)  # ~12 KB of JSON, 400 containers deep
REALISTIC = _nested(24)  # deeper than hand-written or generated schemas go


def _schema_requests(schema: dict) -> list[tuple[str, dict, str]]:
    """(path, body, the param a refusal names) for each way a schema reaches the compiler."""
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return [
        (CHAT, {"messages": HI, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}},
         "response_format"),
        (CHAT, {"messages": HI, "max_tokens": 2, "tools": [tool], "tool_choice": "required"},
         "tools[0].function.parameters"),
        (CHAT, {"messages": HI, "max_tokens": 2, "tools": [tool]},
         "tools[0].function.parameters"),
        (RESPONSES, {"input": "hi", "max_output_tokens": 2, "text": {"format": {
            "type": "json_schema", "name": "deep", "schema": schema}}}, "text.format"),
    ]


@pytest.mark.parametrize("entry", range(4),
                         ids=["response_format", "forced_tool", "auto_tool", "text.format"])
def test_a_deeply_nested_schema_is_a_400_naming_the_field(live_server: LiveServer, entry):
    path, body, param = _schema_requests(DEEP)[entry]
    resp = httpx.post(live_server.base_url + path, json=body, timeout=60)
    err = assert_openai_error(resp, 400, "invalid_value")
    assert err["param"] == param
    assert param in err["message"] and str(MAX_SCHEMA_DEPTH) in err["message"]
    # The server still answers, and a realistically nested schema passes the same way in.
    path, body, _ = _schema_requests(REALISTIC)[entry]
    resp = httpx.post(live_server.base_url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text


# -- a lone surrogate in an echoed field -----------------------------------------------

ECHOED = {"metadata": {"k": "\ud800"}, "prompt_cache_key": "\ud800",
          "user": "a\udfffb", "safety_identifier": "\ud800"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("field", list(ECHOED))
def test_a_lone_surrogate_in_an_echoed_field_is_a_400(live_server: LiveServer, field, stream):
    # json.dumps writes the surrogate as the escape "\ud800", which JSON decoders accept.
    body = json.dumps({"input": "hi", "max_output_tokens": 2, "stream": stream,
                       field: ECHOED[field]})
    before = live_server.metrics().get("veloxquant_prompt_tokens_total", 0.0)
    resp = httpx.post(live_server.base_url + RESPONSES, content=body.encode(), timeout=60,
                      headers={"content-type": "application/json"})
    err = assert_openai_error(resp, 400, "invalid_value")
    assert err["param"] == field and "surrogate" in err["message"]
    assert live_server.metrics().get("veloxquant_prompt_tokens_total", 0.0) == before
    _still_answers(live_server)
