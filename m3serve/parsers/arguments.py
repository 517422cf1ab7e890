"""Tool-call arguments as JSON: the element tree the parser reads from a MiniMax invoke, and its
values typed by the tool's JSON schema (``type`` names and lists, ``anyOf``/``oneOf`` members;
``string`` fits any text, so it is tried last) or, without a schema, read as nested objects,
``item`` arrays and text."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

_FAIL = object()  # a schema type that does not fit the text


@dataclass
class Element:
    """An argument element: its key, what its closing tag says, its text and child elements."""

    key: str
    tag: str
    text: list[str] = field(default_factory=list)
    children: list[Element] = field(default_factory=list)


def tool_properties(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """Each offered tool's parameter schemas by name; None when no tools (keep every call)."""
    if not tools:
        return None
    found: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        found[function["name"]] = properties if isinstance(properties, dict) else {}
    return found


def loose_arguments(loose: list[str]) -> str:
    """Arguments of an invoke with no parameter elements: its body if that is a JSON object."""
    parsed = _json(_strip_one_newline("".join(loose)).strip())
    return json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, dict) else "{}"


def coerce(element: Element, schema: Any) -> Any:
    """The JSON value of an argument element, typed by its JSON schema (None: no schema).

    The schema's types (``type`` as a name or list, ``anyOf``/``oneOf`` members) are tried in
    order, except that ``string`` fits any text and so is tried last; an element that fits none
    is read untyped.
    """
    for kind, subschema in _schema_types(schema):
        value = _as_type(element, kind, subschema)
        if value is not _FAIL:
            return value
    return _untyped(element)


def _schema_types(schema: Any) -> list[tuple[str, dict[str, Any]]]:
    found = list(_walk_types(schema))
    return [t for t in found if t[0] != "string"] + [t for t in found if t[0] == "string"]


def _walk_types(schema: Any) -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    found = [(k, schema) for k in kinds if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        for member in members if isinstance(members, list) else []:
            found += _walk_types(member)
    if not found and "properties" in schema:
        found.append(("object", schema))
    elif not found and "items" in schema:
        found.append(("array", schema))
    return found


def _as_type(element: Element, kind: str, schema: dict[str, Any]) -> Any:
    if kind == "object":
        return _as_object(element, schema)
    if kind == "array":
        return _as_array(element, schema)
    if element.children or kind not in _SCALARS:
        return _FAIL
    return _SCALARS[kind](_strip_one_newline("".join(element.text)))


def _as_object(element: Element, schema: dict[str, Any]) -> Any:
    if element.children:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        extra = schema.get("additionalProperties")
        return {c.key: coerce(c, properties.get(c.key, extra)) for c in element.children}
    text = "".join(element.text).strip()
    if not text:  # an empty object renders as an empty element
        return {}
    parsed = _json(text)
    return parsed if isinstance(parsed, dict) else _FAIL


def _as_array(element: Element, schema: dict[str, Any]) -> Any:
    if element.children:
        return [coerce(child, schema.get("items")) for child in element.children]
    text = "".join(element.text).strip()
    if not text:  # an empty array renders as an empty element
        return []
    parsed = _json(text)
    return parsed if isinstance(parsed, list) else _FAIL


def _as_number(text: str, integer: bool) -> Any:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
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
    """No schema: children make an array (all ``item``) or an object; text stays text unless it
    is a JSON object or array."""
    if element.children:
        if all(child.key == "item" for child in element.children):
            return [_untyped(child) for child in element.children]
        return {child.key: _untyped(child) for child in element.children}
    text = _strip_one_newline("".join(element.text))
    parsed = _json(text.strip())
    return parsed if isinstance(parsed, (dict, list)) else text


def _json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # ValueError also covers integers too long to read
        return _FAIL


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; re-encoded they would make the arguments invalid.
    raise ValueError(f"{name} is not JSON")


def _strip_one_newline(text: str) -> str:
    """Leaf text loses one line break at each end (the model may put values on their own line)."""
    for newline in ("\r\n", "\n"):
        if text.startswith(newline):
            text = text[len(newline) :]
            break
    for newline in ("\r\n", "\n"):
        if text.endswith(newline):
            text = text[: -len(newline)]
            break
    return text
