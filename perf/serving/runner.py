"""Running a benchmark coroutine against a server: the one named by --url, or an `m3serve
serve` started here for the run (perf/server_process.py) and stopped after it."""

from __future__ import annotations

import argparse
import asyncio
import shlex
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

Report = dict[str, Any]


def run_against_server(
    args: argparse.Namespace, bench: Callable[[str], Coroutine[Any, Any, Report]]
) -> tuple[Report, str, bool]:
    """(report, url, started here) of `bench(url)`."""
    if args.url:
        url = args.url.rstrip("/")
        return event_loop_run(bench(url)), url, False
    from server_process import start_m3serve  # perf/ is on sys.path when run by path

    served = start_m3serve(shlex.split(args.server_args))
    try:
        return event_loop_run(bench(served.url)), served.url, True
    finally:
        served.stop()


def event_loop_run(coro: Coroutine[Any, Any, Report]) -> Report:
    try:
        import uvloop
    except ImportError:  # uvloop is faster, not needed
        return asyncio.run(coro)
    return uvloop.run(coro)


async def served_model(http: httpx.AsyncClient) -> str:
    response = await http.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
