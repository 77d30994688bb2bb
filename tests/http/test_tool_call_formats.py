"""Tool calls in the syntax the model's chat template teaches: hermes, llama3_json,
mistral and pythonic.

Parsing runs on whole answers and on streams cut into pieces of every small size
(markers split across pieces). Detection runs on the tiny model's own tokenizer,
copied with a chat template per syntax. End to end, a scripted engine whose chat
template names a syntax answers the openai client over a real server (the tiny
model's vocabulary holds none of the markers, and no grammar writes them); one
real server on the tiny model, its template in Llama 3's syntax, reads the call a
JSON format's grammar makes it write.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from server.http.routes.tool_calls import ToolStream, parse_calls
from server.http.routes.tool_formats import served_format
from server.http.schemas.tools import tool_plan
from server.settings import ConfigError
from server.text.chat_render import tool_call_format
from tests.http.test_tool_calls import ADD, WEATHER
from tests.support.fakes import FakeEngine
from tests.support.servers import make_settings, run_server

TOOLS = [WEATHER, ADD]
FORMATS = ("hermes", "llama3_json", "mistral", "pythonic")
BOTH = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]

# Answers with two calls, as each syntax writes them.
TWO_CALLS = {
    "hermes": ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": '
               '"Paris"}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, '
               '"b": 2}}</tool_call>'),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
    "mistral": ('Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
                '"Paris"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]'),
    "pythonic": '[get_weather(city="Paris"), add(a=1, b=2)]',
}
CONTENT = {"hermes": "Let me check.", "llama3_json": None, "mistral": "Let me check.",
           "pythonic": None}

# More answers per syntax: (text, content, calls).
CASES = {
    "llama3_json": [
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}', None, BOTH[1:]),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '{"name": "add", "parameters": "{\\"a\\": 1, \\"b\\": 2}"}', None, BOTH),
    ],
    "mistral": [
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
         None, BOTH),
        ('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS] {"a": 1, "b": 2}', None, BOTH[1:]),
        # Text after the calls is content; leading whitespace stays, as a stream sends it.
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]\n\nDone.',
         "\n\nDone.", BOTH[1:]),
    ],
    "pythonic": [
        ('<|python_start|>[add(a=-1, b=2)]<|python_end|>', None, [("add", {"a": -1, "b": 2})]),
        ('[get_weather(city="Paris", opts={"units": ("C", "F"), "x": None, "ok": True})]',
         None, [("get_weather", {"city": "Paris",
                                 "opts": {"units": ["C", "F"], "x": None, "ok": True}})]),
    ],
}

# Text that is no call in each syntax: malformed, a function not offered, or code.
NOT_CALLS = {
    "hermes": ['[' * 5000 + ']' * 5000],  # deeper than the JSON parser goes
    "llama3_json": [
        '<|python_tag|>{"name": "add", "parameters": {"a": 1,',
        '{"name": "delete_everything", "parameters": {}}',
        '{"name": "add", "parameters": {"a": 1, "b": 2}} and some words',
        '<|python_tag|>brave_search.call(query="weather")',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}',
        'Sure. [TOOL_CALLS] not json at all',
        '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]',
        '[TOOL_CALLS]add[ARGS][1, 2]',
    ],
    "pythonic": [
        '[get_weather(city=__import__("os").getcwd())]',
        '[add(1, 2)]',
        '[get_weather(city="Paris")',
        '[os.system("ls")]',
        '[1, 2, 3]',
        '[add(a={1, 2}, b=1)]',
        '[add(**{"a": 1, "b": 2})]',
        '[add(a=float("nan"), b=1)]',
        '[add(a=1e999, b=1)]',  # infinity: no JSON number
        '[' * 300 + ']' * 300,
    ],
}


def plan(fmt: str, parallel: bool | None = None):
    return tool_plan(TOOLS, "auto", parallel, fmt)


def named(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(text: str, fmt: str, size: int) -> tuple[str, str, list]:
    """What a stream of ``text`` in pieces of ``size`` sends: content, then the rest."""
    stream = ToolStream(plan(fmt))
    sent = "".join(stream.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = stream.finish()
    return sent, rest, calls


# -- reading whole answers -----------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_two_calls_in_each_syntax(fmt):
    content, calls = parse_calls(TWO_CALLS[fmt], plan(fmt))
    assert content == CONTENT[fmt] and named(calls) == BOTH
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    _, (first,) = parse_calls(TWO_CALLS[fmt], plan(fmt, parallel=False))
    assert first["function"]["name"] == "get_weather"


@pytest.mark.parametrize("fmt,text,content,calls",
                         [(f, *case) for f, cases in CASES.items() for case in cases])
def test_more_shapes_of_each_syntax(fmt, text, content, calls):
    got_content, got = parse_calls(text, plan(fmt))
    assert got_content == content and named(got) == calls


@pytest.mark.parametrize("fmt,text", [(f, t) for f, texts in NOT_CALLS.items() for t in texts])
def test_what_is_no_call_stays_content(fmt, text):
    assert parse_calls(text, plan(fmt)) == (text, [])
    sent, rest, calls = streamed(text, fmt, 4)
    assert sent + rest == text and calls == []


def test_pythonic_arguments_are_never_run(tmp_path):
    target = tmp_path / "written"
    text = f'[get_weather(city=open({str(target)!r}, "w").name)]'
    assert parse_calls(text, plan("pythonic")) == (text, [])
    assert not target.exists()


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral", "pythonic"])
def test_the_servers_own_tags_are_read_in_every_syntax(fmt):
    # A JSON format beside tools lets the grammar write a <tool_call> tag, and a forced
    # call is bare JSON, whatever the model's own syntax.
    assert named(parse_calls(TWO_CALLS["hermes"], plan(fmt))[1]) == BOTH
    forced = tool_plan(TOOLS, "required", None, fmt)
    assert named(parse_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', forced)[1]) == \
        BOTH[1:]


def test_another_syntax_is_text_to_hermes():
    for fmt in ("llama3_json", "mistral", "pythonic"):
        content, calls = parse_calls(TWO_CALLS[fmt], plan("hermes"))
        assert calls == [] and content == TWO_CALLS[fmt]


# -- streams -------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("fmt,text", [(f, TWO_CALLS[f]) for f in FORMATS] +
                         [(f, case[0]) for f, cases in CASES.items() for case in cases])
def test_streams_hold_back_calls_split_anywhere(fmt, text, size):
    content, calls = parse_calls(text, plan(fmt))
    sent, rest, streamed_calls = streamed(text, fmt, size)
    assert (sent + rest or None) == content
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]
    for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|python_start|>", "{"):
        assert marker not in sent


@pytest.mark.parametrize("fmt,text", [
    ("llama3_json", "<|pyramid|> is no tag, and {braces} later are text."),
    ("mistral", "Lists like [1, 2] and [TOOL are text, [TOOL_CALL too."),
    ("pythonic", "<|python is cut; add(a=1) is prose."),
])
def test_streams_pass_on_text_that_only_looked_like_a_call(fmt, text):
    stream = ToolStream(plan(fmt))
    sent = [stream.feed(text[i:i + 2]) for i in range(0, len(text), 2)]
    rest, calls = stream.finish()
    assert "".join(sent) + rest == text and calls == []
    assert "".join(sent[:len(sent) // 2])  # sent as it came, not all held to the end


# -- which syntax: the template, or the setting --------------------------------------------

_CHAT = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
         "{{ message['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _template(howto: str) -> str:
    return ("{{ bos_token }}{% if tools %}<|im_start|>system\n" + howto +
            "\n{{ tools | tojson }}<|im_end|>\n{% endif %}" + _CHAT)


# Each teaches its syntax as such templates do (shortened).
TEMPLATES = {
    "hermes": _template('For each call, return <tool_call>{"name": <function-name>, '
                        '"arguments": <args-json-object>}</tool_call>'),
    "llama3_json": _template('Respond in the format {"name": function name, "parameters": '
                             'dictionary of argument name and its value}. Do not use '
                             'variables.'),
    "mistral": _template('[AVAILABLE_TOOLS] Call tools as [TOOL_CALLS][{"name": <name>, '
                         '"arguments": <args>}]'),
    "pythonic": _template('If you decide to invoke any of the function(s), you MUST put it '
                          'in the format of [func_name1(params_name1=params_value1, '
                          'params_name2=params_value2...), func_name2(params)]'),
}


def tiny_copy(tiny_model_path: Path, folder: Path, template: str) -> Path:
    """The tiny model in ``folder``, with ``template`` as its chat template."""
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tiny_tokenizer_with_each_template_names_its_syntax(tiny_model_path, tmp_path, fmt):
    from mlx_lm.utils import load_tokenizer

    folder = tiny_copy(tiny_model_path, tmp_path / fmt, TEMPLATES[fmt])
    assert tool_call_format(load_tokenizer(folder)) == fmt
    assert tool_call_format(load_tokenizer(tiny_model_path)) == "hermes"  # no tools in it


@pytest.mark.parametrize("template,fmt", [
    (None, "hermes"),
    ("{{ messages }}", "hermes"),  # no tools: the server's own <tool_call> convention
    ("[TOOL_CALLS] {{ messages }}", "hermes"),  # the same: it never shows the tools
    ("{{ tools }} [AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral"),
    ("{{ tools }} <tool_call>", "hermes"),
    ("{{ tools }} <|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
    ("{{ tools }} {%- if builtin_tools %}<|python_tag|>{% endif %}", "llama3_json"),
    ("{{ tools }} [func_name1(params_name1=params_value1)] ipython", "pythonic"),
    ("{{ tools }} respond with a python list of the function calls", "pythonic"),
    ("{{ tools }} call them somehow", "hermes"),
])
def test_template_marks(template, fmt):
    assert tool_call_format(SimpleNamespace(chat_template=template)) == fmt


def test_the_setting_overrides_the_template():
    engine = FakeEngine()
    engine.chat_template = TEMPLATES["mistral"]
    assert served_format(engine, "auto") == "mistral"
    assert served_format(engine, "pythonic") == "pythonic"
    assert make_settings(server={"tool_call_parser": "llama3_json"}).server.tool_call_parser \
        == "llama3_json"
    with pytest.raises(ConfigError, match="tool_call_parser"):
        make_settings(server={"tool_call_parser": "xml"})


# -- end to end: the openai client over a real server --------------------------------------

@pytest.fixture(scope="module")
def scripted():
    engine = FakeEngine()
    with run_server(make_settings(), engine) as server:
        yield engine, openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                    max_retries=0)


def _ask(client: openai.OpenAI, script: str, **fields):
    return client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "SCRIPT:" + script}],
        tools=TOOLS, **fields)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_templates_calls_reach_the_client(scripted, fmt):
    engine, client = scripted
    engine.chat_template = TEMPLATES[fmt]
    choice = _ask(client, TWO_CALLS[fmt]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT[fmt]
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == BOTH
    # Streamed: the SDK's helper puts the delta.tool_calls chunks together into the same calls.
    with client.chat.completions.stream(
            model="fake-model", tools=TOOLS,
            messages=[{"role": "user", "content": "SCRIPT:" + TWO_CALLS[fmt]}]) as stream:
        text = "".join(e.delta for e in stream if e.type == "content.delta")
        final = stream.get_final_completion().choices[0]
    assert (text.strip() or None) == CONTENT[fmt]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in final.message.tool_calls] == BOTH


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral", "pythonic"])
def test_under_a_template_without_tools_the_same_answer_is_text(scripted, fmt):
    engine, client = scripted
    engine.chat_template = None  # the server's own convention: <tool_call> tags
    choice = _ask(client, TWO_CALLS[fmt]).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == TWO_CALLS[fmt]


def test_the_responses_api_reads_the_templates_syntax(scripted):
    engine, client = scripted
    engine.chat_template = TEMPLATES["mistral"]
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    out = client.responses.create(model="fake-model", input="SCRIPT:" + TWO_CALLS["mistral"],
                                  tools=tools)
    calls = [(o.name, json.loads(o.arguments)) for o in out.output if o.type == "function_call"]
    assert calls == BOTH and out.output_text == "Let me check."


def test_a_forced_setting_reads_that_syntax_whatever_the_template():
    engine = FakeEngine()
    settings = make_settings(server={"tool_call_parser": "pythonic"})
    with run_server(settings, engine) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                               max_retries=0)
        choice = _ask(client, TWO_CALLS["pythonic"]).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == BOTH


def test_a_real_server_on_a_llama3_template_reads_its_calls(tiny_model_path, tmp_path):
    folder = tiny_copy(tiny_model_path, tmp_path / "llama3", TEMPLATES["llama3_json"])
    settings = make_settings(model={"path": str(folder)}, pool={"n_blocks": 512})
    # One answer the format allows: Llama 3's call, with "parameters".
    call = {"type": "object", "properties": {
        "name": {"enum": ["add"]},
        "parameters": {"type": "object", "properties": {"a": {"enum": [1]}, "b": {"enum": [2]}},
                       "required": ["a", "b"], "additionalProperties": False}},
        "required": ["name", "parameters"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": call}}
    with run_server(settings) as server:
        assert server.engine.tool_call_format == "llama3_json"
        tag = server.engine.loaded.tokenizer.encode("<tool_call>", add_special_tokens=False)[0]
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                               max_retries=0)
        out = client.chat.completions.create(
            model=server.engine.model_name, tools=[ADD], response_format=fmt,
            messages=[{"role": "user", "content": "Add 1 and 2."}], max_tokens=100,
            temperature=0, logit_bias={str(tag): -100})  # the answer, not a tagged call
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (got,) = choice.message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == ("add", {"a": 1, "b": 2})
