"""Prompts with images for the vision tests: random text around placeholder runs, random patch
vectors per image (the tower's input; preprocessing has its own tests), and the same request as
the engine receives it (`MediaInput` with the pixels in shared memory)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from helpers.core_runs import CoreRun, run_to_end
from m3serve.core.engine_core import EngineCore
from m3serve.core.media import ReqMedia, read_media
from m3serve.core.req import Req
from m3serve.model.generate import PromptEmbeds
from m3serve.model.tiny.tokenizer import special_base, special_token_ids
from m3serve.runtime.messages import MediaInput, SamplingParams
from m3serve.runtime.shm import new_session_id, write_array

PATCH_DIM = 1176
MERGE = 4

Grid = tuple[int, int, int]


@dataclass
class Image:
    grid: Grid
    pixels: np.ndarray  # float32 [t*h*w, 1176]
    span: tuple[int, int]  # (offset of the first placeholder, count)

    @property
    def content_hash(self) -> int:
        digest = hashlib.blake2b(self.pixels.tobytes(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1


@dataclass
class ImagePrompt:
    ids: list[int]
    images: list[Image]

    @property
    def pixels(self) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([im.pixels for im in self.images]))

    @property
    def grids(self) -> list[Grid]:
        return [im.grid for im in self.images]

    @property
    def placeholder_rows(self) -> torch.Tensor:
        rows = [torch.arange(o, o + n) for o, n in (im.span for im in self.images)]
        return torch.cat(rows)

    def embeds(self, features: torch.Tensor) -> PromptEmbeds:
        return PromptEmbeds(self.placeholder_rows, features)

    def media_inputs(self) -> list[MediaInput]:
        """The request's images as the tokenizer hands them over (pixels in shm segments)."""
        session = new_session_id()
        return [
            MediaInput(
                kind="image",
                pixels=write_array(im.pixels, session),
                grids=[im.grid],
                spans=[im.span],
                content_hash=im.content_hash,
            )
            for im in self.images
        ]

    def media(self) -> list[ReqMedia]:
        return read_media(self.media_inputs())

    def req(self, rid: str, max_new: int = 24, media: bool = True) -> Req:
        sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        return Req(
            rid=rid,
            prompt=list(self.ids),
            sampling=sampling,
            stop_ids=frozenset(),
            worker=0,
            media=self.media() if media else [],
        )


def random_pixels(seed: int, grid: Grid) -> np.ndarray:
    t, h, w = grid
    generator = np.random.default_rng(seed)
    return generator.standard_normal((t * h * w, PATCH_DIM), dtype=np.float32)


def image_prompt(
    seed: int, vocab: int, grids: list[Grid], text: list[int], pixel_seeds: list[int] | None = None
) -> ImagePrompt:
    """text[0] random tokens, then for each grid an image (start, placeholders, end) followed by
    text[i + 1] random tokens. Pixels are seeded by `pixel_seeds` (default: seed + i)."""
    specials = special_token_ids(vocab)
    generator = torch.Generator().manual_seed(seed)

    def words(n: int) -> list[int]:
        # Ordinary tokens only: a random placeholder id would be an image the test never gave.
        return torch.randint(0, special_base(vocab), (n,), generator=generator).tolist()

    ids = words(text[0])
    images = []
    seeds = pixel_seeds or [seed + i for i in range(len(grids))]
    for i, grid in enumerate(grids):
        count = grid[0] * grid[1] * grid[2] // MERGE
        ids.append(specials["]<]start of image[>["])
        images.append(Image(grid, random_pixels(seeds[i], grid), (len(ids), count)))
        ids.extend([specials["]<]image[>["]] * count)
        ids.append(specials["]<]end of image[>["])
        ids.extend(words(text[i + 1]))
    return ImagePrompt(ids, images)


def core_outputs(
    core: EngineCore, reqs: list[Req], abort_after: dict[str, int] | None = None
) -> dict[str, list[int]]:
    """Each request's output tokens through the overlap loop; `abort_after`: abort a request after
    that many steps."""

    def abort(run: CoreRun) -> None:
        for rid, after in (abort_after or {}).items():
            if run.steps == after:
                core.abort(rid)

    return run_to_end(core, reqs, overlap=True, after_step=abort).outputs
