"""What perf/fuzz_server.py sends besides schemathesis' cases: hypothesis strategies for chat and
completion bodies shaped like real clients' (most reach generation) with odd values mixed in,
and `clamp`, which keeps the generation of any body cheap (at most 8 new tokens, 2 choices,
3 prompts) while everything else reaches the server as generated.

Integers stay within 64 bits and nesting stays shallow here: values the wire cannot carry are
schemathesis' to find (and a separate fix's to refuse).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

MAX_NEW_TOKENS = 8
MAX_N = 2
MAX_PROMPTS = 3
# The generating endpoints and the fields that bound their new tokens.
LIMITS = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}
# Markers of MiniMax's chat format: text that the parsers and the template must take as text.
MARKERS = ["<mm:think>", "</mm:think>", "]<]minimax[>[", "<tool_call>", "</tool_call>", "<invoke"]

INT64 = st.integers(-(2**63), 2**63 - 1)
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
words = (
    st.lists(st.one_of(text, st.sampled_from(MARKERS)), min_size=1, max_size=4)
    .map("".join)
    .filter(bool)
)
token_ids = st.lists(st.integers(0, 447), min_size=1, max_size=16)  # ids of the tiny vocabulary
name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
leaf = st.one_of(
    st.none(), st.booleans(), INT64, st.floats(allow_nan=False, allow_infinity=False), text
)
json_value = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


prop_schema = st.fixed_dictionaries(
    {"type": st.sampled_from(["string", "integer", "number", "boolean", "array", "object"])},
    optional={"description": text, "enum": st.lists(text, min_size=1, max_size=3)},
)
object_schema = st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(name, prop_schema, max_size=4)},
    optional={"required": st.lists(name, max_size=3), "additionalProperties": st.booleans()},
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": name}, optional={"description": text, "parameters": object_schema}
        ),
    }
)
tool_choice = st.one_of(
    st.sampled_from(["auto", "none", "required"]),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": name})}
    ),
)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": words}),
    st.fixed_dictionaries({"type": text}, optional={"text": words, "image_url": json_value}),
)
content = st.one_of(words, st.none(), st.lists(part, max_size=3))
tool_call = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": name, "arguments": st.one_of(json_value.map(json.dumps), text)}
        ),
    },
    optional={"id": text},
)
plain_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "developer"]), "content": words}
)
message = st.one_of(
    plain_message,
    plain_message,
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer"]), "content": content}
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": content},
        optional={"tool_calls": st.lists(tool_call, max_size=2), "reasoning_content": words},
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": words},
        optional={"tool_call_id": text},
    ),
    st.fixed_dictionaries({"role": text, "content": content}),
)


def unit_interval(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False)


# Every field a client may set, with values the server takes...
SAMPLING = {
    "temperature": unit_interval(0, 2),
    "top_p": unit_interval(0.05, 1),
    "top_k": st.integers(-1, 100),
    "min_p": unit_interval(0, 1),
    "presence_penalty": unit_interval(-2, 2),
    "frequency_penalty": unit_interval(-2, 2),
    "repetition_penalty": unit_interval(0.5, 2),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.none(), words, st.lists(words, max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 447), max_size=3),
    "n": st.integers(1, MAX_N),
    "ignore_eos": st.booleans(),
    "max_tokens": st.integers(1, MAX_NEW_TOKENS),
    "stream": st.booleans(),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "model": text,
    "user": text,
}
CHAT_ONLY = {
    "tools": maybe(st.lists(tool, max_size=3)),
    "tool_choice": maybe(tool_choice),
    "parallel_tool_calls": st.booleans(),
    "max_completion_tokens": st.integers(1, MAX_NEW_TOKENS),
    "logprobs": st.booleans(),
    "top_logprobs": maybe(st.integers(0, 20)),
    "thinking": maybe(
        st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])})
    ),
    "reasoning_effort": maybe(
        st.sampled_from(["low", "medium", "high", "xhigh", "max", "none", "minimal"])
    ),
    "chat_template_kwargs": maybe(
        st.dictionaries(
            st.sampled_from(["thinking", "enable_thinking", "reasoning_effort", "x"]),
            json_value,
            max_size=2,
        )
    ),
    "response_format": maybe(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema"])},
            optional={
                "json_schema": st.fixed_dictionaries({"name": name, "schema": object_schema})
            },
        )
    ),
    "separate_reasoning": st.booleans(),
}
prompt = st.one_of(
    words,
    st.lists(words, min_size=1, max_size=3),
    token_ids,
    st.lists(token_ids, min_size=1, max_size=2),
)
COMPLETION_ONLY = {
    "logprobs": maybe(st.integers(0, 5)),
    "echo": st.booleans(),
}
# ... and values it must refuse (a 400), one of which goes into one body in four.
ODD = {
    "temperature": unit_interval(-5, 1000),
    "top_p": unit_interval(-1, 2),
    "top_k": st.integers(-(2**31), 2**31),
    "min_p": unit_interval(-1, 2),
    "presence_penalty": unit_interval(-5, 5),
    "repetition_penalty": unit_interval(-1, 3),
    "seed": INT64,
    "stop": st.lists(st.one_of(text, INT64), max_size=3),
    "stop_token_ids": st.lists(INT64, max_size=3),
    "n": st.integers(-3, 100),
    "max_tokens": st.one_of(INT64, text),
    "stream_options": json_value,
    "thinking": json_value,
    "reasoning_effort": text,
    "chat_template_kwargs": json_value,
    "tool_choice": json_value,
    "tools": st.lists(json_value, max_size=2),
    "messages": st.lists(json_value, max_size=3),
    "prompt": st.one_of(json_value, st.lists(st.integers(-5, 300_000), max_size=16)),
    "logprobs": st.one_of(st.integers(-3, 50), text),
    "suffix": words,
}
one_odd = st.sampled_from(sorted(ODD)).flatmap(lambda key: ODD[key].map(lambda v: {key: v}))
maybe_odd = st.one_of(st.just({}), st.just({}), st.just({}), one_odd)
# Fields no client sends: ignored by the server, which must not trip over them either.
extras = st.dictionaries(
    st.sampled_from(["foo", "metadata", "logit_bias", "best_of"]), json_value, max_size=2
)


def body(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[Any]:
    return st.builds(
        lambda extra, base, fields, odd: {**extra, **base, **fields, **odd},
        extras,
        st.fixed_dictionaries(required),
        st.fixed_dictionaries({}, optional=optional),
        maybe_odd,
    )


chat_body = body({"messages": st.lists(message, min_size=1, max_size=4)}, {**SAMPLING, **CHAT_ONLY})
completion_body = body({"prompt": prompt}, {**SAMPLING, **COMPLETION_ONLY})
BODIES = {"/v1/chat/completions": chat_body, "/v1/completions": completion_body}


def clamp(path: str, body: Any) -> None:
    """Keep generation short: bound new tokens, choices and prompts of a body that has them."""
    if path not in LIMITS or not isinstance(body, dict):
        return
    limits = LIMITS[path]
    for key in limits:
        value = body.get(key)
        if _is_int(value) and value > MAX_NEW_TOKENS:
            body[key] = MAX_NEW_TOKENS
    if not any(_is_int(body.get(key)) and body[key] > 0 for key in limits):
        # No positive limit means "whatever the context allows"; a wrong type stays, to be refused.
        for key in limits:
            if body.get(key) is None or body[key] == 0:
                body[key] = MAX_NEW_TOKENS
    n = body.get("n")
    if _is_int(n) and n > MAX_N:
        body["n"] = MAX_N
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:MAX_PROMPTS]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
