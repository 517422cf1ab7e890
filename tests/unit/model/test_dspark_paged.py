"""The batched DSpark draft over the paged draft KV pool proposes what the dense per-request
reference (`DSparkDraft.propose` over a `DraftContext`) proposes, for requests of different
lengths on scattered pages, one past the draft window; committed tokens' K/V land at their
slots and nowhere else. The target pass that feeds the draft returns the model's own hidden
states and the reference features."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from m3serve.backends.reference import ReferenceBackend
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.dspark import target_features
from m3serve.model.dspark_loader import load_dspark
from m3serve.model.dspark_paged import (
    DraftKV,
    base_logits,
    greedy_tokens,
    propose,
    target_pass,
    write_context,
)
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

SPEC = TinySpec(dtype="float32", seed=21, dspark=True)
CPU = torch.device("cpu")


def test_paged_batched_proposals_match_the_dense_reference(
    tiny_checkpoint: Callable[[TinySpec], Path],
) -> None:
    path = tiny_checkpoint(SPEC)
    backend = ReferenceBackend(CPU)
    target = load_model(path, backend, progress=False)
    draft = load_dspark(path, target.model, backend, target.dtype)
    page = target.model.cfg.page_size
    kv = DraftKV.allocate(draft.cfg, 32, page, torch.float32, CPU)
    g = torch.Generator().manual_seed(3)
    lengths = [9, draft.cfg.sliding_window + 6]  # the second sees only its window
    tables = [[7, 2, 30], [5, 11, 1, 20, 3, 9, 14]]
    anchors = torch.tensor([17, 40])
    contexts = []
    for n, pages in zip(lengths, tables, strict=True):
        features = torch.randn(n, draft.cfg.feature_size, generator=g)
        positions = torch.arange(n)
        slots = torch.tensor(pages)[positions // page] * page + positions % page
        write_context(draft, kv, features, positions, slots)
        contexts.append(draft.context(features, positions))
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    got = propose(draft, kv, anchors, lengths, table, [0.0, 0.0], [None, None])
    for row, (context, n) in enumerate(zip(contexts, lengths, strict=True)):
        want = draft.propose(int(anchors[row]), n, context)
        assert torch.equal(got.tokens[row], want.tokens)
        torch.testing.assert_close(got.logits[row], want.logits, rtol=1e-4, atol=1e-4)
    used = {
        p * page + s
        for t, n in zip(tables, lengths, strict=True)
        for p_i, p in enumerate(t)
        for s in range(page)
        if p_i * page + s < n
    }
    untouched = torch.tensor([s not in used for s in range(kv.k[0].shape[0])])
    assert torch.count_nonzero(kv.k[0][untouched]) == 0


def test_the_target_pass_keeps_the_draft_features_and_the_final_hidden_states(
    tiny_checkpoint: Callable[[TinySpec], Path],
) -> None:
    path = tiny_checkpoint(SPEC)
    backend = ReferenceBackend(CPU)
    model = load_model(path, backend, progress=False).model
    cfg = model.cfg
    layers = [0, cfg.num_layers - 1]
    tokens = list(range(20, 33))
    seq = SeqStep(tokens, 0, [3, 0, 2, 1])
    outs = []
    for run in range(3):
        kv = KVCache.allocate(cfg, 4, torch.float32, CPU)
        batch = ForwardBatch.build([seq], cfg.page_size, CPU)
        with torch.inference_mode():
            if run == 0:
                outs.append(target_pass(model, batch, kv, layers))
            elif run == 1:
                outs.append(model.hidden_states(batch, kv))
            else:
                outs.append(target_features(model, batch, kv, layers))
    (hidden, features), plain, reference = outs
    torch.testing.assert_close(hidden, plain)
    torch.testing.assert_close(features, reference)
    assert features.shape == (len(tokens), len(layers) * cfg.hidden_size)


def test_hopper_draft_attention_and_the_greedy_tokens_match_the_reference_proposal(
    tiny_checkpoint: Callable[[TinySpec], Path],
) -> None:
    """The same draft on the hopper backend (Triton kernels in the interpreter) proposes the
    reference backend's tokens; the device-only greedy loop that graphs capture agrees too."""
    pytest.importorskip("triton")
    from m3serve.backends.hopper import HopperBackend

    path = tiny_checkpoint(SPEC)
    reference = ReferenceBackend(CPU)
    target = load_model(path, reference, progress=False).model
    drafts = [
        load_dspark(path, target, backend, target.dtype)
        for backend in (reference, HopperBackend(CPU, interpreter=True))
    ]
    page = target.cfg.page_size
    kv = DraftKV.allocate(drafts[0].cfg, 16, page, torch.float32, CPU)
    g = torch.Generator().manual_seed(5)
    lengths, tables = [6, drafts[0].cfg.sliding_window + 3], [[4, 9], [1, 12, 3, 7, 0, 2]]
    for n, pages in zip(lengths, tables, strict=True):
        positions = torch.arange(n)
        slots = torch.tensor(pages)[positions // page] * page + positions % page
        features = torch.randn(n, drafts[0].cfg.feature_size, generator=g)
        write_context(drafts[0], kv, features, positions, slots)
    table = torch.tensor([tables[0] + [-1] * 4, tables[1]], dtype=torch.int32)
    anchors = torch.tensor([11, 29])
    with torch.inference_mode():
        want = propose(drafts[0], kv, anchors, lengths, table, [0.0, 0.0], [None, None])
        got = propose(drafts[1], kv, anchors, lengths, table, [0.0, 0.0], [None, None])
        base = base_logits(drafts[1], kv, anchors, torch.tensor(lengths), table)
        greedy = greedy_tokens(drafts[1], base, anchors)
    assert want.logits is not None and got.logits is not None
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(greedy, got.tokens)
