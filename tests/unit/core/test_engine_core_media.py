"""Image input through the engine core: chunked prefill that splits placeholder runs, the
prefix cache keyed by image content, retraction and re-prefill, every page back after requests
with images finish or abort, and a text-only model refusing images."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import M31_SPEC
from helpers.vision import ImagePrompt, core_outputs, image_prompt
from safetensors.torch import load_file, save_file

from m3serve.core.engine_core import EngineCore
from m3serve.model.generate import generate
from m3serve.runtime.config import ServerArgs

VOCAB = M31_SPEC.vocab_size
GRIDS = [(1, 4, 6), (1, 2, 2)]
TEXT = [1, 9, 7]  # the first image starts on the first page: nothing before it to share


def _core(path: Path, **kwargs: object) -> EngineCore:
    args = ServerArgs.from_kwargs(model_path=str(path), device="cpu", dtype="float32", **kwargs)
    return EngineCore(args, path)


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable) -> Path:
    return tiny_checkpoint(M31_SPEC)


@pytest.fixture(scope="module")
def chunked(path: Path) -> Iterator[EngineCore]:
    core = _core(path, max_total_tokens=1024, chunked_prefill_size=5)
    yield core
    core.close()


@pytest.fixture(scope="module")
def whole(path: Path) -> Iterator[EngineCore]:
    core = _core(path, max_total_tokens=1024, chunked_prefill_size=-1)
    yield core
    core.close()


def _prompt(seed: int, pixel_seeds: list[int] | None = None) -> ImagePrompt:
    return image_prompt(seed, VOCAB, GRIDS, TEXT, pixel_seeds)


def _expected(core: EngineCore, prompt: ImagePrompt, n: int = 12) -> list[int]:
    model = core.model
    assert model.vision is not None
    embeds = prompt.embeds(model.vision.encode(prompt.pixels, prompt.grids))
    return generate(model, prompt.ids, n, embeds=embeds)


def _assert_idle_with_every_page_free(core: EngineCore) -> None:
    scheduler = core.scheduler
    scheduler.idle_check()
    scheduler.cache.reset()
    assert scheduler.pool.num_free == scheduler.pool.num_pages
    assert not core._step_media


def test_chunks_that_split_placeholder_runs_give_the_tokens_of_one_chunk(chunked, whole) -> None:
    prompts = [_prompt(10 + i) for i in range(3)]
    split = core_outputs(chunked, [p.req(f"r{i}", 12) for i, p in enumerate(prompts)])
    at_once = core_outputs(whole, [p.req(f"r{i}", 12) for i, p in enumerate(prompts)])
    assert split == at_once
    assert split["r0"] == _expected(whole, prompts[0])
    _assert_idle_with_every_page_free(chunked)
    _assert_idle_with_every_page_free(whole)


def test_the_same_text_with_another_image_shares_no_cached_tokens(chunked) -> None:
    first, other = _prompt(20, [1, 2]), _prompt(20, [3, 2])
    assert first.ids == other.ids
    a = first.req("a", 4)
    core_outputs(chunked, [a])
    b = other.req("b", 4)
    out = core_outputs(chunked, [b])
    assert b.cached_tokens == 0
    assert out["b"] == _expected(chunked, other, 4)
    _assert_idle_with_every_page_free(chunked)


def test_the_same_image_again_hits_the_prefix_cache(chunked) -> None:
    prompt = _prompt(30)
    first = prompt.req("first", 4)
    expected = core_outputs(chunked, [first])["first"]
    again = prompt.req("again", 4)
    assert core_outputs(chunked, [again])["again"] == expected
    assert first.cached_tokens == 0
    # Every whole page of the prompt but the one holding its last token comes from the cache.
    page = chunked.model.cfg.page_size
    assert again.cached_tokens == (len(prompt.ids) - 1) // page * page > prompt.images[1].span[0]
    _assert_idle_with_every_page_free(chunked)


def test_a_cached_prefix_ending_inside_an_image_takes_the_rest_of_its_rows(chunked) -> None:
    """The second request shares the first image and half of the second one's run... of a
    different prompt: its prefill starts mid-image and must still match a fresh run."""
    short = image_prompt(40, VOCAB, [(1, 4, 8)], [1, 2])
    core_outputs(chunked, [short.req("short", 2)])
    longer = image_prompt(40, VOCAB, [(1, 4, 8)], [1, 2])
    longer.ids = [*longer.ids[:-2], 5, 6, 7, 8, 9, 10, 11]
    req = longer.req("longer", 6)
    out = core_outputs(chunked, [req])
    assert req.cached_tokens > longer.images[0].span[0]
    assert out["longer"] == _expected(chunked, longer, 6)
    _assert_idle_with_every_page_free(chunked)


def test_pages_come_back_after_requests_with_images_finish_or_abort(chunked) -> None:
    prompts = [_prompt(50 + i) for i in range(4)]
    reqs = [p.req(f"r{i}", 8) for i, p in enumerate(prompts)]
    out = core_outputs(chunked, reqs, abort_after={"r1": 2, "r3": 5})
    assert len(out["r0"]) == len(out["r2"]) == 8
    assert len(out["r1"]) < 8 and len(out["r3"]) < 8
    _assert_idle_with_every_page_free(chunked)


def test_requests_with_images_survive_retraction(path: Path) -> None:
    core = _core(
        path,
        max_total_tokens=160,  # 6 requests x (34 + 24) tokens > 160
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
    )
    try:
        prompts = [_prompt(60 + i) for i in range(6)]
        out = core_outputs(core, [p.req(f"r{i}", 24) for i, p in enumerate(prompts)])
        assert core.scheduler.retracted > 0
        for i, prompt in enumerate(prompts):
            assert out[f"r{i}"] == _expected(core, prompt, 24)
        _assert_idle_with_every_page_free(core)
    finally:
        core.close()


def test_a_model_without_a_vision_tower_refuses_images(path: Path, tmp_path: Path) -> None:
    for item in path.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(path / "model.safetensors")
    save_file(
        {n: t for n, t in tensors.items() if n.startswith("language_model.")},
        tmp_path / "model.safetensors",
    )
    core = _core(tmp_path, max_total_tokens=256)
    try:
        prompt = _prompt(70)
        with pytest.raises(ValueError, match="no vision tower"):
            core.add(prompt.req("image", 4))
        assert core_outputs(core, [prompt.req("text", 4, media=False)])["text"]
    finally:
        core.close()


def test_image_requests_decode_speculatively_to_the_same_greedy_tokens(
    tiny_checkpoint: Callable,
) -> None:
    """The verify step's target pass (it also keeps the draft's features) takes the image
    features as the plain forward does."""
    spec_path = tiny_checkpoint(replace(M31_SPEC, dspark=True))
    prompts = [_prompt(50 + i) for i in range(2)]
    plain = _core(spec_path, max_total_tokens=1024, chunked_prefill_size=5)
    spec = _core(
        spec_path, max_total_tokens=1024, chunked_prefill_size=5, speculative_algorithm="DSPARK"
    )
    try:
        expected = core_outputs(plain, [p.req(f"r{i}", 12) for i, p in enumerate(prompts)])
        assert core_outputs(spec, [p.req(f"r{i}", 12) for i, p in enumerate(prompts)]) == expected
        assert spec.scheduler.spec_accept_counts  # verify steps ran
        _assert_idle_with_every_page_free(spec)
    finally:
        plain.close()
        spec.close()
