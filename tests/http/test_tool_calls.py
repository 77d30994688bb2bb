"""Tool calls: the plan from tools/tool_choice, the prompt, parsing, streams, forced calls.

Parsing and streaming run against a scripted engine (``SCRIPT:`` answers, 3
characters per token, so tags arrive split across tokens); forced calls run
on the real tiny model, whose random weights could write anything a grammar
allows, so only the grammar makes the arguments parse.
"""

from __future__ import annotations

import enum
import json
from typing import Literal

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from server.http.app import create_app
from server.http.errors import InvalidRequestError
from server.http.routes.tool_calls import ToolStream, parse_calls
from server.http.schemas.tools import tool_plan
from server.protocol import ChatPrompt
from server.text.chat_render import (
    render_ids,
    template_takes_tools,
    tools_block,
)
from tests.support.fakes import FakeEngine
from tests.support.openai_shapes import CHAT, chat, chat_stream
from tests.support.servers import LiveServer, make_settings

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object",
                                  "properties": {"a": {"type": "integer"},
                                                 "b": {"type": "integer"}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
# Arguments with few possible values: a complete call fits in a few tokens whatever the weights.
PICK = {"type": "function", "function": {
    "name": "pick", "parameters": {"type": "object",
                                   "properties": {"op": {"enum": ["add", "sub"]},
                                                  "exact": {"type": "boolean"}},
                                   "required": ["op", "exact"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
TWO_CALLS = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')


def auto(parallel: bool | None = None):
    return tool_plan(TOOLS, "auto", parallel)


# -- the plan ------------------------------------------------------------------------------

@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None,
     "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "tools"),
    # Arguments are an object: a forced call with an array of them would never read as a call.
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "required", "tools[0].function.parameters"),
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}},
     "tool_choice.allowed_tools"),
    (TOOLS, {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}},
     "tool_choice.allowed_tools.tools[0]"),
])
def test_bad_tool_fields_name_the_field(tools, choice, param):
    with pytest.raises(InvalidRequestError) as info:
        tool_plan(tools, choice, None)
    assert info.value.param == param


def test_plan_modes():
    assert tool_plan(None, None, None).mode == "none"
    assert tool_plan(TOOLS, None, None).mode == "auto"
    assert tool_plan(TOOLS, "none", None).offered == ()
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    assert (named.mode, named.forced_call, named.parallel) == ("named", True, False)
    assert [f.name for f in named.offered] == ["add"]


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_allowed_tools_offer_only_those(mode):
    plan = tool_plan(TOOLS, {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": "add"}}]}}, None)
    assert plan.mode == mode and [f.name for f in plan.offered] == ["add"]
    assert plan.forced_call is (mode == "required")
    # A call to a function left out of the allowed ones is text, not a call.
    assert parse_calls(TWO_CALLS, plan)[1][0]["function"]["name"] == "add"


def test_call_schema_accepts_calls_and_only_calls():
    schema = tool_plan(TOOLS, "required", None).call_schema()
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    for wrong in ({"name": "add", "arguments": {"a": 1}}, {"name": "sub", "arguments": {}},
                  {"name": "add", "arguments": {"a": 1, "b": 2}, "extra": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


# -- parsing -------------------------------------------------------------------------------

def test_tagged_calls_are_parsed_and_the_text_kept():
    content, calls = parse_calls(TWO_CALLS, auto())
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_parallel_false_keeps_the_first_call():
    _, calls = parse_calls(TWO_CALLS, auto(parallel=False))
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize("text,names", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', ["add"]),
    ('[{"name": "add", "parameters": {"a": 1, "b": 2}}, '
     '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]', ["add", "get_weather"]),
    ('<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}', ["add"]),  # cut by the stop
])
def test_bare_json_and_unclosed_tags_are_calls(text, names):
    content, calls = parse_calls(text, auto())
    assert content is None and [c["function"]["name"] for c in calls] == names


@pytest.mark.parametrize("text", [
    '{"name": "delete_everything", "arguments": {}}',  # not an offered function
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "add", "arguments": {</tool_call>',  # not JSON
    'JSON looks like {"a": 1}.',
])
def test_what_is_not_a_call_stays_text(text):
    assert parse_calls(text, auto()) == (text, [])


def test_stream_holds_back_only_what_may_be_a_call():
    stream = ToolStream(auto())
    sent = "".join(stream.feed(TWO_CALLS[i:i + 3]) for i in range(0, len(TWO_CALLS), 3))
    rest, calls = stream.finish()
    assert sent + rest == "Let me check. "[:len(sent + rest)]
    assert "<" not in sent and len(calls) == 2
    plain = ToolStream(auto())
    text = "a <b> and <tool is not a tag"
    sent = "".join(plain.feed(text[i:i + 2]) for i in range(0, len(text), 2))
    rest, calls = plain.finish()
    assert sent + rest == text and calls == []


# -- the prompt ----------------------------------------------------------------------------

class RecordingTokenizer:
    """Records what the chat template would get."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.calls: list[tuple[list, dict]] = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append((messages, kwargs))
        return [1, 2, 3]


HISTORY = ({"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
           {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"})


def test_a_template_without_tools_gets_the_servers_convention():
    tok = RecordingTokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not template_takes_tools(tok)
    render_ids(tok, ChatPrompt(HISTORY, (WEATHER,)))
    messages, kwargs = tok.calls[0]
    assert "tools" not in kwargs and kwargs["add_generation_prompt"] is True
    assert messages[0] == {"role": "system", "content": tools_block((WEATHER,))}
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                           '</tool_call>'}
    assert messages[3] == {"role": "user",
                           "content": "<tool_response>\n18 C, sunny\n</tool_response>"}


def test_a_template_with_tools_gets_them_natively():
    tok = RecordingTokenizer("{% if tools %}{{ tools }}{% endif %}")
    render_ids(tok, ChatPrompt(HISTORY, (WEATHER,)))
    messages, kwargs = tok.calls[0]
    assert kwargs["tools"] == [WEATHER]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2]["role"] == "tool"


def test_a_developer_message_is_a_system_one_unless_the_template_knows_the_role():
    chat = ({"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Say hello"})
    plain = RecordingTokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    render_ids(plain, ChatPrompt(chat, (WEATHER,)))
    messages, _ = plain.calls[0]
    assert messages[0] == {"role": "system",
                           "content": "Answer in French.\n\n" + tools_block((WEATHER,))}
    tooled = RecordingTokenizer("{% if tools %}{{ tools }}{% endif %}{{ messages }}")
    render_ids(tooled, ChatPrompt(chat, ()))
    assert tooled.calls[0][0][0] == {"role": "system", "content": "Answer in French."}
    knowing = RecordingTokenizer("{% if m.role == 'developer' %}{% endif %}")
    render_ids(knowing, ChatPrompt(chat, ()))
    assert knowing.calls[0][0][0]["role"] == "developer"


def test_smollm2_renders_developer_as_its_system_turn():
    # Its template would write "<|im_start|>developer" and add its default system prompt.
    from mlx_lm.utils import load_tokenizer

    from server.model_loader import resolve_model_path
    from tests.support.servers import make_settings

    tok = load_tokenizer(resolve_model_path(make_settings(model={"path": "smollm2"}).model))

    def ids(role: str) -> list[int]:
        return render_ids(tok, ChatPrompt(({"role": role, "content": "Answer in French."},
                                           {"role": "user", "content": "Say hello"}), ()))

    assert ids("developer") == ids("system")
    assert tok.decode(ids("developer")).startswith("<|im_start|>system\nAnswer in French.")


# -- routes, scripted answers --------------------------------------------------------------

@pytest.fixture()
def fake():
    engine = FakeEngine()
    with TestClient(create_app(make_settings(), engine)) as client:
        yield engine, client


def ask(client, script: str, **fields):
    body = {"messages": [{"role": "user", "content": "SCRIPT:" + script}], **fields}
    return client.post(CHAT, json=body)


def test_auto_calls_come_back_as_tool_calls(fake):
    engine, client = fake
    answer = chat(ask(client, TWO_CALLS, tools=TOOLS))
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "add"]
    assert engine.last_params().constraint is None
    assert [t["function"]["name"] for t in engine.submitted[-1].prompt.tools] == \
        ["get_weather", "add"]


def test_parallel_false_stops_after_the_first_call(fake):
    engine, client = fake
    answer = chat(ask(client, TWO_CALLS, tools=TOOLS, parallel_tool_calls=False))
    assert "</tool_call>" in engine.last_params().stop
    assert len(answer.choices[0].message.tool_calls) == 1


def test_no_tools_or_none_means_plain_text(fake):
    engine, client = fake
    for fields in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        answer = chat(ask(client, TWO_CALLS, **fields))
        assert answer.choices[0].message.content == TWO_CALLS
        assert answer.choices[0].message.tool_calls is None
        assert engine.submitted[-1].prompt.tools == ()


def test_streamed_calls_arrive_as_tool_call_deltas(fake):
    _, client = fake
    chunks = chat_stream(ask(client, TWO_CALLS, tools=TOOLS, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather"), (1, "add")]
    assert json.loads(calls[1].function.arguments) == {"a": 1, "b": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streamed_text_without_calls_is_all_content(fake):
    _, client = fake
    text = "No tools needed: <b>bold</b> {not json"
    chunks = chat_stream(ask(client, text, tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_conversation_with_earlier_calls_is_accepted(fake):
    engine, client = fake
    messages = [*HISTORY[:2], {**HISTORY[2]}, {"role": "user", "content": "SCRIPT:Thanks"}]
    answer = chat(client.post(CHAT, json={"messages": messages, "tools": TOOLS}))
    assert answer.choices[0].message.content == "Thanks"
    assert engine.submitted[-1].prompt.messages[1]["tool_calls"][0]["id"] == "call_1"


# -- forced calls on the real tiny model ---------------------------------------------------

@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused")


@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "add", "pick"}),
    ({"type": "function", "function": {"name": "pick"}}, {"pick"}),
])
@pytest.mark.slow
def test_forced_calls_always_parse_and_match_their_schema(client, choice, names):
    finished = 0
    for seed in range(4):
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Add 1 and 2."}],
            tools=[*TOOLS, PICK], tool_choice=choice, max_tokens=120, temperature=1.0,
            seed=seed)
        choice_out = out.choices[0]
        if choice_out.finish_reason == "length":  # random weights may write a long string
            # Cut short: no wrapper text, the call so far (once its name is written).
            assert choice_out.message.content is None
            for call in choice_out.message.tool_calls or ():
                assert call.function.name in names
            continue
        finished += 1
        # OpenAI's API: "tool_calls" for required, "stop" for a function named in tool_choice
        assert choice_out.finish_reason == ("tool_calls" if choice == "required" else "stop")
        (call,) = choice_out.message.tool_calls
        assert call.function.name in names
        params = next(t for t in [*TOOLS, PICK] if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments),
                            params["function"]["parameters"])
    assert finished or choice == "required"  # "pick" alone always fits in 120 tokens


def test_forced_call_with_closed_arguments_is_exact(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Pick."}], tools=[PICK],
        tool_choice="required", max_tokens=60, temperature=0)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    args = json.loads(calls[0].function.arguments)
    assert calls[0].function.name == "pick" and args["op"] in ("add", "sub")
    assert isinstance(args["exact"], bool) and set(args) == {"op", "exact"}


def test_a_forced_call_streams_its_arguments_as_they_are_written(live_server, client):
    import httpx

    body = {"messages": [{"role": "user", "content": "Pick."}], "tools": [ADD, PICK],
            "tool_choice": {"type": "function", "function": {"name": "pick"}},
            "max_tokens": 60, "temperature": 0, "stream": True}
    chunks = chat_stream(httpx.post(live_server.base_url + CHAT, json=body, timeout=60))
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    # As OpenAI streams a call: id and name first (no arguments yet), then argument text.
    assert len(pieces) > 2 and {p.index for p in pieces} == {0}
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "pick"
    assert pieces[0].function.arguments == "" and all(p.id is None for p in pieces[1:])
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert set(json.loads(arguments)) == {"op", "exact"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"  # named
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = httpx.post(live_server.base_url + CHAT, json={**body, "stream": False}, timeout=60)
    (call,) = whole.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == json.loads(arguments)
    # The SDK's stream helper puts the pieces together into the same call.
    del body["stream"]
    with client.chat.completions.stream(model="tiny", **body) as stream:
        for _ in stream:
            pass
        (sdk_call,) = stream.get_final_completion().choices[0].message.tool_calls
    assert json.loads(sdk_call.function.arguments) == json.loads(arguments)
    # Cut by max_tokens mid-arguments: what was written, and finish "length".
    short = whole.json()["usage"]["completion_tokens"] - 3
    cut = chat_stream(httpx.post(live_server.base_url + CHAT, timeout=60,
                                 json={**body, "stream": True, "max_tokens": short}))
    cut_args = "".join(t.function.arguments or "" for c in cut if c.choices
                       for t in c.choices[0].delta.tool_calls or ())
    assert cut_args and arguments.startswith(cut_args) and cut_args != arguments
    assert [c.choices[0].finish_reason for c in cut if c.choices][-1] == "length"


# -- the openai client's own structured helpers --------------------------------------------

class Pick(BaseModel):
    op: Literal["add", "sub"]
    exact: bool


def test_client_parse_with_a_pydantic_format_and_a_pydantic_tool(client):
    messages = [{"role": "user", "content": "Pick."}]
    out = client.chat.completions.parse(model="tiny", messages=messages, response_format=Pick,
                                        max_tokens=40, temperature=0)
    assert isinstance(out.choices[0].message.parsed, Pick)
    out = client.chat.completions.parse(model="tiny", messages=messages,
                                        tools=[openai.pydantic_function_tool(Pick)],
                                        tool_choice="required", max_tokens=40, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "Pick" and isinstance(call.function.parsed_arguments, Pick)


class Address(BaseModel):
    city: str = Field(max_length=6)  # random weights would write a long string


class Shade(str, enum.Enum):
    light = "light"
    dark = "dark"


class Visit(BaseModel):
    where: Address
    shade: Shade


def test_call_schema_keeps_refs_of_nested_models_and_enums():
    # pydantic writes nested models and enums as $defs + $ref from the parameters' root.
    visit = openai.pydantic_function_tool(Visit)
    assert "$defs" in visit["function"]["parameters"]
    schema = tool_plan([visit, ADD], "required", None).call_schema()
    jsonschema.validate({"name": "Visit", "arguments": {"where": {"city": "Oslo"},
                                                        "shade": "dark"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "Visit", "arguments": {"where": {"city": 1},
                                                            "shade": "dark"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "Visit", "arguments": {"where": {"city": "Oslo"},
                                                            "shade": "grey"}}, schema)


def test_a_forced_call_to_a_function_with_nested_models_parses(client):
    out = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Visit."}],
        tools=[openai.pydantic_function_tool(Visit)], tool_choice="required", max_tokens=120,
        temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Visit)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_short_is_a_call_not_text(live_server, stream):
    import httpx

    body = {"messages": [{"role": "user", "content": "Pick."}], "tools": [PICK],
            "tool_choice": "required", "max_tokens": 20, "temperature": 0, "stream": stream}
    out = httpx.post(live_server.base_url + CHAT, json=body, timeout=60)
    if stream:
        chunks = chat_stream(out)
        assert chunks[0].choices[0].delta.content is None  # null, as OpenAI opens a call
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)
        pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
        calls = [pieces[0].model_copy(update={"function": pieces[0].function.model_copy(
            update={"arguments": "".join(p.function.arguments or "" for p in pieces)})})]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        message = out.json()["choices"][0]["message"]
        assert message["content"] is None
        calls = [openai.types.chat.ChatCompletionMessageToolCall(**c)
                 for c in message["tool_calls"]]
        finish = out.json()["choices"][0]["finish_reason"]
    assert finish == "length"
    (call,) = calls
    assert call.function.name == "pick"
    assert '{"name"' not in call.function.arguments  # the wrapper is the server's own
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut: what was written so far


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_a_stop_string_cuts_ends_stop_not_tool_calls(live_server, stream):
    import httpx

    # "exact" occurs only in the arguments: the call is cut after '{"op": "...", "'.
    body = {"messages": [{"role": "user", "content": "Pick."}], "tools": [PICK],
            "tool_choice": "required", "max_tokens": 60, "temperature": 0,
            "stop": ['exact"'], "stream": stream}
    out = httpx.post(live_server.base_url + CHAT, json=body, timeout=60)
    if stream:
        chunks = chat_stream(out)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        arguments = "".join(t.function.arguments or "" for c in chunks if c.choices
                            for t in c.choices[0].delta.tool_calls or ())
    else:
        choice = out.json()["choices"][0]
        finish, arguments = choice["finish_reason"], choice["message"]["tool_calls"][0][
            "function"]["arguments"]
    assert finish == "stop"  # not "tool_calls": the client must not run a cut call
    assert arguments.startswith('{"op": "') and "exact" not in arguments
    with pytest.raises(ValueError):
        json.loads(arguments)


@pytest.mark.parametrize("text", [
    "Sure! " + TWO_CALLS.split("Let me check. ")[1],
    "\n" + TWO_CALLS.split("Let me check. ")[1],
    TWO_CALLS + "\n\nDone. ",
    "  Hello there. " + TWO_CALLS.split("Let me check. ")[1] + "  ",
])
def test_streamed_content_around_calls_is_the_non_streamed_content(text):
    # The stream must not send whitespace before a call (an item of "\n" alone) or the
    # space of "Sure! ", which the non-streamed answer strips.
    content, calls = parse_calls(text, auto())
    stream = ToolStream(auto())
    sent = "".join(stream.feed(text[i:i + 2]) for i in range(0, len(text), 2))
    rest, streamed_calls = stream.finish()
    assert (sent + rest or None) == content
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]


def test_a_json_format_beside_tools_leaves_the_calls_open(live_server, client):
    # The format's grammar must leave a call possible (openai-agents' tools with an
    # output_type): the tag's first token, pushed up, leads to a call.
    import httpx

    tag = httpx.post(live_server.base_url + "/tokenize",
                     json={"prompt": "<tool_call>"}).json()
    first = tag["tokens"][0]
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    messages = [{"role": "user", "content": "Pick."}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, tools=[PICK], response_format=fmt, max_tokens=60,
        temperature=0, logit_bias={str(first): 100})
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "pick"
    assert set(json.loads(call.function.arguments)) == {"op", "exact"}
    # Pushed away from the tag, the answer follows the format.
    plain = client.chat.completions.create(
        model="tiny", messages=messages, tools=[PICK], response_format=fmt, max_tokens=60,
        temperature=0, logit_bias={str(first): -100})
    if plain.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(plain.choices[0].message.content)["ok"], bool)


@pytest.mark.parametrize("cut,calls", [
    ('Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b', ["add"]),  # the call so far
    ('Sure. <tool_call>{"name": "ad', []),  # its name unfinished: dropped, not content
    ('Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_', ["add"]),
])
def test_a_call_cut_in_its_json_is_not_content(cut, calls):
    # A length cut must not leave '<tool_call>{"name": "get' in the visible text.
    content, parsed = parse_calls(cut, auto())
    assert content == "Sure." and [c["function"]["name"] for c in parsed] == calls
    if cut.endswith("</tool_"):  # cut in the closing tag: the call itself is whole
        assert json.loads(parsed[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    stream = ToolStream(auto())
    sent = "".join(stream.feed(cut[i:i + 3]) for i in range(0, len(cut), 3))
    rest, streamed = stream.finish()
    assert (sent + rest).strip() == "Sure." and len(streamed) == len(calls)


def test_a_replayed_assistant_refusal_part_is_its_words():
    # OpenAI's assistant content takes text or refusal parts; a replay is not a 400.
    from server.http.schemas.chat import ChatMessage

    said = ChatMessage(role="assistant", content=[{"type": "refusal", "refusal": "I can't."}])
    assert said.text() == "I can't."
    with pytest.raises(ValueError, match="part 0 has type"):
        ChatMessage(role="user", content=[{"type": "refusal", "refusal": "x"}]).text()
