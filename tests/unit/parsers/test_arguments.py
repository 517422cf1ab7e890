"""Argument values: typed by the tool's JSON schema (through $ref, anyOf/oneOf/allOf, nullable,
nested objects and arrays), strings kept exactly, repeated siblings made arrays; random schemas
and values round-trip through the template's XML."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.m3_tools import (
    block,
    dressed,
    element,
    invoke,
    plain_schemas,
    render_element,
    tool,
    values_for,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.parsers.arguments import Element, coerce
from m3serve.parsers.tools import ToolCallParser


def parsed(properties: dict[str, Any] | None, body: str, **extra: Any) -> dict[str, Any]:
    """The arguments of one invoke of tool ``f`` (no schema at all when properties is None)."""
    tools = None if properties is None else [tool("f", properties, **extra)]
    content, calls = ToolCallParser(tools).parse(block(invoke("f", body)))
    assert content == ""
    return json.loads(calls[0].arguments)


@pytest.mark.parametrize(
    ("schema", "inner", "value"),
    [
        ({"type": "integer"}, "42", 42),
        ({"type": "integer"}, "\n-3.0\n", -3),
        ({"type": "integer"}, "2.5", 2.5),
        ({"type": "integer"}, "many", "many"),
        ({"type": "integer"}, "1_000", "1_000"),
        ({"type": "number"}, "1e3", 1000.0),
        ({"type": "number"}, " 7 ", 7),
        ({"type": "number"}, "NaN", "NaN"),
        ({"type": "number"}, "infinity", "infinity"),
        ({"type": "boolean"}, "True", True),
        ({"type": "boolean"}, " false ", False),
        ({"type": "boolean"}, "yes", "yes"),
        ({"type": "null"}, "null", None),
        ({"type": "string"}, "\n\n 12 \n\n", "\n\n 12 \n\n"),
        ({"type": "string"}, "", ""),
        ({"type": ["string", "null"]}, "null", None),
        ({"type": "string", "nullable": True}, "NULL", None),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "null", None),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "nil", "nil"),
        ({"type": "string"}, "null", "null"),
        ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "5", 5),
        ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "five", "five"),
        ({"allOf": [{"type": "integer"}, {"minimum": 0}]}, "9", 9),
        ({"enum": ["a", "b"]}, "a", "a"),
        ({"enum": [1, 2]}, "2", 2),
        ({"const": True}, "true", True),
        ({"type": "object"}, '{"k": [1]}', {"k": [1]}),
        ({"type": "object"}, element("k", "1"), {"k": "1"}),
        (
            {"type": "object", "properties": {"k": {"type": "integer"}}},
            element("k", "1") + element("j", "true"),
            {"k": 1, "j": "true"},
        ),
        (
            {"type": "object", "additionalProperties": {"type": "number"}},
            element("k", "1.5"),
            {"k": 1.5},
        ),
        ({"type": "object"}, "not json", "not json"),
        ({"type": "array"}, "[1, 2]", [1, 2]),
        (
            {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}}},
            element("item", element("item", "true") + element("item", "FALSE")),
            [[True, False]],
        ),
        (
            {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
            element("item", "1") + element("item", "1"),
            [1, "1"],
        ),
        ({"type": "array", "items": {"type": "number"}}, "", []),
        ({"properties": {"x": {"type": "integer"}}}, element("x", "2"), {"x": 2}),
        ({"items": {"type": "integer"}}, element("item", "2"), [2]),
        ({"type": "string"}, '{"a": 1}', '{"a": 1}'),
        (None, '{"a": 1}', '{"a": 1}'),
        (None, " 12\n", " 12\n"),
        (None, element("item", "a") + element("item", "b"), ["a", "b"]),
        (None, element("x", "a") + element("item", "b"), {"x": "a", "item": "b"}),
        ({"type": "integer"}, "1" * 5000, "1" * 5000),
        ({"type": "object"}, "[" * 100000, "[" * 100000),
    ],
)
def test_values_are_typed_by_schema(schema: Any, inner: str, value: Any) -> None:
    properties = {"v": schema} if schema is not None else {}
    assert parsed(properties, element("v", inner)) == {"v": value}


def test_a_ref_reaches_defs_definitions_and_refs_behind_refs() -> None:
    defs = {
        "Point": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "Alias": {"$ref": "#/$defs/Point"},
        "Count": {"type": ["integer", "null"]},
    }
    properties = {
        "a": {"$ref": "#/$defs/Alias"},
        "b": {"$ref": "#/definitions/Flag"},
        "c": {"type": "array", "items": {"$ref": "#/$defs/Count"}},
    }
    body = element("a", element("x", "4")) + element("b", "false")
    body += element("c", element("item", "1") + element("item", "null"))
    args = parsed(properties, body, **{"$defs": defs, "definitions": {"Flag": {"type": "boolean"}}})
    assert args == {"a": {"x": 4}, "b": False, "c": [1, None]}


def test_a_recursive_schema_types_every_level() -> None:
    node = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
    }
    inner = element("n", "2") + element("kids", "")
    body = element("n", "1") + element("kids", element("item", inner))
    assert parsed(node["properties"], body) == {"n": 1, "kids": [{"n": 2, "kids": []}]}


def test_a_reference_cycle_leaves_the_value_untyped() -> None:
    defs = {"A": {"$ref": "#/$defs/B"}, "B": {"anyOf": [{"$ref": "#/$defs/A"}]}}
    assert parsed({"v": {"$ref": "#/$defs/A"}}, element("v", "7"), **{"$defs": defs}) == {"v": "7"}


def test_all_of_members_add_properties() -> None:
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}},
            {"properties": {"b": {"type": "boolean"}}},
        ]
    }
    assert parsed({"v": schema}, element("v", element("a", "1") + element("b", "true"))) == {
        "v": {"a": 1, "b": True}
    }


def test_repeated_siblings_become_an_array() -> None:
    properties = {"tag": {"type": "string"}, "n": {"type": "array", "items": {"type": "integer"}}}
    body = element("tag", "a") + element("n", "1") + element("tag", "b") + element("n", "2")
    body += element("tag", "c")
    assert parsed(properties, body) == {"tag": ["a", "b", "c"], "n": [1, 2]}
    nested = element("o", element("k", "x") + element("k", "y"))
    assert parsed(None, nested) == {"o": {"k": ["x", "y"]}}


def test_whitespace_between_elements_is_layout() -> None:
    schema = {
        "type": "array",
        "items": {"type": "object", "properties": {"x": {"type": "integer"}}},
    }
    pretty = f"\n  {element('item', chr(10) + '    ' + element('x', '1') + chr(10))}\n"
    assert parsed({"v": schema}, f"\n{element('v', pretty)}\n") == {"v": [{"x": 1}]}


def test_coerce_reads_refs_against_the_root_it_is_given() -> None:
    root = {"$defs": {"Flag": {"type": "boolean"}}}
    value = Element("v", "v", text=["true"])
    assert coerce(value, {"$ref": "#/$defs/Flag"}, root) is True
    assert coerce(value, {"$ref": "#/$defs/Flag"}) == "true"  # no root: the ref leads nowhere
    assert coerce(value, None) == "true"


@st.composite
def schemas_and_values(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], Any]:
    plain = draw(plain_schemas)
    value = draw(values_for(plain))
    defs: dict[str, Any] = {}
    return draw(dressed(plain, defs)), defs, value


@settings(max_examples=400, deadline=None)
@given(schemas_and_values())
def test_random_schemas_and_values_round_trip_through_the_xml(
    case: tuple[dict[str, Any], dict[str, Any], Any],
) -> None:
    schema, defs, value = case
    assert parsed({"v": schema}, render_element("v", value), **{"$defs": defs}) == {"v": value}
