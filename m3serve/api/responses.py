"""POST /v1/responses: OpenAI's Responses API (what the openai-agents SDK calls by default),
stateless, streamed as typed events or not, with reasoning items, function calls and function
tools.

A Responses request is a chat request in another wire shape (`response_input.py`), so the chat
path plans it, renders the template, runs it as one `Generation` and parses its text with the
same reasoning and tool-call parsers; this module renders the Response object and its events
(`response_output.py` builds the output items).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

# The chat path's planning, reused as is: the tool_choice and thinking rules stay in one place.
from m3serve.api.chat import Plan, _choice_output, _load_media, _plan, _requests
from m3serve.api.errors import ERROR_TYPES, APIError, decode, read_body
from m3serve.api.generation import Generation, Outputs
from m3serve.api.protocol import ResponsesRequest, to_builtins
from m3serve.api.response_input import chat_request
from m3serve.api.response_output import Event, OutputItems
from m3serve.api.state import ServerState
from m3serve.engine import EngineDeadError, RequestError
from m3serve.runtime.messages import Finish, GenerateReq, RequestOutput

# Chat's names for the fields whose refusals the chat path raises, as the Responses API names them.
PARAMS = {"messages": "input", "reasoning_effort": "reasoning.effort"}
PARAMS |= {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


async def responses(request: Request) -> Response:
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.args.max_request_bytes)
    body = decode(raw, ResponsesRequest)
    plan, req = await _validated(body, state)
    rid = "resp_" + uuid.uuid4().hex
    state.log_exchange(rid, "request", raw.decode(errors="replace"))
    response = _Response(rid, body, plan, state)
    generation = await Generation.start(state, rid, [req], request)
    if body.stream:
        return generation.event_stream(response.events(generation), named=True)
    return await generation.json_response(request, response.whole)


async def _validated(body: ResponsesRequest, state: ServerState) -> tuple[Plan, GenerateReq]:
    try:
        plan = _plan(chat_request(body), state)
        messages, media = await _load_media(plan, state)
        (req,) = _requests(plan, state, messages, media)
    except APIError as exc:
        exc.param = PARAMS.get(exc.param or "", exc.param)
        raise
    return plan, req


class _Response:
    """The Response object of one request, whole or as its stream of events. Made before the
    request is submitted, so that nothing it builds can fail once the engine is at work."""

    def __init__(self, rid: str, body: ResponsesRequest, plan: Plan, state: ServerState) -> None:
        self.rid = rid
        self.body = body
        self.state = state
        self.parsed = _choice_output(plan, state)
        self.items = OutputItems()
        self.created = int(time.time())
        self._sequence = 0

    def whole(self, outputs: Outputs) -> dict[str, Any]:
        (pieces,) = outputs
        for piece in pieces:
            self._step(piece)
        return self._object(pieces[-1])

    async def events(self, generation: Generation) -> AsyncGenerator[Event, None]:
        """The stream: created, in progress, each item's events, then the terminal event. An
        engine failure ends it with an `error` event, as OpenAI's stream does."""
        yield self._stamp({"type": "response.created", "response": self._object(None)})
        yield self._stamp({"type": "response.in_progress", "response": self._object(None)})
        last = None
        try:
            async for _, piece in generation.stream():
                last = piece
                for event in self._step(piece):
                    yield self._stamp(event)
        except (RequestError, EngineDeadError) as exc:
            code = getattr(exc, "code", 503)
            error = {"type": "error", "code": ERROR_TYPES.get(code, "server_error")}
            yield self._stamp(error | {"message": str(exc), "param": None})
            return
        self.state.log_exchange(self.rid, "streamed", self.items.items)
        final = self._object(last)
        # completed, incomplete or failed: the terminal event is named by the status.
        yield self._stamp({"type": f"response.{final['status']}", "response": final})

    def _step(self, piece: RequestOutput) -> list[Event]:
        delta = self.parsed.feed(piece.text, piece.output_ids)
        if piece.finish is None:
            return self.items.add(delta)
        delta += self.parsed.finish()
        return [*self.items.add(delta), *self.items.finish(piece.finish.reason != "length")]

    def _stamp(self, event: Event) -> Event:
        stamped = {**event, "sequence_number": self._sequence}
        self._sequence += 1
        return stamped

    def _object(self, last: RequestOutput | None) -> dict[str, Any]:
        """The Response object; `last` is the choice's final output, None while in progress."""
        body = self.body
        status = "in_progress" if last is None else _status(last.finish)
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.state.model_name,
            "output": self.items.items if last is not None else [],
            "usage": self._usage(last) if last is not None else None,
            "incomplete_details": _incomplete(status),
            "error": _error(last.finish) if status == "failed" and last else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": to_builtins(body.tool_choice) if body.tool_choice else "auto",
            "tools": [to_builtins(t) for t in body.tools or []],
            "reasoning": to_builtins(body.reasoning) if body.reasoning else None,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": False,  # whatever was asked: nothing is stored
            "previous_response_id": None,
            "metadata": body.metadata or {},
            "user": body.user,
        }
        if status == "completed":
            out["completed_at"] = int(time.time())
        return out

    def _usage(self, last: RequestOutput) -> dict[str, Any]:
        usage = last.usage
        return {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.parsed.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }


def _status(finish: Finish | None) -> str:
    if finish is None or finish.reason == "stop":
        return "completed"
    return "incomplete" if finish.reason == "length" else "failed"


def _incomplete(status: str) -> dict[str, str] | None:
    return {"reason": "max_output_tokens"} if status == "incomplete" else None


def _error(finish: Finish | None) -> dict[str, str]:
    reason = finish.reason if finish else "error"
    message = (finish.matched if finish else None) or f"generation ended: {reason}"
    return {"code": "server_error", "message": message}
