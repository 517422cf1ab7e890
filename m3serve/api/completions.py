"""POST /v1/completions: OpenAI's legacy text completions (prompt strings or token ids)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from m3serve.api.errors import APIError, decode, read_body
from m3serve.api.protocol import CompletionRequest
from m3serve.api.responses import (
    EventStream,
    completion_logprobs,
    finish_reason,
    sse,
    sse_events,
    usage_dict,
)
from m3serve.api.serving import (
    ClientGone,
    ServerState,
    Timing,
    check_n,
    collect,
    log_exchange,
    merged,
    observe_finished,
    sampling_params,
    start,
    until_disconnect,
)
from m3serve.runtime.messages import GenerateReq, RequestOutput, TokenIds

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_LOGPROBS = 5


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.args.max_request_bytes)
    body = decode(raw, CompletionRequest)
    prompts = _prompts(body)
    check_n(body)
    reqs = _requests(body, prompts, state)
    rid = "cmpl-" + uuid.uuid4().hex
    log_exchange(state, rid, "request", raw.decode(errors="replace"))
    timing = Timing()
    streams = await start(state.engine, reqs)
    echoes = [_echo_text(state, p) if body.echo else "" for p in prompts for _ in range(body.n)]
    if body.stream:
        finished: list[list[RequestOutput]] = [[] for _ in streams]
        events = _stream(rid, body, state, streams, echoes, timing, finished)
        return EventStream(sse_events(events, state, finished))
    try:
        chunks = await until_disconnect(request, collect(streams))
    except ClientGone:
        state.metrics.observe_aborted()
        return Response(status_code=499)
    choices = [
        {
            "index": i,
            "text": echoes[i] + "".join(c.text for c in pieces),
            "logprobs": (
                completion_logprobs(state, pieces, len(echoes[i]))
                if body.logprobs is not None
                else None
            ),
            "finish_reason": finish_reason(pieces[-1].finish, False),
        }
        for i, pieces in enumerate(chunks)
    ]
    for pieces in chunks:
        observe_finished(state, pieces, timing)
    log_exchange(state, rid, "response", choices)
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": choices,
            "usage": _usage(state, chunks, body.n),
        }
    )


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [prompt]  # type: ignore[list-item]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        prompts = list(prompt)  # type: ignore[arg-type]
    else:
        raise APIError(400, "prompt mixes strings, token ids and id lists", "prompt")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt must not be empty", "prompt")
    for p in prompts:
        if not isinstance(p, str) and any(not 0 <= t < 2**31 for t in p):
            bad = next(t for t in p if not 0 <= t < 2**31)
            raise APIError(400, f"token id {bad} is outside the vocabulary", "prompt")
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in 0..{MAX_LOGPROBS}", "logprobs")
    return prompts


def _requests(
    body: CompletionRequest, prompts: list[str | list[int]], state: ServerState
) -> list[GenerateReq]:
    reqs = []
    for prompt in prompts:
        for i in range(body.n):
            sampling = sampling_params(
                body,
                state,
                body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS,
                logprobs=body.logprobs is not None,
                top_logprobs=body.logprobs or 0,
                seed_offset=i,
            )
            req = GenerateReq(rid=uuid.uuid4().hex, sampling=sampling, stream=body.stream)
            if isinstance(prompt, str):
                req.prompt = prompt
            else:
                req.input_ids = TokenIds(len(prompt), np.asarray(prompt, dtype=np.int32))
            reqs.append(req)
    return reqs


def _echo_text(state: ServerState, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    if state.tokenizer is None:
        raise APIError(400, "echo of token-id prompts needs a tokenizer", "echo")
    return state.tokenizer.decode(prompt, skip_special_tokens=False)


def _usage(state: ServerState, chunks: list[list[RequestOutput]], n: int) -> dict[str, Any]:
    """Choices are prompt-major (n per prompt): each prompt's tokens count once."""
    usage = usage_dict(chunks)
    firsts = [pieces for k, pieces in enumerate(chunks) if k % n == 0 and pieces]
    usage["prompt_tokens"] = sum(p[-1].usage.prompt_tokens for p in firsts)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


async def _stream(
    rid: str,
    body: CompletionRequest,
    state: ServerState,
    streams: list[AsyncIterator[RequestOutput]],
    echoes: list[str],
    timing: Timing,
    finished: list[list[RequestOutput]],
) -> AsyncIterator[bytes]:
    """The response's SSE events; `finished` collects each choice's chunks as they pass."""
    head = {"id": rid, "object": "text_completion", "created": int(time.time())}
    head["model"] = state.model_name
    sent_echo = [False] * len(streams)
    # Each choice's text_offset runs on across its chunks, from the end of its echoed prompt,
    # so the streamed logprobs equal the non-streamed ones.
    offsets = [len(echo) for echo in echoes]
    async for index, chunk in merged(streams):
        timing.token()
        finished[index].append(chunk)
        text = chunk.text if sent_echo[index] else echoes[index] + chunk.text
        sent_echo[index] = True
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(state, [chunk], offsets[index])
            offsets[index] += sum(len(token) for token in logprobs["tokens"])
        reason = finish_reason(chunk.finish, False)
        if chunk.finish is not None:
            observe_finished(state, finished[index], timing)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        yield sse({**head, "choices": [choice]})
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": _usage(state, finished, body.n)})
