"""The special tokens of MiniMax-M3.1's output markup, defined once: the tags around reasoning,
the namespace token that prefixes every tag of a tool-call block, and the control tokens that
must never reach a client as text. Each is a single token."""

THINK_START = "<mm:think>"
THINK_END = "</mm:think>"
TOOL_NAMESPACE = "]<]minimax[>["
TOOL_CALL_START = TOOL_NAMESPACE + "<tool_call>"

# Special tokens whose text no ordinary reply contains: message framing, padding, media
# placeholders and the markup above. The legacy M2 tags (<think>, <tool_call> and their closers)
# are special tokens too, but their text is also plain markup that an answer may quote, and once
# decoded the two cannot be told apart, so they are not listed.
CONTROL_TOKENS = (
    "]!p~[",
    "]~b]",
    "[e~[",
    "]!d~[",
    "]<]image[>[",
    "]<]video[>[",
    "]<]start of image[>[",
    "]<]end of image[>[",
    "]<]start of video[>[",
    "]<]end of video[>[",
    "]<]vision pad[>[",
    "]~!b[",
    "]<]frame[>[",
    "]<]start of frame[>[",
    "]<]end of frame[>[",
    "<|content_altered_placeholder|>",
    TOOL_NAMESPACE,
    THINK_START,
    THINK_END,
)
