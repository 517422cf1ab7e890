"""The enforced tool-call grammar, run through xgrammar on the tiny tokenizer: it takes the
model's own block format with the namespace as one token, keeps the tools' schemas, and refuses
schema features it cannot enforce by name."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar

from m3serve.core.grammar import GrammarCompiler, tokenizer_vocab
from m3serve.model.special_tokens import TOOL_NAMESPACE
from m3serve.model.tiny.tokenizer import EOS_TOKEN, build_tokenizer
from m3serve.model.tool_grammar import SchemaUnsupported, tool_call_grammar
from m3serve.runtime.messages import Constraint

N = TOOL_NAMESPACE
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"enum": ["c", "f"]},
                "hours": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                "place": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "exact": {"type": "boolean"}},
                    "required": ["lat"],
                },
            },
            "required": ["city", "days"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    vocab = tokenizer_vocab(json.loads(tokenizer.to_str()))
    return GrammarCompiler(vocab, 512, [tokenizer.token_to_id(EOS_TOKEN)])


def specials(tokenizer) -> dict[str, int]:
    added = tokenizer.get_added_tokens_decoder().items()
    return {token.content: i for i, token in added if token.special}


def accepts(tokenizer, compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` as the tokenizer encodes it, and may end after it."""
    compiled = compiler.compile(Constraint("ebnf", grammar)).result(timeout=60).compiled
    matcher = xgrammar.GrammarMatcher(compiled)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return all(matcher.accept_token(i) for i in ids) and matcher.accept_token(
        tokenizer.token_to_id(EOS_TOKEN)
    )


def block(*invokes: str) -> str:
    return f"{N}<tool_call>\n" + "".join(invokes) + f"{N}</tool_call>"


def invoke(name: str, body: str) -> str:
    return f'{N}<invoke name="{name}">{body}{N}</invoke>\n'


def element(key: str, value: str) -> str:
    return f"{N}<{key}>{value}{N}</{key}>"


def grammar(tokenizer, tools: list[dict[str, Any]], names: list[str], parallel: bool) -> str:
    return tool_call_grammar(tools, names, parallel, specials(tokenizer))


VALID = invoke(
    "get_weather",
    element("city", "Paris <b>")
    + element("days", "-3")
    + element("hours", element("item", "7") + element("item", "0"))
    + element("place", element("lat", "48.85")),
)


def test_a_schema_valid_call_in_the_model_format_is_accepted(tokenizer, compiler) -> None:
    text = grammar(tokenizer, [WEATHER, PING], ["get_weather", "ping"], parallel=True)
    assert accepts(tokenizer, compiler, text, block(VALID))
    assert accepts(tokenizer, compiler, text, block(VALID, invoke("ping", "")))


@pytest.mark.parametrize(
    "body",
    [
        element("city", "Paris"),  # days is required
        element("days", "3") + element("city", "Paris"),  # declared order
        element("city", "Paris") + element("days", "three"),
        element("city", "Paris") + element("days", "3") + element("unit", "k"),
        element("city", "Paris") + element("days", "3") + element("wind", "5"),
        element("city", f"a{N}b") + element("days", "3"),  # the namespace inside a value
    ],
    ids=["missing-required", "order", "type", "enum", "unknown-key", "namespace-in-text"],
)
def test_a_call_breaking_the_schema_is_refused(tokenizer, compiler, body: str) -> None:
    text = grammar(tokenizer, [WEATHER], ["get_weather"], parallel=False)
    assert not accepts(tokenizer, compiler, text, block(invoke("get_weather", body)))


def test_a_named_choice_takes_one_call_of_that_tool_only(tokenizer, compiler) -> None:
    text = grammar(tokenizer, [WEATHER, PING], ["ping"], parallel=False)
    assert accepts(tokenizer, compiler, text, block(invoke("ping", "")))
    assert not accepts(tokenizer, compiler, text, block(VALID))
    assert not accepts(tokenizer, compiler, text, block(invoke("ping", ""), invoke("ping", "")))


def test_the_namespace_is_placed_as_its_token_never_spelled(tokenizer) -> None:
    text = grammar(tokenizer, [PING], ["ping"], parallel=False)
    assert f"Token({tokenizer.token_to_id(N)})" in text
    assert N not in text.replace(json.dumps(N), "")  # only as the excluded text of values


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "integer", "minimum": 1}, "minimum"),
        ({"type": "string", "pattern": "^a$"}, "pattern"),
        ({"allOf": [{"type": "string"}]}, "allOf"),
        ({"$ref": "#/$defs/Missing"}, "$ref"),
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ],
)
def test_an_unenforceable_schema_feature_is_refused_by_name(
    tokenizer, schema: dict[str, Any], feature: str
) -> None:
    tool = {"function": {"name": "f", "parameters": {"properties": {"x": schema}}}}
    with pytest.raises(SchemaUnsupported) as caught:
        grammar(tokenizer, [tool], ["f"], parallel=False)
    assert feature in str(caught.value)
    assert "tools.f.parameters.properties.x" in str(caught.value)
