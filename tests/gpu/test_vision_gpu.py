"""Image input on the Hopper backend: the vision tower and the feature scatter give the
reference backend's greedy tokens (fp32), CUDA graphs on and off agree (bf16: steps that carry
features run eagerly, decode steps replay graphs), and the image's content hash keys the
prefix cache as on CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.core_runs import closing_cores
from helpers.vision import ImagePrompt, core_outputs, image_prompt

from m3serve.core.engine_core import EngineCore
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.config import ServerArgs

SPEC = TinySpec(dtype="float32", seed=1)
GRIDS = [(1, 4, 6), (1, 2, 2)]
TEXT = [1, 9, 7]  # the first image starts on the first page: nothing before it to share


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    return tiny_checkpoint(SPEC)


@pytest.fixture
def cores(path: Path) -> Iterator[Callable[..., EngineCore]]:
    def make(**kwargs: object) -> EngineCore:
        args = ServerArgs.from_kwargs(
            model_path=str(path),
            max_total_tokens=2048,
            chunked_prefill_size=16,
            skip_warmup=True,
            **kwargs,
        )
        return EngineCore(args, path)

    yield from closing_cores(make)


def prompts() -> list[ImagePrompt]:
    return [image_prompt(10 + i, SPEC.vocab_size, GRIDS, TEXT) for i in range(3)]


def outputs(core: EngineCore) -> dict[str, list[int]]:
    return core_outputs(core, [p.req(f"r{i}", 12) for i, p in enumerate(prompts())])


def test_hopper_fp32_matches_the_cpu_reference_with_images(cores) -> None:
    reference = outputs(cores(backend="reference", device="cpu", dtype="float32"))
    hopper = outputs(cores(backend="hopper", dtype="float32", disable_cuda_graph=True))
    assert hopper == reference


def test_cuda_graphs_on_and_off_agree_with_images(cores) -> None:
    eager = outputs(cores(backend="hopper", dtype="bfloat16", disable_cuda_graph=True))
    graphs = outputs(cores(backend="hopper", dtype="bfloat16", cuda_graph_max_bs_decode=8))
    assert graphs == eager


def test_the_same_image_hits_the_cache_and_another_does_not(cores) -> None:
    core = cores(backend="hopper", dtype="bfloat16")
    first = image_prompt(20, SPEC.vocab_size, GRIDS, TEXT, [1, 2])
    other = image_prompt(20, SPEC.vocab_size, GRIDS, TEXT, [3, 2])
    core_outputs(core, [first.req("a", 4)])
    again, different = first.req("again", 4), other.req("other", 4)
    core_outputs(core, [again])
    core_outputs(core, [different])
    assert again.cached_tokens > 0 and different.cached_tokens == 0
