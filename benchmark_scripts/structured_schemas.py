"""Five JSON schemas for the structured-output checks, each with a prompt and a valid example.

Shared by ``benchmark_grammar_libs.py`` (the examples are the token streams
whose masks it times), ``benchmark_structured.py`` (the prompts it sends to the
real model) and the tests. Together they cover nested objects, arrays of
objects, enums, required fields, bounded numbers and a string pattern. Strings
carry ``maxLength`` and arrays ``maxItems``, as a careful client's schema
does, and numbers a range and a ``multipleOf`` (a power of two: ``jsonschema``
checks 0.1 in floating point and refuses e.g. 0.3): a 135M model may otherwise ramble
inside a string, or write a decimal's digits, until ``max_tokens`` (measured with
numbers unbounded: two of 50 answers write 300-digit temperatures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    """A named schema, a prompt asking for it, and one instance that validates."""

    name: str
    schema: dict[str, Any]
    prompt: str
    example: Any


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object schema with no extra properties, every property required unless told."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


def _str(max_length: int = 40) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


PERSON = SchemaCase(
    "person",
    _obj({"name": _str(), "age": {"type": "integer", "minimum": 0, "maximum": 150},
          "email": _str(60)}, required=["name", "age"]),
    "Describe a fictional person as JSON with a name, an age and an email address.",
    {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
)

ORDER = SchemaCase(
    "order",
    _obj({
        "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "customer": _obj({"name": _str(), "address": _obj({"street": _str(), "city": _str(),
                                                           "zip": _str(10)})}),
        "items": {"type": "array", "minItems": 1, "maxItems": 4,
                  "items": _obj({"sku": _str(12), "quantity": {"type": "integer", "minimum": 1,
                                                               "maximum": 99},
                                 "price": {"type": "number", "minimum": 0, "maximum": 10000,
                                           "multipleOf": 0.25}})},
        "status": {"enum": ["pending", "shipped", "delivered"]},
    }),
    "Write a JSON record of an online shop order: customer with address, items, status.",
    {"order_id": 1042, "customer": {"name": "Bo Chen", "address": {
        "street": "12 Elm St", "city": "Springfield", "zip": "12345"}},
     "items": [{"sku": "A-100", "quantity": 2, "price": 9.75},
               {"sku": "B-7", "quantity": 1, "price": 120}], "status": "shipped"},
)

WEATHER = SchemaCase(
    "weather",
    _obj({"city": _str(), "unit": {"enum": ["celsius", "fahrenheit"]},
          "forecast": {"type": "array", "minItems": 1, "maxItems": 5,
                       "items": {"type": "number", "minimum": -80, "maximum": 140,
                                 "multipleOf": 0.5}},
          "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]}}),
    "Give a JSON weather forecast for Paris: unit, daily temperatures and conditions.",
    {"city": "Paris", "unit": "celsius", "forecast": [18.5, 21, 19], "conditions": "cloudy"},
)

BOOK = SchemaCase(
    "book",
    _obj({"title": _str(60), "authors": {"type": "array", "minItems": 1, "maxItems": 3,
                                         "items": _str()},
          "year": {"type": "integer", "minimum": 1400, "maximum": 2100},
          "genres": {"type": "array", "maxItems": 3,
                     "items": {"enum": ["fiction", "science", "history", "poetry", "children"]}},
          "available": {"type": "boolean"},
          "rating": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 5,
                                "multipleOf": 0.5},
                               {"type": "null"}]}},
         required=["title", "authors", "year", "available"]),
    "Describe a well-known book as JSON: title, authors, year, genres, availability.",
    {"title": "The Hobbit", "authors": ["J. R. R. Tolkien"], "year": 1937,
     "genres": ["fiction", "children"], "available": True, "rating": 4.5},
)

EVENT = SchemaCase(
    "event",
    _obj({"name": _str(), "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
          "location": _obj({"venue": _str(), "capacity": {"type": "integer", "minimum": 1,
                                                         "maximum": 100000}}),
          "attendees": {"type": "array", "maxItems": 4,
                        "items": _obj({"name": _str(),
                                       "role": {"enum": ["speaker", "guest", "staff"]}})}}),
    "Plan a small conference as JSON: name, date (YYYY-MM-DD), location and attendees.",
    {"name": "PyCon Mini", "date": "2025-06-14",
     "location": {"venue": "Town Hall", "capacity": 300},
     "attendees": [{"name": "Grace", "role": "speaker"}, {"name": "Linus", "role": "guest"}]},
)

CASES: tuple[SchemaCase, ...] = (PERSON, ORDER, WEATHER, BOOK, EVENT)


def response_format(case: SchemaCase, strict: bool = True) -> dict[str, Any]:
    """The OpenAI ``response_format`` that asks for ``case``'s schema."""
    return {"type": "json_schema",
            "json_schema": {"name": case.name, "schema": case.schema, "strict": strict}}
