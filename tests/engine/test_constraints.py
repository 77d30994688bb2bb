"""response_format compiled into grammars (server.text.schemas) and masks on logits.

The tiny model's real tokenizer (4,096 tokens, end tokens 1 and 3) and real
llguidance grammars: what compiles, what is refused and why, the cache, a
document walked token by token, and the MLX mask that turns bits into -inf.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from server.engine.sampling import mask_logits
from server.text.grammar import (
    BatchMasks,
    ConstraintViolation,
    mask_words,
)
from server.text.schemas import (
    SAFE_INTEGER,
    ConstraintError,
    bound_integers,
    close_objects,
    compile_json_schema,
    compile_response_format,
)

SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "tag": {"enum": ["x", "y"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def _schema_format(schema=SCHEMA, name="pick", **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, **extra}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return tiny_model[1]


def _allowed(bitmask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return set(np.nonzero(bits)[0].tolist())


def test_text_and_none_are_unconstrained(tokenizer):
    assert compile_response_format({"type": "text"}, tokenizer) is None
    assert compile_response_format(None, tokenizer) is None


def test_json_object_and_schema_compile_and_are_cached(tokenizer):
    obj = compile_response_format({"type": "json_object"}, tokenizer)
    assert (obj.kind, obj.name, obj.vocab) == ("json_object", "json_object", 4096)
    assert compile_response_format({"type": "json_object"}, tokenizer) is obj
    one = compile_response_format(_schema_format(strict=True), tokenizer)
    # The same schema with keys in another order is the same constraint.
    reordered = dict(reversed(list(SCHEMA.items())))
    assert compile_response_format(_schema_format(reordered, strict=True), tokenizer) is one
    assert (one.kind, one.name) == ("json_schema", "pick")
    # The first token of any JSON object is "{" (a token of its own here).
    assert {tokenizer.decode([t]) for t in _allowed(obj.first_mask())} == {"{"}


@pytest.mark.parametrize(("response_format", "says"), [
    ({"type": "sound"}, "response_format.type must be one of text, json_object, json_schema"),
    ({}, "got nothing"),
    ("json", "response_format must be an object"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, "json_schema.schema must be"),
    (_schema_format(strict="yes"), "json_schema.strict must be true or false"),
    (_schema_format({"type": "integr"}), "cannot be enforced: Invalid type: integr"),
    (_schema_format({"$ref": "#/$defs/missing"}), "cannot be enforced"),
    (_schema_format({"type": "string", "format": "shoe-size"}), "Unknown format: shoe-size"),
])
def test_bad_response_formats_raise_constraint_error(tokenizer, response_format, says):
    with pytest.raises(ConstraintError) as info:
        compile_response_format(response_format, tokenizer)
    assert info.value.param == "response_format"
    assert says in info.value.message


def test_a_document_walks_through_and_then_only_end_tokens_are_allowed(tokenizer):
    constraint = compile_response_format(_schema_format(), tokenizer)
    doc = tokenizer.encode('{"n": 7, "tag": "y"}', add_special_tokens=False)
    untouched = constraint.matcher()
    masks = BatchMasks([None, constraint.matcher()])
    # Walking the document: each token was allowed by the mask before it.
    allowed = _allowed(constraint.first_mask())
    for token in doc:
        assert token in allowed, tokenizer.decode([token])
        assert masks.step([0, token]) == []
        allowed = _allowed(masks.bitmask[1])
        assert _allowed(masks.bitmask[0]) == set(range(4096))  # the free row: everything
    assert allowed == set(tokenizer.eos_token_ids) == {1, 3}
    assert not untouched.ll.is_accepting()  # each row's matcher is its own copy


def test_a_refused_token_is_reported_and_its_row_unmasked(tokenizer):
    constraint = compile_response_format({"type": "json_object"}, tokenizer)
    masks = BatchMasks([constraint.matcher(), constraint.matcher()])
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    refused = masks.step([letter, brace])  # an object cannot start with a letter
    assert [i for i, _ in refused] == [0]
    assert isinstance(refused[0][1], ConstraintViolation)
    assert "json_object" in str(refused[0][1])
    assert (masks.bitmask[0] == -1).all()  # sampled freely until the runner fails it
    assert '"' in {tokenizer.decode([t]) for t in _allowed(masks.bitmask[1])}
    assert masks.step([letter, tokenizer.encode('"', add_special_tokens=False)[0]]) == []


def test_mask_logits_forbids_exactly_the_cleared_bits():
    rng = np.random.default_rng(0)
    vocab = 70  # not a multiple of 32: the last word is partly padding
    logits = mx.array(rng.standard_normal((3, vocab)).astype(np.float32))
    allowed = [{0, 5, 69}, set(range(vocab)), {31, 32, 33}]
    words = np.zeros((3, mask_words(vocab)), dtype=np.int32)
    for row, ids in enumerate(allowed):
        bits = np.zeros(mask_words(vocab) * 32, dtype=np.uint8)
        bits[list(ids)] = 1
        words[row] = np.packbits(bits, bitorder="little").view(np.int32)
    free = mx.array([False, False, True])  # row 2 is free: its bits are ignored
    out = np.array(mask_logits(logits, mx.array(words), free))
    for row in range(3):
        kept = set(np.nonzero(np.isfinite(out[row]))[0].tolist())
        assert kept == (set(range(vocab)) if row == 2 else allowed[row])
        np.testing.assert_array_equal(out[row][sorted(kept)], np.array(logits)[row][sorted(kept)])


def test_mask_logits_forbids_model_tokens_past_the_tokenizer():
    # A model vocabulary padded past the tokenizer's (e.g. to a multiple of 64).
    logits = mx.zeros((2, 100))
    words = mx.array(np.full((2, mask_words(64)), -1, dtype=np.int32))
    out = np.array(mask_logits(logits, words, mx.array([False, True])))
    assert np.isfinite(out[0, :64]).all() and np.isneginf(out[0, 64:]).all()
    assert np.isfinite(out[1]).all()


def test_constraint_error_is_a_value_error_with_its_param():
    err = ConstraintError("bad", param="tools")
    assert isinstance(err, ValueError) and err.param == "tools" and str(err) == "bad"
    assert json.dumps({"param": err.param})  # plain data, ready for an error body


def test_compile_json_schema_names_its_field_for_tool_parameters(tokenizer):
    params = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    tool = compile_json_schema(params, tokenizer, name="get_weather", param="tools")
    assert (tool.kind, tool.name) == ("json_schema", "get_weather")
    with pytest.raises(ConstraintError) as info:
        compile_json_schema({"type": "objet"}, tokenizer, param="tools")
    assert info.value.param == "tools"
    assert info.value.message == "tools schema cannot be enforced: Invalid type: objet"


def test_unbounded_integers_get_the_safe_range_and_data_is_untouched():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "m": {"type": ["integer", "null"], "minimum": 0},
        "tag": {"const": {"type": "integer"}}, "items": {"type": "array",
                                                        "items": {"type": "integer"}}}}
    out = bound_integers(schema)
    props = out["properties"]
    assert props["n"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert props["m"]["minimum"] == 0 and props["m"]["maximum"] == SAFE_INTEGER
    assert props["tag"] == {"const": {"type": "integer"}}  # data, not a schema
    assert props["items"]["items"]["maximum"] == SAFE_INTEGER
    assert "minimum" not in schema["properties"]["n"]  # the client's schema is not changed


def test_objects_with_properties_take_no_others_unless_the_schema_says(tokenizer):
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {}}},  # a property so named
        "free": {"type": "object"}, "open": {"properties": {"y": {}},
                                             "additionalProperties": {"type": "string"}},
        "either": {"anyOf": [{"properties": {"a": {}}}, {"type": "null"}]},
        "ref": {"$ref": "#/$defs/D"}},
        "$defs": {"D": {"properties": {"z": {}}}}, "const": {"properties": {}}}
    out = close_objects(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]  # JSON mode's shape: any object
    assert props["open"]["additionalProperties"] == {"type": "string"}
    assert props["either"]["anyOf"][0]["additionalProperties"] is False  # a whole alternative
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert out["const"] == {"properties": {}}  # data
    assert "additionalProperties" not in schema  # the client's schema is not changed
    # Composed objects stay as they are: each part must accept the others' keys.
    base = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    for composed in (
            {"$defs": {"Base": base}, "allOf": [{"$ref": "#/$defs/Base"}, {
                "type": "object", "properties": {"name": {"type": "string"}},
                "required": ["name"]}]},
            {**base, "allOf": [{"properties": {"b": {}}, "required": ["b"]}]},
            {**base, "anyOf": [{"properties": {"b": {}}, "required": ["b"]}]},
            {**base, "$ref": "#/$defs/E", "$defs": {"E": {"properties": {"e": {}}}}}):
        assert close_objects(composed) == composed
        compile_response_format(_schema_format(composed), tokenizer)  # satisfiable
    # Compiled: a key the schema does not name cannot start.
    constraint = compile_response_format(_schema_format(
        {"type": "object", "properties": {"city": {"type": "string"}}}), tokenizer)
    matcher = constraint.matcher()
    fed = tokenizer.encode('{"city": "Paris", "', add_special_tokens=False)
    assert not all(matcher.ll.consume_token(t) for t in fed)


def test_an_integer_longer_than_sixteen_digits_is_refused(tokenizer):
    constraint = compile_response_format(_schema_format(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
        tokenizer)

    def walks(text: str) -> bool:
        matcher = constraint.matcher()
        return all(matcher.ll.consume_token(t)
                   for t in tokenizer.encode(text, add_special_tokens=False))

    assert walks('{"n": ' + "9" * 15 + "}")
    assert walks('{"n": -9007199254740991}')
    assert not walks('{"n": ' + "9" * 17)


# An object whose required "a" is the object again: no finite document exists. llguidance
# lets its "{" through and its parser gives up at the next token.
ENDLESS = _schema_format({"type": "object", "properties": {"a": {"$ref": "#"}},
                          "required": ["a"]})


def test_a_schema_with_no_finite_value_is_a_client_error(live_server):
    import httpx

    url = live_server.base_url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
            "response_format": ENDLESS}
    resp = httpx.post(url, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "invalid_value" and "no way to finish" in err["message"]
    assert "<state>" not in err["message"]  # llguidance's parser dump stays out
    streamed = httpx.post(url, json={**body, "stream": True}, timeout=60).text
    assert '"code":"invalid_value"' in streamed and streamed.endswith("data: [DONE]\n\n")
    ok = httpx.post(url, json={**body, "response_format": {"type": "json_object"}}, timeout=60)
    assert ok.status_code == 200
    metrics = live_server.wait_idle()
    assert metrics["veloxquant_block_pool_request_blocks_in_use"] == 0


def _essence(answer: dict) -> list:
    """Each choice's end, text and calls (call ids are new each time)."""
    return [(c["finish_reason"], c.get("text"), (c.get("message") or {}).get("content"),
             [t["function"] for t in (c.get("message") or {}).get("tool_calls") or []])
            for c in answer["choices"]]


@pytest.mark.parametrize("path,fields", [
    ("/v1/chat/completions", {"response_format": _schema_format()}),
    ("/v1/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
])
def test_stop_strings_apply_to_constrained_output(live_server, path, fields):
    """As in OpenAI's API: a stop string that cannot occur in JSON (agent frameworks send
    "\nObservation:") leaves the document whole; one that occurs cuts it, ending ``stop``."""
    import httpx

    base = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    body = {**base, **fields, "max_tokens": 48, "temperature": 0}
    plain = httpx.post(live_server.base_url + path, json=body, timeout=60).json()
    framework = httpx.post(live_server.base_url + path, timeout=60,
                           json={**body, "stop": ["\nObservation:"]}).json()
    assert _essence(framework) == _essence(plain)
    cut = httpx.post(live_server.base_url + path, json={**body, "stop": ["{"]}, timeout=60)
    assert cut.status_code == 200, cut.text
    choice = cut.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    text = choice.get("text", (choice.get("message") or {}).get("content")) or ""
    assert "{" not in text and not (choice.get("message") or {}).get("tool_calls")
    assert live_server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0


# -- a JSON format beside tools the model may call --------------------------------------

CALL = {"type": "object", "properties": {"name": {"const": "add"},
                                         "arguments": {"type": "object",
                                                       "properties": {"a": {"type": "integer"}},
                                                       "required": ["a"]}},
        "required": ["name", "arguments"], "additionalProperties": False}
ONE_CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def _accepts(constraint, tokenizer, text: str) -> bool:
    """Whether ``text`` (tokenized as the model would write it) is a whole answer."""
    matcher = constraint.matcher()
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.consume(token)
    except ConstraintViolation:
        return False
    return matcher.ll.is_accepting()


def test_a_json_format_beside_tools_takes_the_answer_or_one_tagged_call(tokenizer):
    constraint = compile_response_format(_schema_format(), tokenizer, calls=CALL)
    assert _accepts(constraint, tokenizer, '{"n": 3, "tag": "x"}')
    assert _accepts(constraint, tokenizer, ONE_CALL)
    # One call, as a forced call: offered more, SmolLM2 repeats its call.
    assert not _accepts(constraint, tokenizer, ONE_CALL + "\n" + ONE_CALL)
    assert not _accepts(constraint, tokenizer, '{"n": 3}')  # the answer's schema holds
    assert not _accepts(constraint, tokenizer, '<tool_call>{"name": "sub", "arguments": {}}')
    assert not _accepts(constraint, tokenizer, "Sure! " + ONE_CALL)


def test_a_bad_tool_schema_beside_a_json_format_is_blamed_on_tools(tokenizer):
    bad = {**CALL, "properties": {**CALL["properties"], "arguments": {"type": "integr"}}}
    with pytest.raises(ConstraintError) as info:
        compile_response_format({"type": "json_object"}, tokenizer, calls=bad)
    assert info.value.param == "tools"
