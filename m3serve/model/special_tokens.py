"""The special tokens of MiniMax-M3.1's output markup, defined once: the tags around reasoning
and the namespace token that prefixes every tag of a tool-call block. Each is a single token."""

THINK_START = "<mm:think>"
THINK_END = "</mm:think>"
TOOL_NAMESPACE = "]<]minimax[>["
TOOL_CALL_START = TOOL_NAMESPACE + "<tool_call>"
