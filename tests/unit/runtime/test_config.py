"""Typed config sections: validation at construction, the generated CLI, and the one message
that lists every setting this build cannot honour."""

from __future__ import annotations

import argparse
import shlex

import pytest

from m3serve.runtime.config import ConfigInvalid, ServerArgs

# The B300 balanced launch command of the MiniMax-M3.1 cookbook, `sglang serve` -> m3serve.
COOKBOOK = """
--trust-remote-code --model-path MiniMaxAI/MiniMax-M3.1-Flash
--revision ce7f4df87d2e05262f5775f373dac4772f134041
--reasoning-parser minimax-m3 --tool-call-parser minimax-m3 --tp 4
--moe-runner-backend flashinfer_trtllm_routed --speculative-algorithm DSPARK
--speculative-use-block-verification --cuda-graph-backend-prefill breakable
--chunked-prefill-size 32768 --max-running-requests 128 --cuda-graph-max-bs-decode 128
--mem-fraction-static 0.8 --tokenizer-worker-num 8 --host 0.0.0.0 --port 30000
--enable-hierarchical-cache --hicache-size 192 --ep 8 --attn-dp-size 2 --enable-dp-lm-head
--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 8
--speculative-dspark-block-size 7 --disable-attn-tp-gather --page-size 128
"""


def parse(argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_arguments(parser)
    return ServerArgs.from_args(parser.parse_args(shlex.split(argv)))


def test_the_cookbook_launch_flags_parse() -> None:
    args = parse(COOKBOOK)
    assert args.parallel.tp_size == 4 and args.sched.chunked_prefill_size == 32768
    assert args.api.reasoning_parser == "minimax-m3" and args.api.port == 30000


def test_every_unsupported_setting_is_listed_in_one_message() -> None:
    problems = parse(COOKBOOK).unsupported()
    listed = " ".join(problems)
    for flag in (
        "--moe-runner-backend flashinfer_trtllm_routed",
        "--disable-attn-tp-gather",
    ):
        assert flag in listed
    assert "--cuda-graph-backend-prefill" not in listed  # piecewise graphs are built
    assert "--speculative" not in listed  # DSpark is built (core/spec/settings.py checks it)
    with pytest.raises(ConfigInvalid, match=r"this build cannot honour: .*attn-tp-gather"):
        parse(COOKBOOK).check_supported()


def test_hicache_and_its_settings_are_built() -> None:
    assert not [p for p in parse(COOKBOOK).unsupported() if "hicache" in p or "hierarchical" in p]
    args = parse("--enable-hierarchical-cache --hicache-ratio 4 --hicache-write-policy write_back")
    assert args.unsupported() == [] and args.hicache.hicache_ratio == 4


def test_hicache_without_the_radix_cache_fails_with_sglangs_message() -> None:
    with pytest.raises(ConfigInvalid) as raised:
        parse("--enable-hierarchical-cache --disable-radix-cache")
    assert str(raised.value) == (
        "The arguments enable-hierarchical-cache and disable-radix-cache are mutually exclusive "
        "and cannot be used at the same time. Please use only one of them."
    )


def test_defaults_are_all_supported() -> None:
    assert ServerArgs().unsupported() == []
    assert parse("--disable-cuda-graph").unsupported() == []


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_running_requests": 0}, "--max-running-requests"),
        ({"chunked_prefill_size": 0}, "--chunked-prefill-size"),
        ({"mixed_step_min_tokens": -1}, "--mixed-step-min-tokens"),
        ({"mixed_step_demand_margin": -0.5}, "--mixed-step-demand-margin"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
        ({"port": 0}, "--port"),
        ({"tokenizer_worker_num": 0}, "--tokenizer-worker-num"),
        ({"graceful_shutdown_timeout": -1.0}, "--graceful-shutdown-timeout"),
        ({"hicache_ratio": 1.0}, "--hicache-ratio 1.0: must be >= 2"),
        ({"hicache_host_memory_fraction": 0.0}, "--hicache-host-memory-fraction"),
        ({"nonsense": 1}, "unknown server argument"),
    ],
)
def test_bad_settings_stop_construction(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigInvalid, match=fragment):
        ServerArgs.from_kwargs(**kwargs)


def test_the_graceful_shutdown_timeout_is_a_runtime_setting() -> None:
    assert ServerArgs().runtime.graceful_shutdown_timeout == 30.0
    assert parse("--graceful-shutdown-timeout 5").runtime.graceful_shutdown_timeout == 5.0


def test_the_file_storage_backend_and_its_directory_are_accepted() -> None:
    args = parse(
        "--enable-hierarchical-cache --hicache-storage-backend file --hicache-storage-dir /tmp/l3"
    )
    assert args.hicache.hicache_storage_backend == "file"
    assert args.hicache.hicache_storage_dir == "/tmp/l3"
    assert not [problem for problem in args.unsupported() if "storage" in problem]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            "--enable-hierarchical-cache --hicache-storage-backend mooncake",
            "--hicache-storage-backend mooncake: this build has file",
        ),
        ("--hicache-storage-backend file", "needs --enable-hierarchical-cache"),
        ("--hicache-storage-dir /tmp/l3", "--hicache-storage-dir needs --hicache-storage-backend"),
    ],
)
def test_bad_storage_settings_stop_the_start(argv: str, fragment: str) -> None:
    with pytest.raises(ConfigInvalid, match=fragment):
        parse(argv)
