"""Structured outputs: ``response_format`` and tool schemas compiled into grammars.

The result is a :class:`~server.text.grammar.Constraint`, which the runner
masks tokens with (server.text.grammar)::

    compile_response_format(rf, tokenizer)  -> Constraint (cached, any thread)

Compiled constraints are kept in a :class:`GrammarCache` bounded by bytes (what
llguidance holds for each, estimated from its grammar's size), least recently
used first out; a schema nested deeper than :data:`MAX_SCHEMA_DEPTH` is refused
before anything walks it. Output is compact JSON (``", "`` and ``": "`` between
items and keys, no other whitespace): a small model may otherwise emit
whitespace without end.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from server.protocol import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ConstraintError,  # noqa: F401 - raised here, part of this API
)
from server.schema_depth import MAX_SCHEMA_DEPTH, check_depth
from server.text.grammar import Constraint, mask_words

# How JSON is laid out: fixed separators, no free whitespace (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# Integers without bounds get I-JSON's interoperable range (RFC 7493: +-(2**53 - 1), what a
# double holds exactly): a small model otherwise writes digits until max_tokens.
SAFE_INTEGER = 2**53 - 1
# Keywords whose values are data, not schemas: never rewritten.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords that already say what other properties an object may have.
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords that combine an object with other schemas, which may add its keys.
_COMBINERS = ("anyOf", "oneOf", "$ref", "if", "then", "else", "not", "dependentSchemas")
# Keywords whose value maps names to schemas (the map itself is no schema).
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
# What the server builds around a client's schema (a tool call around its parameters) may
# nest deeper than the client's own; still far from the recursion limit (see schema_depth).
_MAX_BUILT_DEPTH = 2 * MAX_SCHEMA_DEPTH
DEFAULT_CACHE_BYTES = 256 << 20  # limits.grammar_cache_bytes' default
# What llguidance holds for a compiled grammar, measured with glibc's mallinfo2 around
# compiling (4,096-token vocabulary): ~70 KB, plus 26 to 87 bytes per byte of the grammar's
# serialized form (a 40,000-value enum 33: ~14 MB; 2,000 properties 64; 200 patterns 87).
# The estimate takes the high end, so the cache's real memory stays within its bound.
_MATCHER_BYTES = 96 << 10
_BYTES_PER_GRAMMAR_BYTE = 96


class GrammarCache:
    """Compiled constraints by (tokenizer, type, schema), bounded by their estimated bytes.

    Clients repeat their schemas, so compiling each once pays; but a large schema
    holds megabytes (a 40,000-value enum ~14 MB), so the bound is memory, not a
    count. Past ``max_bytes`` the least recently used entries go; one larger than
    the whole bound is compiled and used, never kept. Each model's llguidance
    tokenizer (its token index, built once) is kept apart and not counted.

    Args:
        max_bytes: Most bytes the cached entries may hold together
            (``limits.grammar_cache_bytes``).
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._tokenizers: dict[int, tuple[Any, llguidance.LLTokenizer]] = {}
        self._cache: OrderedDict[tuple[int, str, str], tuple[Constraint, int]] = OrderedDict()
        self._bytes = 0

    @property
    def bytes(self) -> int:
        """Estimated bytes the cached entries hold together."""
        return self._bytes

    @property
    def entries(self) -> int:
        """Compiled constraints cached."""
        return len(self._cache)

    def compile(self, kind: str, name: str, schema: dict[str, Any], tokenizer: Any,
                param: str) -> Constraint:
        """The constraint of ``schema``: cached, or compiled now (and cached if it fits)."""
        key = (id(tokenizer), kind, json.dumps(schema, sort_keys=True))
        with self._lock:  # compiling takes ~1 ms; the first call per model ~0.4 s (its index)
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
            ll_tok = self._tokenizer(tokenizer)
            grammar = _grammar(kind, schema, param)
            constraint = Constraint(kind, name, _build_matcher(grammar, ll_tok, param),
                                    ll_tok.vocab_size,
                                    estimated_bytes(grammar, ll_tok.vocab_size))
            self._keep(key, constraint)
            return constraint

    def _keep(self, key: tuple[int, str, str], constraint: Constraint) -> None:
        """Cache ``constraint`` (its key's text counted too), evicting the least recently
        used entries past the bound; one larger than the bound alone is not kept."""
        size = constraint.nbytes + len(key[2])
        if size > self.max_bytes:
            return
        self._cache[key] = (constraint, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, evicted) = self._cache.popitem(last=False)
            self._bytes -= evicted

    def _tokenizer(self, tokenizer: Any) -> llguidance.LLTokenizer:
        held = self._tokenizers.get(id(tokenizer))
        if held is None:
            # Keep the tokenizer referenced so its id is never reused by another object.
            held = (tokenizer, _ll_tokenizer(tokenizer))
            self._tokenizers[id(tokenizer)] = held
        return held[1]


# The cache of callers that pass none (the engine passes its own, sized by its settings).
_SHARED_CACHE = GrammarCache()


def estimated_bytes(grammar: str, vocab: int) -> int:
    """What a compiled constraint holds: llguidance's matcher for ``grammar`` (its size
    measured against the grammar's, see ``_BYTES_PER_GRAMMAR_BYTE``) and the start-state
    mask over ``vocab`` tokens."""
    return _MATCHER_BYTES + _BYTES_PER_GRAMMAR_BYTE * len(grammar) + mask_words(vocab) * 4


def _shared(cache: GrammarCache | None) -> GrammarCache:
    return _SHARED_CACHE if cache is None else cache


def compile_response_format(response_format: dict[str, Any] | None, tokenizer: Any,
                            calls: dict[str, Any] | None = None, *,
                            cache: GrammarCache | None = None) -> Constraint | None:
    """Compile an OpenAI ``response_format`` for ``tokenizer`` (cached; any thread).

    Args:
        response_format: ``{"type": "text"}``, ``{"type": "json_object"}`` or
            ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
            (None: no constraint).
        tokenizer: The served model's tokenizer (mlx-lm's wrapper or a Hugging
            Face fast tokenizer).
        calls: With tools the model may call (``tool_choice`` auto),
            the JSON Schema of one call (``ToolPlan.call_schema``): a JSON answer
            may then be a tagged call instead (:func:`compile_answer_or_calls`).
        cache: Where compiled constraints are kept (None: one shared by such callers).

    Returns:
        The constraint for :attr:`SamplingParams.constraint`, or None for text.

    Raises:
        ConstraintError: unknown type, malformed ``json_schema``, a schema nested
            deeper than :data:`MAX_SCHEMA_DEPTH`, or one llguidance cannot compile
            (the message says which, and why).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ConstraintError("response_format must be an object with a 'type'")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ConstraintError(f"response_format.type must be one of "
                              f"{', '.join(RESPONSE_FORMAT_TYPES)}; got {_as_json(kind)}")
    if kind == "text":
        return None
    if kind == "json_object":
        if calls is not None:
            return compile_answer_or_calls({"type": "object"}, calls, tokenizer, name=kind,
                                           cache=cache)
        return _shared(cache).compile(kind, kind, {"type": "object"}, tokenizer,
                                      "response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ConstraintError("response_format.json_schema must be an object with "
                              "'name' and 'schema'")
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if not isinstance(name, str) or not name:
        raise ConstraintError("response_format.json_schema.name must be a non-empty string")
    if not isinstance(schema, dict):
        raise ConstraintError("response_format.json_schema.schema must be a JSON Schema object")
    if strict is not None and not isinstance(strict, bool):
        raise ConstraintError("response_format.json_schema.strict must be true or false")
    check_depth(schema, "response_format")
    # strict or not, the schema is enforced in full: masks cannot be "mostly" followed.
    if calls is not None:
        return compile_answer_or_calls(schema, calls, tokenizer, name=name, cache=cache)
    return compile_json_schema(schema, tokenizer, name=name, cache=cache)


def compile_answer_or_calls(answer: dict[str, Any], call: dict[str, Any], tokenizer: Any, *,
                            name: str = "schema",
                            cache: GrammarCache | None = None) -> Constraint:
    """A JSON answer following ``answer``, or one ``<tool_call>`` tagged call.

    A JSON ``response_format`` beside tools the model may call: the format shapes
    the answer, as in OpenAI's API, and leaves the model free to call a tool
    instead (a grammar of the answer alone made every call impossible). The calls
    are written as the chat templates teach (``<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>``), each held to ``call``, and parsed from the
    text as calls in auto mode are. One call, even with ``parallel_tool_calls``
    (as a forced call): offered more, SmolLM2 wrote the same call again until
    ``max_tokens`` cut it (LangChain then raised, openai-agents saw ``incomplete``).

    Raises:
        ConstraintError: llguidance cannot compile a schema (``param`` is
            ``response_format`` for the answer's, ``tools`` for the calls').
    """
    # Each alone first (cached): a schema llguidance refuses is blamed on its own field.
    compile_json_schema(answer, tokenizer, name=name, cache=cache)
    compile_json_schema(call, tokenizer, name="tool_call", param="tools", cache=cache)
    # Separators as in every other JSON output here (llguidance reads "x-guidance").
    schemas: dict[str, Any] = {
        part: {**close_objects(bound_integers(schema)), "x-guidance": JSON_OPTIONS}
        for part, schema in (("answer", answer), ("call", call))}
    return _shared(cache).compile("answer_or_calls", name, schemas, tokenizer,
                                  "response_format")


def _answer_or_calls_grammar(schemas: dict[str, Any]) -> str:
    """The Lark grammar of :func:`compile_answer_or_calls` (llguidance's ``%json``)."""
    return "\n".join([
        "start: answer | calls",
        f"answer: %json {json.dumps(schemas['answer'])}",
        f"calls: {json.dumps(TOOL_CALL_OPEN)} WS? call WS? {json.dumps(TOOL_CALL_CLOSE)}",
        f"call: %json {json.dumps(schemas['call'])}",
        r"WS: /[ \t\r\n]{1,8}/",
    ])


def _as_json(value: Any) -> str:
    """A client's value as JSON writes it (``null``, not Python's ``None``), or "nothing"."""
    return "nothing" if value is None else json.dumps(value)[:80]


def compile_json_schema(schema: dict[str, Any], tokenizer: Any, *, name: str = "schema",
                        param: str = "response_format",
                        cache: GrammarCache | None = None) -> Constraint:
    """A constraint to JSON that validates against ``schema`` (cached; any thread).

    What ``json_schema`` response formats compile to; also the way to hold a
    tool call's arguments to its function's ``parameters``.

    Raises:
        ConstraintError: llguidance cannot compile ``schema``, or it nests too deep
            to walk; ``param`` names the request field it came from.
    """
    if not isinstance(schema, dict):
        raise ConstraintError(f"{param}: the schema must be a JSON Schema object", param)
    check_depth(schema, param, _MAX_BUILT_DEPTH)
    return _shared(cache).compile("json_schema", name, close_objects(bound_integers(schema)),
                                  tokenizer, param)


def bound_integers(schema: Any) -> Any:
    """A copy of ``schema`` whose unbounded integers stay within I-JSON's safe range.

    An ``integer`` (alone or in a list of types) without ``minimum`` /
    ``exclusiveMinimum`` gets ``minimum: -(2**53 - 1)``, and likewise above:
    at most 16 digits, which every JSON parser reads exactly. Values of
    ``const``, ``enum``, ``default`` and ``examples`` are data and kept as they are.
    """
    return _rewritten(schema, _bound_integer)


def _bound_integer(schema: dict[str, Any], out: dict[str, Any]) -> None:
    kind = schema.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER


def _rewritten(schema: Any, rewrite: Any) -> Any:
    """A copy of ``schema`` in which ``rewrite(node, copy)`` amended each subschema's copy.

    Data keywords' values are copied as they are; a map of names to schemas
    (``properties``, ``$defs``, ...) is walked into, never taken for a schema.
    """
    if isinstance(schema, list):
        return [_rewritten(item, rewrite) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema
            out[key] = {name: _rewritten(sub, rewrite) for name, sub in value.items()}
        else:
            out[key] = _rewritten(value, rewrite)
    rewrite(schema, out)
    return out


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose objects with ``properties`` allow no others, unless it says.

    JSON Schema lets an object carry any other key by default, and the grammar
    then lets a model add keys of its own (and repeat one): SmolLM2 wrote
    ``"city"`` three times into one object, and tools from LangChain's
    ``@tool`` or instructor, whose schemas leave ``additionalProperties`` out,
    came back with invented arguments cut off by ``max_tokens``. vLLM's default
    grammar backend (xgrammar's strict mode) closes them the same way, and
    OpenAI's strict mode demands ``additionalProperties: false``. An object
    that says ``additionalProperties`` (or ``patternProperties``,
    ``unevaluatedProperties``) keeps its meaning; one without ``properties``
    (``{"type": "object"}``, JSON mode) stays free. A schema that composes
    objects is left as it is: one with an ``allOf`` anywhere, or an object with
    ``properties`` beside ``anyOf``, ``oneOf``, ``$ref`` and the like, whose
    parts (and the definitions they reach) must each accept the others' keys.
    """
    if _composes(schema):
        return schema
    return _rewritten(schema, _close)


def _composes(schema: Any) -> bool:
    """Whether ``schema`` has an ``allOf``, or an object whose keys a combiner adds to."""
    if isinstance(schema, list):
        return any(_composes(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    if "allOf" in schema or ("properties" in schema
                             and any(key in schema for key in _COMBINERS)):
        return True
    return any(_composes(value) for key, value in schema.items() if key not in _DATA_KEYWORDS)


def _close(schema: dict[str, Any], out: dict[str, Any]) -> None:
    if (isinstance(schema.get("properties"), dict)
            and not any(key in schema for key in _OPEN_KEYWORDS)):
        out["additionalProperties"] = False


def _grammar(kind: str, schema: dict[str, Any], param: str) -> str:
    """llguidance's serialized grammar of ``schema``, or ConstraintError with its reason."""
    try:
        if kind == "answer_or_calls":
            return llguidance.LLMatcher.grammar_from_lark(_answer_or_calls_grammar(schema))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"{param} schema is not valid JSON: {exc}", param) from exc


def _build_matcher(grammar: str, tokenizer: llguidance.LLTokenizer,
                   param: str) -> llguidance.LLMatcher:
    """llguidance's matcher for ``grammar``, or ConstraintError with llguidance's reason."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    error = messages[0] if failed else ""
    matcher = None if failed else llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher is not None and matcher.is_error():
        error = matcher.get_error()
    if error:
        raise ConstraintError(f"{param} schema cannot be enforced: {error}", param)
    return matcher


def _ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, with every end token the engine stops on."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper wraps HF's
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ConstraintError("structured outputs need a fast (Rust) Hugging Face tokenizer; "
                              f"this model has {type(hf).__name__}")
    backend = copy.copy(backend)  # as llguidance.hf does: serialize without padding/truncation
    backend.no_padding()
    backend.no_truncation()
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or {hf.eos_token_id})
    return llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
