"""The grammar (xgrammar EBNF) of one MiniMax-M3 tool-call block whose arguments satisfy the
tools' JSON schemas: what an enforced `tool_choice` constrains the output to.

The block is the model's own format (see `parsers/tools.py`), with N the namespace token::

    N<tool_call>\\n
    N<invoke name="f">N<a>1N</a>N<b>N<item>xN</item>N</b>N</invoke>\\n
    N</tool_call>

The markup is split the way the tokenizer splits text: every special token in it (N, and the
legacy ``<tool_call>`` / ``</tool_call>`` tokens) is placed by its id (`Token(id)`), the rest
is text. A parameter is an element named by its key: objects hold one element per property (declared
order; required ones always, optional ones maybe), arrays repeated ``item`` elements, scalars
their text (``true``, ``null``, JSON numbers). String text may hold anything but a NUL (how the
engine spells special tokens for the grammar engine) and the namespace's own text, which the
parser would read as a tag. Only declared properties are generated (``additionalProperties`` is
never needed), integers have at most 19 digits, and a schema keyword that the grammar cannot
enforce is refused with `SchemaUnsupported`, naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from m3serve.model.special_tokens import TOOL_NAMESPACE

# Recognised JSON-schema keywords this grammar does not enforce (unknown ones are ignored, as
# JSON Schema says).
UNSUPPORTED = frozenset(
    {
        "allOf", "not", "if", "then", "else", "pattern", "format", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems", "prefixItems",
        "contains", "minContains", "maxContains", "minProperties", "maxProperties",
        "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
        "dependencies", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
        "contentEncoding", "contentMediaType",
    }
)  # fmt: skip
NS = TOOL_NAMESPACE
MAX_DIGITS = 19
_TAG_NAME = re.compile(r"[^\s<>/\"'=]+")
_INTEGER = f'"-"? ("0" | [1-9] [0-9]{{0,{MAX_DIGITS - 1}}})'
_NUMBER = f'{_INTEGER} ("." [0-9]{{1,{MAX_DIGITS}}})? ([eE] [+\\-]? [0-9]{{1,3}})?'
_TEXT = f'TagDispatch(loop_after_dispatch=false, excludes=("\\0", {json.dumps(TOOL_NAMESPACE)}))'
_SCALARS = {"integer": _INTEGER, "number": _NUMBER, "boolean": '"true" | "false"', "null": '"null"'}


class SchemaUnsupported(ValueError):
    """A tool schema the grammar cannot enforce; `where` is the path to it, `feature` the
    keyword (or construct) at fault."""

    def __init__(self, where: str, feature: str, detail: str = "is not supported") -> None:
        super().__init__(f"{where}: {feature} {detail} for an enforced tool call")
        self.where = where
        self.feature = feature


def tool_call_grammar(
    tools: list[dict[str, Any]], names: list[str], parallel: bool, specials: Mapping[str, int]
) -> str:
    """EBNF of one block calling the tools named in `names` (one call, or with `parallel`
    one or more); `specials` maps the tokenizer's special tokens to their ids."""
    if TOOL_NAMESPACE not in specials:
        raise ValueError(f"the tokenizer has no {TOOL_NAMESPACE} token")
    rules = _Rules(_Markup(specials))
    by_name = {_function(t).get("name"): _function(t) for t in tools}
    invokes = [rules.invoke(name, by_name[name]) for name in names]
    choice = rules.add(" | ".join(invokes), "invoke")
    calls = f"{choice}+" if parallel else choice
    opening, closing = rules.markup(f"{NS}<tool_call>\n"), rules.markup(f"{NS}</tool_call>")
    rules.add(f"{opening} {calls} {closing}", "root")
    return rules.text()


class _Markup:
    """Fixed text as the tokenizer would encode it: special tokens by id, the rest as text."""

    def __init__(self, specials: Mapping[str, int]) -> None:
        self._ids = dict(specials)
        longest_first = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def __call__(self, text: str) -> str:
        parts = [p for p in self._split.split(text) if p]
        return " ".join(f"Token({self._ids[p]})" if p in self._ids else _literal(p) for p in parts)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


class _Rules:
    """The rules of one grammar, each value schema turned into a named rule."""

    def __init__(self, markup: _Markup) -> None:
        self.markup = markup
        self._lines: list[str] = []
        self._defs: dict[str, Any] = {}
        self._def_rules: dict[str, str] = {}

    def add(self, body: str, hint: str = "r") -> str:
        name = "root" if hint == "root" else f"{hint}_{len(self._lines)}"
        self._lines.append(f"{name} ::= {body}")
        return name

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"

    def invoke(self, name: str, function: dict[str, Any]) -> str:
        where = f"tools.{name}.parameters"
        if not _TAG_NAME.fullmatch(name):
            raise SchemaUnsupported(f"tools.{name}", "the tool name", "is not a valid tag name")
        parameters = function.get("parameters") or {}
        self._defs = {**parameters.get("$defs", {}), **parameters.get("definitions", {})}
        self._def_rules = {}
        arguments = self.object_body(parameters, where) if parameters else '""'
        opening, closing = (
            self.markup(f'{NS}<invoke name="{name}">'),
            self.markup(f"{NS}</invoke>\n"),
        )
        return self.add(f"{opening} {arguments} {closing}", "invoke")

    def value(self, schema: Any, where: str) -> str:
        """The rule of an element's content for `schema`."""
        if schema is True or schema == {}:
            return self.add(_TEXT, "text")
        if not isinstance(schema, dict):
            raise SchemaUnsupported(where, "a schema that is not an object")
        _check_keywords(schema, where)
        if "$ref" in schema:
            return self.reference(schema["$ref"], where)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            return self.add(" | ".join(_enum_literal(v, where) for v in values), "enum")
        members = schema.get("anyOf") or schema.get("oneOf")
        if members:
            key = "anyOf" if "anyOf" in schema else "oneOf"
            rules = [self.value(m, f"{where}.{key}.{i}") for i, m in enumerate(members)]
            return self.add(" | ".join(rules), key)
        kinds = list(_kinds(schema))
        return self.add(" | ".join(self.typed(k, schema, where) for k in kinds), "value")

    def typed(self, kind: str, schema: dict[str, Any], where: str) -> str:
        if kind == "string":
            return self.string(schema)
        if kind == "object":
            return self.add(self.object_body(schema, where), "object")
        if kind == "array":
            return self.array(schema, where)
        if kind in _SCALARS:
            return self.add(_SCALARS[kind], kind)
        raise SchemaUnsupported(where, f"type {kind!r}")

    def string(self, schema: dict[str, Any]) -> str:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        char = r"[^\0\]]"  # no "]": the namespace's text cannot start inside a bounded string
        if high is not None:
            return self.add(f"{char}{{{low},{high}}}", "string")
        prefix = f"{char}{{{low}}} " if low else ""
        return self.add(prefix + _TEXT, "string")

    def object_body(self, schema: dict[str, Any], where: str) -> str:
        _check_keywords(schema, where)
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        missing = [key for key in required if key not in properties]
        if missing:
            raise SchemaUnsupported(f"{where}.required", f"{missing[0]!r}", "has no schema")
        parts = []
        for key, subschema in properties.items():
            element = self.element(key, subschema, f"{where}.properties.{key}")
            parts.append(element if key in required else f"({element})?")
        return " ".join(parts) or '""'

    def array(self, schema: dict[str, Any], where: str) -> str:
        item = self.element("item", schema.get("items", {}), f"{where}.items")
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        count = f"{{{low},{high}}}" if high is not None else f"{{{low},}}"
        return self.add(f"({item}){count}", "array")

    def element(self, key: str, schema: Any, where: str) -> str:
        if not _TAG_NAME.fullmatch(key):
            raise SchemaUnsupported(where, "the property name", "is not a valid tag name")
        content = self.value(schema, where)
        return f"{self.markup(f'{NS}<{key}>')} {content} {self.markup(f'{NS}</{key}>')}"

    def reference(self, ref: str, where: str) -> str:
        for prefix in ("#/$defs/", "#/definitions/"):
            name = ref.removeprefix(prefix)
            if ref.startswith(prefix) and name in self._defs:
                break
        else:
            raise SchemaUnsupported(where, f"$ref {ref!r}", "does not name a local definition")
        if name not in self._def_rules:
            # Named before it is built, so that a recursive definition refers to itself.
            rule = f"def_{len(self._def_rules)}_{len(self._lines)}"
            self._def_rules[name] = rule
            body = self.value(self._defs[name], f"{where}.$ref")
            self._lines.append(f"{rule} ::= {body}")
        return self._def_rules[name]


def _check_keywords(schema: dict[str, Any], where: str) -> None:
    for keyword in schema:
        if keyword in UNSUPPORTED:
            raise SchemaUnsupported(where, keyword)


def _kinds(schema: dict[str, Any]) -> Iterator[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        yield kind
    elif isinstance(kind, list) and kind:
        yield from kind
    elif "properties" in schema:
        yield "object"
    elif "items" in schema:
        yield "array"
    else:
        yield "string"  # no type: any text (the parser keeps it as text)


def _enum_literal(value: Any, where: str) -> str:
    if isinstance(value, (dict, list)):
        raise SchemaUnsupported(where, "an enum or const of objects or arrays")
    return _literal(value if isinstance(value, str) else json.dumps(value))


def _literal(text: str) -> str:
    """An EBNF string literal (xgrammar takes UTF-8 text and C-style escapes)."""
    if not text:
        return '""'
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(c if ord(c) >= 0x20 else f"\\x{ord(c):02x}" for c in escaped)
    return f'"{escaped}"'
