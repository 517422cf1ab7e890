"""`--speculative-*` at start: DSpark with its defaults is accepted and finds the draft in the
checkpoint's dspark/ subfolder (with the log line that says so) or at
--speculative-draft-model-path; every other value is refused with the flag it came from."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from m3serve.core.spec.settings import FOUND_IN_CHECKPOINT, resolve_spec
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ConfigInvalid, ServerArgs

WITH_DRAFT = TinySpec(dtype="float32", seed=21, dspark=True)
WITHOUT = TinySpec(dtype="float32", seed=22)


def _args(**kwargs: object) -> ServerArgs:
    return ServerArgs.from_kwargs(**kwargs)


def test_dspark_defaults_find_the_draft_in_the_checkpoint(
    tiny_checkpoint: Callable[[TinySpec], Path], caplog: pytest.LogCaptureFixture
) -> None:
    path = tiny_checkpoint(WITH_DRAFT)
    with caplog.at_level(logging.INFO):
        settings = resolve_spec(_args(speculative_algorithm="DSPARK"), path)
    assert settings is not None
    assert (settings.block_size, settings.num_draft_tokens) == (7, 8)
    assert settings.draft_path == path and not settings.block_verification
    assert FOUND_IN_CHECKPOINT in caplog.text
    assert FOUND_IN_CHECKPOINT == "DSpark draft found in the target checkpoint's dspark/ subfolder"


def test_the_sglang_low_latency_flags_are_accepted(
    tiny_checkpoint: Callable[[TinySpec], Path], caplog: pytest.LogCaptureFixture
) -> None:
    path = tiny_checkpoint(WITH_DRAFT)
    args = _args(
        speculative_algorithm="DSPARK",
        speculative_num_steps=1,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=8,
        speculative_dspark_block_size=7,
        speculative_use_block_verification=True,
    )
    with caplog.at_level(logging.INFO):
        settings = resolve_spec(args, path)
    assert settings is not None and settings.block_verification
    assert "no effect for greedy requests" in caplog.text


def test_a_draft_directory_can_be_given(tiny_checkpoint: Callable[[TinySpec], Path]) -> None:
    draft = tiny_checkpoint(WITH_DRAFT) / "dspark"
    args = _args(speculative_algorithm="DSPARK", speculative_draft_model_path=str(draft))
    settings = resolve_spec(args, tiny_checkpoint(WITHOUT))
    assert settings is not None and settings.draft_path == draft


def test_a_checkpoint_without_a_draft_is_refused(
    tiny_checkpoint: Callable[[TinySpec], Path],
) -> None:
    with pytest.raises(ConfigInvalid, match="no dspark/ subfolder"):
        resolve_spec(_args(speculative_algorithm="DSPARK"), tiny_checkpoint(WITHOUT))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE (only DSPARK"),
        ({"speculative_algorithm": "DFLASH"}, "--speculative-algorithm DFLASH (only DSPARK"),
        ({"speculative_eagle_topk": 4}, "--speculative-eagle-topk 4"),
        ({"speculative_num_draft_tokens": 4}, "--speculative-num-draft-tokens 4"),
        ({"speculative_dspark_block_size": 3}, "--speculative-dspark-block-size 3"),
        ({"speculative_num_steps": 3}, "--speculative-num-steps 3"),
        ({"speculative_accept_length_override": 9}, "--speculative-accept-length-override 9"),
        ({"tp_size": 2}, "--tp > 1"),
    ],
)
def test_what_cannot_run_is_refused_by_flag(kwargs: dict[str, object], fragment: str) -> None:
    kwargs.setdefault("speculative_algorithm", "DSPARK")
    with pytest.raises(ConfigInvalid, match="speculative decoding cannot run") as raised:
        resolve_spec(_args(**kwargs), None)
    assert fragment in str(raised.value)


def test_hierarchical_cache_runs_with_dspark(tiny_checkpoint: Callable[[TinySpec], Path]) -> None:
    # The host pool and the L3 pages hold the draft KV (tests/e2e/test_hicache_spec.py).
    args = _args(speculative_algorithm="DSPARK", enable_hierarchical_cache=True)
    assert resolve_spec(args, tiny_checkpoint(WITH_DRAFT)) is not None


def test_speculative_flags_without_an_algorithm_are_refused() -> None:
    with pytest.raises(ConfigInvalid, match="needs --speculative-algorithm DSPARK"):
        resolve_spec(_args(speculative_use_block_verification=True), None)
    assert resolve_spec(_args(), None) is None
