"""Splits MiniMax-M3 output into reasoning and answer text, streaming or all at once.

The model reasons between ``<mm:think>`` and ``</mm:think>`` (single special tokens) and answers
after. Where the output starts depends on the prompt, never on scanning it (a rendered prompt holds
think tags of its own), so the parser is told the thinking mode the template used:

* ``enabled``: the prompt ended with ``<mm:think>``; the output starts inside reasoning, which
  lasts until ``</mm:think>``. A re-emitted leading ``<mm:think>`` is dropped.
* ``disabled``: the prompt ended with ``</mm:think>``; all output is answer, except that a stray
  leading ``</mm:think>`` (the model sometimes repeats the prefix) is dropped.
* ``adaptive``: the model decides. If the first non-whitespace text is ``<mm:think>`` the output is
  reasoning until ``</mm:think>``; if it is a stray ``</mm:think>`` that tag is dropped; either
  way the rest is answer.

Leading whitespace is held until the first non-whitespace text settles the start; whitespace
before a leading tag is dropped with the tag. The tags that delimit reasoning never appear in
either field. Once the answer has started it passes through untouched: the parser never goes back
into reasoning, so a think tag inside the answer is answer text (`specials` removes the tag).

A tool-call block is never reasoning: ``N<tool_call>`` (``TOOL_CALL_START``) inside reasoning that
has not closed ends the reasoning there, like ``</mm:think>``, and the block starts the answer,
where the tool-call parser reads it (the model sometimes calls a tool without closing its trace).

Line breaks (``\\r``, ``\\n``) next to a think tag are layout, not text: the run of them right
after a think tag (the one the prompt ended with in enabled and disabled mode, or one the model
wrote) is dropped, and so is the run right before the ``</mm:think>`` or tool-call block that
closes reasoning.
Nothing else is stripped; in particular an adaptive answer with no tag keeps its leading
whitespace. Reasoning that never closes (``max_tokens`` hit) stays reasoning.

Streaming holds back only a tail that could still become a tag (``<``, ``</mm:th``) or line breaks
that a closing tag may follow; ``finish`` releases it as what it was. The result never depends
on how the text was chunked, and ``parse`` is ``feed`` + ``finish`` on a fresh parser.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from m3serve.model.special_tokens import THINK_END, THINK_START, TOOL_CALL_START
from m3serve.model.thinking import THINKING_MODES
from m3serve.text import held_back_length

LINE_BREAKS = "\r\n"

# What ends reasoning: the closing tag, or a tool call (which stays in the answer to be parsed).
_REASONING_ENDS = (THINK_END, TOOL_CALL_START)
# Tags that may open the output in each mode (after whitespace), and where each one leads.
_LEADING_TAGS: dict[str, tuple[tuple[str, bool], ...]] = {
    "enabled": ((THINK_START, True),),
    "disabled": ((THINK_END, False),),
    "adaptive": ((THINK_START, True), (THINK_END, False)),
}


@dataclass(frozen=True)
class ReasoningDelta:
    """Newly parsed text: ``reasoning`` for ``reasoning_content``, ``content`` for ``content``."""

    reasoning: str = ""
    content: str = ""


class _Phase(enum.Enum):
    START = "start"  # the leading tag (if any) is not known yet
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    """The MiniMax-M3 reasoning parser: one instance per request (see the module docstring)."""

    def __init__(self, thinking_mode: str = "adaptive") -> None:
        if thinking_mode not in THINKING_MODES:
            raise ValueError(
                f"thinking_mode must be one of {', '.join(THINKING_MODES)}, not {thinking_mode!r}"
            )
        self._mode = thinking_mode
        self._phase = _Phase.START
        # START: everything so far; REASONING: the held-back tail; CONTENT: always empty.
        self._buffer = ""
        # The next text directly follows a think tag, so its leading line breaks are dropped.
        self._after_tag = False

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def in_reasoning(self) -> bool:
        """Inside the reasoning trace (or, in enabled mode, about to be)."""
        return self._phase is _Phase.REASONING or (
            self._phase is _Phase.START and self._mode == "enabled"
        )

    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of output; return what can be classified now."""
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        """End of output: release whatever was held back, as what it was."""
        return self._drain(final=True)

    def parse(self, text: str) -> ReasoningDelta:
        """Split a whole output at once; the same as streaming it through a fresh parser."""
        parser = ReasoningParser(self._mode)
        first, last = parser.feed(text), parser.finish()
        return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)

    def _drain(self, final: bool) -> ReasoningDelta:
        # Phases only move forward, so one pass in order handles any transition in this piece.
        if self._phase is _Phase.START:
            self._settle_start(final)
        reasoning = self._take_reasoning(final) if self._phase is _Phase.REASONING else ""
        content = self._take_content() if self._phase is _Phase.CONTENT else ""
        return ReasoningDelta(reasoning, content)

    def _settle_start(self, final: bool) -> None:
        """Leave START once the first non-whitespace text shows whether it is a leading tag."""
        body = self._buffer.lstrip()
        for tag, to_reasoning in _LEADING_TAGS[self._mode]:
            if body.startswith(tag):
                self._enter(to_reasoning, body[len(tag) :], after_tag=True)
                return
        could_be_tag = any(tag.startswith(body) for tag, _ in _LEADING_TAGS[self._mode])
        if could_be_tag and not final:
            return
        # No leading tag: the output continues from the prompt, which ended with a think tag in
        # enabled and disabled mode (so the same line-break rule applies) and with none otherwise.
        self._enter(self._mode == "enabled", self._buffer, after_tag=self._mode != "adaptive")

    def _enter(self, to_reasoning: bool, rest: str, after_tag: bool) -> None:
        self._phase = _Phase.REASONING if to_reasoning else _Phase.CONTENT
        self._buffer = rest
        self._after_tag = after_tag

    def _take_reasoning(self, final: bool) -> str:
        text = self._skip_breaks(self._buffer)
        ends = [(at, tag) for tag in _REASONING_ENDS if (at := text.find(tag)) >= 0]
        if ends:
            end, tag = min(ends)
            if tag == THINK_END:
                self._enter(False, text[end + len(THINK_END) :], after_tag=True)
            else:
                self._enter(False, text[end:], after_tag=False)
            return text[:end].rstrip(LINE_BREAKS)
        if final:
            self._buffer = ""
            return text
        # Keep what could still grow into an end of reasoning, and line breaks it may follow.
        partial = len(text) - held_back_length(text, _REASONING_ENDS)
        ready = len(text[:partial].rstrip(LINE_BREAKS))
        self._buffer = text[ready:]
        return text[:ready]

    def _take_content(self) -> str:
        text = self._skip_breaks(self._buffer)
        self._buffer = ""
        return text

    def _skip_breaks(self, text: str) -> str:
        """Drop the line breaks right after a think tag, however the text arrived in pieces."""
        if self._after_tag:
            text = text.lstrip(LINE_BREAKS)
            # The tag's line breaks may continue into the next piece; the first other character
            # ends them.
            self._after_tag = not text
        return text
