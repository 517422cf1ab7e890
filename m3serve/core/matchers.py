"""Per-slot grammar state for constrained requests: which tokens each may take next (a packed
bitmask the sampler applies to the logits) and the tokens it took.

Everything here runs on the executor thread, inside `EngineCore.run`. That thread runs steps
strictly in order and samples every token itself, so when step N+1 fills its masks the tokens of
step N are already accepted — with the overlap scheduler on or off, although the event loop
has not seen those tokens yet. `run` fills the masks after it has launched the forward and
before it samples: on a GPU the (host) mask filling overlaps the (device) forward; on the CPU
backend the forward is synchronous and the two run one after the other.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import xgrammar

from m3serve.core.grammar import Grammar
from m3serve.runtime.messages import SKIPPED_TOKEN

log = logging.getLogger(__name__)

BITS = 32  # tokens per word of an xgrammar bitmask


class GrammarMatchers:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[int, xgrammar.GrammarMatcher] = {}
        self._narrow: dict[int, torch.Tensor] = {}

    def start(self, slot: int, grammar: Grammar | None, output_ids: Sequence[int] = ()) -> None:
        """A new request in `slot`; `output_ids` are the tokens a recomputed request already
        took, replayed so that its grammar continues where it stopped."""
        self._matchers.pop(slot, None)
        self._narrow.pop(slot, None)
        if grammar is None:
            return
        matcher = xgrammar.GrammarMatcher(grammar.compiled)
        for token in output_ids:
            matcher.accept_token(int(token))
        self._matchers[slot] = matcher
        if grammar.narrow is not None:
            self._narrow[slot] = grammar.narrow

    def constrains(self, slot: int) -> bool:
        """Whether a grammar constrains the request in `slot`."""
        return slot in self._matchers

    def fill(self, slots: Sequence[int]) -> torch.Tensor | None:
        """The allowed-token bitmask [len(slots), ceil(V/32)] (int32, on the CPU) for a step's
        sampled rows; unconstrained rows allow everything. None when no row is constrained."""
        rows = [(i, m) for i, m in enumerate(map(self._matchers.get, slots)) if m is not None]
        if not rows:
            return None
        bitmask = torch.full((len(slots), -(-self.vocab_size // BITS)), -1, dtype=torch.int32)
        for row, matcher in rows:
            # A finished grammar's request is done; its row in a step launched before the
            # engine knew that is discarded, so it stays unconstrained.
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row)
                narrow = self._narrow.get(slots[row])
                if narrow is not None:
                    bitmask[row] &= narrow
        return bitmask

    def accept(self, slots: Sequence[int], tokens: Sequence[int]) -> list[bool]:
        """Advance each constrained row by its sampled token (none for SKIPPED_TOKEN); per row,
        whether its grammar ended with it (empty when no row is constrained)."""
        if not any(slot in self._matchers for slot in slots):
            return []
        return [self._accept(slot, token) for slot, token in zip(slots, tokens, strict=True)]

    def _accept(self, slot: int, token: int) -> bool:
        matcher = self._matchers.get(slot)
        # SKIPPED_TOKEN: a dead row's draw (its request ended on the step before), discarded.
        if matcher is None or token == SKIPPED_TOKEN or matcher.is_terminated():
            return False
        if not matcher.accept_token(token):
            # The mask allowed only tokens the matcher takes; ending the request is safer than
            # constraining the rest of it from a state its output no longer matches.
            log.error("slot %d: the grammar rejected sampled token %d; ending it", slot, token)
            return True
        return matcher.is_terminated()
