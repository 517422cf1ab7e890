"""The engine core's warm-up with speculative decoding on, run on the CPU (it runs only on a GPU
at start): every plain and spec plan goes through the verify step, and what it leaves behind
(garbage KV and draft KV, slot lengths, sampler state) changes no later output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from m3serve.core.engine_core import EngineCore
from m3serve.core.spec.verify_step import SpecStep
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SamplingParams

from .engine_runs import DSPARK, at_baseline, generate, request

SMALL = {"max_running_requests": 3, "context_length": 48, "chunked_prefill_size": 16}


def test_spec_warm_up_runs_verify_steps_and_leaves_outputs_unchanged(
    path: Path, cores: Callable[..., EngineCore], monkeypatch: pytest.MonkeyPatch
) -> None:
    off, on = cores(**SMALL), cores(**SMALL, **DSPARK)
    assert on.spec is not None and on.spec.step is not None
    verify_rows = 0
    original = SpecStep.run

    def counted(self: SpecStep, step: int, seqs: list, *args: object, **kwargs: object) -> object:
        nonlocal verify_rows
        verify_rows += sum(1 for seq in seqs if seq.draft)
        return original(self, step, seqs, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SpecStep, "run", counted)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    args = ServerArgs.from_kwargs(
        model_path=str(path), device="cpu", dtype="float32", max_total_tokens=2048,
        **SMALL, **DSPARK,
    )  # fmt: skip
    on._warm_up(args, SMALL["context_length"], SMALL["max_running_requests"])
    assert verify_rows > 0, "the warm-up ran no verify row"
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 20)]
    reqs = lambda: [  # noqa: E731
        request(str(i), p, SamplingParams(max_new_tokens=12, temperature=0.0))
        for i, p in enumerate(prompts)
    ]
    assert generate(on, reqs()).outputs == generate(off, reqs()).outputs
    at_baseline(on)
