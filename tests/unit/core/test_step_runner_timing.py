"""`StepRunner.time_step`, what the step-cost measurement times: a decode step draws every row's
token with the sampling a default request gets, but each slot is started once (a request
starts its slot once, not every step)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from helpers.devices import CPU_REFERENCE

from m3serve.core.engine_start import default_sampling
from m3serve.core.matchers import GrammarMatchers
from m3serve.core.sampler import Sampler
from m3serve.core.step_cost import measure_step_cost
from m3serve.core.step_runner import StepRunner
from m3serve.model.build import load_model
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SamplingParams

SPEC = TinySpec(dtype="float32", seed=1)
PAGES = 64


def test_timed_decode_steps_start_each_slot_once(
    tiny_checkpoint: Callable[[TinySpec], Path],
) -> None:
    model = load_model(tiny_checkpoint(SPEC), CPU_REFERENCE, "float32", progress=False).model
    cfg = model.cfg
    kv = KVCache.allocate(cfg, PAGES, model.dtype, torch.device("cpu"))
    sampler = Sampler(8, cfg.vocab_size, torch.device("cpu"))
    started: list[int] = []
    start = sampler.start
    sampling = SamplingParams(temperature=0.7, top_p=0.95, top_k=40)

    def counted_start(slot: int, params: SamplingParams, *args: object) -> object:
        assert params == sampling
        started.append(slot)
        return start(slot, params, *args)

    sampler.start = counted_start  # type: ignore[method-assign]
    runner = StepRunner(
        model, kv, cfg.page_size, sampler, GrammarMatchers(cfg.vocab_size), {}, None
    )
    cost = measure_step_cost(
        lambda seqs: runner.time_step(seqs, sampling),
        lambda: None,
        [1, 4, 8],
        cfg.page_size,
        PAGES,
        64,
        cfg.vocab_size,
    )
    assert sorted(cost.decode_ms) == [1, 4, 8]
    # Four calls per size (one untimed, three timed); slots 0..7 each started exactly once.
    assert sorted(started) == list(range(8))


def test_timed_steps_sample_as_a_request_that_sets_nothing(tmp_path: Path) -> None:
    """The checkpoint's generation_config.json defaults (a top-p draw costs more than a plain
    one), and the plain defaults where it has none."""
    assert default_sampling(tmp_path) == SamplingParams()
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 1.0, "top_p": 0.95, "top_k": 40, "do_sample": true}'
    )
    assert default_sampling(tmp_path) == SamplingParams(temperature=1.0, top_p=0.95, top_k=40)
