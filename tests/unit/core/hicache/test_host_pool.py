"""HostKVPool: the page-major byte layout, views over it, and a second process's view of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from m3serve.core.hicache.host_pool import (
    ALIGN,
    HostKVPool,
    PageLayout,
    PoolTensor,
    draft_tensors,
    model_layout,
)
from m3serve.model.config import TextConfig, load_model_config
from m3serve.model.tiny.checkpoint import TinySpec, make_tiny
from m3serve.runtime.shm import list_session_segments

SESSION = "hostpooltest"


def layout() -> PageLayout:
    tensors = [
        PoolTensor("k", 0, (2, 3), torch.float32),
        PoolTensor("v", 0, (2, 3), torch.float32),
        PoolTensor("index_k", 0, (5,), torch.bfloat16),
    ]
    return PageLayout.of(tensors, page_size=4)


def test_pieces_follow_each_other_aligned_inside_a_page() -> None:
    lay = layout()
    # k: 4 x 2 x 3 x 4 bytes = 96 -> next at 128; v likewise; index_k: 4 x 5 x 2 = 40.
    assert lay.offsets == (0, 128, 256)
    assert lay.page_bytes == 320 and lay.page_bytes % ALIGN == 0


def test_model_layout_is_k_v_then_index_k_per_sparse_layer(tmp_path: Path) -> None:
    spec = TinySpec(num_layers=3, full_attention_layers=1)
    cfg: TextConfig = load_model_config(make_tiny(tmp_path, spec)).text
    lay = model_layout(cfg, torch.float32)
    names = [(t.layer, t.name) for t in lay.tensors]
    expected = []
    for layer in range(3):
        expected += [(layer, "k"), (layer, "v")]
        if cfg.is_sparse(layer):
            expected.append((layer, "index_k"))
    assert names == expected and not cfg.is_sparse(0)


def test_a_drafts_kv_follows_the_targets_and_leaves_its_bytes_in_place(tmp_path: Path) -> None:
    spec = TinySpec(num_layers=3, full_attention_layers=1)
    cfg: TextConfig = load_model_config(make_tiny(tmp_path, spec)).text
    target = model_layout(cfg, torch.float32)
    draft = draft_tensors(cfg.num_layers, 2, (1, 8), torch.bfloat16)
    both = model_layout(cfg, torch.float32, draft)
    n = len(target.tensors)
    # Without a draft: the target's layout, unchanged; with one: the same prefix, then the
    # draft's layers numbered after the target's, so a layer-by-layer load copies them last.
    assert both.tensors[:n] == target.tensors and both.offsets[:n] == target.offsets
    assert [(t.layer, t.name) for t in both.tensors[n:]] == [
        (3, "draft_k"),
        (3, "draft_v"),
        (4, "draft_k"),
        (4, "draft_v"),
    ]
    draft_bytes = sum(-(-t.page_nbytes(cfg.page_size) // ALIGN) * ALIGN for t in draft)
    assert both.page_bytes == target.page_bytes + draft_bytes
    assert both.describe() != target.describe()


def test_a_page_is_one_contiguous_byte_range_of_every_pool_tensor() -> None:
    pool = HostKVPool.create(SESSION, layout(), num_pages=3)
    try:
        k, v, index_k = pool.views
        assert k.shape == (3, 4, 2, 3) and index_k.shape == (3, 4, 5)
        v[1] = 2.0
        index_k[1] = 1.0
        page = pool.raw[1]
        assert torch.equal(page[128:224].view(torch.float32), torch.full((24,), 2.0))
        assert torch.equal(page[256:296].view(torch.bfloat16), torch.ones(20, dtype=torch.bfloat16))
        assert int(pool.raw[0].sum()) == 0 and int(pool.raw[2].sum()) == 0
    finally:
        pool.close()


def test_another_process_attaches_by_name_and_the_creator_removes_it() -> None:
    pool = HostKVPool.create(SESSION, layout(), num_pages=2)
    assert list_session_segments(SESSION) == [pool.segment_name]
    other = HostKVPool.attach(pool.segment_name, layout(), num_pages=2)
    pool.views[0][1, 2] = 7.0
    assert torch.equal(other.views[0][1, 2], torch.full((2, 3), 7.0))
    other.close()  # an attached pool leaves the segment in place
    assert list_session_segments(SESSION) == [pool.segment_name]
    pool.close()
    assert list_session_segments(SESSION) == []


def test_a_segment_too_small_for_the_pages_is_refused() -> None:
    pool = HostKVPool.create(SESSION, layout(), num_pages=1)
    try:
        with pytest.raises(ValueError, match="2 pages need"):
            HostKVPool.attach(pool.segment_name, layout(), num_pages=2)
        with pytest.raises(ValueError, match="1 pages of rank 1 need"):  # rank 1's lies beyond
            HostKVPool.attach(pool.segment_name, layout(), num_pages=1, rank=1)
    finally:
        pool.close()
