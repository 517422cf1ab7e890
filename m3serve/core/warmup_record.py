"""Which warm-up plans a restart runs: the record of the plans that brought in a kernel variant.

The warm-up pass (core/warmup.py) runs every step shape class: 7635 plans on the 4-layer
M3.1-shaped slice at a 4K context, 47 s of an H200's start-up with every kernel already in
Triton's disk cache (perf/results/h200_2026-12-07_mixed_launch/), and 12208 plans carrying
11.2M prompt tokens at a 1M context. Only a few of them launch a kernel variant that no plan
before them did (the slice's pass loaded 165 kernels). Launch decisions are functions of a
plan's shapes alone, so a process that runs only those plans, in the same order, brings in every
variant the whole pass does (tests/unit/core/test_warmup.py checks it with Triton's own
specialization keys).

The first start runs the whole pass and notes each plan after which Triton's post-compile hook
had fired (it fires for a compile and for a load from the disk cache alike:
`trace.CompileCounter`); a later start whose key matches runs only those. The key hashes all a
launch decision can depend on: m3serve's source, the Triton and torch versions, the device, the
settings, the model's config and dtype, and the warm-up's own limits and layers. A changed key,
a missing or unreadable record: the whole pass runs and writes it anew (`--full-warmup` always
runs it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from m3serve.core.warmup import WarmupLimits
from m3serve.model.parallel import RankGroup

log = logging.getLogger(__name__)


@functools.cache
def source_digest() -> str:
    """A hash of every Python file of the m3serve package (its path and its bytes)."""
    root = Path(__file__).resolve().parents[1]  # the m3serve package
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """`value` as JSON can hold it, the same in every process (sets sorted: their order
    follows string hashes, which differ from process to process)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def record_key(parts: Mapping[str, Any]) -> str:
    """The hash of `parts` (anything dataclasses, mappings, sequences, sets and scalars make)
    and of m3serve's source."""
    text = json.dumps(_plain(parts), sort_keys=True)
    return hashlib.sha256(f"{source_digest()}\n{text}".encode()).hexdigest()[:32]


class WarmupRecord:
    """One key's record under `directory`: the indices, in the order `warmup_plans` gives them,
    of the plans that brought in a kernel variant."""

    def __init__(self, directory: Path, key: str) -> None:
        self.path = directory / f"{key}.json"
        self.key = key

    def load(self) -> frozenset[int] | None:
        """The plans to run; None where there is no usable record (the whole pass runs)."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("warm-up record %s unreadable (%s): running the whole pass", self.path, exc)
            return None
        loaded = raw.get("loaded") if isinstance(raw, dict) else None
        if (
            not isinstance(loaded, list)
            or not all(isinstance(i, int) for i in loaded)
            or raw.get("key") != self.key
        ):
            log.warning("warm-up record %s malformed: running the whole pass", self.path)
            return None
        return frozenset(loaded)

    def save(self, plans: int, loaded: list[int]) -> None:
        """Write the record (whole, or not at all: a start that dies halfway leaves none)."""
        body = json.dumps({"key": self.key, "plans": plans, "loaded": loaded})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(body)
            partial.replace(self.path)
        except OSError as exc:  # a read-only cache: the next start runs the whole pass again
            log.warning("could not write the warm-up record %s: %s", self.path, exc)


@dataclasses.dataclass(frozen=True)
class Recorder:
    """Where a start keeps its warm-up record and what it counts loads with: `parts` is what
    the key hashes besides the pass's own limits and layers (`record`), `compiles` the kernels
    brought in so far (trace.CompileCounter.count). Under --tp every rank runs the same plans
    (their collectives pair up): the ranks agree on the record's plans or all run the whole
    pass, whose record is the union of the plans that brought in a kernel on any rank, written
    by rank 0."""

    directory: Path
    parts: Mapping[str, Any]
    compiles: Callable[[], int]
    ranks: RankGroup = dataclasses.field(default_factory=RankGroup)

    def record(self, limits: WarmupLimits, layers: list[int], gamma: int) -> WarmupRecord:
        # The pool's page count moves with the free memory at start; the plans only take page
        # numbers from it (values, not shapes), so it stays out of the key.
        pass_limits = dataclasses.replace(limits, num_pages=0)
        key = record_key({**self.parts, "limits": pass_limits, "layers": layers, "gamma": gamma})
        return WarmupRecord(self.directory, key)

    def agree(self, chosen: frozenset[int] | None) -> frozenset[int] | None:
        """`chosen` where every rank loaded the same plans, else None on every rank."""
        if self.ranks.size == 1:
            return chosen
        text = json.dumps(sorted(chosen)) if chosen is not None else ""
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
        mine = digest if chosen is not None else -1
        # The smallest digest and the smallest negated one: equal when every rank's is.
        both = torch.tensor([mine, -mine], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=self.ranks.host)
        return chosen if int(both[0]) == -int(both[1]) else None

    def union(self, loaded: list[int], plans: int) -> list[int]:
        """The plans that brought in a kernel on any rank (`loaded`: this rank's)."""
        if self.ranks.size == 1:
            return loaded
        mask = torch.zeros(plans, dtype=torch.int32)
        mask[loaded] = 1
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.ranks.host)
        return mask.nonzero().flatten().tolist()

    def save(self, record: WarmupRecord, plans: int, loaded: list[int]) -> None:
        """The whole pass's record: every rank's plans, written once (by rank 0)."""
        union = self.union(loaded, plans)
        if self.ranks.rank == 0:
            record.save(plans, union)
