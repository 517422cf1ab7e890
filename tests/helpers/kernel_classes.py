"""A stand-in for Triton's loads in one process, for warm-up record tests
(core/warmup_record.py): a plan brings in its token count's power-of-two class, and on rank 1
also its row count's, so that two ranks' plans differ."""

from __future__ import annotations

from m3serve.runtime.messages import StepPlan


class KernelClasses:
    def __init__(self, rank: int = 0) -> None:
        self.loaded: set[tuple[str, int]] = set()
        self.rank = rank
        self.plans = 0  # plans seen

    def see(self, plan: StepPlan) -> None:
        self.plans += 1
        tokens = sum(seq.extend for seq in plan.seqs)
        self.loaded.add(("tokens", 1 << (tokens - 1).bit_length()))
        if self.rank == 1:
            self.loaded.add(("rows", len(plan.seqs)))

    def count(self) -> int:
        return len(self.loaded)
