"""Matching in text that arrives in pieces: where a stop string or tag completes, and how much
of a stream's tail must be held back because it could still grow into one. Shared by the
detokenizer (stop strings) and the output parsers (think and tool-call tags)."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the first stop string to complete in ``text`` starts, and which one it is.

    "First" means the earliest end, so the answer is the same however the text arrived in
    pieces and a stop is reported as soon as it is complete; of stop strings ending at the same
    place the longest (earliest-starting) one wins.
    """
    hits = [(start + len(s), -len(s), start, s) for s in stops if (start := text.find(s)) >= 0]
    if not hits:
        return None
    _, _, start, stop = min(hits)
    return start, stop


def held_back_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
