"""The library's call surface of `AsyncEngine`: `generate` and `generate_stream` (SGLang's
result dicts) and `chat` (one chat turn, parsed as the API parses it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from m3serve.engine.chat import chat_request, parsed, with_media
from m3serve.engine.recovery import Recovery
from m3serve.engine.requests import (
    Prompt,
    Result,
    SamplingArg,
    generate_requests,
    stream_request,
    with_keywords,
)
from m3serve.runtime.messages import GenerateReq


class LibraryCalls(Recovery):
    """Whole-result and streamed calls built on `stream`."""

    async def generate(
        self,
        prompt: Prompt | list[Prompt] | None = None,
        sampling_params: SamplingArg = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | list[str] | None = None,
        **sampling: Any,
    ) -> Any:
        """Generate from a prompt (text or token ids; or `input_ids=`): SGLang's result dict
        (`text`, `output_ids`, `meta_info`), or a list of them for a list of prompts. Sampling
        is a plain dict and/or keywords with SGLang's names (`temperature`, `max_new_tokens`,
        `top_p`, `stop`, `seed`, ...)."""
        params = with_keywords(sampling_params, sampling)
        reqs, single = generate_requests(
            prompt, input_ids, params, rid, return_logprob, top_logprobs_num
        )
        results = await asyncio.gather(*(self._collect(req) for req in reqs))
        return results[0] if single else list(results)

    async def generate_stream(
        self,
        prompt: Prompt | None = None,
        sampling_params: dict[str, Any] | None = None,
        *,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """`generate` for one prompt, as it is written: each dict holds the new text and token
        ids; the last one has the finish reason. Leaving the loop early aborts the request."""
        params = with_keywords(sampling_params, sampling)
        reqs, single = generate_requests(
            prompt, input_ids, params, rid, return_logprob, top_logprobs_num
        )
        async for chunk in self._increments(stream_request(reqs, single)):
            yield chunk

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        thinking: str | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        rid: str | None = None,
        **sampling: Any,
    ) -> dict[str, Any]:
        """One chat turn through the model's chat template, parsed as the API parses it: the
        generate result plus `content`, `reasoning_content` (None without reasoning) and
        `tool_calls` (OpenAI's shape: id, type, function name and JSON arguments). Messages
        and tools are OpenAI chat dicts; thinking is enabled, disabled or adaptive."""
        req = chat_request(
            messages, tools, sampling, thinking, reasoning_effort, chat_template_kwargs, rid
        )
        req = await with_media(req, self.args.media)
        return parsed(await self._collect(req), req)

    async def _collect(self, req: GenerateReq) -> dict[str, Any]:
        started = time.monotonic()
        result = Result(req.rid)
        async for chunk in self.stream(req):
            result.add(chunk)
        return result.as_dict(time.monotonic() - started)

    async def _increments(self, req: GenerateReq) -> AsyncIterator[dict[str, Any]]:
        started = time.monotonic()
        async for chunk in self.stream(req):
            result = Result(req.rid)
            result.add(chunk)
            yield result.as_dict(time.monotonic() - started)
