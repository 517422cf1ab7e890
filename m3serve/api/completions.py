"""POST /v1/completions: OpenAI's legacy text completions (prompt strings or token ids).

This module validates a request into engine requests (n per prompt, prompt-major) and renders
the `text_completion` format; the requests' life (submit, stream, abort, metrics) is the
`Generation`'s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from m3serve.api.bodies import completion_logprobs, finish_reason, running_usage, usage_dict
from m3serve.api.constraints import response_format_constraint
from m3serve.api.errors import APIError, decode, read_body
from m3serve.api.generation import Generation, Outputs, check_fanout
from m3serve.api.protocol import CompletionRequest
from m3serve.api.sampling import check_n, sampling_params
from m3serve.api.state import ServerState
from m3serve.runtime.messages import Constraint, GenerateReq, RequestOutput, TokenIds

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_LOGPROBS = 5
MAX_TOKEN_ID = 2**31  # ids travel as int32


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.args.max_request_bytes)
    body = decode(raw, CompletionRequest)
    prompts = _prompts(body)
    check_n(body)
    check_fanout(state, len(prompts) * body.n)  # before building thousands of requests
    constraint = response_format_constraint(body.response_format)
    reqs = [_request(body, p, i, state, constraint) for p in prompts for i in range(body.n)]
    rid = "cmpl-" + uuid.uuid4().hex
    state.log_exchange(rid, "request", raw.decode(errors="replace"))
    response = _CompletionResponse(rid, body, state, prompts)
    generation = await Generation.start(state, rid, reqs, request)
    if body.stream:
        return generation.event_stream(response.chunks(generation))
    return await generation.json_response(request, response.completion)


# ---------------------------------------------------------------------- validation


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    prompts = _prompt_list(body.prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt must not be empty", "prompt")
    for p in prompts:
        bad = [] if isinstance(p, str) else [t for t in p if not 0 <= t < MAX_TOKEN_ID]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", "prompt")
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in 0..{MAX_LOGPROBS}", "logprobs")
    return prompts


def _prompt_list(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """The four forms OpenAI accepts -> a list of prompts (strings or id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    raise APIError(400, "prompt mixes strings, token ids and id lists", "prompt")


def _request(
    body: CompletionRequest,
    prompt: str | list[int],
    seed_offset: int,
    state: ServerState,
    constraint: Constraint | None,
) -> GenerateReq:
    """Choice `seed_offset` of `prompt`; the n choices of each prompt come together (choice k
    is prompt k // n)."""
    sampling = sampling_params(
        body,
        state.defaults,
        body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        seed_offset=seed_offset,
        constraint=constraint,
    )
    req = GenerateReq(rid=uuid.uuid4().hex, sampling=sampling, stream=body.stream)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.input_ids = TokenIds(len(prompt), np.asarray(prompt, dtype=np.int32))
    return req


def _echo_text(state: ServerState, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    if state.tokenizer is None:
        raise APIError(400, "echo of token-id prompts needs a tokenizer", "echo")
    return state.tokenizer.decode(prompt, skip_special_tokens=False)


# ---------------------------------------------------------------------- rendering


class _CompletionResponse:
    """The `text_completion` response to one request, whole or as chunk events. Made before the
    request is submitted, so that a refused echo never leaves engine requests behind."""

    def __init__(
        self, rid: str, body: CompletionRequest, state: ServerState, prompts: list[str | list[int]]
    ) -> None:
        self.rid = rid
        self.body = body
        self.state = state
        self.echoes = [
            _echo_text(state, p) if body.echo else "" for p in prompts for _ in range(body.n)
        ]

    def completion(self, outputs: Outputs) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.state.model_name,
            "choices": [self._choice(i, pieces) for i, pieces in enumerate(outputs)],
            "usage": self._usage(outputs),
        }

    async def chunks(self, generation: Generation) -> AsyncGenerator[dict[str, Any], None]:
        head = {"id": self.rid, "object": "text_completion", "created": int(time.time())}
        head["model"] = self.state.model_name
        # Each choice's text_offset runs on across its chunks, from the end of its echoed
        # prompt, so the streamed logprobs equal the non-streamed ones.
        offsets = [len(echo) for echo in self.echoes]
        sent_echo = [False] * len(self.echoes)
        options = self.body.stream_options
        continuous = options is not None and options.continuous
        async for index, piece in generation.stream():
            text = piece.text if sent_echo[index] else self.echoes[index] + piece.text
            sent_echo[index] = True
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = completion_logprobs(self.state, [piece], offsets[index])
                offsets[index] += sum(len(token) for token in logprobs["tokens"])
            choice = {"index": index, "text": text, "logprobs": logprobs}
            choice["finish_reason"] = finish_reason(piece.finish, False)
            chunk = {**head, "choices": [choice]}
            if continuous:
                chunk["usage"] = running_usage(piece.usage)
            yield chunk
        if options and options.include_usage:
            yield {**head, "choices": [], "usage": self._usage(generation.outputs)}

    def _choice(self, index: int, pieces: list[RequestOutput]) -> dict[str, Any]:
        echo = self.echoes[index]
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(self.state, pieces, len(echo))
        return {
            "index": index,
            "text": echo + "".join(p.text for p in pieces),
            "logprobs": logprobs,
            "finish_reason": finish_reason(pieces[-1].finish, False),
        }

    def _usage(self, outputs: Outputs) -> dict[str, Any]:
        """Choices are prompt-major (n per prompt): each prompt's tokens count once."""
        usage = usage_dict(outputs)
        firsts = [pieces for k, pieces in enumerate(outputs) if k % self.body.n == 0 and pieces]
        usage["prompt_tokens"] = sum(p[-1].usage.prompt_tokens for p in firsts)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage
