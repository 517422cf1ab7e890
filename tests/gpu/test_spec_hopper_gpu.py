"""Speculative decoding (DSpark) on the hopper backend, on the GPU: greedy output through the
engine with the draft and verify CUDA graphs equals output without speculation; the Triton
draft block attention matches the torch reference at the real model's shapes (64/4 heads, head
128, page 128, window 4096) and replays from a CUDA graph; a replayed draft proposal and verify
forward equal the eager ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.draft_batch import make_draft_batch
from helpers.greedy import engine_outputs, first_divergence

from m3serve.backends import create_backend
from m3serve.core.graph_set import GraphSet
from m3serve.core.spec.draft_graphs import DraftGraphs
from m3serve.core.spec.verify_graphs import VerifyGraphs
from m3serve.kernels.draft_attention import draft_attention as reference
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.dspark_loader import load_dspark
from m3serve.model.dspark_paged import DraftKV, propose, target_pass, write_context
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

SPEC = TinySpec(dtype="float32", seed=21, dspark=True)
PROMPTS = [list(range(5, 5 + n)) for n in (4, 11, 23, 37, 50)]
DSPARK = {"speculative_algorithm": "DSPARK"}
GPU = torch.device("cuda")


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Which spec graph set replayed which bucket, every replay (the engine runs in this
    process). The piecewise steps' draw (HeadDraws) replays a graph set too, with or without
    speculation: not counted."""
    seen: list[tuple[str, int]] = []
    original = GraphSet.replay

    def counted(self: GraphSet, bs: int) -> Any:
        name = type(self.forward.__self__).__name__
        if name in ("DraftGraphs", "VerifyGraphs"):
            seen.append((name, bs))
        return original(self, bs)

    monkeypatch.setattr(GraphSet, "replay", counted)
    yield seen


def test_dspark_greedy_with_graphs_equals_spec_off(
    path: Path, replays: list[tuple[str, int]]
) -> None:
    common = {"backend": "hopper", "dtype": "float32", "cuda_graph_max_bs_decode": 8}
    off, _ = engine_outputs(path, PROMPTS, **common)
    eager, _ = engine_outputs(path, PROMPTS, disable_cuda_graph=True, **common, **DSPARK)
    assert not replays
    graphs, _ = engine_outputs(path, PROMPTS, **common, **DSPARK)
    assert {name for name, _ in replays} == {"DraftGraphs", "VerifyGraphs"}, replays
    assert any(bs == 8 for _, bs in replays), "5 requests never padded the 8-bucket"
    for name, got in (("eager", eager), ("graphs", graphs)):
        assert got == off, (name, [first_divergence(g, o) for g, o in zip(got, off, strict=True)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_draft_attention_kernel_matches_the_reference_at_real_shapes(dtype: torch.dtype) -> None:
    from m3serve.kernels.triton.draft_attention import draft_attention

    # No context, mid-page, a page boundary, inside the window, past it by a few pages.
    anchors = [0, 77, 256, 3000, 4095, 4096, 5000, 6143]
    batch = make_draft_batch(
        anchors, num_kv=4, group=16, head_dim=128, page_size=128, window=4096, seed=1
    )
    want = reference(*batch.to("cpu", dtype).to("cpu", torch.float32).args())
    got = draft_attention(*batch.to(GPU, dtype).args())
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)


def test_draft_attention_kernel_replays_from_a_cuda_graph() -> None:
    from m3serve.kernels.triton.draft_attention import draft_attention

    batch = make_draft_batch([300, 5000, 12], num_kv=4, group=16, head_dim=128, page_size=128,
                             window=4096, seed=2).to(GPU, torch.bfloat16)  # fmt: skip
    args = list(batch.args())
    draft_attention(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = draft_attention(*args)
    # Shorter contexts (anchors past the window would read slots the batch left NaN).
    batch.anchor_pos.copy_(torch.tensor([299, 5000, 1], device=GPU))
    graph.replay()
    torch.testing.assert_close(out, draft_attention(*args), rtol=0, atol=0)


def _hopper_draft(path: Path) -> tuple[Any, Any, DraftKV]:
    backend = create_backend("hopper", GPU)
    target = load_model(path, backend, "float32", progress=False).model
    draft = load_dspark(path, target, backend, target.dtype)
    kv = DraftKV.allocate(draft.cfg, 40, target.cfg.page_size, torch.float32, GPU)
    return target, draft, kv


def test_a_replayed_draft_proposal_equals_the_eager_one(path: Path) -> None:
    target, draft, kv = _hopper_draft(path)
    page = target.cfg.page_size
    g = torch.Generator().manual_seed(3)
    tables = [[3, 8, 1, 0, 12, 5, 9, 20], [4, 2, 6], [10, 7, 11, 13, 30]]
    lengths = [draft.cfg.sliding_window + 9, 6, 13]
    for n, pages in zip(lengths, tables, strict=True):
        positions = torch.arange(n, device=GPU)
        slots = torch.tensor(pages, device=GPU)[positions // page] * page + positions % page
        features = torch.randn(n, draft.cfg.feature_size, generator=g).to(GPU)
        write_context(draft, kv, features, positions, slots)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    table = table.to(GPU)
    anchors = torch.tensor([21, 30, 44], device=GPU)
    graphs = DraftGraphs(draft, kv, [1, 2, 4], max_pages=8)
    graphs.capture()
    with torch.inference_mode():
        for rows in (3, 1, 2):
            got = graphs.propose(anchors[:rows], lengths[:rows], table[:rows]).clone()
            want = propose(draft, kv, anchors[:rows], lengths[:rows], table[:rows],
                           [0.0] * rows, [None] * rows)  # fmt: skip
            assert torch.equal(got, want.tokens)


def test_a_replayed_verify_forward_equals_the_eager_one(path: Path) -> None:
    backend = create_backend("hopper", GPU)
    model = load_model(path, backend, "float32", progress=False).model
    cfg, gamma, page = model.cfg, 7, model.cfg.page_size
    scratch = 16
    layer_ids = [0, cfg.num_layers - 1]
    prompts = [list(range(30, 41)), list(range(50, 56)), list(range(60, 79))]
    tables = [[2, 9, 4, 11, 6], [1, 7, 3, 15], [0, 5, 8, 10, 12, 13, 14]]
    kv = KVCache.allocate(cfg, scratch + 1, torch.float32, GPU)
    graphs = VerifyGraphs(model, kv, layer_ids, gamma, scratch, [1, 2, 4], 8)
    graphs.capture()
    rows = [
        SeqStep([*range(3, 3 + gamma + 1)], len(p), pages, slot=i, draft=gamma)
        for i, (p, pages) in enumerate(zip(prompts, tables, strict=True))
    ]
    with torch.inference_mode():
        prefill = [
            SeqStep(p, 0, t, slot=i) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ]
        model(ForwardBatch.build(prefill, page, GPU), kv)
        batch = ForwardBatch.build(rows, page, GPU)
        hidden, features = target_pass(model, batch, kv, layer_ids)
        want = model.compute_logits(hidden)
        got_logits, got_features = graphs.run(batch)
    torch.testing.assert_close(got_logits, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_features, features, rtol=1e-4, atol=1e-4)
