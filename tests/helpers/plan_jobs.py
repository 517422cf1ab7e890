"""Rank jobs of the step-plan broadcast tests (module-level: the ranks are spawned processes)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from m3serve.core.ranks import PlanChannel, RankLost, TokenShare, follow
from m3serve.model.parallel import RankGroup
from m3serve.runtime.messages import SamplingParams, SeqStep, StepPlan


def plans(count: int) -> list[StepPlan]:
    return [
        StepPlan(
            step=i,
            seqs=[SeqStep(list(range(i + 3)), 0, [i, i + 1], slot=i % 2)],
            sampling={i % 2: SamplingParams(temperature=0.0)},
            stop_ids={i % 2: [7, 9]},
        )
        for i in range(count)
    ]


def relay(ranks: RankGroup, count: int) -> list[StepPlan]:
    """Rank 0 sends `count` plans then stop; every follower returns what it ran."""
    channel = PlanChannel(ranks)
    if ranks.rank == 0:
        for plan in plans(count):
            channel.send(plan)
        channel.send(None)
        return plans(count)
    ran: list[StepPlan] = []
    assert follow(channel, ran.append) == count
    return ran


def relay_over_the_host_group(ranks: RankGroup, count: int) -> tuple[list[StepPlan], list[int]]:
    """`relay`, and one token share, where the device group is no group at all (any collective
    on it raises) and only the host group is real: as on GPUs, where plans and tokens must not
    queue behind the device's NCCL work."""
    host = dist.new_group(backend="gloo")
    split = RankGroup(ranks.rank, ranks.size, group=object(), host_group=host)
    ran = relay(split, count)
    tokens = [11, 12, 13] if ranks.rank == 0 else [0, 0, 0]
    shared, _ = TokenShare(split).share(tokens, [])
    return ran, shared


def leader_dies(ranks: RankGroup, report: str) -> None:
    """Rank 0 sends two plans and dies; a follower writes how long it took to notice."""
    channel = PlanChannel(ranks)
    if ranks.rank == 0:
        for plan in plans(2):
            channel.send(plan)
        time.sleep(0.5)
        Path(report + ".leader").write_text(json.dumps(time.monotonic()))
        os._exit(17)  # no goodbye: as a crash or SIGKILL
    ran: list[int] = []
    try:
        follow(channel, lambda plan: ran.append(plan.step))
    except RankLost as exc:
        died = time.monotonic()
        Path(report).write_text(json.dumps({"ran": ran, "at": died, "error": str(exc)}))
        os._exit(0)  # the group cannot be torn down politely any more
