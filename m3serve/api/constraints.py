"""What a request constrains its output to, validated into a `Constraint` the engine compiles:
`response_format` (`json_object`, or a `json_schema` checked for features the grammar engine
cannot enforce) and an enforced `tool_choice` (`required` or a named function: one MiniMax-M3
tool-call block whose arguments satisfy the tools' schemas, `model/tool_grammar.py`).

Every refusal is a 400 naming the feature, before anything reaches the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import xgrammar

from m3serve.api.errors import APIError
from m3serve.api.protocol import ChatCompletionRequest, ResponseFormat
from m3serve.model.tool_grammar import SchemaUnsupported, tool_call_grammar
from m3serve.runtime.messages import Constraint

# JSON-schema keywords xgrammar's converter accepts without enforcing them.
NOT_ENFORCED = frozenset(
    {
        "not", "if", "then", "else", "uniqueItems", "dependentRequired", "dependentSchemas",
        "dependencies", "$dynamicRef", "$dynamicAnchor", "contentEncoding", "contentMediaType",
        "contentSchema",
    }
)  # fmt: skip
FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference",
        "uri-template", "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
# Where a schema holds subschemas: one, a list, or a map of them.
ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
       "unevaluatedItems", "not", "if", "then", "else")  # fmt: skip
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def response_format_constraint(fmt: ResponseFormat | None) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object")
    param = "response_format.json_schema"
    if fmt.json_schema is None or not isinstance(fmt.json_schema.schema_, dict):
        raise APIError(400, "response_format json_schema needs json_schema.schema", param)
    schema = fmt.json_schema.schema_
    for where, problem in _unenforced(schema, f"{param}.schema"):
        raise APIError(400, f"{where}: {problem} is not supported in structured output", param)
    text = json.dumps(schema)
    try:
        xgrammar.Grammar.from_json_schema(text)
    except RuntimeError as exc:
        reason = str(exc).rsplit(": ", 1)[-1]
        raise APIError(400, f"{param}.schema is not supported: {reason}", param) from exc
    return Constraint("json_schema", text)


def tool_choice_constraint(
    body: ChatCompletionRequest, tools: list[dict[str, Any]], specials: dict[str, int] | None
) -> Constraint | None:
    """The grammar of the call `tool_choice` forces (None for auto / none / unset)."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise APIError(400, "tool_choice other than none or auto needs tools", "tool_choice")
    names = [t.get("function", t).get("name") for t in tools]
    if choice != "required":
        name = choice.function.name  # type: ignore[union-attr]
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        names = [name]
    if specials is None:
        raise APIError(400, "an enforced tool_choice needs the tokenizer", "tool_choice")
    parallel = body.parallel_tool_calls and choice == "required"
    try:
        return Constraint("ebnf", tool_call_grammar(tools, names, parallel, specials))
    except SchemaUnsupported as exc:
        raise APIError(400, str(exc), "tools") from exc


def _unenforced(schema: Any, where: str) -> Iterator[tuple[str, str]]:
    """(path, feature) of every keyword in `schema` or its subschemas that would be ignored."""
    if not isinstance(schema, dict):
        return
    for keyword in schema:
        if keyword in NOT_ENFORCED:
            yield where, keyword
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS:
        yield where, f"format {fmt!r}"
    for key in ONE:
        if key in schema:
            yield from _unenforced(schema[key], f"{where}.{key}")
    for key in MANY:
        for i, member in enumerate(schema.get(key) or []):
            yield from _unenforced(member, f"{where}.{key}.{i}")
    for key in NAMED:
        members = schema.get(key)
        for name, member in members.items() if isinstance(members, dict) else ():
            yield from _unenforced(member, f"{where}.{key}.{name}")
