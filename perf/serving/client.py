"""One streamed OpenAI request: its body (`Target`), its client-side stamps and the server's
counts (`RequestRecord`), the SSE parser that records them, and `send`, which runs it."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

ERROR_CHARS = 300


@dataclass
class RequestRecord:
    """One request's client-side stamps (time.perf_counter seconds) and the server's counts."""

    start: float
    prompt_text_tokens: int
    scheduled: float | None = None  # open loop: when the Poisson schedule wanted it sent
    chunk_times: list[float] = field(default_factory=list)  # content-bearing chunks only
    done: float | None = None  # [DONE] arrived, or the request failed
    prompt_tokens: int | None = None  # usage.prompt_tokens
    completion_tokens: int | None = None  # usage.completion_tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_text_tokens

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def e2e_done(self) -> float:
        assert self.done is not None
        return self.done - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    def summary(self) -> dict[str, Any]:
        """The per-request row of the JSON (no per-gap list: that would dwarf the rest)."""
        row: dict[str, Any] = {"ok": self.ok}
        if self.ok:
            tpot = self.tpot
            row |= {
                "ttft_ms": 1e3 * self.ttft,
                "e2e_ms": 1e3 * self.e2e,
                "tpot_ms": None if tpot is None else 1e3 * tpot,
                "content_chunks": len(self.chunk_times),
            }
        else:
            row["error"] = self.error
        return row | {
            "prompt_text_tokens": self.prompt_text_tokens,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


class StreamParser:
    """Splits an SSE byte stream into `data:` events and records what each one carries."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.buffer = b""
        self.saw_done = False

    def feed(self, data: bytes, now: float) -> None:
        # SSE allows CRLF line ends. A CR split from its LF by a read stays at the buffer's end
        # (no event can end there yet) and meets the LF on the next read.
        self.buffer = (self.buffer + data).replace(b"\r\n", b"\n")
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            return  # a comment or a keep-alive
        payload = b"\n".join(lines)
        if payload.strip() == b"[DONE]":
            self.saw_done = True
            self.record.done = now
            return
        message = json.loads(payload)
        if not isinstance(message, dict):
            raise ValueError(f"unexpected event {payload[:ERROR_CHARS]!r}")
        if message.get("error"):
            raise RuntimeError(f"error event: {json.dumps(message['error'])[:ERROR_CHARS]}")
        usage = message.get("usage")
        if usage:  # some servers send "usage": null on every chunk
            self.record.prompt_tokens = usage.get("prompt_tokens")
            self.record.completion_tokens = usage.get("completion_tokens")
        if any(_has_output(choice) for choice in message.get("choices") or ()):
            self.record.chunk_times.append(now)


def _has_output(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is None:  # /v1/completions
        return bool(choice.get("text"))
    return bool(
        delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
    )


@dataclass
class Target:
    path: str  # /v1/chat/completions or /v1/completions
    model: str
    output_len: int
    ignore_eos: bool
    extra_body: dict[str, Any]

    def body(self, text: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model}
        if self.path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        body |= {
            "max_tokens": self.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body | self.extra_body


@dataclass
class Prompt:
    text: str
    tokens: int  # by the server's tokenizer, or the approximation


async def send(
    http: httpx.AsyncClient, target: Target, prompt: Prompt, scheduled: float | None = None
) -> RequestRecord:
    body = target.body(prompt.text)
    record = RequestRecord(start=time.perf_counter(), prompt_text_tokens=prompt.tokens)
    record.scheduled = scheduled
    parser = StreamParser(record)
    try:
        async with http.stream("POST", target.path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:ERROR_CHARS]}")
            async for data in response.aiter_bytes():
                parser.feed(data, time.perf_counter())
        if not parser.saw_done:
            raise RuntimeError("the stream ended without [DONE]")
        if not record.chunk_times:
            raise RuntimeError("the stream carried no content")
    except Exception as exc:  # any failure is a failed request: counted, never dropped
        record.error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    if record.done is None or not record.ok:
        record.done = time.perf_counter()
    return record
