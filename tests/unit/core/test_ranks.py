"""The step-plan broadcast between real ranks (gloo, spawned processes): followers run exactly
rank 0's plans, in order, until it says stop; and when rank 0 dies mid-stream a follower
notices within 5 s instead of hanging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.plan_jobs import leader_dies, plans, relay
from helpers.ranks import run_on_ranks, start_ranks

from m3serve.core.ranks import PlanChannel, RankLost
from m3serve.model.parallel import RankGroup


@pytest.mark.slow
def test_followers_run_rank_zeros_plans_in_order() -> None:
    per_rank = run_on_ranks(3, relay, 5)
    assert per_rank == [plans(5)] * 3


@pytest.mark.slow
def test_a_dead_leader_fails_the_followers_within_5_s(tmp_path: Path) -> None:
    report = tmp_path / "follower.json"
    procs = start_ranks(2, leader_dies, str(report))
    try:
        for proc in procs:
            proc.join(timeout=60)
        assert [proc.exitcode for proc in procs] == [17, 0]
        seen = json.loads(report.read_text())
        leader_exit = json.loads(Path(f"{report}.leader").read_text())
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert seen["ran"] == [0, 1]
    assert "broadcast failed" in seen["error"]
    assert seen["at"] - leader_exit < 5.0  # CLOCK_MONOTONIC: one clock for every process


def test_a_follower_cannot_send() -> None:
    with pytest.raises(RuntimeError, match="only rank 0"):
        PlanChannel(RankGroup(1, 2)).send(None)
    assert issubclass(RankLost, RuntimeError)
