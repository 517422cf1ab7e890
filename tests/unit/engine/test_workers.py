"""Routing requests to tokenizer workers while one is down, and the restart budget."""

from __future__ import annotations

from typing import Any

import pytest

from m3serve.engine import workers
from m3serve.engine.workers import TokenizerWorkers, worker_index

RIDS = [f"req-{i}" for i in range(200)]


def pool(n: int) -> TokenizerWorkers:
    outboxes: list[Any] = [object() for _ in range(n)]
    return TokenizerWorkers(outboxes)


def test_requests_spread_over_every_live_worker_and_stay_put() -> None:
    three = pool(3)
    routed = [three.route(rid) for rid in RIDS]
    assert set(routed) == {0, 1, 2}
    assert routed == [three.route(rid) for rid in RIDS]


def test_a_dead_worker_gets_no_new_request_until_it_is_ready() -> None:
    three = pool(3)
    assert three.died(1)
    assert {three.route(rid) for rid in RIDS} == {0, 2}
    assert three.any_live
    assert three.ready(1) and not three.ready(1)
    assert {three.route(rid) for rid in RIDS} == {0, 1, 2}


def test_with_every_worker_down_there_is_no_route() -> None:
    one = pool(1)
    one.died(0)
    assert not one.any_live
    assert one.route("x") is None


def test_workers_that_keep_dying_are_not_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(workers.time, "monotonic", lambda: now[0])
    two = pool(2)
    assert all(two.died(i % 2) for i in range(workers.MAX_RESTARTS))
    assert not two.died(0)
    # Deaths further apart than the window start the count again.
    now[0] += workers.RESTART_WINDOW_S + 1
    assert two.died(0)


def test_worker_names_map_to_indexes() -> None:
    assert worker_index("tokenizer0") == 0 and worker_index("tokenizer12") == 12
    assert worker_index("engine") is None and worker_index("tokenizer") is None
