"""A request's output stream: what queued up while its consumer was busy comes out as one
output (text, ids and logprobs joined; the last usage and finish), and an error queued behind
outputs still ends the stream after them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from m3serve.engine.errors import EngineDeadError
from m3serve.engine.plumbing import RequestPlumbing, merge_outputs
from m3serve.engine.workers import TokenizerWorkers
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import (
    Finish,
    GenerateReq,
    RequestOutput,
    SamplingParams,
    TextBatch,
    TokenLogprob,
    Usage,
)


class Sent:
    def __init__(self) -> None:
        self.msgs: list[Any] = []

    async def send(self, msg: Any) -> None:
        self.msgs.append(msg)


def plumbing() -> tuple[RequestPlumbing, Sent]:
    engine = RequestPlumbing(ServerArgs())
    outbox = Sent()
    engine.workers = TokenizerWorkers([outbox])  # type: ignore[list-item]
    engine.healthy = True
    return engine, outbox


def output(text: str, ids: list[int], done: int, finish: Finish | None = None) -> RequestOutput:
    logprobs = [TokenLogprob(i, -0.5, []) for i in ids]
    return RequestOutput("r", text, ids, finish, Usage(3, done, 0), logprobs)


def request() -> GenerateReq:
    return GenerateReq(rid="r", prompt="hi", sampling=SamplingParams(max_new_tokens=8))


async def test_outputs_queued_while_the_consumer_was_busy_come_out_as_one() -> None:
    engine, _ = plumbing()
    stream = engine.stream(request())
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # the request is sent; its stream waits
    engine._deliver(TextBatch([output("a", [1], 1)]))
    assert (await first).text == "a"
    # Three steps' outputs arrive before the consumer asks again.
    engine._deliver(TextBatch([output("b", [2], 2)]))
    engine._deliver(TextBatch([output("c", [3], 3)]))
    engine._deliver(TextBatch([output("d", [4], 4, Finish("stop"))]))
    merged = await anext(stream)
    assert (merged.text, merged.output_ids) == ("bcd", [2, 3, 4])
    assert [lp.token_id for lp in merged.logprobs] == [2, 3, 4]
    assert merged.usage.completion_tokens == 4 and merged.finish == Finish("stop")
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_an_error_queued_after_outputs_is_raised_after_them() -> None:
    engine, _ = plumbing()
    stream = engine.stream(request())
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    engine._deliver(TextBatch([output("a", [1], 1), output("b", [2], 2)]))
    engine._fail_all(EngineDeadError("the engine died"))
    assert (await first).text == "ab"
    with pytest.raises(EngineDeadError, match="died"):
        await anext(stream)


def test_merge_keeps_the_request_and_joins_in_order() -> None:
    merged = merge_outputs(output("x", [7], 1), output("yz", [8, 9], 3))
    assert (merged.rid, merged.text, merged.output_ids, merged.finish) == (
        "r",
        "xyz",
        [7, 8, 9],
        None,
    )
    assert merged.usage == Usage(3, 3, 0)
