"""Host pool sizing at start: the ratio or an explicit size, checked against the host's
available memory (the probe is monkeypatched)."""

from __future__ import annotations

import logging

import pytest

from m3serve.core.hicache import sizing
from m3serve.core.hicache.sizing import plan_host_pages
from m3serve.runtime.config import ConfigInvalid, HiCacheArgs

GIB = 2**30
PAGE = 1 << 20  # 1 MiB pages
DEVICE = 1024  # a 1 GiB device pool


@pytest.fixture
def available(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    free = [64 * GIB]
    monkeypatch.setattr(sizing, "mem_available_bytes", lambda: free[0])
    return free


def test_the_ratio_sizes_the_pool_when_it_fits(available: list[int]) -> None:
    assert plan_host_pages(HiCacheArgs(hicache_ratio=4), DEVICE, PAGE) == 4 * DEVICE


def test_a_ratio_that_does_not_fit_is_lowered_and_logged(
    available: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    available[0] = 4 * GIB  # 80% of it: 3.2 GiB, so ratio 4 (4 GiB) does not fit
    with caplog.at_level(logging.WARNING, logger=sizing.__name__):
        pages = plan_host_pages(HiCacheArgs(hicache_ratio=4), DEVICE, PAGE)
    assert pages == int(0.8 * 4 * GIB) // PAGE
    assert "--hicache-ratio 4 " in caplog.text and "lowered to 3.20" in caplog.text


def test_the_memory_fraction_caps_the_share(available: list[int]) -> None:
    available[0] = 8 * GIB
    args = HiCacheArgs(hicache_ratio=4, hicache_host_memory_fraction=0.25)
    assert plan_host_pages(args, DEVICE, PAGE) == 2 * DEVICE  # lowered from 4 to 2


def test_a_ratio_lowered_below_two_refuses_to_start(available: list[int]) -> None:
    available[0] = 2 * GIB  # 1.6 GiB allowed: ratio 1.6
    with pytest.raises(ConfigInvalid, match=r"the ratio that fits, 1\.60, is below 2"):
        plan_host_pages(HiCacheArgs(), DEVICE, PAGE)


def test_a_size_overrides_the_ratio_and_is_refused_when_it_does_not_fit(
    available: list[int],
) -> None:
    assert plan_host_pages(HiCacheArgs(hicache_size=3), DEVICE, PAGE) == 3 * 10**9 // PAGE
    with pytest.raises(ConfigInvalid, match="--hicache-size 100"):
        plan_host_pages(HiCacheArgs(hicache_size=100), DEVICE, PAGE)


def test_tensor_parallel_ranks_each_take_their_share_of_the_memory(
    available: list[int],
) -> None:
    available[0] = 16 * GIB  # 12.8 GiB allowed, 3.2 GiB per rank of 4
    args = HiCacheArgs(hicache_ratio=4)
    assert plan_host_pages(args, DEVICE, PAGE, ranks_on_host=2) == 4 * DEVICE
    assert plan_host_pages(args, DEVICE, PAGE, ranks_on_host=4) == int(0.8 * 4 * GIB) // PAGE
    with pytest.raises(ConfigInvalid, match=r"1/4 \(one rank's share\) of 80%"):
        plan_host_pages(HiCacheArgs(hicache_size=4), DEVICE, PAGE, ranks_on_host=4)


def test_a_ratio_below_two_is_rejected_by_the_config() -> None:
    with pytest.raises(ConfigInvalid, match=r"--hicache-ratio 1\.5: must be >= 2"):
        HiCacheArgs(hicache_ratio=1.5)


def test_the_probe_reads_meminfo() -> None:
    assert sizing.mem_available_bytes() > 0
