"""API-layer overhead: streamed chat completions through `m3serve serve` vs a bare SSE echo app.

Both servers run in their own subprocess on uvicorn (uvloop, h11), as `m3serve serve` does. The
m3serve side serves the built-in tiny model (multi-process engine) and every request is a
streamed chat completion with `max_tokens` tokens at temperature 0 with `ignore_eos`, so every
stream has the same chunks. The echo side is a Starlette app with no engine that answers the
same POST with the same number of SSE chunks of about the same size, each JSON-encoded on the
fly: the ceiling for an SSE server on this machine. Load comes from httpx.AsyncClient (uvloop)
in this process at each concurrency level (the echo server gets ECHO_FACTOR times the requests,
as it finishes them ~100x sooner).

Columns: requests/s and streamed chunks/s of each server, `ratio` = echo req/s / m3serve req/s
(how many times slower than the bare SSE server; on a CPU box mostly the tiny model's decode),
and the CPU the API process itself burns per request — m3serve's uvicorn process (engine and
tokenizer processes excluded) next to the echo process — with its share of all m3serve CPU.
That last pair is the API layer's own cost, independent of the model.

    python perf/bench_api.py [--requests 64] [--max-tokens 32] [--out perf/results/bench_api.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import server_process
import uvloop
from server_process import Served, free_port

CONCURRENCY = (1, 16, 64)
WARMUP_REQUESTS = 4
# The echo server is ~100x faster: it runs this many times the requests, for a stable rate.
ECHO_FACTOR = 8
PROMPT = [{"role": "user", "content": "Stream a short answer about sparse attention."}]


# ---------------------------------------------------------------------- the echo server


def echo_app(chunks: int, chunk_bytes: int) -> Any:
    """Starlette app: POST /v1/chat/completions streams `chunks` chat.completion.chunk events of
    about `chunk_bytes` bytes each, then [DONE]; GET /health answers 200."""
    import orjson
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    head = {
        "id": "chatcmpl-" + "0" * 32,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "echo",
    }
    empty = len(orjson.dumps({**head, "choices": [_choice("")]})) + len(b"data: \n\n")
    text = "x" * max(1, chunk_bytes - empty)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())  # parse the request, as a real server must
        assert body["stream"] is True

        async def events() -> Any:
            for i in range(chunks):
                reason = "length" if i == chunks - 1 else None
                choice = _choice(text, reason)
                yield b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _choice(text: str, reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}


def serve_echo(port: int, chunks: int, chunk_bytes: int) -> None:
    import uvicorn

    config = uvicorn.Config(
        echo_app(chunks, chunk_bytes),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="h11",
        lifespan="off",
        log_level="warning",
        access_log=False,
    )
    uvicorn.Server(config).run()


# ---------------------------------------------------------------------- server processes


def start_m3serve(model_path: str | None) -> Served:
    return server_process.start_m3serve(["--model-path", model_path] if model_path else [])


def start_echo(chunks: int, chunk_bytes: int) -> Served:
    port = free_port()
    command = [sys.executable, __file__, "--serve-echo", str(port), str(chunks), str(chunk_bytes)]
    return server_process.start("echo", command, port)


# ---------------------------------------------------------------------- load


def request_body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def one_stream(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, int, float]:
    """(data chunks before [DONE], bytes, seconds) of one streamed request."""
    started = time.perf_counter()
    parts = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for part in response.aiter_raw():
            parts.append(part)
    raw = b"".join(parts)
    if not raw.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"stream did not end with [DONE]: {raw[-200:]!r}")
    return raw.count(b"data: ") - 1, len(raw), time.perf_counter() - started


async def load(served: Served, concurrency: int, requests: int, body: dict[str, Any]) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=served.url, limits=limits, timeout=300.0) as http:
        await asyncio.gather(*(one_stream(http, body) for _ in range(WARMUP_REQUESTS)))
        results: list[tuple[int, int, float]] = []
        remaining = requests

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                results.append(await one_stream(http, body))

        api_cpu, total_cpu = served.api_cpu_s(), served.total_cpu_s()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
        api_cpu, total_cpu = served.api_cpu_s() - api_cpu, served.total_cpu_s() - total_cpu
    chunks = sum(r[0] for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "req_per_s": len(results) / wall,
        "chunks_per_s": chunks / wall,
        "chunks_per_request": chunks / len(results),
        "bytes_per_chunk": sum(r[1] for r in results) / max(1, chunks),
        "latency_p50_s": statistics.median(r[2] for r in results),
        "api_cpu_ms_per_request": 1e3 * api_cpu / len(results),
        "api_cpu_share": api_cpu / total_cpu if total_cpu > 0 else 0.0,
    }


async def calibrate(served: Served, body: dict[str, Any]) -> tuple[int, int]:
    """(chunks per stream, mean bytes per chunk) of m3serve's stream, for the echo app."""
    async with httpx.AsyncClient(base_url=served.url, timeout=300.0) as http:
        chunks, size, _ = await one_stream(http, body)
    return chunks, round((size - len(b"data: [DONE]\n\n")) / chunks)


# ---------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model-path", default=None, help="default: the built-in tiny model")
    parser.add_argument("--out", type=Path, default=Path("perf/results/bench_api.json"))
    parser.add_argument("--serve-echo", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_echo:
        serve_echo(*args.serve_echo)
        return

    body = request_body(args.max_tokens)
    m3 = start_m3serve(args.model_path)
    echo = None
    try:
        chunks, chunk_bytes = uvloop.run(calibrate(m3, body))
        echo = start_echo(chunks, chunk_bytes)
        rows = []
        for concurrency in CONCURRENCY:
            requests = max(args.requests, concurrency)
            ours = uvloop.run(load(m3, concurrency, requests, body))
            bare = uvloop.run(load(echo, concurrency, requests * ECHO_FACTOR, body))
            rows.append(
                {
                    "concurrency": concurrency,
                    "m3serve": ours,
                    "echo": bare,
                    "ratio": bare["req_per_s"] / ours["req_per_s"],
                }
            )
    finally:
        m3.stop()
        if echo is not None:
            echo.stop()

    print(
        f"streamed chat completions, {args.max_tokens} tokens, tiny model on {platform.machine()} "
        f"({os.cpu_count()} cpus); echo: {chunks} chunks of ~{chunk_bytes} B"
    )
    print(
        f"{'conc':>4} {'req/s':>8} {'chunks/s':>9} {'echo req/s':>10} {'echo chunks/s':>13} "
        f"{'ratio':>6} {'api ms/req':>10} {'echo ms/req':>11} {'api share':>9}"
    )
    for r in rows:
        ours, bare = r["m3serve"], r["echo"]
        print(
            f"{r['concurrency']:4d} {ours['req_per_s']:8.1f} {ours['chunks_per_s']:9.0f} "
            f"{bare['req_per_s']:10.1f} {bare['chunks_per_s']:13.0f} {r['ratio']:6.1f} "
            f"{ours['api_cpu_ms_per_request']:10.2f} {bare['api_cpu_ms_per_request']:11.2f} "
            f"{ours['api_cpu_share']:9.0%}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "bench_api",
        "command": (
            f"python perf/bench_api.py --requests {args.requests} --max-tokens {args.max_tokens}"
        ),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "echo_chunks": chunks,
        "echo_chunk_bytes": chunk_bytes,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
