"""The engine's load figures reach `/metrics` in both process modes: with actor processes the
engine process writes them into prometheus_client's multiprocess files and the API reads those
files back; single-process, the API renders the scheduler's own registry."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from helpers.metrics_text import samples

from m3serve.api.app import create_app
from m3serve.engine.async_engine import AsyncEngine
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import GenerateReq, SamplingParams

MODES = ["single-process", "multi-process"]
SETTLE_TIMEOUT_S = 10.0
# Long enough to fill several KV pages (the tiny model's page is 4 tokens).
PROMPT = "The engine's gauges should show this request while it runs. " * 3


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert "# TYPE m3serve:num_retractions_total counter" in response.text
    assert "_created" not in response.text
    return samples(response.text)


async def settle(
    http: httpx.AsyncClient, done: Callable[[dict[str, float]], bool]
) -> dict[str, float]:
    """Scrapes until `done` holds (the engine updates its figures after its next step)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not done(figures := await scrape(http)):
        assert time.monotonic() < deadline, f"metrics did not settle: {figures}"
        # A scrape through ASGITransport never yields to the loop, where a single-process
        # engine runs.
        await asyncio.sleep(0.02)
    return figures


@pytest.mark.parametrize("mode", MODES)
async def test_engine_load_figures_reach_metrics(mode: str, model_path: Path) -> None:
    args = ServerArgs.from_kwargs(
        model_path=str(model_path),
        single_process=mode == "single-process",
        max_total_tokens=4096,
    )
    engine = AsyncEngine(args)
    app = create_app(engine, own_engine=True)
    wire = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=wire, base_url="http://test") as http,
    ):
        idle = await scrape(http)
        assert idle["m3serve:num_running_reqs"] == 0
        assert idle["m3serve:num_waiting_reqs"] == 0
        assert idle["m3serve:kv_cache_usage_ratio"] == 0
        assert idle["m3serve:num_retractions_total"] == 0

        sampling = SamplingParams(temperature=0.0, max_new_tokens=2000, ignore_eos=True)
        stream = engine.stream(GenerateReq(rid="busy", prompt=PROMPT, sampling=sampling))
        await anext(stream)  # the engine wrote its figures before sending these tokens
        busy = await scrape(http)
        assert busy["m3serve:num_running_reqs"] == 1
        assert busy["m3serve:num_waiting_reqs"] == 0
        assert 0 < busy["m3serve:kv_cache_usage_ratio"] <= 1
        await stream.aclose()  # aborts the request

        after = await settle(http, lambda s: s["m3serve:num_running_reqs"] == 0)
        assert after["m3serve:num_waiting_reqs"] == 0
        # Its whole pages stay in the prefix cache, and cached pages are not free.
        assert after["m3serve:num_cached_pages"] >= 1
        assert 0 < after["m3serve:kv_cache_usage_ratio"] <= busy["m3serve:kv_cache_usage_ratio"]
        assert after["m3serve:num_retractions_total"] == 0

        response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200
        served = await scrape(http)
        assert served['m3serve:request_total{endpoint="/v1/completions",status="200"}'] == 1
        assert served["m3serve:num_running_reqs"] == 0

        # Where the figures came from: the engine process's files, or this process's registry.
        assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
        supervisor = engine.supervisor
        assert supervisor is not None
        files = sorted(p.name for p in (supervisor.run_dir / "metrics").glob("*.db"))
        if mode == "multi-process":
            pid = engine.processes["engine"]
            assert f"gauge_livesum_{pid}.db" in files
            assert f"counter_{pid}.db" in files
        else:
            assert files == []
    assert engine.metrics is None
