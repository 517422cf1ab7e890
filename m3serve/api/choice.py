"""One chat completion choice's output pipeline: model text -> reasoning parser -> tool-call
parser -> deltas of reasoning_content, content and tool_calls. The same object serves the
streaming and the non-streaming response, so both always agree."""

from __future__ import annotations

from dataclasses import dataclass, field

from m3serve.parsers.reasoning import ReasoningParser
from m3serve.parsers.tools import ToolCall, ToolCallDelta, ToolCallParser


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __add__(self, later: Delta) -> Delta:
        return Delta(
            self.reasoning + later.reasoning, self.content + later.content, self.calls + later.calls
        )


class ChoiceOutput:
    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolCallParser | None,
        forced_prefix: str = "",
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel_tool_calls
        self.text = Delta()  # everything emitted so far, for the non-streaming message
        self.reasoning_tokens = 0
        self._pending = Delta()
        if forced_prefix:
            # The prompt already holds the start of a tool call; the parsers must see it as
            # output so that they are in the state the model continues from. What that yields
            # (the call's id and name) goes out with the first real delta.
            self._pending = self.feed(forced_prefix, tokens=0)

    def feed(self, text: str, tokens: int = 1) -> Delta:
        """The next piece of model output, worth `tokens` tokens (for the reasoning count)."""
        if self.reasoning is None:
            return self._with_pending(self._route("", text))
        was_reasoning = self.reasoning.in_reasoning
        step = self.reasoning.feed(text)
        if was_reasoning or self.reasoning.in_reasoning:
            # The tokens that open, fill or close the trace are reasoning tokens.
            self.reasoning_tokens += tokens
        return self._with_pending(self._route(step.reasoning, step.content))

    def _with_pending(self, delta: Delta) -> Delta:
        if not self._pending:
            return delta
        pending, self._pending = self._pending, Delta()
        return pending + delta

    def finish(self) -> Delta:
        if self.reasoning is None:
            return self._with_pending(self._route("", "", final=True))
        step = self.reasoning.finish()
        return self._with_pending(self._route(step.reasoning, step.content, final=True))

    @property
    def calls(self) -> list[ToolCall]:
        if self.tools is None:
            return []
        calls = self.tools.calls
        return calls if self.parallel else calls[:1]

    def _route(self, reasoning: str, content: str, final: bool = False) -> Delta:
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            step = self.tools.feed(content) if content else None
            pieces = [step] if step else []
            if final:
                pieces.append(self.tools.finish())
            content = "".join(p.content for p in pieces)
            calls = [c for p in pieces for c in p.calls if self.parallel or c.index == 0]
        delta = Delta(reasoning, content, calls)
        self.text.reasoning += reasoning
        self.text.content += content
        return delta
