"""Copier: backups and layer-by-layer load-backs between a real model's paged KV cache and the
host pool. A prefix's KV is computed, backed up, wiped from the device and loaded back into
other device pages while the continuation's forward runs: each layer finds its own pages loaded
(and the next layer's not yet), and the logits equal one forward over the whole prompt."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import M31_SPEC
from helpers.hf_oracle import full_logits, load_ours, random_prompt

from m3serve.core.hicache.copier import Copier
from m3serve.core.hicache.host_pool import HostKVPool, model_layout
from m3serve.core.hicache.tickets import Ticket
from m3serve.core.hicache.tier import device_tensors, host_layout
from m3serve.model.batch import ForwardBatch
from m3serve.model.dspark_paged import DraftKV
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[[TinySpec], Path]) -> M3ForCausalLM:
    return load_ours(tiny_checkpoint(M31_SPEC))


@pytest.fixture
def setup(model: M3ForCausalLM) -> Iterator[tuple[KVCache, HostKVPool, Copier]]:
    kv = KVCache.allocate(model.cfg, 12, torch.float32, "cpu")
    layout = model_layout(model.cfg, torch.float32)
    pool = HostKVPool.create("copiertest", layout, num_pages=8)
    copier = Copier(pool, device_tensors(kv, layout))
    yield kv, pool, copier
    copier.close()
    pool.close()


def pages_of(kv: KVCache, layer: int, pages: list[int]) -> torch.Tensor:
    ps = kv.page_size
    k = kv.layers[layer].k.view(-1, ps, *kv.layers[layer].k.shape[1:])
    return k[torch.tensor(pages)]


@torch.inference_mode()
def test_a_backed_up_prefix_loads_back_layer_by_layer_inside_the_forward(
    model: M3ForCausalLM, setup: tuple[KVCache, HostKVPool, Copier]
) -> None:
    kv, _, copier = setup
    ps = model.cfg.page_size
    ids = random_prompt(900, 5 * ps + 3, model.cfg.vocab_size - 64)
    first, host, again = [3, 7, 1, 8, 5], [6, 0, 2, 4, 1], [9, 4, 0, 6, 10]
    model(ForwardBatch.build([SeqStep(ids[: 5 * ps], 0, first)], ps, "cpu"), kv)
    computed = [pages_of(kv, layer, first).clone() for layer in range(len(kv.layers))]
    backup = Ticket(1, "backup", first, host)
    backup.settle(copier.backup(backup))
    for layer in kv.layers:  # the device forgets the prefix
        for t in (layer.k, layer.v, layer.index_k):
            if t is not None:
                t.zero_()
    load_back = Ticket(2, "load", again, host)
    load = copier.start_load([load_back])
    seen: list[tuple[bool, bool]] = []

    def before_layer(layer: int) -> None:
        load.before_layer(layer)
        here = torch.equal(pages_of(kv, layer, again), computed[layer])
        later = layer + 1 < len(kv.layers) and bool(pages_of(kv, layer + 1, again).any())
        seen.append((here, later))

    step = SeqStep(ids[5 * ps :], 5 * ps, [*again, 11])
    logits = model(ForwardBatch.build([step], ps, "cpu"), kv, before_layer=before_layer)
    load.finish()
    assert seen == [(True, False)] * len(kv.layers)
    assert load_back.done()
    torch.testing.assert_close(logits[-1], full_logits(model, ids)[-1], atol=1e-4, rtol=1e-4)


def test_a_load_without_per_layer_hooks_still_copies_everything(
    setup: tuple[KVCache, HostKVPool, Copier],
) -> None:
    kv, pool, copier = setup
    for view in pool.views:
        view[3] = 1.5
    load = copier.start_load([Ticket(1, "load", [2], [3])])
    load.before_layer(0)
    assert bool((pages_of(kv, 0, [2]) == 1.5).all()) and not pages_of(kv, 1, [2]).any()
    load.finish()  # a forward that stopped early, or a graph replay: the rest is copied too
    assert all(bool((pages_of(kv, layer, [2]) == 1.5).all()) for layer in range(len(kv.layers)))
    assert all(ticket.done() for ticket in load.tickets)


def test_the_draft_kv_is_backed_up_and_loaded_back_after_the_targets_layers(
    model: M3ForCausalLM,
) -> None:
    # Speculative decoding: the draft's KV pool shares the target's page ids, and a host page
    # holds both. The draft's layers come after every target layer: the forward that loads a
    # prefix back never waits for them, and they are there once the load finishes.
    kv = KVCache.allocate(model.cfg, 12, torch.float32, "cpu")
    slots = kv.layers[0].k.shape[0]
    gen = torch.Generator().manual_seed(5)
    draft = DraftKV(
        [torch.randn(slots, 1, 8, generator=gen) for _ in range(2)],
        [torch.randn(slots, 1, 8, generator=gen) for _ in range(2)],
        kv.page_size,
    )
    layout = host_layout(model.cfg, kv, draft)
    pool = HostKVPool.create("copiertest", layout, num_pages=4)
    copier = Copier(pool, device_tensors(kv, layout, draft))
    try:
        ps, first, again = kv.page_size, [3, 7], [5, 9]

        def draft_pages(pages: list[int]) -> list[torch.Tensor]:
            return [t.view(-1, ps, 1, 8)[torch.tensor(pages)] for t in [*draft.k, *draft.v]]

        computed = [t.clone() for t in draft_pages(first)]
        backup = Ticket(1, "backup", first, [0, 2])
        backup.settle(copier.backup(backup))
        for t in [*draft.k, *draft.v]:  # the device forgets the draft KV too
            t.zero_()
        load = copier.start_load([Ticket(2, "load", again, [0, 2])])
        load.before_layer(len(kv.layers) - 1)
        assert not any(t.any() for t in draft_pages(again)), "the draft KV was loaded early"
        load.finish()
        for got, want in zip(draft_pages(again), computed, strict=True):
            assert torch.equal(got, want)
    finally:
        copier.close()
        pool.close()
