"""Page keys: a hash chain over the token prefix, rooted in what decides a page's bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.core.hicache.host_pool import PageLayout, PoolTensor
from m3serve.core.hicache.keys import checkpoint_identity, next_key, page_keys, root_key
from m3serve.core.hicache.storage_tier import page_key_root

PAGE = 4
ROOT = root_key("model-a", PAGE, "bfloat16")

prompts = st.lists(st.integers(0, 2**31 - 1), min_size=PAGE, max_size=6 * PAGE)


@settings(max_examples=60, deadline=None)
@given(tokens=prompts)
def test_the_same_prefix_gives_the_same_keys(tokens: list[int]) -> None:
    keys = page_keys(ROOT, tokens, PAGE)
    assert keys == page_keys(ROOT, np.array(tokens, np.int64), PAGE)
    assert len(keys) == len(tokens) // PAGE
    assert len(set(keys)) == len(keys)
    # A longer prompt with this prefix starts with the same keys.
    assert page_keys(ROOT, [*tokens, 7] * 2, PAGE)[: len(keys)] == keys


@settings(max_examples=60, deadline=None)
@given(tokens=prompts, data=st.data())
def test_one_token_changed_in_page_i_changes_the_keys_from_i_on_only(
    tokens: list[int], data: st.DataObject
) -> None:
    full = len(tokens) // PAGE * PAGE
    at = data.draw(st.integers(0, full - 1))
    changed = list(tokens)
    changed[at] = (changed[at] + 1) % 2**31
    before, after = page_keys(ROOT, tokens, PAGE), page_keys(ROOT, changed, PAGE)
    i = at // PAGE
    assert before[:i] == after[:i]
    assert all(b != a for b, a in zip(before[i:], after[i:], strict=True))


OTHER_ROOTS = [
    root_key("model-b", PAGE, "bfloat16"),
    root_key("model-a", PAGE, "fp8_e4m3"),
    root_key("model-a", 2 * PAGE, "bfloat16"),
    root_key("model-a", PAGE, "bfloat16", layout="tp2/rank1"),
]


@settings(max_examples=30, deadline=None)
@given(tokens=prompts)
def test_another_model_or_layout_never_shares_a_key(tokens: list[int]) -> None:
    seen = set(page_keys(ROOT, tokens, PAGE))
    for root in OTHER_ROOTS:
        keys = set(page_keys(root, tokens, PAGE))
        assert seen.isdisjoint(keys)
        seen |= keys


def test_the_chain_is_built_from_next_key_and_only_full_pages_have_keys() -> None:
    tokens = list(range(2 * PAGE + 3))
    first = next_key(ROOT, tokens[:PAGE])
    assert page_keys(ROOT, tokens, PAGE) == [first, next_key(first, tokens[PAGE : 2 * PAGE])]
    assert page_keys(ROOT, tokens[: PAGE - 1], PAGE) == []
    # Continuing from a page's key gives the keys of the pages after it.
    assert page_keys(first, tokens[PAGE:], PAGE) == page_keys(ROOT, tokens, PAGE)[1:]


def test_root_parts_are_length_prefixed() -> None:
    assert root_key("ab", 1, "c") != root_key("a", 1, "bc")


def test_token_ids_must_fit_int32() -> None:
    with pytest.raises(ValueError, match="int32"):
        next_key(ROOT, [2**31])
    with pytest.raises(TypeError, match="integers"):
        next_key(ROOT, [1.5])


def test_checkpoint_identity_tells_weights_apart(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = checkpoint_identity(tmp_path)
    assert checkpoint_identity(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert checkpoint_identity(tmp_path) != first


def test_the_engines_root_names_the_checkpoint_and_the_page_layout(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")

    def layout(dtype: torch.dtype, heads: int = 2) -> PageLayout:
        return PageLayout.of([PoolTensor("k", 0, (heads, 8), dtype)], PAGE)

    root = page_key_root(tmp_path, layout(torch.float32))
    assert root == page_key_root(tmp_path, layout(torch.float32))  # a replica's, on one store
    assert root != page_key_root(tmp_path, layout(torch.bfloat16))
    assert root != page_key_root(tmp_path, layout(torch.float32, heads=1))  # another TP share
    (tmp_path / "config.json").write_text('{"changed": 1}')
    assert root != page_key_root(tmp_path, layout(torch.float32))


def test_the_root_names_the_draft_whose_kv_the_pages_carry(tmp_path: Path) -> None:
    # Same checkpoint, same layout bytes: a replica without a draft, or with another draft of
    # the same shape, must not read pages whose draft KV is not its own.
    model, draft_a, draft_b = tmp_path / "m", tmp_path / "m" / "dspark", tmp_path / "other"
    for d, config in ((model, "{}"), (draft_a, '{"draft": "a"}'), (draft_b, '{"draft": "b"}')):
        d.mkdir(parents=True)
        (d / "config.json").write_text(config)
    lay = PageLayout.of([PoolTensor("k", 0, (2, 8), torch.float32)], PAGE)
    plain = page_key_root(model, lay)
    with_a = page_key_root(model, lay, draft_a)
    assert with_a == page_key_root(model, lay, draft_a)  # a replica with the same draft
    assert len({plain, with_a, page_key_root(model, lay, draft_b)}) == 3
    assert plain == page_key_root(model, lay, None)
