"""Incremental detokenization: a request's growing token ids become final text deltas.

This is the offset technique of vLLM and SGLang. Only the ids from ``prefix_offset`` on are
decoded: ``ids[prefix_offset:read_offset]`` is context whose text was already emitted and
``ids[read_offset:]`` is new, so the new text is the decode of the whole window minus the decode
of the context. Context is needed because decoding is not concatenative (byte-level BPE splits a
character over several tokens, SentencePiece drops the first token's leading space); a window of
a few tokens keeps the cost per token constant. Text that ends in U+FFFD may be an unfinished
UTF-8 character, so it waits for more ids.

Stop strings are applied afterwards, to final text only (OpenAI semantics: the output ends just
before the stop string, which is not part of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from m3serve.text import find_stop, held_back_length

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first generated one, as in vLLM: enough for a leading space
# or a character split over byte tokens to decode the way it does inside the whole text.
INITIAL_CONTEXT_TOKENS = 5
# An unfinished UTF-8 character has at most 3 bytes, so with at least one byte per token it lies
# in the last 3 tokens: a push of several ids looks that far back for a cut on a whole character.
MAX_UNFINISHED_TOKENS = 3


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer; ``tokenizers.Tokenizer`` is one."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class StopFilter:
    """Cuts a stream of text before its first stop string, holding back what could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        # A bare string is one stop string, as in the OpenAI API, not a sequence of characters.
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Take more text; return the part that can no longer belong to a stop string."""
        if self.matched is not None:
            return ""
        # Text before the held part can start no stop string, so only this needs searching.
        pending = self._held + text
        hit = find_stop(pending, self._stops)
        if hit is not None:
            start, self.matched = hit
            self._held = ""
            return pending[:start]
        final = len(pending) - held_back_length(pending, self._stops)
        self._held = pending[final:]
        return pending[:final]

    def flush(self) -> str:
        """At the end of the stream: the held text, which turned out not to be a stop string."""
        held, self._held = self._held, ""
        return held


class IncrementalDetokenizer:
    """Turns a request's growing token list into text deltas. Never emits half a UTF-8 character,
    never re-emits text, and with stop strings never emits text past (or part of) a stop string.

    The deltas of ``push`` and ``finish`` concatenate to ``tokenizer.decode(ids)`` of all pushed
    ids (with prompt ids: ``decode(prompt + ids)`` minus the first ``len(decode(prompt))``
    characters), cut before the first stop string to complete.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = StopFilter(stop)
        context = [] if prompt_ids is None else prompt_ids[-INITIAL_CONTEXT_TOKENS:]
        # The window is ids[prefix_offset:]: older ids are never decoded again, so they are
        # dropped and prefix_offset is always 0; read_offset is the first id not yet emitted.
        self._window = [int(i) for i in context]
        self._read_offset = len(self._window)
        self._context_text: str | None = None  # decode(window[:read_offset]), once needed
        self._num_tokens = 0
        self._parts: list[str] = []
        self._finished = False

    @property
    def stopped(self) -> str | None:
        """The stop string that matched, once one did."""
        return self._stop.matched

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def num_tokens(self) -> int:
        """Tokens pushed so far (special tokens and tokens after a stop string included)."""
        return self._num_tokens

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text that is now final (often "")."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        self._num_tokens += len(new_ids)
        if self._stop.matched is not None or len(new_ids) == 0:
            return ""
        self._window.extend(int(i) for i in new_ids)
        return self._emit(self._stop.feed(self._decode_final()))

    def finish(self) -> str:
        """End of generation: return the held-back text that is not part of a stop string.

        An unfinished UTF-8 character at the very end comes out as U+FFFD, as in a full decode.
        """
        if self._finished:
            return ""
        self._finished = True
        if self._stop.matched is not None:
            return ""
        text = self._stop.feed(self._decode_rest())
        if self._stop.matched is None:
            text += self._stop.flush()
        return self._emit(text)

    def _decode_final(self) -> str:
        """The new text up to the last cut that ends on a whole character; advances offsets."""
        context_text = self._context()
        end = len(self._window)
        # Trying shorter cuts lets a multi-token push emit its finished part at once.
        lowest = max(self._read_offset, end - MAX_UNFINISHED_TOKENS - 1)
        for cut in range(end, lowest, -1):
            text = self._decode(self._window[:cut])
            # Not longer: nothing new yet (e.g. only skipped special tokens), so keep the window.
            if len(text) > len(context_text) and not text.endswith(REPLACEMENT_CHAR):
                self._advance(cut)
                return text[len(context_text) :]
        return ""

    def _decode_rest(self) -> str:
        """All text not emitted yet, an unfinished character included; advances nothing."""
        context_text = self._context()
        text = self._decode(self._window)
        return text[len(context_text) :] if len(text) > len(context_text) else ""

    def _advance(self, cut: int) -> None:
        # The ids just emitted become the next window's context: prefix_offset moves to the old
        # read_offset and read_offset to the cut.
        del self._window[: self._read_offset]
        self._read_offset = cut - self._read_offset
        self._context_text = None

    def _context(self) -> str:
        if self._context_text is None:
            self._context_text = self._decode(self._window[: self._read_offset])
        return self._context_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text
