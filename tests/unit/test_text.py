"""Matching in streamed text (m3serve.text): the held-back tail is exactly the longest suffix
that could still grow into a stop string, and the reported stop is the first to complete."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m3serve.text import find_stop, held_back_length


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("xyab", ["abc"], 2),
        ("xya", ["abc", "ab"], 1),
        ("xaba", ["abab"], 3),
        ("abc", ["abc"], 0),
        ("zz", ["ab"], 0),
    ],
)
def test_held_back_length(text: str, stops: list[str], expected: int) -> None:
    assert held_back_length(text, stops) == expected


def test_find_stop_prefers_the_earliest_end() -> None:
    assert find_stop("xabcd", ["abcd", "bc"]) == (2, "bc")
    assert find_stop("xabc", ["bc", "abc"]) == (1, "abc")
    assert find_stop("xyz", ["a"]) is None


@given(st.text("ab", max_size=12), st.lists(st.text("ab", min_size=1, max_size=4), max_size=3))
def test_the_held_back_tail_is_the_longest_proper_prefix_of_a_stop(
    text: str, stops: list[str]
) -> None:
    held = held_back_length(text, stops)
    tail = text[len(text) - held :]
    assert held == 0 or any(len(stop) > held and stop.startswith(tail) for stop in stops)
    longer = [
        size
        for size in range(held + 1, len(text) + 1)
        if any(len(stop) > size and stop.startswith(text[len(text) - size :]) for stop in stops)
    ]
    assert longer == []
