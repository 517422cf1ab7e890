"""`Generation`: one HTTP request's engine requests — its n choices — from submit to the last
output. It owns their whole life: submitting them (an engine refusal becomes an `APIError`
before any response starts), the merged stream of their outputs, collecting them for a JSON
response while watching for a client hang-up, the SSE frame around a handler's chunks, aborting
whatever is still running when the response ends, and the metrics of each choice (latency,
tokens, finish reason) and of the request (aborted or not).

The handlers in chat.py and completions.py only render their response format around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from m3serve.api import sse
from m3serve.api.errors import CLIENT_CLOSED, APIError, ClientGone, overloaded
from m3serve.api.state import ServerState
from m3serve.engine import EngineDeadError, RequestError
from m3serve.runtime.messages import GenerateReq, RequestOutput

Outputs = list[list[RequestOutput]]  # each choice's outputs, in choice order
Indexed = tuple[int, RequestOutput]  # an output tagged with its choice index
Render = Callable[[Outputs], dict[str, Any]]


@dataclass
class Timing:
    """One choice's latency figures: its first output, the gaps between its outputs, its end."""

    started: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)

    def output(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    @property
    def ttft(self) -> float:
        return (self.first or time.monotonic()) - self.started

    @property
    def e2e(self) -> float:
        return time.monotonic() - self.started


class Choice:
    """One engine request of a generation: its engine stream, its outputs so far, their timing.
    Timing is per choice so that the inter-token gaps of n choices never mix."""

    def __init__(self, stream: AsyncIterator[RequestOutput]) -> None:
        self.stream = stream
        self.outputs: list[RequestOutput] = []
        self.timing = Timing()

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finish is not None

    def add(self, output: RequestOutput) -> None:
        self.outputs.append(output)
        self.timing.output()


class Generation:
    """The engine requests of one HTTP request (`rid`), one per choice. Made by `start`; ended
    by the response it builds (`event_stream` or `json_response`) or by `close`."""

    def __init__(self, state: ServerState, rid: str, reqs: list[GenerateReq]) -> None:
        self.state = state
        self.rid = rid
        self.choices = [Choice(state.engine.stream(req)) for req in reqs]
        self._stream: AsyncGenerator[Indexed, None] | None = None
        self._pumps: list[asyncio.Task[None]] = []
        self._closed = False

    @classmethod
    async def start(
        cls,
        state: ServerState,
        rid: str,
        reqs: list[GenerateReq],
        client: Request | None = None,
    ) -> Generation:
        """Submit every choice's request and wait for each one's first output, so that a
        refusal (too many choices, bad prompt, context overflow, overload, dead engine) is an
        `APIError` before any response starts. One refusal aborts every choice already
        submitted. With the `client`'s request, a hang-up before the first outputs aborts them
        too — a queued or prefilling request is never run for nobody — and raises ClientGone."""
        check_fanout(state, len(reqs))
        generation = cls(state, rid, reqs)
        first = generation._first_outputs()
        try:
            await (first if client is None else _unless_disconnect(client, first))
        except ClientGone:
            await generation.close()
            raise
        except BaseException:
            await generation._release()
            raise
        return generation

    @property
    def outputs(self) -> Outputs:
        return [choice.outputs for choice in self.choices]

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    # ------------------------------------------------------------------ outputs

    def stream(self) -> AsyncGenerator[Indexed, None]:
        """Every output of every choice, tagged with its choice index: the first outputs (in
        choice order), then the rest as they arrive. There is one stream per generation."""
        if self._stream is None:
            self._stream = self._indexed()
        return self._stream

    async def collect(self, request: Request) -> Outputs:
        """Every output of every choice, for a non-streamed response. If the client hangs up
        first, the choices are aborted and `ClientGone` is raised."""
        await _unless_disconnect(request, self._drain())
        return self.outputs

    # ------------------------------------------------------------------ responses

    def event_stream(
        self, events: AsyncGenerator[dict[str, Any], None], named: bool = False
    ) -> sse.EventStream:
        """The streamed response: a handler's chunks (drawn from `stream`) as SSE. An engine
        failure mid-stream is reported in-band, `[DONE]` ends it, and the generation is closed
        as the response ends, also when the client hangs up. `named` is the Responses API's
        framing: each frame names its event type, and no `[DONE]` follows (the handler's own
        terminal event ends the stream)."""
        return sse.EventStream(self._framed(events, named))

    async def json_response(self, request: Request, render: Render) -> Response:
        """The non-streamed response: `render` turns the collected outputs into the body. A
        client that left before they were complete is answered 499, for the access log and
        the request metrics."""
        try:
            outputs = await self.collect(request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            await self.close()
        body = render(outputs)
        self.state.log_exchange(self.rid, "response", body.get("choices", body.get("output")))
        return JSONResponse(body)

    async def close(self) -> None:
        """End the generation: abort the choices still running, so their KV is freed now, and
        count the request as aborted if any choice did not finish. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Counted before the first await: in a response cancelled by a hang-up, an await may
        # be cancelled in turn.
        if not self.finished:
            self.state.metrics.observe_aborted()
        await self._release()

    # ------------------------------------------------------------------ internals

    async def _first_outputs(self) -> None:
        # Concurrently: the engine batches the prefills of all n choices.
        tasks = [asyncio.create_task(self._first(choice)) for choice in self.choices]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            await _cancel(tasks)
        errors = [task.exception() for task in tasks if not task.cancelled()]
        refusal = next((error for error in errors if error is not None), None)
        if refusal is not None:
            raise refusal

    async def _first(self, choice: Choice) -> None:
        try:
            output = await anext(choice.stream)
        except RequestError as exc:
            message = str(exc)
            raise (overloaded(message) if exc.code == 503 else APIError(exc.code, message)) from exc
        except EngineDeadError as exc:
            raise APIError(503, f"the engine is not available: {exc}") from exc
        except StopAsyncIteration as exc:
            raise APIError(500, "the engine ended a request without output") from exc
        self._add(choice, output)

    async def _indexed(self) -> AsyncGenerator[Indexed, None]:
        for index, choice in enumerate(self.choices):
            yield index, choice.outputs[0]
        live = [index for index, choice in enumerate(self.choices) if not choice.finished]
        rest = self._one(live[0]) if len(live) == 1 else self._merged(live)
        async with contextlib.aclosing(rest):
            async for item in rest:
                yield item

    async def _one(self, index: int) -> AsyncGenerator[Indexed, None]:
        choice = self.choices[index]
        async for output in choice.stream:
            self._add(choice, output)
            yield index, output

    async def _merged(self, live: list[int]) -> AsyncGenerator[Indexed, None]:
        """The outputs of several choices as they arrive, each choice pumped by its own task."""
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(index, queue)) for index in live]
        try:
            remaining = len(live)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            await _cancel(self._pumps)

    async def _pump(
        self, index: int, queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]]
    ) -> None:
        choice = self.choices[index]
        try:
            async for output in choice.stream:
                self._add(choice, output)
                queue.put_nowait((index, output))
        except Exception as exc:  # the consumer re-raises it: an engine failure mid-stream
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, None))

    async def _drain(self) -> None:
        async for _ in self.stream():
            pass

    async def _framed(
        self, events: AsyncGenerator[dict[str, Any], None], named: bool
    ) -> AsyncIterator[bytes]:
        frame = sse.named_event if named else sse.event
        try:
            async for payload in events:
                yield frame(payload)
        except (RequestError, EngineDeadError) as exc:
            yield sse.error_event(str(exc), getattr(exc, "code", 503))
        finally:
            await self.close()
            await events.aclose()
        if not named:
            yield sse.DONE

    def _add(self, choice: Choice, output: RequestOutput) -> None:
        choice.add(output)
        if output.finish is not None:
            self._observe_finished(choice)

    def _observe_finished(self, choice: Choice) -> None:
        last = choice.outputs[-1]
        self.state.metrics.observe_finished(
            prompt_tokens=last.usage.prompt_tokens,
            completion_tokens=last.usage.completion_tokens,
            cached_tokens=last.usage.cached_tokens,
            ttft_s=choice.timing.ttft,
            itl_s=choice.timing.gaps,
            e2e_s=choice.timing.e2e,
            finish_reason=last.finish.reason if last.finish else "unknown",
        )
        self.state.metrics.count_tokens(last.usage.completion_tokens)

    async def _release(self) -> None:
        """Stop everything that still reads from the engine: closing an engine stream that has
        not finished aborts its request. The pumps go first, as a stream they drive cannot be
        closed from outside."""
        await _cancel(self._pumps)
        closing = [choice.stream.aclose() for choice in self.choices]  # type: ignore[attr-defined]
        await asyncio.gather(*closing, return_exceptions=True)
        if self._stream is not None:
            await self._stream.aclose()


def check_fanout(state: ServerState, count: int) -> None:
    """Refuse a request that makes more engine requests (n x prompts) than one request may
    (400), or than the engine can hold beside those already in flight (503)."""
    limit = state.args.max_fanout
    if count > limit:
        raise APIError(
            400,
            f"the request makes {count} engine requests (n x prompts); at most {limit} are "
            "allowed per request (--max-fanout)",
            "n",
        )
    sched = state.engine.args.sched
    capacity = sched.max_running_requests + sched.max_queued_requests
    busy = state.engine.num_requests
    if busy + count > capacity:
        raise overloaded(
            f"the engine holds {busy} requests; {count} more would exceed its {capacity} "
            "(--max-running-requests + --max-queued-requests)"
        )


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnect(request: Request, work: Awaitable[None]) -> None:
    """Run `work` unless the client goes away first; then cancel it (which aborts the engine
    requests it drives) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            raise ClientGone
        task.result()
    finally:
        await _cancel([task, watcher])


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
