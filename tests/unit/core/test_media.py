"""A request's media in the engine: shared memory read and freed, placeholder rows of a chunk,
the prefix-cache key, and the checks that refuse inconsistent input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.vision import image_prompt

from m3serve.core.media import ReqMedia, check_media, media_key, placeholder_key, read_media
from m3serve.model.tiny.tokenizer import special_token_ids
from m3serve.runtime.messages import MediaInput, ShmRef
from m3serve.runtime.shm import attach_segment

VOCAB = 512
IMAGE = special_token_ids(VOCAB)["]<]image[>["]
IDS = {"image": IMAGE, "video": special_token_ids(VOCAB)["]<]video[>["]}


def _item(spans: list[tuple[int, int]], grids=((1, 4, 4),), hash_: int = 7) -> ReqMedia:
    patches = sum(t * h * w for t, h, w in grids)
    return ReqMedia("image", torch.zeros(patches * 1176), list(grids), spans, hash_)


def test_reading_media_copies_the_pixels_and_frees_the_segments() -> None:
    prompt = image_prompt(0, VOCAB, [(1, 4, 6), (1, 2, 2)], [3, 4, 5])
    inputs = prompt.media_inputs()
    media = read_media(inputs)
    for item, image in zip(media, prompt.images, strict=True):
        assert np.array_equal(item.pixels.numpy().reshape(image.pixels.shape), image.pixels)
        assert item.spans == [image.span] and item.num_rows == image.span[1]
    for item in inputs:
        with pytest.raises(FileNotFoundError):
            attach_segment(item.pixels.name)


def test_an_unreadable_segment_fails_the_request_and_frees_the_others() -> None:
    good = image_prompt(1, VOCAB, [(1, 2, 2), (1, 2, 2)], [1, 1, 1]).media_inputs()
    lost = MediaInput("image", ShmRef("m3serve-no-such-segment", 16), [(1, 2, 2)], [(1, 1)], 1)
    with pytest.raises(ValueError, match="cannot read the pixels"):
        read_media([good[0], lost, good[1]])
    for item in good:
        with pytest.raises(FileNotFoundError):
            attach_segment(item.pixels.name)


def test_rows_in_a_chunk_follow_the_spans() -> None:
    item = _item([(3, 4), (10, 2)], grids=((1, 4, 4), (1, 2, 4)))
    assert item.rows_in(0, 3) == []
    assert item.rows_in(0, 5) == [(3, 0, 2)]
    assert item.rows_in(5, 6) == [(0, 2, 2), (5, 4, 1)]  # the end of one run, the start of the next
    assert item.rows_in(11, 10) == [(0, 5, 1)]


def test_the_cache_key_carries_the_image_hash_only_at_placeholders() -> None:
    prompt = image_prompt(2, VOCAB, [(1, 4, 4)], [5, 6])
    (offset, count) = prompt.images[0].span
    one, other = _item([(offset, count)], hash_=11), _item([(offset, count)], hash_=12)
    key = media_key(prompt.ids, [one])
    assert (
        key[:offset] == prompt.ids[:offset]
        and key[offset + count :] == prompt.ids[offset + count :]
    )
    assert set(key[offset : offset + count]) == {placeholder_key(11)}
    assert placeholder_key(11) < 0  # never a token id
    assert media_key(prompt.ids, [other]) != key
    assert media_key(prompt.ids, [_item([(offset, count)], hash_=11)]) == key


def test_media_that_does_not_add_up_is_refused() -> None:
    prompt = image_prompt(3, VOCAB, [(1, 4, 4)], [5, 6])
    offset, count = prompt.images[0].span
    check_media(prompt.ids, [_item([(offset, count)])], IDS, 1176, 2)
    bad = {
        "placeholder tokens": _item([(offset, count - 1)]),
        "not image tokens": _item([(offset - 1, count)]),
        "outside the prompt": _item([(len(prompt.ids) - 2, count)]),
        "pixel values": ReqMedia("image", torch.zeros(10), [(1, 4, 4)], [(offset, count)], 1),
        "merge windows": _item([(offset, count)], grids=((1, 2, 3), (1, 2, 5))),
    }
    for message, item in bad.items():
        with pytest.raises(ValueError, match=message):
            check_media(prompt.ids, [item], IDS, 1176, 2)
