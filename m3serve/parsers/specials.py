"""Removes MiniMax-M3 control tokens (`CONTROL_TOKENS`: message framing, padding, media
placeholders, the tool-call namespace token, think tags) from text meant for a client.

The parsers need these tokens in the text, so with parsers on the output is decoded with special
tokens kept; whatever the parsers leave over (a namespace token outside a tool-call block, a think
tag inside the answer, a stray ``[e~[``) is removed here, as the last step of ``content`` and
``reasoning_content``. Only the token is removed, the text around it is kept as it was.

Without a reasoning parser the think tags are kept: the trace then stays in ``content`` as the
model wrote it, delimiters included, for the client to split (``separate_reasoning: false``).

Streaming holds back a tail that could still grow into a token; ``finish`` releases it. The
result is one left-to-right pass of removals over the whole text, however it was chunked (text
that spells a token only once another token between its parts is removed is kept as written).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from m3serve.model.special_tokens import CONTROL_TOKENS, THINK_END, THINK_START
from m3serve.text import held_back_length

# The control tokens but the think tags, for output read without a reasoning parser.
NON_THINK_TOKENS = tuple(t for t in CONTROL_TOKENS if t not in (THINK_START, THINK_END))


@functools.cache
def _pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(token) for token in tokens))


def strip_control_tokens(text: str, tokens: Sequence[str] = CONTROL_TOKENS) -> str:
    """``text`` without its control tokens."""
    return _pattern(tuple(tokens)).sub("", text)


class ControlTokenFilter:
    """One output stream's filter: `feed` pieces, then `finish`."""

    def __init__(self, tokens: Sequence[str] = CONTROL_TOKENS) -> None:
        self._tokens = tuple(tokens)
        self._pattern = _pattern(self._tokens)
        self._held = ""

    def feed(self, text: str) -> str:
        """Take the next piece; return the text that is final now."""
        if not text:
            return ""
        text = self._held + text
        last_end = 0
        for match in self._pattern.finditer(text):
            last_end = match.end()
        # Only text after the last complete token can still be the start of another one.
        ready = len(text) - held_back_length(text[last_end:], self._tokens)
        self._held = text[ready:]
        return self._pattern.sub("", text[:ready])

    def finish(self) -> str:
        """End of the stream: the held tail, which turned out not to be a token."""
        held, self._held = self._held, ""
        return held
