"""A model-free stand-in for `EngineCore.run` that checks the scheduler's bookkeeping end to end.

Its "KV cache" stores token ids: every step writes each input token at the slot its page table
names, and the next token is a hash of the whole sequence *read back through the page table*.
So wrong pages, a stale prefix-cache hit, a page freed too early or a mis-fed decode input all
change the tokens, and a test only has to compare against the same hash run alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from m3serve.model.slot_pages import SlotPages
from m3serve.runtime.messages import SeqStep, StepPlan, StepResult

VOCAB = 1000


def next_token(sequence: list[int]) -> int:
    digest = hashlib.blake2b(repr(sequence).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def reference_output(prompt: list[int], max_new: int, stop: frozenset[int]) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_new:
        token = next_token(seq)
        out.append(token)
        seq.append(token)
        if token in stop:
            break
    return out


class FakeModel:
    """`deltas`: the plans' rows carry page-list changes (the scheduler's `page_deltas`), which
    this model applies to slot lists (`SlotPages`) as the engine core does before it reads."""

    def __init__(self, num_pages: int, page_size: int, max_slots: int, deltas: bool = False):
        self.page_size = page_size
        self.kv: list[int | None] = [None] * (num_pages * page_size)
        self.last_tokens = [0] * max_slots
        self.slot_pages = SlotPages(max_slots, num_pages, "cpu") if deltas else None

    def whole_pages(self, seqs: Sequence[SeqStep]) -> list[SeqStep]:
        """The rows with whole page lists: with deltas, each row's change applied to its slot's
        list and the list read back."""
        if self.slot_pages is None:
            return list(seqs)
        self.slot_pages.update(seqs)
        host, lengths = self.slot_pages.host, self.slot_pages.lengths
        return [
            msgspec.structs.replace(s, pages=host[s.slot, : lengths[s.slot]].tolist(), page_start=0)
            for s in seqs
        ]

    def run(self, plan: StepPlan) -> StepResult:
        slots, tokens = [], []
        for seq in self.whole_pages(plan.seqs):
            inputs = seq.input_ids if seq.input_ids is not None else [self.last_tokens[seq.slot]]
            assert len(inputs) == seq.extend
            for offset, token in enumerate(inputs):
                self.kv[self._slot(seq.pages, seq.start + offset)] = token
            if seq.sample:
                end = seq.start + seq.extend
                history = [self.kv[self._slot(seq.pages, p)] for p in range(end)]
                assert None not in history, "read a KV slot nobody wrote"
                token = next_token(history)
                self.last_tokens[seq.slot] = token
                slots.append(seq.slot)
                tokens.append(token)
        return StepResult(step=plan.step, slots=slots, tokens=tokens)

    def _slot(self, pages: list[int], position: int) -> int:
        return pages[position // self.page_size] * self.page_size + position % self.page_size
