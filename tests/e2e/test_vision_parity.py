"""Parity of image input with transformers' minimax_m3_vl on the tiny VL checkpoint: the vision
features, the logits at every position of prompts with 1-3 images of different sizes (and one
video), and 24 greedy tokens, through the model (chunked so that chunks split placeholder runs)
and through the engine core. Prompts are long enough that the sparse indexer drops blocks
(>= 36 tokens)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import M31_SPEC
from helpers.hf_oracle import load_hf, load_ours
from helpers.vision import ImagePrompt, core_outputs, image_prompt, random_pixels

from m3serve.core.engine_core import EngineCore
from m3serve.core.media import ReqMedia
from m3serve.core.req import Req
from m3serve.model.batch import ForwardBatch
from m3serve.model.generate import PromptEmbeds, generate
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.tokenizer import special_token_ids
from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import SamplingParams, SeqStep

TOLERANCE = 1e-4
MIN_SPARSE_LENGTH = 3 * M31_SPEC.index_topk_blocks * M31_SPEC.index_block_size
# (grids, text lengths around the images)
CASES = {
    "one-image": ([(1, 4, 6)], [10, 26]),
    "two-images": ([(1, 4, 4), (1, 2, 6)], [8, 12, 16]),
    "three-images": ([(1, 2, 2), (1, 6, 4), (1, 4, 6)], [4, 8, 6, 20]),
}


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable) -> Path:
    return tiny_checkpoint(M31_SPEC)


@pytest.fixture(scope="module")
def pair(path: Path) -> tuple[M3ForCausalLM, torch.nn.Module]:
    return load_ours(path), load_hf(path)


def prompt_for(case: str, vocab: int) -> ImagePrompt:
    grids, text = CASES[case]
    prompt = image_prompt(len(case), vocab, grids, text)
    assert len(prompt.ids) >= MIN_SPARSE_LENGTH
    return prompt


@torch.inference_mode()
def our_logits(model: M3ForCausalLM, prompt: ImagePrompt, features: bool = True) -> torch.Tensor:
    cfg = model.cfg
    pages = list(range(-(-len(prompt.ids) // cfg.page_size)))
    kv = KVCache.allocate(cfg, len(pages), model.dtype, model.device, model.kv_heads)
    batch = ForwardBatch.build([SeqStep(prompt.ids, 0, pages)], cfg.page_size, "cpu", True)
    if features:
        assert model.vision is not None
        embeds = model.vision.encode(prompt.pixels, prompt.grids)
        batch = batch.with_embeds(prompt.placeholder_rows, embeds)
    return model(batch, kv)


def hf_inputs(prompt: ImagePrompt) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor([prompt.ids]),
        "pixel_values": prompt.pixels,
        "image_grid_thw": torch.tensor(prompt.grids),
    }


@torch.inference_mode()
def hf_greedy(hf: torch.nn.Module, prompt: ImagePrompt, n: int) -> list[int]:
    inputs = hf_inputs(prompt)
    mask = torch.ones_like(inputs["input_ids"])
    out = hf.generate(**inputs, attention_mask=mask, max_new_tokens=n, do_sample=False)
    return out[0, len(prompt.ids) :].tolist()


def test_image_features_match_transformers(pair) -> None:
    ours, hf = pair
    prompt = prompt_for("three-images", ours.cfg.vocab_size)
    assert ours.vision is not None
    features = ours.vision.encode(prompt.pixels, prompt.grids)
    with torch.inference_mode():
        out = hf.model.get_image_features(prompt.pixels, torch.tensor(prompt.grids))
    expected = torch.cat(out.pooler_output)
    assert features.shape == expected.shape == (len(prompt.placeholder_rows), ours.cfg.hidden_size)
    assert (features - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_logits_with_images_match_transformers_at_every_position(pair, case: str) -> None:
    ours, hf = pair
    prompt = prompt_for(case, ours.cfg.vocab_size)
    with torch.inference_mode():
        expected = hf(**hf_inputs(prompt)).logits[0].float()
    delta = (our_logits(ours, prompt) - expected).abs().max().item()
    assert delta <= TOLERANCE, f"max |dlogit| {delta:.2e}"


def test_the_image_features_change_the_logits(pair) -> None:
    ours, _ = pair
    prompt = prompt_for("one-image", ours.cfg.vocab_size)
    first = prompt.images[0].span[0]
    with_image, without = our_logits(ours, prompt), our_logits(ours, prompt, features=False)
    # Before the image nothing differs but fp32 rounding (CPU GEMMs need not round a row the same
    # in two calls: on an AMD EPYC host MKL's did not); from its first placeholder on, the logits
    # do, by orders of magnitude more.
    torch.testing.assert_close(with_image[:first], without[:first], rtol=1e-5, atol=1e-5)
    assert (with_image[first:] - without[first:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("case", list(CASES))
def test_24_greedy_tokens_with_images_match_transformers(pair, case: str) -> None:
    ours, hf = pair
    prompt = prompt_for(case, ours.cfg.vocab_size)
    assert ours.vision is not None
    embeds = prompt.embeds(ours.vision.encode(prompt.pixels, prompt.grids))
    expected = hf_greedy(hf, prompt, 24)
    # Chunks of 5 split every placeholder run of more than one token.
    assert generate(ours, prompt.ids, 24, prefill_chunk=5, embeds=embeds) == expected


@pytest.fixture(scope="module")
def core(path: Path) -> Iterator[EngineCore]:
    args = ServerArgs.from_kwargs(
        model_path=str(path),
        device="cpu",
        dtype="float32",
        max_total_tokens=2048,
        chunked_prefill_size=16,
    )
    engine = EngineCore(args, path)
    yield engine
    engine.close()


def test_engine_greedy_with_images_matches_transformers(pair, core: EngineCore) -> None:
    """All three prompts in one batch: their images are encoded together, chunks of 16 split
    placeholder runs, and each request's tokens are transformers'."""
    ours, hf = pair
    prompts = {case: prompt_for(case, ours.cfg.vocab_size) for case in CASES}
    out = core_outputs(core, [p.req(case) for case, p in prompts.items()])
    for case, prompt in prompts.items():
        assert out[case] == hf_greedy(hf, prompt, 24), case
    core.scheduler.cache.reset()
    core.scheduler.idle_check()


def video_prompt(vocab: int) -> tuple[list[int], torch.Tensor, tuple[int, int, int], list]:
    """Text, then a video of 2 temporal patches (4x4 patches each): per temporal patch, some
    text (the timestamp) and a run of 4 video placeholders between image start/end markers."""
    specials = special_token_ids(vocab)
    words = image_prompt(99, vocab, [], [40]).ids
    grid = (2, 4, 4)
    per_frame = grid[1] * grid[2] // 4
    ids, spans = list(words[:10]), []
    for t in range(grid[0]):
        ids.extend(words[10 + 3 * t : 13 + 3 * t])
        ids.append(specials["]<]start of image[>["])
        spans.append((len(ids), per_frame))
        ids.extend([specials["]<]video[>["]] * per_frame)
        ids.append(specials["]<]end of image[>["])
    ids.extend(words[16:40])
    pixels = torch.from_numpy(random_pixels(98, grid))
    return ids, pixels, grid, spans


def test_logits_and_greedy_tokens_with_a_video_match_transformers(pair) -> None:
    ours, hf = pair
    ids, pixels, grid, spans = video_prompt(ours.cfg.vocab_size)
    assert len(ids) >= MIN_SPARSE_LENGTH and ours.vision is not None
    rows = torch.cat([torch.arange(o, o + n) for o, n in spans])
    features = ours.vision.encode(pixels, [grid])
    cfg = ours.cfg
    pages = list(range(-(-len(ids) // cfg.page_size)))
    kv = KVCache.allocate(cfg, len(pages), ours.dtype, ours.device, ours.kv_heads)
    batch = ForwardBatch.build([SeqStep(ids, 0, pages)], cfg.page_size, "cpu", True)
    with torch.inference_mode():
        logits = ours(batch.with_embeds(rows, features), kv)
        inputs = {
            "input_ids": torch.tensor([ids]),
            "pixel_values_videos": pixels,
            "video_grid_thw": torch.tensor([grid]),
        }
        expected = hf(**inputs).logits[0].float()
        mask = torch.ones_like(inputs["input_ids"])
        out = hf.generate(**inputs, attention_mask=mask, max_new_tokens=24, do_sample=False)
    assert (logits - expected).abs().max().item() <= TOLERANCE
    ours_greedy = generate(ours, ids, 24, prefill_chunk=5, embeds=PromptEmbeds(rows, features))
    assert ours_greedy == out[0, len(ids) :].tolist()


def test_engine_greedy_with_a_video_matches_the_model(pair, core: EngineCore) -> None:
    """A video's placeholder runs (one per temporal patch, text between them) through the
    engine core, chunks of 16 splitting them: the tokens of the model checked above."""
    ours, _ = pair
    ids, pixels, grid, spans = video_prompt(ours.cfg.vocab_size)
    assert ours.vision is not None
    rows = torch.cat([torch.arange(o, o + n) for o, n in spans])
    expected = generate(
        ours, ids, 24, embeds=PromptEmbeds(rows, ours.vision.encode(pixels, [grid]))
    )
    media = [ReqMedia("video", pixels.flatten(), [grid], spans, 12345)]
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0)
    req = Req(
        rid="video", prompt=ids, sampling=sampling, stop_ids=frozenset(), worker=0, media=media
    )
    assert core_outputs(core, [req])["video"] == expected
    core.scheduler.cache.reset()
    core.scheduler.idle_check()
