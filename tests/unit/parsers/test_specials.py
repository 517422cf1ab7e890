"""The control-token filter: every control token removed and nothing else, the same result
however the text is chunked."""

from __future__ import annotations

from helpers.chunking import all_chunkings
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.model.special_tokens import CONTROL_TOKENS
from m3serve.parsers.specials import ControlTokenFilter, strip_control_tokens


def stream(pieces: list[str]) -> str:
    token_filter = ControlTokenFilter()
    return "".join(token_filter.feed(piece) for piece in pieces) + token_filter.finish()


def test_every_control_token_is_removed_and_its_surroundings_kept() -> None:
    for token in CONTROL_TOKENS:
        assert strip_control_tokens(f"a {token}b\n") == "a b\n"
    assert strip_control_tokens("<think>x</think> <tool_call> ]<]minimax[> [e~") == (
        "<think>x</think> <tool_call> ]<]minimax[> [e~"
    )


def test_a_possible_token_start_is_held_until_it_is_known() -> None:
    token_filter = ControlTokenFilter()
    assert token_filter.feed("Hi ]<]mini") == "Hi "
    assert token_filter.feed("max[>[ there [e") == " there "
    assert token_filter.feed("~[") == ""
    assert token_filter.feed("]~") == ""
    assert token_filter.feed("x") == "]~x"
    assert token_filter.feed("<mm:") == ""
    assert token_filter.finish() == "<mm:"


PIECES = [*CONTROL_TOKENS, "]", "[", "<", "~", "]<]", "]~", "[e~", "<mm:", "</mm:think", "b]"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)), max_size=20),
    st.integers(0, 2**32),
    st.lists(st.integers(0, 10**6), max_size=8),
)
def test_any_chunking_gives_the_one_shot_result(
    parts: list[str], seed: int, points: list[int]
) -> None:
    text = "".join(parts)
    for pieces in all_chunkings(text, seed, points):
        assert stream(pieces) == strip_control_tokens(text)
