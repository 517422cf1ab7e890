"""Piecewise graphs' split and padding, run eagerly on the CPU: a mixed step (decodes next to
prompt chunks, prompts long enough that sparse selection drops blocks) padded to a bucket gives
the logits and KV of the plain forward."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.hf_oracle import load_ours, random_prompt

from m3serve.core.piecewise import PiecewiseGraphs, token_buckets
from m3serve.model.batch import ForwardBatch
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

SPEC = TinySpec(dtype="float32", seed=3)
TOLERANCE = 1e-4
NUM_PAGES = 64  # page NUM_PAGES is the scratch page


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[[TinySpec], Path]) -> M3ForCausalLM:
    return load_ours(tiny_checkpoint(SPEC))


def prefilled(model: M3ForCausalLM, prompts: list[list[int]], pages: list[list[int]]) -> KVCache:
    kv = KVCache.allocate(model.cfg, NUM_PAGES + 1, model.dtype, model.device)
    for ids, table in zip(prompts, pages, strict=True):
        batch = ForwardBatch.build([SeqStep(ids, 0, table)], model.cfg.page_size, "cpu")
        model(batch, kv)
    return kv


def mixed_step(model: M3ForCausalLM) -> tuple[list[SeqStep], list[list[int]], list[list[int]]]:
    """Two requests decoding after long prompts, one chunk after a cached prefix, one new prompt."""
    ps, vocab = model.cfg.page_size, model.cfg.vocab_size
    lengths = [9 * ps + 3, 6 * ps, 4 * ps + 5]
    prompts = [random_prompt(seed, n, vocab) for seed, n in enumerate(lengths)]
    pages = [list(range(0, 12)), list(range(12, 22)), list(range(22, 30))]
    seqs = [
        SeqStep([prompts[0][-1]], lengths[0] - 1, pages[0], sample=True),
        SeqStep([prompts[1][-1]], lengths[1] - 1, pages[1], sample=True),
        SeqStep(random_prompt(7, 2 * ps + 1, vocab), lengths[2], pages[2], sample=True),
        SeqStep(random_prompt(8, 3 * ps - 2, vocab), 0, list(range(30, 34)), sample=True),
    ]
    cached = [p[:-1] for p in prompts[:2]] + [prompts[2]]
    return seqs, cached, pages


def test_buckets_end_at_the_largest_step() -> None:
    assert token_buckets(100) == [16, 32, 48, 64, 80, 96, 100]
    assert token_buckets(8) == [8]
    sizes = token_buckets(4096)
    assert all(b / a <= 1 + 1 / 8 for a, b in itertools.pairwise(sizes[8:]))


@torch.inference_mode()
def test_padded_pieces_give_the_logits_and_kv_of_the_plain_forward(model: M3ForCausalLM) -> None:
    seqs, cached, pages = mixed_step(model)
    ps = model.cfg.page_size
    batch = ForwardBatch.build(seqs, ps, "cpu")
    assert batch.num_tokens not in token_buckets(512)  # so the step is padded

    plain_kv = prefilled(model, cached, pages)
    plain = model(batch, plain_kv)

    piece_kv = prefilled(model, cached, pages)
    graphs = PiecewiseGraphs(model, piece_kv, NUM_PAGES, max_tokens=512, capture=False)
    assert graphs.fits(batch)
    hidden = graphs.run(batch)
    pieced = model.compute_logits(hidden[batch.logit_rows])

    assert (pieced - plain).abs().max().item() <= TOLERANCE
    # The real rows' KV is the same; padding wrote only to the scratch page.
    owned = NUM_PAGES * ps
    for ours, theirs in zip(piece_kv.layers, plain_kv.layers, strict=True):
        assert torch.allclose(ours.k[:owned], theirs.k[:owned], atol=TOLERANCE)
        assert torch.allclose(ours.v[:owned], theirs.v[:owned], atol=TOLERANCE)
        if ours.index_k is not None:
            assert torch.allclose(ours.index_k[:owned], theirs.index_k[:owned], atol=TOLERANCE)


@torch.inference_mode()
def test_a_smaller_step_after_a_larger_one_is_unaffected_by_stale_rows(
    model: M3ForCausalLM,
) -> None:
    seqs, cached, pages = mixed_step(model)
    ps = model.cfg.page_size
    kv = prefilled(model, cached, pages)
    graphs = PiecewiseGraphs(model, kv, NUM_PAGES, max_tokens=512, capture=False)
    graphs.run(ForwardBatch.build(seqs, ps, "cpu"))  # leaves its rows in the buffers

    small = [SeqStep(seqs[0].input_ids, seqs[0].start, seqs[0].pages, sample=True)]
    batch = ForwardBatch.build(small, ps, "cpu")
    expected = model(batch, prefilled(model, cached, pages))
    got = model.compute_logits(graphs.run(batch)[batch.logit_rows])
    assert (got - expected).abs().max().item() <= TOLERANCE
