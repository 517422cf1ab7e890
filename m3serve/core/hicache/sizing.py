"""How many host pages the HiCache pool gets: `--hicache-size` GB, else `--hicache-ratio` x the
device pool, checked against the host's available memory.

A ratio that does not fit in the allowed share of available memory (`--hicache-host-memory-
fraction`, default 80%) is lowered until it does, and logged; below 2 after lowering the start
is refused, since a host pool barely larger than the device pool keeps almost nothing the device
evicted. An explicit `--hicache-size` that does not fit is refused: the user asked for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from m3serve.runtime.config import ConfigInvalid, HiCacheArgs

log = logging.getLogger(__name__)

MIN_RATIO = 2.0
GB = 10**9  # --hicache-size is in GB, as in SGLang
MEMINFO = Path("/proc/meminfo")


def mem_available_bytes() -> int:
    """The kernel's estimate of memory available to new allocations (MemAvailable)."""
    for line in MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no MemAvailable in {MEMINFO}")


def plan_host_pages(
    args: HiCacheArgs, device_pages: int, page_bytes: int, ranks_on_host: int = 1
) -> int:
    """The host pool's page count for a device pool of `device_pages` pages of `page_bytes`
    (a host page: every pool tensor of the layout, the speculative draft's KV included).
    With tensor parallelism each of the `ranks_on_host` ranks holds a pool of its own KV slice
    (`--hicache-size` is per rank, as in SGLang), so each may take its share of the memory."""
    available = mem_available_bytes()
    allowed = int(available * args.hicache_host_memory_fraction) // ranks_on_host
    share = f"{args.hicache_host_memory_fraction:.0%} of the {_gib(available)} of available"
    if ranks_on_host > 1:
        share = f"1/{ranks_on_host} (one rank's share) of {share}"
    if args.hicache_size > 0:
        pages = args.hicache_size * GB // page_bytes
        if pages * page_bytes > allowed:
            raise ConfigInvalid(
                f"--hicache-size {args.hicache_size}: {_gib(pages * page_bytes)} does not fit in "
                f"{share} host memory ({_gib(allowed)}); lower it or raise "
                "--hicache-host-memory-fraction"
            )
        return max(pages, 1)
    pages = int(device_pages * args.hicache_ratio)
    if pages * page_bytes <= allowed:
        return pages
    fits = allowed // page_bytes
    ratio = fits / device_pages if device_pages else 0.0
    if ratio < MIN_RATIO:
        raise ConfigInvalid(
            f"--hicache-ratio {args.hicache_ratio}: the host pool ({_gib(pages * page_bytes)}) "
            f"does not fit in {share} host memory, and the ratio that fits, {ratio:.2f}, is "
            f"below {MIN_RATIO:g}; free host memory, lower --mem-fraction-static or "
            "--max-total-tokens, or turn HiCache off"
        )
    log.warning(
        "HiCache: --hicache-ratio %g (%s) does not fit in %s host memory; lowered to %.2f (%s)",
        args.hicache_ratio,
        _gib(pages * page_bytes),
        share,
        ratio,
        _gib(fits * page_bytes),
    )
    return fits


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
