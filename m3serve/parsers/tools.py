"""Reads MiniMax-M3 tool calls out of the answer text, streaming or all at once.

The model writes its calls after the answer, in one block where every tag is prefixed by the
namespace token N = ``]<]minimax[>[`` (a single special token)::

    N<tool_call>
    N<invoke name="get_weather">N<location>BeijingN</location>N<unit>celsiusN</unit>N</invoke>
    N<invoke name="other">...N</invoke>
    N</tool_call>

Parameters are elements named by the parameter (``N<parameter name="x">...N</parameter>`` is
accepted too); objects are nested elements, arrays repeated ``<item>`` elements, scalars raw text.
Only N-prefixed tags are structure, so a value may hold ``<`` and ``>`` freely. Values are untyped
text; `arguments.coerce` types them by the tool's JSON schema.

Streaming: text before the block is content, emitted at once except a tail that could still grow
into ``N<tool_call>`` (``]`` recurs inside N, so the longest such tail is held). Each invoke emits
a delta with its index, id and name as soon as its opening tag is complete, then its arguments as
JSON text, one fragment per completed top-level parameter (``{"location": "Beijing"``, then
``, "unit": "celsius"``) and the closing ``}`` (or ``{}``) when the invoke ends; the fragments of a
call concatenate to its final arguments. Text after ``N</tool_call>`` is content again.

Tolerance, never an exception: line breaks and stray text between invokes are ignored, a missing
``</invoke>`` or element closer is implied by the next invoke or an enclosing closer, an invoke
of a tool not in ``tools`` is read but dropped (with no tools given, every call is kept), and an
invoke body that is raw JSON text (no elements) is taken as the arguments. A block in which no
invoke tag was read (garbage, or cut off) is returned as content, verbatim, when it closes or at
``finish``. At ``finish`` an unclosed invoke is closed with the parameters completed so far: its
id and name are already out, so it stays a call.

One state machine serves both uses: ``parse`` is ``feed`` + ``finish`` on a fresh parser.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from m3serve.model.special_tokens import TOOL_CALL_START, TOOL_NAMESPACE
from m3serve.parsers.arguments import Element, coerce, loose_arguments, tool_properties
from m3serve.text import held_back_length

# A would-be tag this long without its ">" is text: real tags are short, and the bound keeps the
# search for ">" from rescanning a long run of garbage on every piece.
MAX_TAG_CHARS = 256
# Deeper elements are ignored, so that typing values and writing JSON cannot run out of stack.
MAX_DEPTH = 32
_NAME_ATTR = r"""\s+name\s*=\s*(?:"(?P<dq>[^"]*)"|'(?P<sq>[^']*)'|(?P<bare>[^\s"']+))\s*"""
_INVOKE = re.compile("invoke" + _NAME_ATTR)
_PARAMETER = re.compile("parameter" + _NAME_ATTR)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one call: ``id`` and ``name`` only on the call's first delta."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ToolDelta:
    """What one ``feed`` or ``finish`` produced: content text and call pieces (one per call)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    """A finished call; ``arguments`` is JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass
class _Invoke:
    name: str
    id: str
    index: int | None  # None: a tool not offered, read but not emitted
    properties: dict[str, Any]
    stack: list[Element] = field(default_factory=list)
    loose: list[str] = field(default_factory=list)  # text outside any element
    arguments: list[str] = field(default_factory=list)  # JSON fragments emitted so far


class ToolCallParser:
    """The MiniMax-M3 tool-call parser: one instance per request (see the module docstring).

    ``tools`` is the request's OpenAI tool list; ``seed`` makes call ids reproducible.
    """

    def __init__(
        self, tools: list[dict[str, Any]] | None, id_prefix: str = "call_", seed: int | None = None
    ) -> None:
        self._config = (tools, id_prefix, seed)
        self._schemas = tool_properties(tools)
        self._id_prefix = id_prefix
        self._rng = random.Random(seed) if seed is not None else None
        # Outside a block: the held-back tail. Inside: the block text from the cursor on, or from
        # its start marker while no invoke was read (it may still turn out to be content).
        self._text = ""
        self._cursor = 0
        self._in_block = False
        self._block_has_invoke = False
        self._invoke: _Invoke | None = None
        self._next_index = 0
        self._calls: list[ToolCall] = []
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    @property
    def calls(self) -> list[ToolCall]:
        """The calls completed so far, in order."""
        return list(self._calls)

    def feed(self, text: str) -> ToolDelta:
        """Take the next piece of answer text; return the content and call pieces now known."""
        self._text += text
        while self._scan_block() if self._in_block else self._scan_text():
            pass
        return self._take()

    def finish(self) -> ToolDelta:
        """End of output: release held text and settle an unfinished block."""
        if self._in_block:
            self._end_invoke(complete=False)
            if not self._block_has_invoke:
                self._content.append(self._text)
            self._in_block = False
        else:
            self._content.append(self._text)
        self._text, self._cursor = "", 0
        return self._take()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; the same as streaming it through a fresh parser."""
        parser = ToolCallParser(*self._config)
        content = parser.feed(text).content + parser.finish().content
        return content, parser.calls

    def _take(self) -> ToolDelta:
        # A call's pieces from one feed become one entry: clients expect an index once per chunk.
        merged: list[ToolCallDelta] = []
        for delta in self._deltas:
            if merged and merged[-1].index == delta.index:
                last = merged[-1]
                merged[-1] = dataclasses.replace(last, arguments=last.arguments + delta.arguments)
            else:
                merged.append(delta)
        content = "".join(self._content)
        self._content, self._deltas = [], []
        return ToolDelta(content, merged)

    # Outside a block.

    def _scan_text(self) -> bool:
        """Emit content up to the block start; True when a block started."""
        start = self._text.find(TOOL_CALL_START)
        if start < 0:
            ready = len(self._text) - held_back_length(self._text, (TOOL_CALL_START,))
            self._content.append(self._text[:ready])
            self._text = self._text[ready:]
            return False
        self._content.append(self._text[:start])
        self._text = self._text[start:]
        self._cursor = len(TOOL_CALL_START)
        self._in_block, self._block_has_invoke = True, False
        return True

    # Inside a block.

    def _scan_block(self) -> bool:
        """Read text up to the next complete tag; True when there may be more to read."""
        at = self._text.find(TOOL_NAMESPACE, self._cursor)
        if at < 0:
            end = max(
                self._cursor, len(self._text) - held_back_length(self._text, (TOOL_NAMESPACE,))
            )
            self._on_text(self._text[self._cursor : end])
            self._consumed(end)
            return False
        self._on_text(self._text[self._cursor : at])
        self._cursor = at
        found = self._next_tag(at)
        if found is None:
            return False
        body, end = found
        if body is None:
            self._on_text(self._text[at:end])
        elif self._on_tag(body.strip()):
            self._close_block(end)
            return True
        self._consumed(end)
        return True

    def _consumed(self, end: int) -> None:
        """Everything before ``end`` has been read."""
        self._cursor = end
        if self._block_has_invoke:
            # The block can no longer turn into content, so its text is not needed again; this
            # also keeps a long argument streamed in small pieces from being copied over and over.
            self._text, self._cursor = self._text[end:], 0

    def _next_tag(self, at: int) -> tuple[str | None, int] | None:
        """The tag whose namespace token starts at ``at``: (body, end), or (None, end) when the
        token does not start a tag and is text up to ``end``; None until there is enough text."""
        text = self._text
        opener = at + len(TOOL_NAMESPACE)
        if opener >= len(text):
            return None
        if text[opener] != "<":
            return None, opener
        limit = opener + MAX_TAG_CHARS
        close = text.find(">", opener, limit)
        again = text.find(TOOL_NAMESPACE, opener, close if close >= 0 else limit)
        if again >= 0:
            return None, again
        if close < 0:
            return None if len(text) < limit else (None, opener)
        return text[opener + 1 : close], close + 1

    def _close_block(self, end: int) -> None:
        if not self._block_has_invoke:
            self._content.append(self._text[:end])
        self._text, self._cursor = self._text[end:], 0
        self._in_block = False

    def _on_text(self, text: str) -> None:
        invoke = self._invoke
        if not text or invoke is None:
            return  # text between invokes is layout or garbage
        (invoke.stack[-1].text if invoke.stack else invoke.loose).append(text)

    def _on_tag(self, tag: str) -> bool:
        """Act on one tag; True when it closes the block."""
        if tag == "/tool_call":
            self._end_invoke(complete=True)
            return True
        invoke = _INVOKE.fullmatch(tag)
        if invoke is not None:
            self._end_invoke(complete=True)
            self._begin_invoke(_name(invoke))
        elif tag == "/invoke":
            self._end_invoke(complete=True)
        elif self._invoke is not None and tag != "tool_call":
            self._on_element_tag(tag)
        return False

    def _on_element_tag(self, tag: str) -> None:
        assert self._invoke is not None
        stack = self._invoke.stack
        if tag.startswith("/"):
            self._close_element(tag[1:].strip())
            return
        if len(stack) >= MAX_DEPTH:
            return
        empty = tag.endswith("/")  # <name/>: an element with no text
        spec = tag[:-1].strip() if empty else tag
        parameter = _PARAMETER.fullmatch(spec)
        stack.append(Element(_name(parameter), "parameter") if parameter else Element(spec, spec))
        if empty:
            self._pop_element()

    def _close_element(self, tag: str) -> None:
        """Close the innermost open element with this tag, and any left open inside it."""
        assert self._invoke is not None
        stack = self._invoke.stack
        depth = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].tag == tag), None)
        if depth is None:
            return  # a closer with no opener: ignore it
        while len(stack) > depth:
            self._pop_element()

    def _pop_element(self) -> None:
        assert self._invoke is not None
        stack = self._invoke.stack
        element = stack.pop()
        if stack:
            stack[-1].children.append(element)
        else:
            self._emit_argument(element)

    def _emit_argument(self, element: Element) -> None:
        assert self._invoke is not None
        value = coerce(element, self._invoke.properties.get(element.key))
        separator = ", " if self._invoke.arguments else "{"
        key = json.dumps(element.key, ensure_ascii=False)
        self._add_arguments(f"{separator}{key}: {json.dumps(value, ensure_ascii=False)}")

    def _begin_invoke(self, name: str) -> None:
        self._block_has_invoke = True
        offered = self._schemas is None or name in self._schemas
        properties = (self._schemas or {}).get(name, {})
        index = self._next_index if offered else None
        self._invoke = _Invoke(name, self._new_id(), index, properties)
        if index is not None:
            self._next_index += 1
            self._deltas.append(ToolCallDelta(index, self._invoke.id, name, ""))

    def _end_invoke(self, complete: bool) -> None:
        """Close the open invoke, if any. Elements left open are closed with it when the model
        ended the invoke, and dropped when the output was cut off inside them."""
        invoke = self._invoke
        if invoke is None:
            return
        if not complete:
            invoke.stack.clear()
        while invoke.stack:
            self._pop_element()
        self._add_arguments("}" if invoke.arguments else loose_arguments(invoke.loose))
        if invoke.index is not None:
            self._calls.append(ToolCall(invoke.id, invoke.name, "".join(invoke.arguments)))
        self._invoke = None

    def _add_arguments(self, fragment: str) -> None:
        assert self._invoke is not None
        self._invoke.arguments.append(fragment)
        if self._invoke.index is not None:
            self._deltas.append(ToolCallDelta(self._invoke.index, None, None, fragment))

    def _new_id(self) -> str:
        bits = self._rng.getrandbits(96) if self._rng is not None else secrets.randbits(96)
        return f"{self._id_prefix}{bits:024x}"


def _name(match: re.Match[str] | None) -> str:
    """The name attribute of an ``invoke`` or ``parameter`` tag, however it was quoted."""
    assert match is not None
    return (match["dq"] or match["sq"] or match["bare"] or "").strip()
