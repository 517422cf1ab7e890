"""Fuzzing a real `m3serve serve` over HTTP: schemathesis cases from the server's /openapi.json
(schema-valid bodies, which reach generation, and invalid ones) plus hypothesis-made chat and
completion bodies (fuzz_bodies.py), sent by concurrent clients while the cases of the next
batch are generated. Every status is counted (an error event inside a 200 stream counts as the
5xx it stands for), and the RSS of every server process (API, tokenizer workers, engine) is
sampled against its idle size.

It passes with 0 x 5xx, no request timed out or lost its connection, the server healthy at the
end, and every process's peak RSS within 2x its idle RSS. Prints a table, writes JSON
(perf/results/fuzz_server.json) and exits 1 if it did not pass.

    python perf/fuzz_server.py --requests 20000            # the long run
    python perf/fuzz_server.py --requests 300 --workers 0  # the short one tests/e2e runs
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import json
import math
import multiprocessing
import re
import shlex
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fuzz_bodies import BODIES, clamp  # perf/ is on sys.path when run by path
from hypothesis import HealthCheck, Phase, given, seed, settings
from server_process import Served, descendants, free_port, start

RSS_LIMIT = 2.0  # peak / idle, per process
REQUEST_TIMEOUT_S = 120.0
SAMPLE_EVERY_S = 0.25
ROUND = 1000  # cases per round of the plan below
KEPT_FAILURES = 20
KEPT_BODY_CHARS = 20_000  # enough to replay a failing request
# Below uvicorn's keep-alive (5 s): the client drops an idle connection before the server
# closes it, so a request never races a server-side close (a ReadError that is no bug).
KEEPALIVE_S = 2.0
# (source, method, path, mode, share of each round)
PLAN = [
    ("schemathesis", "POST", "/v1/chat/completions", "positive", 0.03),
    ("schemathesis", "POST", "/v1/chat/completions", "negative", 0.02),
    ("schemathesis", "POST", "/v1/completions", "positive", 0.08),
    ("schemathesis", "POST", "/v1/completions", "negative", 0.05),
    ("schemathesis", "POST", "/v1/tokenize", "positive", 0.03),
    ("schemathesis", "POST", "/v1/tokenize", "negative", 0.02),
    ("schemathesis", "POST", "/v1/detokenize", "positive", 0.03),
    ("schemathesis", "POST", "/v1/detokenize", "negative", 0.02),
    ("hypothesis", "POST", "/v1/chat/completions", "bodies", 0.40),
    ("hypothesis", "POST", "/v1/completions", "bodies", 0.30),
    ("fixed", "GET", "/health", "get", 0.005),
    ("fixed", "GET", "/v1/models", "get", 0.005),
    ("fixed", "GET", "/metrics", "get", 0.005),
    ("fixed", "GET", "/openapi.json", "get", 0.005),
]
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
WARM_UP = [
    ("POST", "/v1/chat/completions", HI),
    ("POST", "/v1/chat/completions", {**HI, "stream": True}),
    ("POST", "/v1/completions", {"prompt": "Hello", "n": 2, "max_tokens": 8}),
    ("POST", "/v1/tokenize", {"prompt": "Hello"}),
    ("POST", "/v1/detokenize", {"tokens": [1, 2, 3]}),
    ("GET", "/metrics", None),
]


@dataclass(frozen=True)
class Chunk:
    """A batch of cases to generate: `count` of one kind, from its own seed."""

    source: str
    method: str
    path: str
    mode: str
    count: int
    seed: int

    @property
    def kind(self) -> str:
        return f"{self.source} {self.method} {self.path} {self.mode}"


@dataclass(frozen=True)
class Request:
    kind: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None


def chunks(size: int) -> Iterator[Chunk]:
    """The plan, round after round of `size` cases, each chunk with a fresh seed."""
    for round_ in range(1_000_000):
        for i, (source, method, path, mode, share) in enumerate(PLAN):
            count = max(1, math.ceil(share * size))
            yield Chunk(source, method, path, mode, count, round_ * len(PLAN) + i)


# ---------------------------------------------------------------------- generating cases


@functools.lru_cache(maxsize=1)
def _schema(document: str) -> Any:
    import schemathesis

    return schemathesis.openapi.from_dict(json.loads(document))


def generate(chunk: Chunk, document: str) -> list[Request]:
    """The requests of one chunk (run in a worker process, or a thread with --workers 0)."""
    if chunk.source == "fixed":
        return [Request(chunk.kind, chunk.method, chunk.path, {}, None)] * chunk.count
    made: list[Request] = []
    strategy = BODIES[chunk.path] if chunk.source == "hypothesis" else _cases(chunk, document)

    @seed(chunk.seed)
    @settings(
        max_examples=chunk.count,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw(value: Any) -> None:
        made.append(_request(chunk, value))

    try:
        draw()
    except Exception as exc:  # e.g. hypothesis ran out of distinct inputs: keep what it made
        print(f"{chunk.kind}: generation stopped early: {type(exc).__name__}", file=sys.stderr)
    return made


def _cases(chunk: Chunk, document: str) -> Any:
    from schemathesis.generation import GenerationMode

    operation = _schema(document)[chunk.path][chunk.method]
    return operation.as_strategy(GenerationMode(chunk.mode))


def _request(chunk: Chunk, value: Any) -> Request:
    if chunk.source == "hypothesis":
        clamp(chunk.path, value)
        return Request(
            chunk.kind,
            chunk.method,
            chunk.path,
            {"content-type": "application/json"},
            json.dumps(value).encode(),
        )
    clamp(chunk.path, value.body)
    sent = value.as_transport_kwargs(base_url="")
    headers = {k: str(v) for k, v in sent.get("headers", {}).items() if not _own_header(k)}
    body = json.dumps(sent["json"]).encode() if "json" in sent else sent.get("data")
    if isinstance(body, str):
        body = body.encode()
    return Request(chunk.kind, chunk.method, chunk.path, headers, body)


def _own_header(name: str) -> bool:
    return name.lower() in {"user-agent", "x-schemathesis-testcaseid", "connection"}


# ---------------------------------------------------------------------- the server's processes


@dataclass
class Rss:
    idle_mb: float = 0.0
    peak_mb: float = 0.0
    trace_mb: list[float] = field(default_factory=list)  # at every tenth of the run

    @property
    def ratio(self) -> float:
        return self.peak_mb / self.idle_mb if self.idle_mb else math.inf


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def processes(served: Served) -> dict[str, int]:
    """Name -> pid of the server and every process below it (names from the supervisor's log
    lines; others by what they run)."""
    named: dict[int, str] = {served.proc.pid: "api"}
    for line in served.log_tail(1 << 30).splitlines():
        if "m3serve.runtime.supervisor: started " in line:
            name, _, pid = line.split("started ", 1)[1].partition(" (pid ")
            named[int(pid.rstrip(")"))] = name
    found = {}
    for pid in [served.proc.pid, *descendants(served.proc.pid)]:
        name = named.get(pid)
        if name is None:
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                name = "resource_tracker" if b"resource_tracker" in cmdline else f"pid{pid}"
        if name is None:
            continue  # gone meanwhile
        found[name] = pid
    return found


async def sample_rss(
    pids: dict[str, int], rss: dict[str, Rss], results: Results, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        for name, pid in pids.items():
            now = rss_mb(pid)
            if now is not None:
                rss[name].peak_mb = max(rss[name].peak_mb, now)
                if len(rss[name].trace_mb) < results.tenths:
                    rss[name].trace_mb.append(round(now, 1))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)


# ---------------------------------------------------------------------- sending


@dataclass
class Results:
    requests: int = 0
    status: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    inband_5xx: int = 0
    tenths: int = 0  # tenths of the run done, for the RSS trace
    refusals: Counter[str] = field(default_factory=Counter)  # 4xx messages, digits masked
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for code, n in self.status.items() if code.startswith("5")) + self.inband_5xx

    @property
    def lost(self) -> int:
        return sum(n for code, n in self.status.items() if not code.isdigit())

    def record(self, request: Request, status: str, response: bytes) -> None:
        self.requests += 1
        self.status[status] += 1
        self.by_kind.setdefault(request.kind, Counter())[status] += 1
        inband = status == "200" and _inband_server_error(response)
        if status.startswith("4"):
            self.refusals[_refusal(response)] += 1
        self.inband_5xx += inband
        if (status.startswith("5") or inband or not status.isdigit()) and (
            len(self.failures) < KEPT_FAILURES
        ):
            self.failures.append(
                {
                    "kind": request.kind,
                    "status": status,
                    "inband": inband,
                    "body": (request.body or b"")[:KEPT_BODY_CHARS].decode(errors="replace"),
                    "response": response[-600:].decode(errors="replace"),
                }
            )


def _refusal(response: bytes) -> str:
    try:
        message = str(json.loads(response)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response[:60].decode(errors="replace")
    return re.sub(r"[0-9]+", "N", message)[:70]


def _inband_server_error(response: bytes) -> bool:
    """An SSE error event with a 5xx code: the status a stream could not send any more."""
    for line in response.split(b"\n"):
        if line.startswith(b'data: {"error"'):
            code = json.loads(line[6:])["error"].get("code")
            if isinstance(code, int) and code >= 500:
                return True
    return False


async def send(http: httpx.AsyncClient, request: Request) -> tuple[str, bytes]:
    try:
        response = await http.request(
            request.method, request.path, content=request.body, headers=request.headers
        )
    except httpx.TimeoutException:
        return "timeout", b""
    except httpx.TransportError as exc:
        return f"transport:{type(exc).__name__}", b""
    return str(response.status_code), response.content


async def produce(
    queue: asyncio.Queue[Request | None], total: int, workers: int, document: str, consumers: int
) -> None:
    """Generate chunk after chunk (the next ones while the current is sent) until `total`."""
    loop = asyncio.get_running_loop()
    pool = (
        concurrent.futures.ProcessPoolExecutor(workers, multiprocessing.get_context("fork"))
        if workers
        else None
    )
    plan = chunks(min(ROUND, total))  # a short run still gets every kind of case
    pending: deque[asyncio.Future[list[Request]]] = deque()
    produced = 0
    try:
        while produced < total:
            while len(pending) < max(workers, 1) + 1:
                pending.append(loop.run_in_executor(pool, generate, next(plan), document))
            for request in await pending.popleft():
                if produced == total:
                    break
                await queue.put(request)
                produced += 1
    finally:
        for future in pending:
            future.cancel()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for _ in range(consumers):
            await queue.put(None)


async def consume(
    http: httpx.AsyncClient, queue: asyncio.Queue[Request | None], results: Results, total: int
) -> None:
    while (request := await queue.get()) is not None:
        status, body = await send(http, request)
        results.record(request, status, body)
        if results.requests % max(total // 10, 1) == 0:
            results.tenths += 1
            print(
                f"{results.requests}/{total} requests, {results.server_errors} x 5xx",
                file=sys.stderr,
                flush=True,
            )


async def fuzz(served: Served, args: argparse.Namespace) -> dict[str, Any]:
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    limits = httpx.Limits(max_connections=args.concurrency, keepalive_expiry=KEEPALIVE_S)
    async with httpx.AsyncClient(base_url=served.url, timeout=timeout, limits=limits) as http:
        document = (await http.get("/openapi.json")).text
        for method, path, body in WARM_UP:  # lazy imports and first allocations count as idle
            response = await http.request(method, path, json=body)
            assert response.status_code == 200, (path, response.text)
        await asyncio.sleep(1.0)
        pids = processes(served)
        rss = {name: Rss(idle_mb=rss_mb(pid) or 0.0) for name, pid in pids.items()}
        stop = asyncio.Event()
        results = Results()
        sampler = asyncio.create_task(sample_rss(pids, rss, results, stop))
        queue: asyncio.Queue[Request | None] = asyncio.Queue(maxsize=4 * ROUND)
        started = time.monotonic()
        await asyncio.gather(
            produce(queue, args.requests, args.workers, document, args.concurrency),
            *(consume(http, queue, results, args.requests) for _ in range(args.concurrency)),
        )
        seconds = time.monotonic() - started
        health = (await http.get("/health")).status_code
        stop.set()
        await sampler
    alive = served.proc.poll() is None and health == 200
    within = all(r.ratio <= RSS_LIMIT for r in rss.values())
    return {
        "requests": results.requests,
        "seconds": round(seconds, 1),
        "requests_per_s": round(results.requests / seconds, 1),
        "concurrency": args.concurrency,
        "server_args": args.server_args,
        "status": dict(sorted(results.status.items())),
        "server_errors_5xx": results.server_errors,
        "inband_5xx": results.inband_5xx,
        "lost": results.lost,
        "top_refusals": dict(results.refusals.most_common(15)),
        "status_by_kind": {k: dict(sorted(v.items())) for k, v in sorted(results.by_kind.items())},
        "rss_mb": {
            name: {
                "idle": round(r.idle_mb, 1),
                "peak": round(r.peak_mb, 1),
                "ratio": round(r.ratio, 2),
                "trace": r.trace_mb,
            }
            for name, r in rss.items()
        },
        "alive": alive,
        "passed": results.server_errors == 0 and results.lost == 0 and alive and within,
        "failures": results.failures,
    }


# ---------------------------------------------------------------------- running it


def print_report(report: dict[str, Any]) -> None:
    print(
        f"\n{report['requests']} requests in {report['seconds']}s "
        f"({report['requests_per_s']}/s, concurrency {report['concurrency']})"
    )
    print(f"{'status':<28}{'count':>8}")
    for status, count in report["status"].items():
        print(f"{status:<28}{count:>8}")
    print(f"{'5xx (incl. in-band)':<28}{report['server_errors_5xx']:>8}")
    print(f"\n{'process':<18}{'idle MB':>10}{'peak MB':>10}{'peak/idle':>11}")
    for name, rss in report["rss_mb"].items():
        print(f"{name:<18}{rss['idle']:>10.1f}{rss['peak']:>10.1f}{rss['ratio']:>11.2f}")
    print(f"\nserver alive: {report['alive']}    passed: {report['passed']}")
    for failure in report["failures"][:5]:
        print(
            f"\n{failure['kind']} -> {failure['status']}\n  body: {failure['body'][:300]}"
            f"\n  response: {failure['response'][:300]}"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--workers", type=int, default=2, help="case-generating processes; 0: a thread"
    )
    parser.add_argument("--server-args", default="--tokenizer-worker-num 2")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "fuzz_server.json"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "m3serve",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *shlex.split(args.server_args),
    ]
    served = start("m3serve", command, port)
    try:
        report = asyncio.run(fuzz(served, args))
    finally:
        served.stop()
    report["exit_code"] = served.proc.returncode
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
