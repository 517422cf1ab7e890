"""What chat and text completions share: the server state, request fields -> SamplingParams,
running engine streams (kick-started, merged over choices, aborted on disconnect) and timing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

from m3serve.api.errors import APIError, overloaded
from m3serve.api.metrics import ServerMetrics
from m3serve.api.protocol import SamplingFields
from m3serve.engine import AsyncEngine, EngineDeadError, RequestError
from m3serve.runtime.config import ApiArgs
from m3serve.runtime.messages import GenerateReq, RequestOutput, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_N = 16


@dataclass
class ServerState:
    """Everything a handler needs, built once when the engine is up."""

    engine: AsyncEngine
    args: ApiArgs
    metrics: ServerMetrics
    model_name: str = ""
    context_length: int = 0
    tokenizer: Any = None  # tokenizers.Tokenizer, for logprob token strings and /v1/tokenize
    chat_template: str | None = None
    defaults: dict[str, float] = field(default_factory=dict)  # from generation_config.json
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, engine: AsyncEngine, args: ApiArgs, metrics: ServerMetrics) -> ServerState:
        from m3serve.model.chat_template import load_chat_template

        path = Path(engine.info["model_path"])
        state = cls(
            engine=engine,
            args=args,
            metrics=metrics,
            model_name=args.served_model_name or str(engine.args.model.model_path or path.name),
            context_length=int(engine.info.get("context_length", 0)),
            defaults=_generation_defaults(path),
        )
        if (path / "tokenizer.json").is_file() and not engine.args.runtime.skip_tokenizer_init:
            from tokenizers import Tokenizer

            state.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            state.chat_template = load_chat_template(path)
        return state


def _generation_defaults(model_dir: Path) -> dict[str, float]:
    """The checkpoint's recommended sampling (e.g. temperature 1.0, top_p 0.95)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in config}


def sampling_params(
    req: SamplingFields,
    state: ServerState,
    max_tokens: int | None,
    *,
    logprobs: bool = False,
    top_logprobs: int = 0,
    skip_special_tokens: bool = True,
    seed_offset: int = 0,
) -> SamplingParams:
    """Request fields -> SamplingParams; unset fields take the checkpoint's defaults."""

    def pick(name: str, fallback: float) -> Any:
        value = getattr(req, name)
        return value if value is not None else state.defaults.get(name, fallback)

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=int(pick("top_k", -1)),
        min_p=pick("min_p", 0.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        seed=None if req.seed is None else req.seed + seed_offset,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        skip_special_tokens=skip_special_tokens,
    )
    # OpenAI's field names in the messages, not the engine's.
    problems = [p.replace("max_new_tokens", "max_tokens") for p in params.problems()]
    if params.temperature > 2.0:
        problems.append("temperature must be <= 2")
    if problems:
        raise APIError(400, "; ".join(problems), _param_of(problems[0]))
    return params


def check_n(req: SamplingFields) -> None:
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in 1..{MAX_N}", "n")


def _param_of(problem: str) -> str | None:
    word = problem.split(" ", 1)[0]
    return word if word.isidentifier() else None


def to_builtins(value: Any) -> Any:
    """Structs -> plain JSON values (what the chat template and the tokenizer actor take)."""
    return msgspec.to_builtins(value, builtin_types=(bytes,))


# ---------------------------------------------------------------------- running requests


async def start(engine: AsyncEngine, reqs: list[GenerateReq]) -> list[AsyncIterator[RequestOutput]]:
    """Submit requests and wait for each one's first chunk, so that refusals (bad prompt,
    context overflow, overload) become HTTP errors before any response is started."""
    streams = [engine.stream(req) for req in reqs]
    try:
        firsts = [await anext_or_raise(s) for s in streams]
    except BaseException:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise
    return [_prepend(first, s) for first, s in zip(firsts, streams, strict=True)]


async def anext_or_raise(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        return await stream.__anext__()
    except RequestError as exc:
        raise (overloaded(str(exc)) if exc.code == 503 else APIError(exc.code, str(exc))) from exc
    except EngineDeadError as exc:
        raise APIError(503, f"the engine is not available: {exc}") from exc
    except StopAsyncIteration as exc:
        raise APIError(500, "the engine ended a request without output") from exc


async def _prepend(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    try:
        yield first
        if first.finish is None:
            async for chunk in rest:
                yield chunk
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def merged(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Chunks of several choices as they arrive, tagged with their choice index."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk))
        except BaseException as exc:
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def collect(streams: list[AsyncIterator[RequestOutput]]) -> list[list[RequestOutput]]:
    """Every chunk of every choice, for a non-streaming response."""
    chunks: list[list[RequestOutput]] = [[] for _ in streams]
    async for index, chunk in merged(streams):
        chunks[index].append(chunk)
    return chunks


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work` unless the client goes away first; then cancel it (which aborts the
    engine requests it holds) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    finally:
        watcher.cancel()


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class Timing:
    """Per-request latency figures for the metrics."""

    started: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)

    def token(self) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now

    @property
    def ttft(self) -> float:
        return (self.first or time.monotonic()) - self.started

    @property
    def e2e(self) -> float:
        return time.monotonic() - self.started


def log_exchange(state: ServerState, rid: str, kind: str, payload: Any) -> None:
    """Prompts and outputs are user data: logged only with --log-requests."""
    if state.args.log_requests:
        log.info("%s %s: %s", rid, kind, payload)


def observe_finished(state: ServerState, pieces: list[RequestOutput], timing: Timing) -> None:
    """Record one finished choice in the server metrics."""
    last = pieces[-1]
    state.metrics.observe_finished(
        prompt_tokens=last.usage.prompt_tokens,
        completion_tokens=last.usage.completion_tokens,
        cached_tokens=last.usage.cached_tokens,
        ttft_s=timing.ttft,
        itl_s=timing.gaps,
        e2e_s=timing.e2e,
        finish_reason=last.finish.reason if last.finish else "unknown",
    )
    state.metrics.count_tokens(last.usage.completion_tokens)
