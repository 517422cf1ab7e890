"""MiniMax-M3 tool calls for parser tests: rendering calls the way the chat template does, and
hypothesis strategies for tools (JSON schemas dressed up with $ref, allOf/anyOf/oneOf and
nullable forms), argument values that a schema types unambiguously, and model outputs."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from m3serve.model.special_tokens import THINK_END, THINK_START, TOOL_CALL_START, TOOL_NAMESPACE

N = TOOL_NAMESPACE
BREAKS = "\r\n"


def tool(name: str, properties: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties or {}, **extra}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def element(name: str, inner: str) -> str:
    return f"{N}<{name}>{inner}{N}</{name}>"


def invoke(name: str, body: str) -> str:
    return f'{N}<invoke name="{name}">{body}{N}</invoke>'


def block(*invokes: str) -> str:
    return f"{TOOL_CALL_START}\n" + "".join(f"{i}\n" for i in invokes) + f"{N}</tool_call>"


def render_element(name: str, value: Any, parameter_spelling: bool = False) -> str:
    opener, closer = (f'<parameter name="{name}">', "</parameter>")
    if not parameter_spelling:
        opener, closer = f"<{name}>", f"</{name}>"
    if isinstance(value, dict):
        inner = "".join(render_element(k, v) for k, v in value.items())
    elif isinstance(value, list):
        inner = "".join(render_element("item", v) for v in value)
    elif isinstance(value, str):
        inner = value
    else:  # numbers, booleans and null as JSON, like the template's tojson
        inner = json.dumps(value)
    return f"{N}{opener}{inner}{N}{closer}"


def render_block(
    calls: list[tuple[str, dict[str, Any]]], separator: str = "\n", parameter_spelling: bool = False
) -> str:
    invokes = "".join(
        f'{N}<invoke name="{name}">'
        + "".join(render_element(k, v, parameter_spelling) for k, v in args.items())
        + f"{N}</invoke>{separator}"
        for name, args in calls
    )
    return f"{TOOL_CALL_START}{separator}{invokes}{N}</tool_call>"


# Values.

# Parameters named like the block's own tags (invoke, tool_call) could not be told apart from
# them; "item" is fine where a schema says the parent is an object.
names = st.sampled_from(["location", "unit", "a", "b_2", "x", "item", "query", "n", "días", "k-9"])
STRING_PIECES = ["<", ">", "</a>", "<b>", "]", "]<]", "]<]minimax[>", "[>[", '"', "\\", "{}"]
STRING_PIECES += ["[1]", "\n", "\r\n", " ", "\t", "日本", "😀", "null", "true", "1", "&amp;"]
STRING_PIECES += ["<item>", "    indented\n", "\n\n"]
# Any text but N, which would end the value: whitespace and line breaks anywhere are the value's.
strings = (
    st.lists(
        st.one_of(
            st.text(st.characters(codec="utf-8"), max_size=5), st.sampled_from(STRING_PIECES)
        ),
        max_size=4,
    )
    .map("".join)
    .filter(lambda s: N not in s)
)
integers = st.integers(-(10**15), 10**15)
numbers = st.floats(allow_nan=False, allow_infinity=False)
SCALARS = {
    "string": strings,
    "integer": integers,
    "number": numbers,
    "boolean": st.booleans(),
    "null": st.none(),
}
NULLABLE_FORMS = ["list", "nullable", "anyOf"]


def nullable(kind: str, form: str) -> dict[str, Any]:
    """A nullable scalar schema, spelled one of the ways schemas spell it."""
    if form == "list":
        return {"type": [kind, "null"]}
    if form == "nullable":
        return {"type": kind, "nullable": True}
    return {"anyOf": [{"type": kind}, {"type": "null"}]}


scalar_schemas = st.one_of(
    st.sampled_from([{"type": kind} for kind in SCALARS]),
    st.builds(
        nullable,
        st.sampled_from(["integer", "number", "boolean", "string"]),
        st.sampled_from(NULLABLE_FORMS),
    ),
)
# Plain schemas: scalars, objects of optional properties, arrays.
plain_schemas = st.recursive(
    scalar_schemas,
    lambda inner: st.one_of(
        st.dictionaries(names, inner, max_size=3).map(
            lambda props: {"type": "object", "properties": props}
        ),
        inner.map(lambda items: {"type": "array", "items": items}),
    ),
    max_leaves=6,
)


def values_for(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that a plain schema types unambiguously (a nullable string is never "null")."""
    kind = schema.get("type")
    if isinstance(kind, list) or "anyOf" in schema or schema.get("nullable"):
        base = kind[0] if isinstance(kind, list) else kind or schema["anyOf"][0]["type"]
        value = SCALARS[base]
        if base == "string":
            value = strings.filter(lambda s: s.strip().lower() != "null")
        return st.one_of(st.none(), value)
    if kind == "object":
        optional = {k: values_for(v) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries({}, optional=optional)
    if kind == "array":
        return st.lists(values_for(schema["items"]), max_size=3)
    return SCALARS[kind]


@st.composite
def dressed(draw: st.DrawFn, schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The same schema written less plainly: parts moved behind $refs (into ``defs``, some
    pointing at other refs), wrapped in one-member allOf/anyOf/oneOf, objects split over allOf."""
    if schema.get("type") == "object":
        properties = {k: draw(dressed(v, defs)) for k, v in schema["properties"].items()}
        keys = list(properties)
        cut = draw(st.integers(0, len(keys)))
        if draw(st.booleans()) and keys:
            first = {k: properties[k] for k in keys[:cut]}
            rest = {k: properties[k] for k in keys[cut:]}
            schema = {"allOf": [{"type": "object", "properties": first}, {"properties": rest}]}
        else:
            schema = {"type": "object", "properties": properties}
    elif schema.get("type") == "array":
        schema = {"type": "array", "items": draw(dressed(schema["items"], defs))}
    for _ in range(draw(st.integers(0, 2))):
        wrap = draw(st.sampled_from(["ref", "allOf", "anyOf", "oneOf", "described"]))
        if wrap == "ref":
            name = f"Def{len(defs)}"
            defs[name] = schema
            schema = {"$ref": f"#/$defs/{name}"}
        elif wrap == "described":
            schema = {**schema, "description": "a value"}
        else:
            schema = {wrap: [schema]}
    return schema


@st.composite
def toolsets(draw: st.DrawFn) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """1-3 tools, each with the plain schemas of its properties (to draw values from)."""
    found = []
    for name in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
        plain = draw(st.dictionaries(names, plain_schemas, max_size=4))
        defs: dict[str, Any] = {}
        properties = {k: draw(dressed(v, defs)) for k, v in plain.items()}
        extra = {"$defs": defs} if defs else {}
        found.append((tool(name, properties, **extra), plain))
    return found


@st.composite
def calls_for(
    draw: st.DrawFn, tools: list[tuple[dict[str, Any], dict[str, Any]]]
) -> list[tuple[str, dict[str, Any]]]:
    """0-3 calls; some to a tool that was not offered (to be dropped)."""
    calls = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.integers(0, 4)) == 0:
            args = draw(st.dictionaries(names, strings, max_size=2))
            calls.append((f"not.offered.{draw(names)}", args))
            continue
        offered, plain = draw(st.sampled_from(tools))
        args = draw(values_for({"type": "object", "properties": plain}))
        calls.append((offered["function"]["name"], args))
    return calls


# Free text that never holds N or a think tag but plenty that looks like a start of one.
ANSWER_PIECES = ["<", ">", "]", "]<]", "]]<]", "]<]minimax[>", "[>[", "<tool_call>"]
ANSWER_PIECES += ["</tool_call>", '<invoke name="f">', "<mm:thi", "</mm:", "\n", " ", "ñ", "🙂"]
free_text = (
    st.lists(
        st.one_of(
            st.text(st.characters(codec="utf-8"), max_size=6), st.sampled_from(ANSWER_PIECES)
        ),
        max_size=6,
    )
    .map("".join)
    .filter(lambda s: N not in s and THINK_START not in s and THINK_END not in s)
)


@st.composite
def model_outputs(draw: st.DrawFn) -> dict[str, Any]:
    """A whole model output in some thinking mode, with what the parsers should make of it.

    Its calls may come after the answer or straight out of an unclosed trace, and the output may
    stop inside its last invoke (cut off: that invoke is no call, the text after it never came).
    """
    offered = draw(toolsets())
    tools = [t for t, _ in offered]
    calls = draw(calls_for(offered))
    answer, trailing, reasoning = draw(free_text), draw(free_text), draw(free_text)
    separator = draw(st.sampled_from(["\n", "", "\n\n", " \n"]))
    block = render_block(calls, separator, draw(st.booleans())) if calls else ""
    cut = bool(calls) and draw(st.booleans())
    if cut:
        last = block.rindex(f"{N}<invoke")
        end = block.rindex(f"{N}</invoke>") + len(f"{N}</invoke>")
        block = block[: draw(st.integers(block.index('">', last) + 2, end - 1))]
        trailing = ""
    mode = draw(st.sampled_from(["enabled", "disabled", "adaptive"]))
    shapes = {"enabled": ["think"], "disabled": ["", "stray"], "adaptive": ["", "stray", "think"]}
    shape = draw(
        st.sampled_from(shapes[mode] + (["call in think"] if calls and mode != "disabled" else []))
    )
    if shape == "call in think":
        answer = ""  # the trace ends where the block starts
    prefix = {"": "", "stray": THINK_END, "think": reasoning + THINK_END}.get(shape, reasoning)
    if mode == "adaptive" and shape in ("think", "call in think"):
        prefix = THINK_START + prefix
    # Line breaks after a think tag are dropped, be it in the output or at the end of the prompt.
    after_tag = mode != "adaptive" or shape != ""
    answer_part = answer + block + trailing
    content = answer_part.lstrip(BREAKS) if after_tag and shape != "call in think" else answer_part
    names = {t["function"]["name"] for t in tools}
    return {
        "mode": mode,
        "tools": tools,
        "text": prefix + answer_part,
        "reasoning": reasoning.strip(BREAKS) if shape in ("think", "call in think") else "",
        "content": content.replace(block, "", 1),
        "calls": [(name, args) for name, args in calls[: len(calls) - cut] if name in names],
    }
