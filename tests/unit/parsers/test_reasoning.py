"""The reasoning parser: start state from the thinking mode, stray and duplicated tags dropped,
line breaks next to tags dropped, minimal hold-back, and the same result in any chunking."""

from __future__ import annotations

import pytest
from helpers.chunking import all_chunkings, token_pieces
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.model.special_tokens import THINK_END, THINK_START
from m3serve.parsers.reasoning import ReasoningDelta, ReasoningParser

BREAKS = "\r\n"


def stream(mode: str, pieces: list[str]) -> ReasoningDelta:
    """Feed ``pieces`` one by one, then finish; the deltas joined."""
    parser = ReasoningParser(mode)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return ReasoningDelta("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))


# Text with no complete think tag, rich in what could be mistaken for one.
FRAGMENTS = ["<", ">", "/", "<mm:", "</mm:th", "<mm:thin", "mm:think>", "]", "]<]", "\n", "\r\n"]
fragment = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=6),
    st.text(" \t\n\r", min_size=1, max_size=3),
    st.sampled_from(["日本語", "é", "😀", *FRAGMENTS]),
)
tagless = (
    st.lists(fragment, max_size=6)
    .map("".join)
    .filter(lambda s: THINK_START not in s and THINK_END not in s)
)
whitespace = st.text(" \t\n\r", max_size=3)


@st.composite
def outputs(draw: st.DrawFn) -> tuple[str, str, str, str]:
    """(mode, output text, expected reasoning, expected content) under the documented rules."""
    mode = draw(st.sampled_from(["enabled", "disabled", "adaptive"]))
    lead, reasoning, answer = draw(whitespace), draw(tagless), draw(tagless)
    if mode == "disabled":
        stray = draw(st.booleans())
        text = (lead + THINK_END if stray else "") + answer
        return mode, text, "", answer.lstrip(BREAKS)
    shapes = (
        ["think", "unclosed"] if mode == "enabled" else ["think", "unclosed", "stray", "direct"]
    )
    shape = draw(st.sampled_from(shapes))
    if shape == "stray":
        return mode, lead + THINK_END + answer, "", answer.lstrip(BREAKS)
    if shape == "direct":
        return mode, answer, "", answer
    # Enabled mode starts inside reasoning; a repeated opener is dropped like adaptive's opener.
    opener = lead + THINK_START if mode == "adaptive" or draw(st.booleans()) else ""
    if shape == "unclosed":
        return mode, opener + reasoning, reasoning.lstrip(BREAKS), ""
    text = opener + reasoning + THINK_END + answer
    return mode, text, reasoning.strip(BREAKS), answer.lstrip(BREAKS)


@settings(max_examples=300, deadline=None)
@given(outputs(), st.integers(0, 2**32), st.lists(st.integers(0, 10**6), max_size=8))
def test_any_chunking_gives_the_one_shot_result(
    case: tuple[str, str, str, str], seed: int, points: list[int]
) -> None:
    mode, text, reasoning, content = case
    one_shot = ReasoningParser(mode).parse(text)
    assert one_shot == ReasoningDelta(reasoning, content)
    for pieces in all_chunkings(text, seed, points):
        assert stream(mode, pieces) == one_shot
    for field in (one_shot.reasoning, one_shot.content):
        assert THINK_START not in field and THINK_END not in field


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["enabled", "disabled", "adaptive"]),
    st.lists(st.one_of(fragment, st.sampled_from([THINK_START, THINK_END])), max_size=10),
    st.integers(0, 2**32),
    st.lists(st.integers(0, 10**6), max_size=8),
)
def test_arbitrary_text_streams_like_one_shot(
    mode: str, parts: list[str], seed: int, points: list[int]
) -> None:
    """Tags anywhere (repeated, nested, split): never an error, never chunking-dependent."""
    text = "".join(parts)
    one_shot = ReasoningParser(mode).parse(text)
    for pieces in all_chunkings(text, seed, points):
        assert stream(mode, pieces) == one_shot


@pytest.mark.parametrize(
    ("mode", "text", "reasoning", "content"),
    [
        # enabled: the prompt ended with <mm:think>.
        ("enabled", "\nLet me think.\n</mm:think>\n\nParis.", "Let me think.", "Paris."),
        ("enabled", "a\n\nb\r\n</mm:think>  x\n", "a\n\nb", "  x\n"),
        ("enabled", " \n<mm:think>\nrepeated opener\n</mm:think>ok", "repeated opener", "ok"),
        ("enabled", "</mm:think>answer only", "", "answer only"),
        ("enabled", "\nnever closed (max_tokens)\n", "never closed (max_tokens)\n", ""),
        ("enabled", "ends in a partial tag </mm:thi", "ends in a partial tag </mm:thi", ""),
        # disabled: the prompt ended with </mm:think>.
        ("disabled", "Hello", "", "Hello"),
        ("disabled", "\n\nHello\n", "", "Hello\n"),
        ("disabled", " \n</mm:think>\nHello", "", "Hello"),
        ("disabled", "</mm:think></mm:think>x", "", "</mm:think>x"),
        ("disabled", "<mm:think>not thinking", "", "<mm:think>not thinking"),
        ("disabled", "  Hi", "", "  Hi"),
        # adaptive: the model decides.
        ("adaptive", "<mm:think>\nhmm\n</mm:think>\nHi", "hmm", "Hi"),
        ("adaptive", "\n\n  <mm:think>hmm</mm:think>Hi", "hmm", "Hi"),
        ("adaptive", "\n</mm:think>\n\nHi", "", "Hi"),
        ("adaptive", "\n  Hi <mm:think> there", "", "\n  Hi <mm:think> there"),
        ("adaptive", "\n\n", "", "\n\n"),
        ("adaptive", " <mm:thin", "", " <mm:thin"),
        ("adaptive", "<mm:think>cut off", "cut off", ""),
        ("adaptive", "", "", ""),
    ],
)
def test_crafted_outputs(mode: str, text: str, reasoning: str, content: str) -> None:
    assert ReasoningParser(mode).parse(text) == ReasoningDelta(reasoning, content)
    assert stream(mode, list(text)) == ReasoningDelta(reasoning, content)
    assert stream(mode, token_pieces(text, 0)) == ReasoningDelta(reasoning, content)


def test_hold_back_is_minimal() -> None:
    parser = ReasoningParser("enabled")
    assert parser.feed("abc<") == ReasoningDelta("abc", "")
    assert parser.feed("b") == ReasoningDelta("<b", "")
    # Line breaks wait: a closing tag may follow, and then they are dropped.
    assert parser.feed("x\n\n") == ReasoningDelta("x", "")
    assert parser.feed("</mm:") == ReasoningDelta("", "")
    assert parser.feed("y") == ReasoningDelta("\n\n</mm:y", "")
    assert parser.feed("\n</mm:think>") == ReasoningDelta("", "")
    # The tag's line breaks may come in their own piece; the answer then passes straight through.
    assert parser.feed("\n") == ReasoningDelta("", "")
    assert parser.feed("\nA<") == ReasoningDelta("", "A<")
    assert parser.feed("mm:think>") == ReasoningDelta("", "mm:think>")
    assert parser.finish() == ReasoningDelta("", "")


def test_leading_whitespace_waits_for_the_decision() -> None:
    parser = ReasoningParser("adaptive")
    assert parser.feed("\n ") == ReasoningDelta()
    assert parser.feed("<mm:") == ReasoningDelta()
    assert parser.feed("think>") == ReasoningDelta()
    assert parser.feed("\nwhy") == ReasoningDelta("why", "")

    direct = ReasoningParser("adaptive")
    assert direct.feed("\n ") == ReasoningDelta()
    assert direct.feed("<b>") == ReasoningDelta("", "\n <b>")


def test_split_closing_tag_and_release_at_finish() -> None:
    parser = ReasoningParser("enabled")
    assert parser.feed("plan</mm:th") == ReasoningDelta("plan", "")
    assert parser.finish() == ReasoningDelta("</mm:th", "")

    parser = ReasoningParser("adaptive")
    assert parser.feed("  </mm:th") == ReasoningDelta()
    assert parser.finish() == ReasoningDelta("", "  </mm:th")


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="thinking_mode"):
        ReasoningParser("auto")
