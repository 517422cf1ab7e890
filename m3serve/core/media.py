"""A request's images and videos in the engine process, from `MediaInput` to the rows of a
prefill chunk whose embeddings the vision features replace.

Pixels are read out of their shared-memory segment when the request arrives (which unlinks it:
a crash later leaves no segment behind) and stay in host memory until the request is dropped,
so a retracted request can be prefilled again. Features are computed on the executor thread the
first time a prefill chunk needs rows of an image, for all such images of the step in one
encoder call, and kept on the `ReqMedia` until that request's prefill is done: a chunk boundary
inside a placeholder span takes the rest of the rows from the same features.

The prefix cache never sees placeholder token ids: `media_key` replaces each placeholder
position by a value derived from its image's content hash, so the same text with another image
shares no KV past the first placeholder, and the same image again hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from m3serve.model.vision.encoder import VisionEncoder
from m3serve.runtime.messages import MediaInput, SeqStep
from m3serve.runtime.shm import read_array

Grid = tuple[int, int, int]
# Cache keys of placeholders are negative int32s: never a token id, and HiCache page keys hash
# tokens as int32.
_KEY_RANGE = 2**31 - 1


@dataclass(eq=False)
class ReqMedia:
    kind: str
    pixels: torch.Tensor  # float32, flat: [patches * patch_dim]
    grids: list[Grid]
    spans: list[tuple[int, int]]  # (offset in the prompt, placeholder count), ascending
    content_hash: int
    # [rows, hidden] on the device, while the request's prefill needs them (executor thread).
    features: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return sum(count for _, count in self.spans)

    @property
    def num_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    def rows_in(self, start: int, extend: int) -> list[tuple[int, int, int]]:
        """Where positions [start, start + extend) overlap the spans: (row in the chunk, row
        of the features, count) per overlapping span."""
        out, base, end = [], 0, start + extend
        for offset, count in self.spans:
            lo, hi = max(offset, start), min(offset + count, end)
            if lo < hi:
                out.append((lo - start, base + lo - offset, hi - lo))
            base += count
        return out


def read_media(inputs: Sequence[MediaInput]) -> list[ReqMedia]:
    """Copy each input's pixels out of shared memory, unlinking every segment (also the ones
    after a segment that cannot be read); raises ValueError naming the one that failed."""
    media, failure = [], None
    for item in inputs:
        try:
            pixels = torch.from_numpy(read_array(item.pixels, np.float32))
        except (OSError, ValueError) as exc:
            failure = failure or f"cannot read the pixels of a {item.kind} ({exc})"
            continue
        spans = [(int(o), int(c)) for o, c in item.spans]
        grids = [(int(t), int(h), int(w)) for t, h, w in item.grids]
        media.append(ReqMedia(item.kind, pixels, grids, spans, int(item.content_hash)))
    if failure is not None:
        raise ValueError(failure)
    return media


def placeholder_key(content_hash: int) -> int:
    return -1 - content_hash % _KEY_RANGE


def media_key(prompt: list[int], media: Sequence[ReqMedia]) -> list[int]:
    """The prompt as the prefix cache keys it: placeholders carry their image's hash."""
    key = list(prompt)
    for item in media:
        value = placeholder_key(item.content_hash)
        for offset, count in item.spans:
            key[offset : offset + count] = [value] * count
    return key


def check_media(
    prompt: list[int],
    media: Sequence[ReqMedia],
    placeholder_ids: dict[str, int | None],
    patch_dim: int,
    spatial_merge: int,
) -> None:
    """Refuse media whose pixels, grids and placeholder spans do not agree (ValueError)."""
    merge = spatial_merge**2
    for i, item in enumerate(media):
        what = f"{item.kind} {i}"
        if item.pixels.numel() != item.num_patches * patch_dim:
            raise ValueError(
                f"{what}: {item.pixels.numel()} pixel values for grids {item.grids} "
                f"(expected {item.num_patches} patches of {patch_dim})"
            )
        if any(h % spatial_merge or w % spatial_merge for _, h, w in item.grids):
            raise ValueError(f"{what}: grid {item.grids} is not a whole number of merge windows")
        if item.num_rows * merge != item.num_patches:
            raise ValueError(
                f"{what}: {item.num_rows} placeholder tokens for {item.num_patches // merge} "
                "feature rows"
            )
        token = placeholder_ids.get(item.kind)
        for offset, count in item.spans:
            if offset < 0 or offset + count > len(prompt):
                raise ValueError(f"{what}: span ({offset}, {count}) is outside the prompt")
            if token is not None and any(t != token for t in prompt[offset : offset + count]):
                raise ValueError(f"{what}: span ({offset}, {count}) is not {item.kind} tokens")


def step_embeds(
    encoder: VisionEncoder, seqs: Sequence[SeqStep], media: dict[int, list[ReqMedia]]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch rows of the step `seqs` whose embeddings are features, and those features;
    encodes, in one call, every image the step needs that has none yet. A seq whose prefill ends
    here lets go of its features."""
    pieces: list[tuple[int, ReqMedia, int, int]] = []
    row = 0
    for seq in seqs:
        for item in media.get(seq.slot, []) if seq.input_ids is not None else []:
            for at, first, count in item.rows_in(seq.start, seq.extend):
                pieces.append((row + at, item, first, count))
        row += seq.extend
    if not pieces:
        return None
    _encode_missing(encoder, [item for _, item, _, _ in pieces])
    rows = torch.cat([torch.arange(r, r + n) for r, _, _, n in pieces])
    embeds = torch.cat([item.features[f : f + n] for _, item, f, n in pieces])  # type: ignore[index]
    for seq in seqs:
        if seq.sample and seq.input_ids is not None:
            for item in media.get(seq.slot, []):
                item.features = None
    return rows, embeds


def _encode_missing(encoder: VisionEncoder, needed: list[ReqMedia]) -> None:
    todo = list({id(m): m for m in needed if m.features is None}.values())
    if not todo:
        return
    dim = encoder.cfg.patch_dim
    pixels = torch.cat([m.pixels.view(-1, dim) for m in todo])
    grids = [g for m in todo for g in m.grids]
    features = encoder.encode(pixels, grids)
    for item, part in zip(todo, features.split([m.num_rows for m in todo]), strict=True):
        item.features = part
