"""`Generation`, the life of one HTTP request's engine requests, on a scripted engine: start
(refusals, aborting the choices already submitted), the merged stream, collecting with a client
that hangs up, the metrics of each choice and of the request; then the same over HTTP."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from helpers.scripted_engine import ScriptedEngine
from starlette.requests import Request
from starlette.types import Message

from m3serve.api.errors import APIError
from m3serve.api.generation import ClientGone, Generation
from m3serve.api.state import ServerState
from m3serve.engine.async_engine import EngineDeadError, RequestError
from m3serve.runtime.config import ApiArgs, ServerArgs
from m3serve.runtime.messages import GenerateReq, SamplingParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@dataclass
class Recorder:
    """Duck-types the ServerMetrics calls a Generation makes."""

    finished: list[dict[str, Any]] = field(default_factory=list)
    aborted: int = 0
    tokens: list[int] = field(default_factory=list)

    def observe_finished(self, **figures: Any) -> None:
        self.finished.append(figures)

    def observe_aborted(self) -> None:
        self.aborted += 1

    def count_tokens(self, n: int) -> None:
        self.tokens.append(n)


def state_for(engine: ScriptedEngine) -> tuple[ServerState, Recorder]:
    recorder = Recorder()
    state = ServerState(engine=engine, args=ApiArgs(), metrics=recorder)  # type: ignore[arg-type]
    return state, recorder


def reqs(n: int) -> list[GenerateReq]:
    return [GenerateReq(rid=f"r{i}", sampling=SamplingParams(seed=i)) for i in range(n)]


def ticks(count: int):
    return lambda req: [f"{req.sampling.seed}:{i} " for i in range(count)]


def client(hang_up: asyncio.Event | None = None) -> Request:
    """A request whose client hangs up when `hang_up` is set (never, without one)."""

    async def receive() -> Message:
        await (hang_up or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def refusing_seed(seed: int, exc: Exception, then: list[str]):
    def script(req: GenerateReq) -> list[str]:
        if req.sampling.seed == seed:
            raise exc
        return then

    return script


# ---------------------------------------------------------------------- start


async def test_start_receives_every_first_output_before_returning() -> None:
    engine = ScriptedEngine(ticks(3), "unused")
    state, recorder = state_for(engine)
    generation = await Generation.start(state, "cmpl-1", reqs(3))
    assert [r.rid for r in engine.seen] == ["r0", "r1", "r2"]
    assert [[o.text for o in outputs] for outputs in generation.outputs] == [
        ["0:0 "],
        ["1:0 "],
        ["2:0 "],
    ]
    await generation.close()
    assert sorted(engine.aborted) == ["r0", "r1", "r2"]
    assert recorder.aborted == 1


@pytest.mark.parametrize("refused", [0, 1, 2])
async def test_one_refusal_aborts_every_choice_already_submitted(refused: int) -> None:
    refusal = RequestError("the waiting queue is full", code=503)
    engine = ScriptedEngine(refusing_seed(refused, refusal, ["a", "b", "c"]), "u", delay_s=0.01)
    state, recorder = state_for(engine)
    with pytest.raises(APIError) as caught:
        await Generation.start(state, "cmpl-1", reqs(3))
    assert (caught.value.status, caught.value.headers) == (503, {"Retry-After": "1"})
    assert "queue is full" in caught.value.message
    others = sorted(f"r{i}" for i in range(3) if i != refused)
    assert sorted(engine.aborted) == others
    # A refused request was never under way: it is an error response, not an abort.
    assert (recorder.aborted, recorder.finished) == (0, [])


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (RequestError("prompt is longer than the context", code=400), 400),
        (EngineDeadError("the scheduler process exited"), 503),
    ],
)
async def test_refusals_keep_their_status(exc: Exception, status: int) -> None:
    engine = ScriptedEngine(refusing_seed(1, exc, ["a", "b"]), "unused")
    state, _ = state_for(engine)
    with pytest.raises(APIError) as caught:
        await Generation.start(state, "cmpl-1", reqs(2))
    assert caught.value.status == status
    assert engine.aborted == ["r0"]


# ---------------------------------------------------------------------- stream and metrics


async def test_the_stream_tags_every_output_with_its_choice() -> None:
    engine = ScriptedEngine(ticks(4), "unused", delay_s=0.001)
    state, recorder = state_for(engine)
    generation = await Generation.start(state, "cmpl-1", reqs(3))
    seen: dict[int, list[str]] = {}
    async for index, output in generation.stream():
        seen.setdefault(index, []).append(output.text)
    assert seen == {i: [f"{i}:{k} " for k in range(4)] for i in range(3)}
    assert generation.finished
    await generation.close()
    assert engine.aborted == []
    assert recorder.aborted == 0
    assert recorder.tokens == [4, 4, 4]


@pytest.mark.parametrize("streamed", [True, False])
async def test_timing_is_per_choice(streamed: bool) -> None:
    pieces = 5
    engine = ScriptedEngine(ticks(pieces), "unused", delay_s=0.002)
    state, recorder = state_for(engine)
    generation = await Generation.start(state, "cmpl-1", reqs(3))
    if streamed:
        async for _ in generation.stream():
            pass
    else:
        await generation.collect(client())
    await generation.close()
    assert len(recorder.finished) == 3
    for figures in recorder.finished:
        # Only the gaps within one choice: n choices of p outputs have n * (p - 1) of them.
        assert len(figures["itl_s"]) == pieces - 1
        assert all(gap >= 0.001 for gap in figures["itl_s"])
        assert 0 < figures["ttft_s"] < figures["e2e_s"]
        assert figures["finish_reason"] == "stop"
        assert figures["completion_tokens"] == pieces
    for choice in generation.choices:
        assert len(choice.timing.gaps) == pieces - 1


async def test_a_mid_stream_failure_reaches_the_consumer_and_aborts_the_rest() -> None:
    class FailsAfterFirst(list):
        def __iter__(self):
            yield self[0]
            raise RequestError("the executor failed", code=500)

    def script(req: GenerateReq) -> list[str]:
        return FailsAfterFirst(["x", "y"]) if req.sampling.seed == 0 else ["tick"] * 100

    engine = ScriptedEngine(script, "unused", delay_s=0.005)
    state, recorder = state_for(engine)
    generation = await Generation.start(state, "cmpl-1", reqs(2))
    with pytest.raises(RequestError):
        async for _ in generation.stream():
            pass
    await generation.close()
    assert "r1" in engine.aborted
    assert recorder.aborted == 1


# ---------------------------------------------------------------------- collect and disconnect


async def test_a_client_leaving_mid_collect_aborts_every_choice() -> None:
    engine = ScriptedEngine(ticks(1000), "unused", delay_s=0.005)
    state, recorder = state_for(engine)
    generation = await Generation.start(state, "cmpl-1", reqs(3))
    hang_up = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, hang_up.set)
    with pytest.raises(ClientGone):
        await generation.collect(client(hang_up))
    assert sorted(engine.aborted) == ["r0", "r1", "r2"]
    assert all(0 < len(outputs) < 1000 for outputs in generation.outputs)
    await generation.close()
    assert (recorder.aborted, recorder.finished) == (1, [])


async def test_json_response_is_499_for_a_client_that_left() -> None:
    engine = ScriptedEngine(ticks(1000), "unused", delay_s=0.005)
    state, recorder = state_for(engine)
    generation = await Generation.start(state, "cmpl-1", reqs(2))
    hang_up = asyncio.Event()
    hang_up.set()
    response = await generation.json_response(client(hang_up), lambda outputs: {"choices": []})
    assert response.status_code == 499
    assert sorted(engine.aborted) == ["r0", "r1"]
    assert recorder.aborted == 1


async def test_json_response_renders_the_collected_outputs() -> None:
    engine = ScriptedEngine(ticks(3), "unused")
    state, recorder = state_for(engine)
    generation = await Generation.start(state, "cmpl-1", reqs(2))

    def render(outputs: list[list[Any]]) -> dict[str, Any]:
        return {"choices": ["".join(o.text for o in pieces) for pieces in outputs]}

    response = await generation.json_response(client(), render)
    assert response.status_code == 200
    assert response.body == b'{"choices":["0:0 0:1 0:2 ","1:0 1:1 1:2 "]}'
    assert (recorder.aborted, len(recorder.finished)) == (0, 2)


# ---------------------------------------------------------------------- over HTTP


def itl_count(metrics: str) -> float:
    (value,) = re.findall(r"^m3serve:inter_token_latency_seconds_count (\S+)$", metrics, re.M)
    return float(value)


@pytest.mark.parametrize("stream", [False, True])
async def test_inter_token_latency_counts_only_gaps_within_a_choice(
    serve, model_dir, stream
) -> None:
    pieces = 4
    engine = ScriptedEngine(lambda req: ["tick "] * pieces, str(model_dir), delay_s=0.001)
    async with serve(engine) as s:
        response = await s.post(CHAT, {"messages": MESSAGES, "n": 3, "stream": stream})
        assert response.status_code == 200
        metrics = (await s.client.get("/metrics")).text
    assert itl_count(metrics) == 3 * (pieces - 1)


async def test_a_refused_choice_aborts_its_siblings_over_http(serve, model_dir) -> None:
    refusal = RequestError("the waiting queue is full", code=503)
    engine = ScriptedEngine(refusing_seed(12, refusal, ["a"] * 50), str(model_dir), delay_s=0.01)
    async with serve(engine) as s:
        response = await s.post(CHAT, {"messages": MESSAGES, "n": 3, "seed": 10, "stream": True})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert sorted(engine.aborted) == sorted(r.rid for r in engine.seen[:2])


async def test_a_refused_echo_submits_nothing(serve, model_dir) -> None:
    args = ServerArgs.from_kwargs(skip_tokenizer_init=True)
    engine = ScriptedEngine(lambda req: ["!"], str(model_dir), args=args)
    async with serve(engine) as s:
        response = await s.post(COMPLETIONS, {"prompt": [[1, 2]], "echo": True})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "echo"
    assert engine.seen == []


async def test_hanging_up_on_a_stream_of_n_choices_aborts_them_all(serve, model_dir) -> None:
    engine = ScriptedEngine(lambda req: ["tick "] * 200, str(model_dir), delay_s=0.01)
    async with serve(engine, streaming=True) as s:
        body = {"messages": MESSAGES, "n": 3, "stream": True}
        async with s.client.stream("POST", CHAT, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"content":"tick' in line:
                    break
        for _ in range(200):
            if len(engine.aborted) == 3:
                break
            await asyncio.sleep(0.01)
        assert sorted(engine.aborted) == sorted(r.rid for r in engine.seen)
        metrics = (await s.client.get("/metrics")).text
    assert re.search(r"^m3serve:request_aborted_total 1(\.0)?$", metrics, re.M)
