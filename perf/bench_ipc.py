"""IPC cost of one engine step's TokenBatch: the ZeroMQ mailbox vs pickle over multiprocessing.Pipe.

Two processes, the same message, one run. Latency: ping-pong round trips (the peer decodes and
re-encodes each message), p50/p99. Throughput: a one-way stream of N messages that the peer
decodes, timed until the peer acknowledges the last. The mailbox runs once on the stock asyncio
loop and once on uvloop (what the API process uses); a row on blocking zmq sockets with the same
codec shows what the event-loop integration costs. Also the in-process encode+decode time of each
serializer, and bytes per message. Prints a table and writes JSON.

    python perf/bench_ipc.py [--messages N] [--batch 64] [--out perf/results/bench_ipc.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import pickle
import platform
import tempfile
import time
from collections.abc import Callable, Coroutine
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import uvloop
import zmq

from m3serve.runtime.codec import Codec
from m3serve.runtime.messages import Abort, Finish, Shutdown, TokenBatch, ToTokenizer
from m3serve.runtime.transport import SyncZmqOutbox, ZmqInbox, ZmqOutbox, ipc_address

WARMUP = 200
# Latency needs far fewer samples than throughput for a stable p99.
MAX_ROUND_TRIPS = 5000


def token_batch(batch: int) -> TokenBatch:
    """One decode step for `batch` requests: one new id each, one of them finishing."""
    return TokenBatch(
        rids=[f"chatcmpl-{i:08x}" for i in range(batch)],
        new_ids=[[1000 + i] for i in range(batch)],
        finish=[None] * (batch - 1) + [Finish("stop", 2)],
        cached_tokens=[256 + 3 * i for i in range(batch)],
    )


def stream_count(msg: Any) -> int | None:
    """The peer protocol: Abort("stream:N") announces N one-way messages to acknowledge."""
    if isinstance(msg, Abort) and msg.rid.startswith("stream:"):
        return int(msg.rid.removeprefix("stream:"))
    return None


# ---------------------------------------------------------------- ZeroMQ mailbox


async def zmq_peer_loop(inbox_address: str, outbox_address: str) -> None:
    codec: Codec[ToTokenizer] = Codec(ToTokenizer)
    inbox, outbox = ZmqInbox(inbox_address, codec), ZmqOutbox(outbox_address, codec)
    try:
        while not isinstance(msg := await inbox.recv(), Shutdown):
            count = stream_count(msg)
            if count is None:
                await outbox.send(msg)
                continue
            for _ in range(count):
                await inbox.recv()
            await outbox.send(Abort("done"))
    finally:
        inbox.close()
        outbox.close()


def zmq_peer(inbox_address: str, outbox_address: str, use_uvloop: bool) -> None:
    run_on_loop(zmq_peer_loop(inbox_address, outbox_address), use_uvloop)


def run_on_loop(coro: Coroutine[Any, Any, Any], use_uvloop: bool) -> Any:
    if use_uvloop:
        return uvloop.run(coro)
    return asyncio.run(coro)


async def zmq_measure(
    run_dir: Path, msg: TokenBatch, round_trips: int, stream: int, use_uvloop: bool
) -> tuple[np.ndarray, float]:
    here, there = ipc_address(run_dir, "bench-here"), ipc_address(run_dir, "bench-there")
    codec: Codec[ToTokenizer] = Codec(ToTokenizer)
    inbox = ZmqInbox(here, codec)
    peer = spawn(zmq_peer, there, here, use_uvloop)
    outbox = ZmqOutbox(there, codec)
    try:

        async def round_trip() -> None:
            await outbox.send(msg)
            await inbox.recv()

        for _ in range(WARMUP):
            await round_trip()
        latencies = await time_each(round_trip, round_trips)
        started = time.perf_counter()
        await outbox.send(Abort(f"stream:{stream}"))
        for _ in range(stream):
            await outbox.send(msg)
        await inbox.recv()
        elapsed = time.perf_counter() - started
        await outbox.send(Shutdown())
        peer.join(timeout=30)
    finally:
        outbox.close()
        inbox.close()
    return latencies, elapsed


async def time_each(fn: Callable[[], Coroutine[Any, Any, None]], count: int) -> np.ndarray:
    out = np.empty(count)
    for i in range(count):
        started = time.perf_counter_ns()
        await fn()
        out[i] = time.perf_counter_ns() - started
    return out / 1e3


# ---------------------------------------------------------------- blocking: Pipe and plain zmq


def serve_blocking(recv: Callable[[], Any], send: Callable[[Any], None]) -> None:
    """The peer protocol on blocking calls (the mailbox peer above, without an event loop)."""
    while not isinstance(msg := recv(), Shutdown):
        count = stream_count(msg)
        if count is None:
            send(msg)
            continue
        for _ in range(count):
            recv()
        send(Abort("done"))


def measure_blocking(
    recv: Callable[[], Any],
    send: Callable[[Any], None],
    msg: TokenBatch,
    round_trips: int,
    stream: int,
) -> tuple[np.ndarray, float]:
    for _ in range(WARMUP):
        send(msg)
        recv()
    latencies = np.empty(round_trips)
    for i in range(round_trips):
        started = time.perf_counter_ns()
        send(msg)
        recv()
        latencies[i] = time.perf_counter_ns() - started
    started = time.perf_counter()
    send(Abort(f"stream:{stream}"))
    for _ in range(stream):
        send(msg)
    recv()
    elapsed = time.perf_counter() - started
    send(Shutdown())
    return latencies / 1e3, elapsed


def pipe_peer(conn: Connection) -> None:
    serve_blocking(conn.recv, conn.send)


def pipe_measure(msg: TokenBatch, round_trips: int, stream: int) -> tuple[np.ndarray, float]:
    conn, peer_conn = multiprocessing.Pipe()
    peer = spawn(pipe_peer, peer_conn)
    result = measure_blocking(conn.recv, conn.send, msg, round_trips, stream)
    peer.join(timeout=30)
    return result


class BlockingZmqEnds:
    """A plain PULL socket plus a SyncZmqOutbox: the mailbox's sockets and codec, no asyncio."""

    def __init__(self, inbox_address: str, outbox_address: str) -> None:
        self.codec: Codec[ToTokenizer] = Codec(ToTokenizer)
        self.pull = zmq.Context.instance().socket(zmq.PULL)
        self.pull.bind(inbox_address)
        self.outbox = SyncZmqOutbox(outbox_address, self.codec)

    def recv(self) -> Any:
        frames = self.pull.recv_multipart(copy=False)
        return self.codec.decode([frame.buffer for frame in frames])

    def close(self) -> None:
        self.outbox.close()
        self.pull.close(linger=0)


def sync_zmq_peer(inbox_address: str, outbox_address: str) -> None:
    ends = BlockingZmqEnds(inbox_address, outbox_address)
    try:
        serve_blocking(ends.recv, ends.outbox.send_nowait)
    finally:
        ends.close()


def sync_zmq_measure(
    run_dir: Path, msg: TokenBatch, round_trips: int, stream: int
) -> tuple[np.ndarray, float]:
    here, there = ipc_address(run_dir, "sync-here"), ipc_address(run_dir, "sync-there")
    ends = BlockingZmqEnds(here, there)
    peer = spawn(sync_zmq_peer, there, here)
    try:
        result = measure_blocking(ends.recv, ends.outbox.send_nowait, msg, round_trips, stream)
        peer.join(timeout=30)
    finally:
        ends.close()
    return result


# ---------------------------------------------------------------- in-process serializer cost


def serializer_us(encode: Callable[[], Any], decode: Callable[[], Any], repeats: int) -> float:
    """Mean µs of one encode plus one decode of the message, best of three batches."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            encode()
            decode()
        best = min(best, time.perf_counter() - started)
    return best / repeats * 1e6


def codec_costs(msg: TokenBatch, repeats: int) -> dict[str, tuple[float, int]]:
    codec: Codec[ToTokenizer] = Codec(ToTokenizer)
    frames = codec.encode(msg)
    pickled = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return {
        "msgspec": (
            serializer_us(lambda: codec.encode(msg), lambda: codec.decode(frames), repeats),
            sum(len(memoryview(frame)) for frame in frames),
        ),
        "pickle": (
            serializer_us(
                lambda: pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL),
                lambda: pickle.loads(pickled),
                repeats,
            ),
            len(pickled),
        ),
    }


# ---------------------------------------------------------------- driver


def spawn(target: Callable[..., None], *args: Any) -> BaseProcess:
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def row(name: str, serializer: str, latencies: np.ndarray, stream: int, elapsed: float) -> dict:
    return {
        "transport": name,
        "serializer": serializer,
        "round_trips": latencies.size,
        "p50_us": float(np.percentile(latencies, 50)),
        "p99_us": float(np.percentile(latencies, 99)),
        "stream_messages": stream,
        "msgs_per_s": stream / elapsed,
    }


def measure_all(msg: TokenBatch, messages: int) -> list[dict]:
    round_trips = min(messages, MAX_ROUND_TRIPS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="m3s-bench-") as run_dir:
        for use_uvloop in (False, True):
            loop = "uvloop" if use_uvloop else "asyncio"
            lat, elapsed = run_on_loop(
                zmq_measure(Path(run_dir), msg, round_trips, messages, use_uvloop), use_uvloop
            )
            rows.append(row(f"zmq mailbox ({loop})", "msgspec", lat, messages, elapsed))
        lat, elapsed = sync_zmq_measure(Path(run_dir), msg, round_trips, messages)
        rows.append(row("zmq, blocking sockets", "msgspec", lat, messages, elapsed))
    lat, elapsed = pipe_measure(msg, round_trips, messages)
    rows.append(row("multiprocessing.Pipe", "pickle", lat, messages, elapsed))
    return rows


def print_table(rows: list[dict], costs: dict[str, tuple[float, int]], batch: int) -> None:
    print(f"TokenBatch of {batch} requests, 2 processes, {os.cpu_count()} CPUs")
    print(f"{'transport':24} {'serializer':10} {'p50 µs':>8} {'p99 µs':>8} {'msgs/s':>10}")
    for r in rows:
        print(
            f"{r['transport']:24} {r['serializer']:10} {r['p50_us']:8.1f} {r['p99_us']:8.1f} "
            f"{r['msgs_per_s']:10.0f}"
        )
    by_name = {r["transport"]: r for r in rows}
    pipe, best = by_name["multiprocessing.Pipe"], by_name["zmq mailbox (uvloop)"]
    print(
        f"zmq mailbox (uvloop) vs Pipe: p50 latency {pipe['p50_us'] / best['p50_us']:.2f}x, "
        f"throughput {best['msgs_per_s'] / pipe['msgs_per_s']:.2f}x (>1: mailbox better)"
    )
    for name, (us, size) in costs.items():
        print(f"{name:8} encode+decode {us:6.1f} µs, {size} bytes per message")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000, help="one-way stream length")
    parser.add_argument("--batch", type=int, default=64, help="requests per TokenBatch")
    parser.add_argument("--out", type=Path, default=Path("perf/results/bench_ipc.json"))
    args = parser.parse_args()
    msg = token_batch(args.batch)
    costs = codec_costs(msg, repeats=2000)
    rows = measure_all(msg, args.messages)
    print_table(rows, costs, args.batch)
    report = {
        "benchmark": "bench_ipc",
        "command": f"python perf/bench_ipc.py --messages {args.messages} --batch {args.batch}",
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "batch": args.batch,
        "serializers": {
            name: {"encode_decode_us": us, "bytes": size} for name, (us, size) in costs.items()
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
