"""A request as the scheduler sees it: its tokens, its KV pages and where it is in its life."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from m3serve.core.kvcache.radix import Match
from m3serve.core.media import ReqMedia, media_key
from m3serve.runtime.messages import Finish, SamplingParams

if TYPE_CHECKING:
    from m3serve.core.grammar import Grammar
    from m3serve.core.hicache.tickets import Completion


class Phase(Enum):
    WAITING = "waiting"  # queued, holds no KV (new, or retracted to be recomputed)
    RUNNING = "running"  # holds a slot and pages; prefilling or decoding
    DONE = "done"  # finished or aborted; resources released


@dataclass(eq=False)
class Req:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    worker: int
    max_new: int = 0  # resolved max_new_tokens (0: take it from sampling)
    output: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)  # match pages first, then own pages
    # Leading pages its slot's device list already holds as they are (page deltas): a step sends
    # pages from here on. Lowered when pages are given back, 0 at each admission (a new list).
    pages_synced: int = 0
    match: Match | None = None
    kv_len: int = 0  # tokens whose KV is computed or scheduled in a step in flight
    prefilled: bool = False  # the last prefill chunk is scheduled: from now on, decode
    cached_tokens: int = 0  # prefix-cache hit at first admission (what usage reports)
    admitted_once: bool = False
    inflight: int = 0  # sampling steps submitted whose token has not come back yet
    retractions: int = 0
    # Speculative decoding: verify steps run, and the tokens they committed (what the per-request
    # acceptance length is made of).
    spec_steps: int = 0
    spec_tokens: int = 0
    # Drafts of its verify rows in flight: positions past kv_len that those steps may still keep
    # (overlap plans the next step before the verdict is in, so pages are held for all of them).
    spec_unseen: int = 0
    finish: Finish | None = None
    grammar: Grammar | None = None  # its constraint, compiled (set before it is queued)
    # HiCache L3: its prefix being fetched into host memory. Admission passes over the request
    # (and takes the ones behind it) until this is done; the fetch then adds the pages with
    # HiPrefixCache.add_host_prefix and admission loads them back like any host hit.
    fetch: Completion | None = None
    media: list[ReqMedia] = field(default_factory=list)  # its images/videos, in prompt order
    # The prompt as the prefix cache keys it (placeholders by content hash); set at creation.
    key_prompt: list[int] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        """Nothing it waits for before admission is still under way."""
        return self.fetch is None or self.fetch.done()

    @property
    def tokens(self) -> list[int]:
        """The sequence whose KV a (re)admission computes: prompt plus output so far."""
        return self.prompt + self.output

    @property
    def key_tokens(self) -> list[int]:
        """`tokens` as the prefix cache keys them (the same list content without media)."""
        return self.key_prompt + self.output

    @property
    def prefill_target(self) -> int:
        return len(self.prompt) + len(self.output)

    def __post_init__(self) -> None:
        self.key_prompt = media_key(self.prompt, self.media) if self.media else self.prompt
        if not self.max_new:
            self.max_new = self.sampling.max_new_tokens or 1

    @property
    def remaining_new(self) -> int:
        return max(self.max_new - len(self.output), 0)
