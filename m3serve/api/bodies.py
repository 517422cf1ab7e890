"""Pieces of OpenAI response bodies shared by the handlers: finish reasons, usage with cached
and reasoning tokens, logprobs."""

from __future__ import annotations

from typing import Any

from m3serve.api.state import ServerState
from m3serve.runtime.messages import Finish, RequestOutput, TokenLogprob, Usage

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def finish_reason(finish: Finish | None, called_tools: bool) -> str | None:
    if finish is None:
        return None
    if finish.reason == "stop" and called_tools:
        return "tool_calls"
    return _FINISH[finish.reason]


def usage_dict(
    chunks: list[list[RequestOutput]], reasoning_tokens: list[int] | None = None
) -> dict[str, Any]:
    """Usage over all choices: the prompt counts once, completions add up. Reasoning tokens
    are those of the text the reasoning parser put in reasoning_content."""
    finals = [pieces[-1].usage for pieces in chunks if pieces]
    prompt = finals[0].prompt_tokens if finals else 0
    completion = sum(u.completion_tokens for u in finals)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": finals[0].cached_tokens if finals else 0},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning_tokens)}
    return out


def running_usage(usage: Usage) -> dict[str, Any]:
    """One choice's usage so far, for a chunk under `continuous_usage_stats` (vLLM's shape:
    the prompt, the completion tokens generated up to this chunk, their total)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def token_text(state: ServerState, token_id: int) -> str:
    if state.tokenizer is None:
        return f"<{token_id}>"
    return state.tokenizer.decode([token_id], skip_special_tokens=False)


def _entry(state: ServerState, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(state, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprobs_content(state: ServerState, pieces: list[RequestOutput]) -> dict[str, Any]:
    """Chat-completion logprobs: one entry per output token, with its top alternatives."""
    content = []
    for lp in _logprobs(pieces):
        entry = _entry(state, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_entry(state, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    state: ServerState, pieces: list[RequestOutput], offset: int
) -> dict[str, Any]:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in _logprobs(pieces):
        text = token_text(state, lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({token_text(state, t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _logprobs(pieces: list[RequestOutput]) -> list[TokenLogprob]:
    return [lp for chunk in pieces for lp in chunk.logprobs]
