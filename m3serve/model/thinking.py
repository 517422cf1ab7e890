"""MiniMax-M3.1's thinking controls: which `thinking` modes and `reasoning_effort` values exist,
and how a request's fields resolve to what the chat template receives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

THINKING_MODES = ("enabled", "disabled", "adaptive")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
NO_THINKING_EFFORTS = ("none", "minimal")


class ThinkingInvalid(ValueError):
    """A thinking mode or effort outside the model's set (HTTP 400)."""


def resolve_thinking(
    thinking: str | None, effort: str | None, template_kwargs: Mapping[str, Any] | None = None
) -> tuple[str, str | None]:
    """(thinking_mode, reasoning_effort or None) for the template.

    Top-level fields win; vLLM-style `chat_template_kwargs` (`thinking`/`thinking_mode`,
    `reasoning_effort`) are honoured too. `none`/`minimal` effort turns thinking off, and an
    effort is dropped when thinking is off.
    """
    kwargs = template_kwargs or {}
    mode = thinking or kwargs.get("thinking") or kwargs.get("thinking_mode")
    effort = effort or kwargs.get("reasoning_effort")
    if isinstance(mode, Mapping):  # {"type": ...} passed through chat_template_kwargs
        mode = mode.get("type")
    if effort in NO_THINKING_EFFORTS:
        mode, effort = "disabled", None
    if mode is not None and mode not in THINKING_MODES:
        raise ThinkingInvalid(f"thinking must be one of {', '.join(THINKING_MODES)}, not {mode!r}")
    if effort is not None and effort not in EFFORTS + NO_THINKING_EFFORTS:
        allowed = ", ".join(EFFORTS + NO_THINKING_EFFORTS)
        raise ThinkingInvalid(f"reasoning_effort must be one of {allowed}, not {effort!r}")
    mode = mode or "adaptive"
    return mode, (effort if mode != "disabled" else None)
