"""A response's `output` items, built from the parsed deltas of its one choice: the reasoning
trace becomes a `reasoning` item, answer text a `message` item, each tool call a `function_call`
item, in the order the model wrote them.

Every change to the items is also a stream event, named as OpenAI names it; `OutputItems`
returns the events of each step without sequence numbers (the stream stamps them). The
non-streamed response is the same items with the events dropped, so both always agree.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from typing import Any

from m3serve.api.choice import Delta
from m3serve.parsers.tools import ToolCallDelta

Event = dict[str, Any]


@dataclass(frozen=True)
class TextKind:
    """How one kind of text item is written: its id prefix, content part type, event prefix."""

    item_type: str
    id_prefix: str
    part_type: str
    events: str


REASONING = TextKind("reasoning", "rs", "reasoning_text", "response.reasoning_text")
MESSAGE = TextKind("message", "msg", "output_text", "response.output_text")


class OutputItems:
    """The output items of one response. The item being written is the last one; the next
    kind of output closes it."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: TextKind | str | None = None  # a text kind, "call", or nothing open
        self._calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item

    def add(self, delta: Delta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._text(REASONING, delta.reasoning)
        if delta.content:
            events += self._text(MESSAGE, delta.content)
        for call in delta.calls:
            events += self._call(call)
        return events

    def finish(self, complete: bool) -> list[Event]:
        """The output is over: close its last item. An output with nothing in it is one empty
        message, so that every finished response has an answer to read."""
        events = [] if self.items else self._open_text(MESSAGE)
        return [*events, *self.close(complete)]

    def close(self, complete: bool) -> list[Event]:
        """End the item being written: completed, or incomplete when the output was cut."""
        if self._open is None:
            return []
        item, kind = self.items[-1], self._open
        self._open = None
        item["status"] = "completed" if complete else "incomplete"
        index = len(self.items) - 1
        done = {"type": "response.output_item.done", "output_index": index}
        done["item"] = copy.deepcopy(item)
        if isinstance(kind, TextKind):
            return [*self._text_done(kind, item, index), done]
        arguments = {"type": "response.function_call_arguments.done", "output_index": index}
        arguments |= {"item_id": item["id"], "arguments": item["arguments"]}
        return [arguments, done]

    # ------------------------------------------------------------------ text items

    def _text(self, kind: TextKind, text: str) -> list[Event]:
        events = [] if self._open is kind else [*self.close(True), *self._open_text(kind)]
        item = self.items[-1]
        item["content"][0]["text"] += text
        delta = {"type": f"{kind.events}.delta", **self._where(item), "content_index": 0}
        delta["delta"] = text
        if kind is MESSAGE:
            delta["logprobs"] = []
        return [*events, delta]

    def _open_text(self, kind: TextKind) -> list[Event]:
        item: dict[str, Any] = {"id": _new_id(kind.id_prefix), "type": kind.item_type}
        if kind is REASONING:
            item["summary"] = []
        else:
            item["role"] = "assistant"
        item |= {"status": "in_progress", "content": []}
        self.items.append(item)
        self._open = kind
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
        added["item"] = copy.deepcopy(item)
        part = _part(kind)
        item["content"].append(part)
        part_added = {"type": "response.content_part.added", **self._where(item)}
        part_added |= {"content_index": 0, "part": copy.deepcopy(part)}
        return [added, part_added]

    def _text_done(self, kind: TextKind, item: dict[str, Any], index: int) -> list[Event]:
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        text_done = {"type": f"{kind.events}.done", **where, "text": part["text"]}
        if kind is MESSAGE:
            text_done["logprobs"] = []
        part_done = {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)}
        return [text_done, part_done]

    # ------------------------------------------------------------------ function calls

    def _call(self, call: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if call.index not in self._calls:
            events += self.close(True)
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress"}
            item |= {"call_id": call.id or _new_id("call"), "name": call.name or ""}
            item["arguments"] = ""
            self.items.append(item)
            self._calls[call.index] = item
            self._open = "call"
            added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
            events.append(added | {"item": copy.deepcopy(item)})
        item = self._calls[call.index]
        if call.arguments:
            item["arguments"] += call.arguments
            delta = {"type": "response.function_call_arguments.delta", **self._where(item)}
            events.append(delta | {"delta": call.arguments})
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        index = next(i for i, known in enumerate(self.items) if known is item)
        return {"item_id": item["id"], "output_index": index}


def _part(kind: TextKind) -> dict[str, Any]:
    if kind is REASONING:
        return {"type": "reasoning_text", "text": ""}
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
