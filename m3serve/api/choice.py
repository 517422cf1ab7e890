"""One chat completion choice's output pipeline: model text -> reasoning parser -> tool-call
parser -> control-token filter -> deltas of reasoning_content, content and tool_calls. The same
object serves the streaming and the non-streaming response, so both always agree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from m3serve.model.special_tokens import CONTROL_TOKENS, THINK_END, THINK_START, TOOL_NAMESPACE
from m3serve.parsers.reasoning import ReasoningParser
from m3serve.parsers.specials import NON_THINK_TOKENS, ControlTokenFilter
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


@dataclass(frozen=True)
class TagIds:
    """Token ids of the markup where a reasoning trace opens and ends (each a single token)."""

    think_start: int
    think_end: int
    tool_namespace: int  # the first token of a tool-call block, which also ends the reasoning

    @classmethod
    def of(cls, tokenizer: Any) -> TagIds | None:
        """From a `tokenizers.Tokenizer`; None without one or without these tokens."""
        if tokenizer is None:
            return None
        ids = [tokenizer.token_to_id(t) for t in (THINK_START, THINK_END, TOOL_NAMESPACE)]
        return None if None in ids else cls(*ids)


class ReasoningCount:
    """The output tokens of the reasoning trace, counted token by token from the ids: the
    opening tag (adaptive mode), the trace and `</mm:think>`, or the trace up to a tool-call
    block. The text parser sees pieces whose cut depends on timing (how many tokens one stream
    chunk carries); counting by ids gives the stream and the non-stream response one number."""

    def __init__(self, tags: TagIds, mode: str) -> None:
        self.tags = tags
        self.tokens = 0
        # True inside the trace, False once it ended or never opened, None while an adaptive
        # output has not shown whether it opens with <mm:think>.
        self.open: bool | None = {"enabled": True, "disabled": False}.get(mode)

    def feed(self, ids: list[int], answered: bool) -> None:
        """The next piece's ids; `answered`: answer text has come out (no trace can open)."""
        for token in ids:
            if self.open is None:
                self.open = token == self.tags.think_start or None
                if self.open is None and answered:
                    self.open = False
                if not self.open:
                    continue  # whitespace before a leading tag, or an answer without a trace
            if not self.open:
                return
            if token == self.tags.tool_namespace:
                self.open = False
                return
            self.tokens += 1
            if token == self.tags.think_end:
                self.open = False
                return


class ChoiceOutput:
    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolCallParser | None,
        parallel_tool_calls: bool = True,
        special_tokens_in_text: bool = True,
        tag_ids: TagIds | None = None,
    ) -> None:
        """`tag_ids`: the markup's token ids, which make the reasoning-token count exact; without
        them a piece that opens, fills or closes the trace counts whole."""
        self.reasoning = reasoning
        self.count = ReasoningCount(tag_ids, reasoning.mode) if reasoning and tag_ids else None
        self.tools = tools
        self.parallel = parallel_tool_calls
        self.text = Delta()  # everything emitted so far, for the non-streaming message
        self.reasoning_tokens = 0
        # Text decoded for the parsers keeps special tokens; none may reach the client, except
        # that without a reasoning parser the think tags stay with the trace they delimit.
        self._clean = special_tokens_in_text
        self._clean_reasoning = ControlTokenFilter()
        self._clean_content = ControlTokenFilter(CONTROL_TOKENS if reasoning else NON_THINK_TOKENS)
        self._pending = Delta()

    def feed(self, text: str, ids: list[int] | None = None) -> Delta:
        """The next piece of model output: its text and token ids (for the reasoning count;
        None: one token, id unknown)."""
        if self.reasoning is None:
            return self._with_pending(self._route("", text))
        was_reasoning = self.reasoning.in_reasoning
        step = self.reasoning.feed(text)
        if ids is None:
            ids = [-1]
        if self.count is not None:
            self.count.feed(ids, answered=bool(step.content))
            self.reasoning_tokens = self.count.tokens
        elif was_reasoning or self.reasoning.in_reasoning:
            # The tokens that open, fill or close the trace are reasoning tokens.
            self.reasoning_tokens += len(ids)
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
        if self._clean:
            reasoning = self._clean_reasoning.feed(reasoning)
            content = self._clean_content.feed(content)
            if final:
                reasoning += self._clean_reasoning.finish()
                content += self._clean_content.finish()
        delta = Delta(reasoning, content, calls)
        self.text.reasoning += reasoning
        self.text.content += content
        return delta
