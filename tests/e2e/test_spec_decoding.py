"""Speculative decoding (DSpark) through the whole engine, single-process: greedy outputs equal
those without it, `meta_info` carries each request's acceptance length, and `/metrics` the
histogram of verify steps' acceptance lengths."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from helpers.greedy import engine_outputs
from helpers.metrics_text import samples

from m3serve import Engine
from m3serve.api.app import create_app
from m3serve.engine.async_engine import AsyncEngine
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ServerArgs

SPEC = TinySpec(dtype="float32", seed=21, dspark=True)
PROMPTS = [list(range(5, 5 + n)) for n in (4, 11, 23)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


def test_greedy_engine_outputs_match_and_report_acceptance(
    tiny_checkpoint: Callable[[TinySpec], Path],
) -> None:
    path = tiny_checkpoint(SPEC)
    want, _ = engine_outputs(path, PROMPTS)
    with Engine(
        str(path), single_process=True, max_total_tokens=4096, speculative_algorithm="DSPARK"
    ) as engine:
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r["output_ids"] for r in results] == [ids[:12] for ids in want]
    for result in results:
        meta = result["meta_info"]
        assert meta["spec_verify_ct"] >= 1
        assert 1.0 <= meta["spec_accept_length"] <= 8.0


async def test_metrics_show_the_acceptance_histogram(
    tiny_checkpoint: Callable[[TinySpec], Path],
) -> None:
    path = tiny_checkpoint(SPEC)
    args = ServerArgs.from_kwargs(
        model_path=str(path),
        single_process=True,
        max_total_tokens=4096,
        speculative_algorithm="DSPARK",
    )
    engine = AsyncEngine(args)
    app = create_app(engine, own_engine=True)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http,
    ):
        body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200
        figures = samples((await http.get("/metrics")).text)
    verify_steps = figures["m3serve:spec_accept_length_count"]
    assert verify_steps >= 1
    assert figures['m3serve:spec_accept_length_bucket{le="8.0"}'] == verify_steps
