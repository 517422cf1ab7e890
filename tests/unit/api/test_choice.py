"""A choice's output pipeline (reasoning parser, tool-call parser, control-token filter): the
same reasoning, content and calls in any chunking; no control token reaches a client; a tool call
inside an unclosed trace is a call; a cut-off invoke is no call."""

from __future__ import annotations

import itertools
import json
from typing import Any

from helpers.chunking import all_chunkings, token_pieces
from helpers.m3_tools import N, block, element, invoke, model_outputs, tool
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.api.choice import ChoiceOutput, Delta, TagIds
from m3serve.model.special_tokens import (
    CONTROL_TOKENS,
    THINK_END,
    THINK_START,
    TOOL_CALL_START,
    TOOL_NAMESPACE,
)
from m3serve.parsers.reasoning import ReasoningParser
from m3serve.parsers.specials import strip_control_tokens
from m3serve.parsers.tools import ToolCallParser

WEATHER = tool("get_weather", {"location": {"type": "string"}})


def run(mode: str, tools: Any, pieces: list[str], **options: Any) -> tuple[ChoiceOutput, Delta]:
    """Feed ``pieces`` and finish; the output and every delta joined."""
    output = ChoiceOutput(ReasoningParser(mode), ToolCallParser(tools, seed=7), **options)
    total = Delta()
    for piece in pieces:
        total += output.feed(piece)
    return output, total + output.finish()


@settings(max_examples=200, deadline=None)
@given(model_outputs(), st.integers(0, 2**32), st.lists(st.integers(0, 10**6), max_size=10))
def test_any_chunking_gives_the_one_shot_result_without_control_tokens(
    case: dict[str, Any], seed: int, points: list[int]
) -> None:
    reasoning = strip_control_tokens(case["reasoning"])
    content = strip_control_tokens(case["content"])
    for pieces in all_chunkings(case["text"], seed, points):
        output, streamed = run(case["mode"], case["tools"], pieces)
        assert (streamed.reasoning, streamed.content) == (reasoning, content)
        assert (output.text.reasoning, output.text.content) == (reasoning, content)
        assert [(c.name, json.loads(c.arguments)) for c in output.calls] == case["calls"]


def test_control_tokens_never_reach_reasoning_or_content() -> None:
    text = f"]~b]Plan[e~[ it.</mm:think>Hi {N}{THINK_START}there]<]image[>[.]!p~["
    for pieces in [list(text), token_pieces(text, 3)]:
        output, streamed = run("enabled", None, pieces)
        assert (streamed.reasoning, streamed.content) == ("Plan it.", "Hi there.")
        for token in CONTROL_TOKENS:
            assert token not in output.text.reasoning + output.text.content


def test_a_garbled_block_is_content_without_its_namespace_tokens() -> None:
    text = f"Answer {TOOL_CALL_START}\n{N}<invoke"
    _, streamed = run("disabled", [WEATHER], token_pieces(text, 0))
    assert streamed.content == "Answer <tool_call>\n<invoke"


def test_text_decoded_without_special_tokens_is_left_alone() -> None:
    text = "a ]~b] b"
    output = ChoiceOutput(None, None, special_tokens_in_text=False)
    assert output.feed(text).content + output.finish().content == text


def test_a_tool_call_inside_an_unclosed_trace_ends_it_and_is_a_call() -> None:
    text = "Need the weather.\n" + block(invoke("get_weather", element("location", "Oslo")))
    for mode, opener in (("enabled", ""), ("adaptive", THINK_START)):
        output, streamed = run(mode, [WEATHER], token_pieces(opener + text, 1))
        assert (streamed.reasoning, streamed.content) == ("Need the weather.", "")
        (call,) = output.calls
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"location": "Oslo"})
        assert [c.arguments for c in streamed.calls] == ["", call.arguments]


def test_an_invoke_cut_off_by_max_tokens_is_not_a_call() -> None:
    done = invoke("get_weather", element("location", "Oslo"))
    text = f'On it.{TOOL_CALL_START}\n{done}\n{N}<invoke name="get_weather">{N}<location>Ber'
    output, streamed = run("disabled", [WEATHER], token_pieces(text, 2))
    assert [json.loads(c.arguments) for c in output.calls] == [{"location": "Oslo"}]
    assert streamed.content == "On it."
    # Streamed: the cut invoke's opening went out (it cannot be unsent), nothing more of it.
    assert [(c.index, c.arguments) for c in streamed.calls if c.index == 1] == [(1, "")]


def test_without_a_reasoning_parser_think_tags_stay_with_the_trace() -> None:
    text = "<mm:think>why</mm:think>]~b]Because."
    output = ChoiceOutput(None, ToolCallParser([WEATHER]))
    assert output.feed(text).content + output.finish().content == "<mm:think>why</mm:think>Because."


# A vocabulary for token-level tests: the markup's tags are single tokens, as in M3.1's.
TAGS = TagIds(think_start=1, think_end=2, tool_namespace=3)
VOCAB = {1: THINK_START, 2: THINK_END, 3: TOOL_NAMESPACE, 4: "so", 5: " yes", 6: "\n"}


def count_reasoning(mode: str, ids: list[int], cuts: list[int]) -> int:
    """Feed `ids` cut at `cuts` (each piece with its text, as the detokenizer sends them)."""
    output = ChoiceOutput(ReasoningParser(mode), None, tag_ids=TAGS)
    bounds = [0, *sorted(set(cuts)), len(ids)]
    for start, end in itertools.pairwise(bounds):
        piece = ids[start:end]
        if piece:
            output.feed("".join(VOCAB[i] for i in piece), piece)
    output.finish()
    return output.reasoning_tokens


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["enabled", "adaptive"]),
    st.lists(st.sampled_from([4, 5, 6]), max_size=6),
    st.lists(st.sampled_from([4, 5, 6]), max_size=6),
    st.lists(st.integers(0, 16), max_size=5),
)
def test_the_reasoning_token_count_is_the_same_in_any_chunking(
    mode: str, trace: list[int], answer: list[int], cuts: list[int]
) -> None:
    opener = [1] if mode == "adaptive" else []
    ids = [*opener, *trace, 2, *answer]
    # The opening tag, the trace and the closing tag: however the pieces fall.
    assert count_reasoning(mode, ids, cuts) == len(opener) + len(trace) + 1


def test_a_tool_call_block_ends_the_count_before_its_first_token() -> None:
    ids = [4, 5, 3, 4]  # a trace of two tokens, then a tool-call block (namespace token first)
    assert count_reasoning("enabled", ids, []) == count_reasoning("enabled", ids, [1, 3]) == 2


def test_tag_ids_come_from_the_tokenizer_or_not_at_all() -> None:
    class Tokenizer:
        def __init__(self, known: dict[str, int]) -> None:
            self.known = known

        def token_to_id(self, token: str) -> int | None:
            return self.known.get(token)

    tags = {THINK_START: 10, THINK_END: 11, TOOL_NAMESPACE: 12}
    assert TagIds.of(Tokenizer(tags)) == TagIds(10, 11, 12)
    assert TagIds.of(Tokenizer({THINK_START: 10})) is None
    assert TagIds.of(None) is None
