"""--tp / --ep at start: sizes below 1 fail when the flags are parsed; what this model, these
devices or --tp cannot run fails in the start-up checks with one message naming every problem;
--tp above 1 runs as engine processes (gloo on the CPU, NCCL on GPUs), HiCache and its L3 storage
included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3serve.engine.checks import check_parallel
from m3serve.model.config import ModelConfig, TextConfig
from m3serve.runtime.config import ConfigInvalid, ParallelArgs, ServerArgs

REAL = ModelConfig(TextConfig())
CPU = torch.device("cpu")


def test_sizes_below_one_fail_when_parsed() -> None:
    with pytest.raises(ConfigInvalid, match="must be >= 1"):
        ParallelArgs(tp_size=0)


@pytest.mark.parametrize(("tp", "ep"), [(4, 8), (4, 3)])
def test_ep_must_divide_tp(tp: int, ep: int) -> None:
    args = ServerArgs.from_kwargs(tp_size=tp, ep_size=ep)  # parses: SGLang commands do this
    with pytest.raises(ConfigInvalid, match=f"--ep {ep} must divide --tp {tp}"):
        check_parallel(args, REAL, CPU)


def test_model_dependent_problems_come_in_one_message() -> None:
    args = ServerArgs.from_kwargs(tp_size=6, ep_size=3)
    with pytest.raises(ConfigInvalid) as info:
        check_parallel(args, REAL, CPU)
    message = str(info.value)
    assert message.startswith("--tp 6 --ep 3 cannot run this model: ")
    assert "attention heads 64 do not split over --tp 6" in message
    assert "KV heads 4 can be neither split over nor replicated on --tp 6" in message
    assert "--ep 3 does not divide the 128 routed experts" in message


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (4, 4), (8, 2), (8, 8)])
def test_the_real_model_runs_at_tp_2_4_8(tp: int, ep: int) -> None:
    check_parallel(ServerArgs.from_kwargs(tp_size=tp, ep_size=ep), REAL, CPU)


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigInvalid, match="--tp 4 needs 4 GPUs; 2 are visible"):
        check_parallel(ServerArgs.from_kwargs(tp_size=4), REAL, torch.device("cuda"))


def test_tp_4_on_four_gpus_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    check_parallel(ServerArgs.from_kwargs(tp_size=4, ep_size=2), REAL, torch.device("cuda"))


def test_tp_and_ep_are_built() -> None:
    args = ServerArgs.from_kwargs(tp_size=4, ep_size=4)
    assert args.unsupported() == []
    assert dataclasses.replace(args, parallel=ParallelArgs()).unsupported() == []


def test_what_ranks_cannot_do_yet_is_refused_in_the_one_message() -> None:
    args = ServerArgs.from_kwargs(
        tp_size=4,
        ep_size=3,
        single_process=True,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
    )
    with pytest.raises(ConfigInvalid) as info:
        check_parallel(args, REAL, torch.device("cuda"))
    message = str(info.value)
    assert message.startswith("--tp 4 --ep 3 cannot run this model: ")
    for part in ("--ep 3 must divide", "--single-process"):
        assert part in message
    assert "not on GPUs" not in message  # NCCL ranks are built
    assert "hicache" not in message  # HiCache and its L3 run with --tp


def test_hicache_host_tier_runs_with_tp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = ServerArgs.from_kwargs(tp_size=2, enable_hierarchical_cache=True)
    check_parallel(args, REAL, torch.device("cuda"))
