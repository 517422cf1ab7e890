"""A tokenizer worker's preprocessing CPU budget: its torch pool is its share of the cores
(cores // workers, at least 1), and its media requests run one at a time on one thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch
from helpers.vision_images import png

from m3serve.actors.media import MediaPreprocessor, Prepared
from m3serve.actors.preprocess_threads import bound_worker_threads, usable_cpus, worker_threads
from m3serve.runtime.messages import MediaBlob


@pytest.fixture
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("workers", "cpus", "share"), [(1, 8, 8), (4, 16, 4), (3, 16, 5), (4, 2, 1), (8, 1, 1)]
)
def test_each_worker_gets_its_share_of_the_cores(workers: int, cpus: int, share: int) -> None:
    assert worker_threads(workers, cpus) == share


def test_the_share_defaults_to_the_usable_cores() -> None:
    assert worker_threads(1) == usable_cpus() >= 1


def test_bounding_sizes_this_process_torch_pool(torch_threads: None) -> None:
    threads = bound_worker_threads(usable_cpus() * 4)  # more workers than cores
    assert threads == 1 == torch.get_num_threads()
    assert bound_worker_threads(1) == usable_cpus() == torch.get_num_threads()


async def test_concurrent_requests_preprocess_one_at_a_time_on_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    media = MediaPreprocessor(None, 4_000_000)
    real = media.prepare
    lock, running, seen = threading.Lock(), [0], []

    def recording(blob: MediaBlob) -> Prepared:
        with lock:
            running[0] += 1
            seen.append((threading.current_thread().name, running[0]))
        try:
            return real(blob)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(media, "prepare", recording)
    blobs = [[MediaBlob("image", png(60 + 8 * i, 40, i))] for i in range(6)]
    results = await asyncio.gather(*(media.prepare_all(b) for b in blobs))
    assert [r[0].grids for r in results] == [[real(b[0]).grids[0]] for b in blobs]
    assert len({name for name, _ in seen}) == 1 and seen[0][0].startswith("preprocess")
    assert max(depth for _, depth in seen) == 1
