"""Reading a JSON schema: types, properties and items through $ref, combinators and nullable;
cycles and oversized schemas end the walk."""

from __future__ import annotations

from typing import Any

import pytest

from m3serve.parsers.schema import MAX_VISITS, Schema


def at(node: Any, root: Any = None) -> Schema:
    return Schema(node, node if root is None else root)


@pytest.mark.parametrize(
    ("node", "types"),
    [
        ({"type": "integer"}, ["integer"]),
        ({"type": ["string", "null"]}, ["string", "null"]),
        ({"type": "number", "nullable": True}, ["number", "null"]),
        ({"anyOf": [{"type": "boolean"}, {"type": "null"}]}, ["boolean", "null"]),
        ({"oneOf": [{"type": "string"}, {"oneOf": [{"type": "integer"}]}]}, ["string", "integer"]),
        ({"allOf": [{"type": "object"}, {"properties": {}}]}, ["object"]),
        ({"properties": {"a": {}}}, ["object"]),
        ({"items": {}}, ["array"]),
        ({"enum": ["x", 1, None, True]}, ["string", "integer", "null", "boolean"]),
        ({"const": 2.5}, ["number"]),
        ({"description": "anything"}, []),
        (True, []),
        (None, []),
    ],
)
def test_types(node: Any, types: list[str]) -> None:
    assert at(node).types() == types


def test_refs_resolve_through_json_pointers() -> None:
    root = {
        "$defs": {
            "a/b": {"type": "integer"},
            "pct%": {"type": "boolean"},
            "x": {"$ref": "#/$defs/y"},
        },
        "definitions": {"list": [{"type": "string"}]},
    }
    root["$defs"]["y"] = {"type": "number"}
    assert at({"$ref": "#/$defs/a~1b"}, root).types() == ["integer"]
    assert at({"$ref": "#/$defs/pct%25"}, root).types() == ["boolean"]
    assert at({"$ref": "#/$defs/x"}, root).types() == ["number"]
    assert at({"$ref": "#/definitions/list/0"}, root).types() == ["string"]
    for dangling in ("#/$defs/missing", "https://example.com/s.json", "#anchor", 7):
        assert at({"$ref": dangling}, root).types() == []


def test_a_ref_keeps_its_sibling_keywords() -> None:
    root = {"$defs": {"N": {"type": "integer"}}}
    assert at({"$ref": "#/$defs/N", "nullable": True}, root).types() == ["null", "integer"]


def test_properties_and_items_are_found_in_members() -> None:
    root = {"$defs": {"Base": {"properties": {"id": {"type": "integer"}}}}}
    node = {
        "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}}],
        "additionalProperties": {"type": "boolean"},
    }
    schema = at(node, root)
    assert schema.property("id").types() == ["integer"]
    assert schema.property("name").types() == ["string"]
    assert schema.property("other").types() == ["boolean"]
    tuple_ = at({"prefixItems": [{"type": "integer"}], "items": {"type": "string"}})
    assert [tuple_.item(i).types() for i in range(2)] == [["integer"], ["string"]]
    assert at({"anyOf": [{"type": "null"}, {"items": {"type": "number"}}]}).item(5).types() == [
        "number"
    ]


def test_cycles_end_the_walk() -> None:
    root: dict[str, Any] = {"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "string"}]}}}
    assert at({"$ref": "#/$defs/A"}, root).types() == ["string"]
    itself: dict[str, Any] = {"allOf": []}
    itself["allOf"].append(itself)
    assert at(itself).types() == []


def test_a_huge_schema_is_cut_short() -> None:
    # A chain of shared references doubles at each level: 2**40 paths, one lookup stays bounded.
    defs = {
        f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"} for _ in range(2)]} for i in range(40)
    }
    defs["D40"] = {"type": "integer"}
    deep = {"anyOf": [{"allOf": [{}]} for _ in range(MAX_VISITS * 2)] + [{"type": "null"}]}
    assert at({"$ref": "#/$defs/D0"}, {"$defs": defs}).types() == ["integer"]
    assert at(deep).types() == []
