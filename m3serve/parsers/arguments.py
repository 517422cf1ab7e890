"""Tool-call arguments as JSON: the element tree the parser reads from a MiniMax invoke, and its
values typed by the tool's JSON schema (`schema.Schema`).

Rules, as SGLang's and vLLM's MiniMax-M3 parsers read values:

* A value's types are tried in the schema's order, except that ``string`` fits any text and so
  goes last; a value that fits none, or has no schema, is read untyped: text stays text,
  elements holding only ``item`` elements make an array, other elements an object.
* Text is kept exactly as written: a string keeps every space and line break, including a line
  break right after the opening tag or right before the closing one. vLLM's and SGLang's M3
  parsers keep string text verbatim too; stripping one such line break is the rule of formats
  whose template writes one there (Qwen3-Coder's ``<parameter=x>\n``), and the M3 template writes
  values with none, so any there is the value's own. Numbers, booleans, null, and JSON objects
  or arrays written as text, are read with surrounding whitespace ignored; whitespace between
  elements is layout.
* Sibling elements with the same name become one array, in order (each typed as an item when
  the property is an array); no value is silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from m3serve.parsers.schema import Schema

_FAIL = object()  # a schema type that does not fit the value
_INTEGER = re.compile(r"-?[0-9]+")
_NUMBER = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


@dataclass
class Element:
    """An argument element: its key, what its closing tag says, its text and child elements."""

    key: str
    tag: str
    text: list[str] = field(default_factory=list)
    children: list[Element] = field(default_factory=list)


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """Each offered tool's ``parameters`` schema by name; None when no tools (keep every call)."""
    if not tools:
        return None
    found: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        found[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return found


def arguments(elements: list[Element], parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The arguments object of an invoke's top-level elements, typed by the tool's schema."""
    return _as_object_of(elements, Schema(parameters, parameters))


def loose_arguments(loose: list[str]) -> str:
    """Arguments of an invoke with no parameter elements: its body if that is a JSON object."""
    parsed = _json("".join(loose).strip())
    return json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, dict) else "{}"


def coerce(element: Element, schema: Any, root: Any = None) -> Any:
    """The JSON value of an argument element, typed by its JSON schema (None: no schema).

    ``root`` is the document the schema's ``$ref``s point into (the tool's ``parameters``); by
    default the schema itself.
    """
    return _coerce(element, Schema(schema, schema if root is None else root))


def _coerce(element: Element, schema: Schema) -> Any:
    kinds = schema.types()
    for kind in [k for k in kinds if k != "string"] + [k for k in kinds if k == "string"]:
        value = _as_type(element, kind, schema)
        if value is not _FAIL:
            return value
    return _untyped(element)


def _as_type(element: Element, kind: str, schema: Schema) -> Any:
    if kind == "object":
        return _as_object(element, schema)
    if kind == "array":
        return _as_array(element, schema)
    if element.children or kind not in _SCALARS:
        return _FAIL
    return _SCALARS[kind]("".join(element.text))


def _as_object(element: Element, schema: Schema) -> Any:
    if element.children:
        return _as_object_of(element.children, schema)
    text = "".join(element.text).strip()
    if not text:  # an empty object renders as an empty element
        return {}
    parsed = _json(text)
    return parsed if isinstance(parsed, dict) else _FAIL


def _as_object_of(children: list[Element], schema: Schema) -> dict[str, Any]:
    siblings: dict[str, list[Element]] = {}
    for child in children:
        siblings.setdefault(child.key, []).append(child)
    found: dict[str, Any] = {}
    for key, group in siblings.items():
        value = schema.property(key)
        if len(group) == 1:
            found[key] = _coerce(group[0], value)
        else:
            typed_as_items = "array" in value.types()
            found[key] = [
                _coerce(child, value.item(i) if typed_as_items else value)
                for i, child in enumerate(group)
            ]
    return found


def _as_array(element: Element, schema: Schema) -> Any:
    if element.children:
        if any(child.key != "item" for child in element.children):
            return _FAIL
        return [_coerce(child, schema.item(i)) for i, child in enumerate(element.children)]
    text = "".join(element.text).strip()
    if not text:  # an empty array renders as an empty element
        return []
    parsed = _json(text)
    return parsed if isinstance(parsed, list) else _FAIL


def _as_number(text: str, integer: bool) -> Any:
    text = text.strip()
    try:
        if _INTEGER.fullmatch(text):
            return int(text)
        value = float(text) if _NUMBER.fullmatch(text) else math.nan
    except ValueError:  # more digits than Python reads as an int
        return _FAIL
    if not math.isfinite(value):  # JSON has no infinities or NaN
        return _FAIL
    return int(value) if integer and value.is_integer() else value


def _as_boolean(text: str) -> Any:
    word = text.strip().lower()
    return word == "true" if word in ("true", "false") else _FAIL


def _as_null(text: str) -> Any:
    return None if text.strip().lower() == "null" else _FAIL


_SCALARS = {
    "string": lambda text: text,
    "integer": lambda text: _as_number(text, integer=True),
    "number": lambda text: _as_number(text, integer=False),
    "boolean": _as_boolean,
    "null": _as_null,
}


def _untyped(element: Element) -> Any:
    if not element.children:
        return "".join(element.text)
    if all(child.key == "item" for child in element.children):
        return [_untyped(child) for child in element.children]
    return _as_object_of(element.children, Schema(None))


def _json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # ValueError also covers integers too long to read
        return _FAIL


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; re-encoded they would make the arguments invalid.
    raise ValueError(f"{name} is not JSON")
