"""Pieces of OpenAI response bodies shared by the handlers: SSE framing, finish reasons, usage
with cached and reasoning tokens, logprobs."""

from __future__ import annotations

from typing import Any

import orjson

from m3serve.api.serving import ServerState
from m3serve.runtime.engine import Chunk
from m3serve.runtime.messages import Finish, TokenLogprob

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_done() -> bytes:
    return b"data: [DONE]\n\n"


def finish_reason(finish: Finish | None, called_tools: bool) -> str | None:
    if finish is None:
        return None
    if finish.reason == "stop" and called_tools:
        return "tool_calls"
    return _FINISH[finish.reason]


def usage_dict(
    state: ServerState, chunks: list[list[Chunk]], thinking: str | None = None
) -> dict[str, Any]:
    """Usage over all choices: the prompt counts once, completions add up."""
    finals = [pieces[-1].usage for pieces in chunks if pieces]
    prompt = finals[0].prompt_tokens if finals else 0
    completion = sum(u.completion_tokens for u in finals)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": finals[0].cached_tokens if finals else 0},
    }
    if thinking is not None:
        reasoning = sum(_reasoning_tokens(state, pieces, thinking) for pieces in chunks)
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def _reasoning_tokens(state: ServerState, pieces: list[Chunk], thinking: str) -> int:
    """Tokens up to and including `</mm:think>`; all of them if thinking never closed."""
    ids = [i for chunk in pieces for i in chunk.output_ids]
    end = state.special_ids.get("think_end")
    if end is not None and end in ids:
        return ids.index(end) + 1
    if thinking == "enabled":
        return len(ids)
    start = state.special_ids.get("think_start")
    return len(ids) if start is not None and start in ids[:1] else 0


def token_text(state: ServerState, token_id: int) -> str:
    if state.tokenizer is None:
        return f"<{token_id}>"
    return state.tokenizer.decode([token_id], skip_special_tokens=False)


def _entry(state: ServerState, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(state, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprobs_content(state: ServerState, pieces: list[Chunk]) -> dict[str, Any]:
    """Chat-completion logprobs: one entry per output token, with its top alternatives."""
    content = []
    for lp in _logprobs(pieces):
        entry = _entry(state, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_entry(state, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(state: ServerState, pieces: list[Chunk], offset: int) -> dict[str, Any]:
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


def _logprobs(pieces: list[Chunk]) -> list[TokenLogprob]:
    return [lp for chunk in pieces for lp in chunk.logprobs]
