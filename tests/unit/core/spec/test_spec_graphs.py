"""The draft-proposal and verify-forward graphs' static buffers, run eagerly on the CPU
(`capture=False`): loading a step over a bucket's buffers and padding the rest changes nothing.
Greedy output through the engine with them equals output without speculation, with buckets
that pad and that shrink between steps; a proposal equals the eager one; a verify replay gives
the eager forward's logits and features and writes the KV only at the step's slots and the
scratch page."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from m3serve.backends.reference import ReferenceBackend
from m3serve.core.graph_set import GraphSet
from m3serve.core.spec.draft_graphs import DraftGraphs
from m3serve.core.spec.verify_graphs import VerifyGraphs
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.dspark_loader import load_dspark
from m3serve.model.dspark_paged import DraftKV, propose, target_pass, write_context
from m3serve.model.kv_cache import KVCache
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SamplingParams, SeqStep

from .engine_runs import DSPARK, OVERLAP, at_baseline, generate, make_core, request

SPEC = TinySpec(dtype="float32", seed=21, dspark=True)
CPU = torch.device("cpu")
SIZES = [1, 2, 4]


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, int]]:
    """Replays counted by the GraphSet's id."""
    counts: dict[int, int] = {}
    original = GraphSet.replay

    def counted(self: GraphSet, bs: int) -> Any:
        counts[id(self)] = counts.get(id(self), 0) + 1
        return original(self, bs)

    monkeypatch.setattr(GraphSet, "replay", counted)
    yield counts


@OVERLAP
def test_greedy_output_with_spec_graphs_equals_spec_off(
    path: Path, replays: dict[int, int], overlap: bool
) -> None:
    kwargs = {"chunked_prefill_size": 8}
    off, on = make_core(path, **kwargs), make_core(path, **kwargs, **DSPARK)
    try:
        assert on.spec is not None
        on.spec.capture_graphs(SIZES, max_pages=16, scratch_page=on.budget.num_pages, capture=False)
        # Three requests pad the 4-bucket; as they end at different lengths the bucket shrinks.
        prompts = [list(range(5, 5 + n)) for n in (6, 13, 29)]
        lengths = [9, 14, 20]
        reqs = lambda: [  # noqa: E731
            request(str(i), p, SamplingParams(max_new_tokens=n, temperature=0.0))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        want, got = generate(off, reqs()), generate(on, reqs(), overlap=overlap)
        assert got.outputs == want.outputs
        step, proposer = on.spec.step, on.spec.proposer
        assert step is not None and step.graphs is not None
        assert replays.get(id(step.graphs.graphs), 0) > 0, "no verify step replayed"
        assert replays.get(id(proposer.graphs.graphs), 0) > 0, "no proposal replayed"  # type: ignore[union-attr]
        at_baseline(on)
    finally:
        off.close()
        on.close()


def test_sampled_rows_propose_eagerly(path: Path, replays: dict[int, int]) -> None:
    core = make_core(path, **DSPARK)
    try:
        assert core.spec is not None
        core.spec.capture_graphs(SIZES, 16, core.budget.num_pages, capture=False)
        sampling = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)
        got = generate(core, [request("s", list(range(5, 15)), sampling)])
        assert len(got.outputs["s"]) == 6
        graphs = core.spec.proposer.graphs  # type: ignore[union-attr]
        assert replays.get(id(graphs.graphs), 0) == 0
    finally:
        core.close()


def _draft_setup(path: Path) -> tuple[Any, Any, DraftKV, int]:
    backend = ReferenceBackend(CPU)
    target = load_model(path, backend, progress=False).model
    draft = load_dspark(path, target, backend, target.dtype)
    page = target.cfg.page_size
    kv = DraftKV.allocate(draft.cfg, 24, page, torch.float32, CPU)
    return target, draft, kv, page


def test_a_replayed_proposal_equals_the_eager_one_after_a_larger_step(path: Path) -> None:
    _, draft, kv, page = _draft_setup(path)
    g = torch.Generator().manual_seed(7)
    tables = [[3, 8, 1, 0, 12, 5, 9], [4, 2, 6], [10, 7, 11, 13]]
    lengths = [draft.cfg.sliding_window + 5, 6, 13]
    for n, pages in zip(lengths, tables, strict=True):
        positions = torch.arange(n)
        slots = torch.tensor(pages)[positions // page] * page + positions % page
        write_context(
            draft, kv, torch.randn(n, draft.cfg.feature_size, generator=g), positions, slots
        )
    graphs = DraftGraphs(draft, kv, SIZES, max_pages=8, capture=False)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    anchors = torch.tensor([21, 30, 44])
    with torch.inference_mode():
        for rows in (3, 1, 2):  # 3 pads the 4-bucket; then fewer rows over stale buffers
            got = graphs.propose(anchors[:rows], lengths[:rows], table[:rows])
            want = propose(
                draft, kv, anchors[:rows], lengths[:rows], table[:rows], [0.0] * rows,
                [None] * rows,
            )  # fmt: skip
            assert torch.equal(got, want.tokens)


def test_a_verify_replay_equals_the_eager_forward_and_writes_only_its_slots(path: Path) -> None:
    model = load_model(path, ReferenceBackend(CPU), progress=False).model
    cfg, gamma = model.cfg, 7
    page = cfg.page_size
    scratch = 16
    layer_ids = [0, cfg.num_layers - 1]
    prompts = [list(range(30, 41)), list(range(50, 56)), list(range(60, 79))]
    tables = [[2, 9, 4, 11, 6], [1, 7, 3, 15], [0, 5, 8, 10, 12, 13, 14]]
    kvs = [KVCache.allocate(cfg, scratch + 1, torch.float32, CPU) for _ in range(2)]
    graphs = VerifyGraphs(model, kvs[1], layer_ids, gamma, scratch, SIZES, 8, capture=False)
    rows = [
        SeqStep([*range(3, 3 + gamma + 1)], len(p), pages, slot=i, draft=gamma)
        for i, (p, pages) in enumerate(zip(prompts, tables, strict=True))
    ]
    with torch.inference_mode():
        for kv in kvs:  # the same prompts' KV in both caches
            prefill = [
                SeqStep(p, 0, t, slot=i)
                for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
            ]
            model(ForwardBatch.build(prefill, page, CPU), kv)
        batch = ForwardBatch.build(rows, page, CPU)
        hidden, features = target_pass(model, batch, kvs[0], layer_ids)
        want = model.compute_logits(hidden)
        assert graphs.fits(rows, batch)
        got_logits, got_features = graphs.run(batch)
    torch.testing.assert_close(got_logits, want)
    torch.testing.assert_close(got_features, features)
    outside = torch.ones(kvs[0].layers[0].k.shape[0], dtype=torch.bool)
    outside[scratch * page : (scratch + 1) * page] = False  # padding rows write there only
    # Up to fp32 rounding: CPU GEMMs need not round a row the same in two calls (on an AMD
    # EPYC host MKL's did not), while a stray write would differ by the values' own size.
    for a, b in zip(kvs[0].layers, kvs[1].layers, strict=True):
        torch.testing.assert_close(a.k[outside], b.k[outside], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.v[outside], b.v[outside], rtol=1e-5, atol=1e-5)


def test_steps_with_prefill_rows_do_not_fit_the_verify_graphs(path: Path) -> None:
    model = load_model(path, ReferenceBackend(CPU), progress=False).model
    kv = KVCache.allocate(model.cfg, 8, torch.float32, CPU)
    graphs = VerifyGraphs(model, kv, [0], 7, 7, SIZES, 4, capture=False)
    verify = SeqStep(None, 4, [0, 1, 2], slot=0, draft=7)
    chunk = SeqStep([5, 6, 7], 0, [3], slot=1)
    page = model.cfg.page_size
    assert graphs.fits([verify], ForwardBatch.build([verify], page, CPU))
    assert not graphs.fits([verify, chunk], ForwardBatch.build([verify, chunk], page, CPU))
    many = [SeqStep(None, 4, [0, 1, 2], slot=i, draft=7) for i in range(5)]
    assert not graphs.fits(many, ForwardBatch.build(many, page, CPU))  # past the 4-bucket
