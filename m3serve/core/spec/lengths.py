"""`SlotLengths`: each slot's KV length as the executor thread knows it, so verify steps can run
under the overlap scheduler.

With overlap, step N+1 is planned before the scheduler has seen step N's verdict, so the
scheduler does not know how many of step N's drafts were accepted: the start it writes into a
decode or verify row of N+1 is a lower bound (every committed token it has seen, plus one anchor
per step in flight). The executor thread runs the steps in order, so when it builds N+1 it has
already verified N: it keeps each slot's true length here and puts it in place of the planned
start. The scheduler reserves pages for the worst case (every draft in flight accepted), so the
true block always lies inside the row's pages; it gives back the surplus once N is processed.

A prefill chunk carries its exact start (the scheduler always knows it), so a slot's length is
reset by every chunk, which is also how a new request, or one recomputed after retraction, takes
over a slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from m3serve.runtime.messages import SeqStep


class SlotLengths:
    def __init__(self, num_slots: int) -> None:
        # Tokens of the slot's request whose KV is final (committed), after the last step run.
        self._lengths = [0] * num_slots

    def resolve(self, seqs: Sequence[SeqStep]) -> list[SeqStep]:
        """The seqs with each decode or verify row starting at its slot's committed length."""
        resolved = []
        for seq in seqs:
            known = self._lengths[seq.slot]
            if seq.input_ids is not None or known == seq.start:
                resolved.append(seq)
                continue
            if known < seq.start:
                raise RuntimeError(
                    f"slot {seq.slot}: the plan starts a decode at {seq.start}, past the "
                    f"{known} tokens committed"
                )
            resolved.append(msgspec.structs.replace(seq, start=known))
        return resolved

    def advance(self, seq: SeqStep, committed: int) -> None:
        """`seq` ran (with its resolved start) and kept the KV of its first `committed` tokens:
        a prefill chunk all of them, a decode its input, a verify row its anchor and the
        accepted drafts."""
        self._lengths[seq.slot] = seq.start + committed

    def place(self, seqs: Sequence[SeqStep]) -> None:
        """Each row's slot at the row's planned start: the warm-up's rows continue no request,
        so their starts are taken as they are."""
        for seq in seqs:
            self._lengths[seq.slot] = seq.start
