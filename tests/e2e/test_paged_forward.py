"""The paged forward is one call for prefill chunks, decode steps, verify steps and mixed batches:
any split of a sequence into steps must give the logits of one full forward."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.hf_oracle import full_logits, load_ours, random_prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3serve.model.batch import ForwardBatch
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

SPEC = TinySpec(dtype="float32", seed=1)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[[TinySpec], Path]) -> M3ForCausalLM:
    return load_ours(tiny_checkpoint(SPEC))


def shuffled_pages(count: int, seed: int) -> list[int]:
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def stepwise_logits(
    model: M3ForCausalLM, ids: list[int], steps: list[int], pages: list[int]
) -> torch.Tensor:
    """Feed ids in steps of the given sizes, collecting every position's logits."""
    kv = KVCache.allocate(model.cfg, len(pages), model.dtype, model.device)
    outputs, start = [], 0
    for size in steps:
        chunk = SeqStep(ids[start : start + size], start, pages)
        batch = ForwardBatch.build([chunk], model.cfg.page_size, "cpu", all_logits=True)
        outputs.append(model(batch, kv))
        start += size
    assert start == len(ids)
    return torch.cat(outputs)


def test_chunked_prefill_then_decode_equals_one_forward(model: M3ForCausalLM) -> None:
    ids = random_prompt(3, 57, model.cfg.vocab_size)
    # Splits mid-block (7, 13) and on a block boundary (12 -> position 32), then 1-token decode.
    steps = [7, 13, 12, 9] + [1] * 16
    pages = shuffled_pages(20, 1)
    delta = (stepwise_logits(model, ids, steps, pages) - full_logits(model, ids)).abs()
    assert delta.max().item() <= TOLERANCE


def test_multi_token_verify_step_equals_one_forward(model: M3ForCausalLM) -> None:
    ids = random_prompt(4, 50, model.cfg.vocab_size)
    # A prefix, then an 8-token block appended to the cache the way speculative verify does.
    steps = [34, 8, 8]
    delta = stepwise_logits(model, ids, steps, shuffled_pages(16, 2)) - full_logits(model, ids)
    assert delta.abs().max().item() <= TOLERANCE


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_split_into_steps_equals_one_forward(model: M3ForCausalLM, data: st.DataObject) -> None:
    length = data.draw(st.integers(min_value=36, max_value=64), label="length")
    cuts = data.draw(st.sets(st.integers(min_value=1, max_value=length - 1), max_size=6))
    bounds = [0, *sorted(cuts), length]
    steps = [b - a for a, b in itertools.pairwise(bounds)]
    ids = random_prompt(length, length, model.cfg.vocab_size)
    pages = shuffled_pages(-(-length // model.cfg.page_size) + 2, length)
    delta = (stepwise_logits(model, ids, steps, pages) - full_logits(model, ids)).abs()
    assert delta.max().item() <= TOLERANCE


@torch.inference_mode()
def test_mixed_batch_equals_each_request_alone(model: M3ForCausalLM) -> None:
    """One step holding a prefill chunk, a decode token and a verify block of three requests."""
    cfg = model.cfg
    prompts = [random_prompt(s, n, cfg.vocab_size) for s, n in ((21, 45), (22, 38), (23, 52))]
    prefix = [20, 37, 44]  # tokens already cached when the mixed step runs
    pool = shuffled_pages(60, 3)
    page_sets = [pool[0:20], pool[20:40], pool[40:60]]
    kv = KVCache.allocate(cfg, 60, model.dtype, model.device)
    for ids, cached, pages in zip(prompts, prefix, page_sets, strict=True):
        model(ForwardBatch.build([SeqStep(ids[:cached], 0, pages)], cfg.page_size, "cpu"), kv)
    chunks = [
        SeqStep(ids[cached:], cached, pages)
        for ids, cached, pages in zip(prompts, prefix, page_sets, strict=True)
    ]
    mixed = model(ForwardBatch.build(chunks, cfg.page_size, "cpu", all_logits=True), kv)
    expected = torch.cat(
        [full_logits(model, ids)[cached:] for ids, cached in zip(prompts, prefix, strict=True)]
    )
    assert mixed.shape == expected.shape
    assert (mixed - expected).abs().max().item() <= TOLERANCE


def test_last_token_logits_by_default(model: M3ForCausalLM) -> None:
    ids = random_prompt(9, 40, model.cfg.vocab_size)
    kv = KVCache.allocate(model.cfg, 12, model.dtype, model.device)
    batch = ForwardBatch.build([SeqStep(ids, 0, list(range(12)))], model.cfg.page_size, "cpu")
    with torch.inference_mode():
        last = model(batch, kv)
    assert last.shape == (1, model.cfg.vocab_size)
    assert (last[0] - full_logits(model, ids)[-1]).abs().max().item() <= TOLERANCE


def test_batch_rejects_too_few_pages() -> None:
    with pytest.raises(ValueError, match="need 3 pages"):
        ForwardBatch.build([SeqStep(list(range(10)), 0, [0, 1])], 4, "cpu")
