"""The step-plan broadcast between real ranks (gloo, spawned processes): followers run exactly
rank 0's plans, in order, until it says stop; and when rank 0 dies mid-stream a follower
notices within 5 s instead of hanging. The media-feature share checks rank 0's rows against the
plan's count before any collective, and a step without feature rows broadcasts nothing. Plans
and sampled tokens go over the host group, which on GPUs is a gloo group beside NCCL's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.plan_jobs import leader_dies, plans, relay, relay_over_the_host_group
from helpers.ranks import run_on_ranks, start_ranks

from m3serve.core.ranks import MediaShare, PlanChannel, RankLost
from m3serve.model.parallel import RankGroup


@pytest.mark.slow
def test_followers_run_rank_zeros_plans_in_order() -> None:
    per_rank = run_on_ranks(3, relay, 5)
    assert per_rank == [plans(5)] * 3


@pytest.mark.slow
def test_plans_and_tokens_cross_the_host_group_not_the_device_group() -> None:
    per_rank = run_on_ranks(2, relay_over_the_host_group, 3)
    assert per_rank == [(plans(3), [11, 12, 13])] * 2


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


def test_rank_0_refuses_feature_rows_the_plan_did_not_promise() -> None:
    share = MediaShare(RankGroup(0, 2), "cpu", hidden=8, dtype=torch.float32)
    rows, features = torch.arange(3), torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match="promised 2 feature rows; the step has 3"):
        share.share(2, (rows, features))
    with pytest.raises(RuntimeError, match="promised 0 feature rows; the step has 3"):
        share.share(0, (rows, features))
    with pytest.raises(RuntimeError, match="promised 3 feature rows; the step has 0"):
        share.share(3, None)


def test_a_step_without_feature_rows_shares_nothing() -> None:
    # No process group exists here: a collective would raise.
    assert MediaShare(RankGroup(0, 2), "cpu", 8, torch.float32).share(0, None) is None
    assert MediaShare(RankGroup(1, 2), "cpu", 8, torch.float32).share(0, None) is None
