"""Output parsers for MiniMax-M3: reasoning/answer split and tool calls, streaming or one-shot.

A response's text (special tokens kept) goes through `ReasoningParser` first; its ``content``
then goes through `ToolCallParser`. Both are pure state machines, one instance per request.
"""

from m3serve.parsers.reasoning import ReasoningDelta, ReasoningParser
from m3serve.parsers.tools import ToolCall, ToolCallDelta, ToolCallParser, ToolDelta

__all__ = [
    "ReasoningDelta",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolDelta",
]
