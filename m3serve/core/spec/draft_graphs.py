"""CUDA graphs for the DSpark draft's greedy proposal: per batch-size bucket, the whole block
forward (embedding, every draft layer with its paged block attention, final norm, LM head) and
the slot-by-slot Markov-corrected argmax, captured over static anchors, anchor positions and
page table.

Only all-greedy proposals replay: a sampled row draws from its own host-side generator, so a
step with one runs the eager proposal (dspark_paged.propose). Padding rows are anchor token 0
at position 0 with an empty page table: they see no context and read no pool slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from m3serve.core.graph_set import GraphSet
from m3serve.model.dspark import DSparkDraft
from m3serve.model.dspark_paged import DraftKV, base_logits, greedy_tokens


@dataclass(frozen=True)
class DraftInputs:
    anchors: torch.Tensor  # [bs] int64
    anchor_pos: torch.Tensor  # [bs] int64
    page_table: torch.Tensor  # [bs, max_pages] int32, −1 padded


class DraftGraphs:
    def __init__(
        self,
        draft: DSparkDraft,
        kv: DraftKV,
        sizes: Sequence[int],
        max_pages: int,
        capture: bool = True,
    ) -> None:
        self.draft, self.kv, self.max_pages = draft, kv, max_pages
        self.device = draft.inv_freq.device
        # The tokens come out through a buffer outside the graphs' memory pool: a pool shared
        # with graphs replayed later in the step (the verify forward's) may reuse the pool's
        # blocks for their own intermediates, which would overwrite the drafts before they are
        # verified.
        block = draft.cfg.block_size
        self._tokens = torch.zeros(max(sizes), block, dtype=torch.int64, device=self.device)
        self.graphs = GraphSet(sizes, self._inputs, self._forward, self.device, capture)

    @property
    def sizes(self) -> list[int]:
        return self.graphs.sizes

    def capture(self, pool: object | None = None) -> object | None:
        return self.graphs.capture(pool)

    def fits(self, rows: int, page_table: torch.Tensor, temperatures: Sequence[float]) -> bool:
        return (
            0 < rows <= self.graphs.max_bs
            and page_table.shape[1] <= self.max_pages
            and all(t <= 0 for t in temperatures)
        )

    def propose(
        self,
        anchors: torch.Tensor,
        anchor_pos: Sequence[int] | torch.Tensor,
        page_table: torch.Tensor,
    ) -> torch.Tensor:
        """Greedy draft tokens [rows, block_size] (a view of the graph's output: read it before
        the next proposal replays)."""
        rows = anchors.shape[0]
        bs = self.graphs.bucket(rows)
        static = self.graphs.inputs(bs)
        width = page_table.shape[1]
        positions = torch.as_tensor(anchor_pos, dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        static.anchors[:rows].copy_(anchors)
        static.anchor_pos[:rows].copy_(positions)
        static.page_table[:rows, :width].copy_(page_table)
        static.page_table[:rows, width:].fill_(-1)
        # Padding rows: no context at all (they may hold an earlier step's rows).
        static.anchors[rows:].zero_()
        static.anchor_pos[rows:].zero_()
        static.page_table[rows:].fill_(-1)
        return self.graphs.replay(bs)[:rows]

    def _inputs(self, bs: int) -> DraftInputs:
        device = self.device
        return DraftInputs(
            anchors=torch.zeros(bs, dtype=torch.int64, device=device),
            anchor_pos=torch.zeros(bs, dtype=torch.int64, device=device),
            page_table=torch.full((bs, self.max_pages), -1, dtype=torch.int32, device=device),
        )

    def _forward(self, inputs: DraftInputs) -> torch.Tensor:
        base = base_logits(
            self.draft, self.kv, inputs.anchors, inputs.anchor_pos, inputs.page_table
        )
        tokens = greedy_tokens(self.draft, base, inputs.anchors)
        out = self._tokens[: tokens.shape[0]]
        out.copy_(tokens)
        return out
