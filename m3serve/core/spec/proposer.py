"""Who proposes the drafts a verify step checks: the `Proposer` contract and the DSpark one.

`DSparkProposer` owns the draft network and the draft KV pool, the third paged pool beside the
target's K/V and index-K: allocated over the same page ids (plus the scratch page), so a token's
draft K/V sits at the token's target KV slot and the scheduler's page accounting and radix tree
manage all three at once — a cached prefix page carries its draft KV, a freed page frees it.
On a capturable backend an all-greedy proposal replays a CUDA graph (draft_graphs.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from m3serve.core.spec.draft_graphs import DraftGraphs
from m3serve.model.backend import Backend
from m3serve.model.dspark import DSparkDraft
from m3serve.model.dspark_loader import load_dspark
from m3serve.model.dspark_paged import BlockProposal, DraftKV, propose, write_context
from m3serve.model.m3 import M3ForCausalLM


class Proposer(Protocol):
    """What a verify step needs from a draft."""

    @property
    def layer_ids(self) -> list[int]:
        """The target layers whose residual streams `commit` takes, concatenated."""
        ...

    def propose(
        self,
        anchors: torch.Tensor,
        anchor_pos: list[int],
        page_table: torch.Tensor,
        temperatures: list[float],
        generators: list[torch.Generator | None],
    ) -> BlockProposal:
        """A block per row after its anchor token [R] at `anchor_pos`; page_table [R, P]."""
        ...

    def commit(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Committed tokens' target features [N, F] at `positions`, KV `slots` [N]."""
        ...


class DSparkProposer:
    def __init__(self, draft: DSparkDraft, kv: DraftKV) -> None:
        self.draft, self.kv = draft, kv
        # CUDA graphs of greedy proposals (SpecPlugin.capture_graphs, hopper); None: eager.
        self.graphs: DraftGraphs | None = None

    @classmethod
    def load(
        cls,
        path: Path,
        target: M3ForCausalLM,
        backend: Backend,
        num_pages: int,
        page_size: int,
        kv_dtype: torch.dtype,
        kv: DraftKV | None = None,
    ) -> DSparkProposer:
        """`kv`: the draft KV pool allocated beforehand (the HiCache host tier copies it)."""
        draft = load_dspark(path, target, backend, target.dtype)
        if kv is None:
            kv = DraftKV.allocate(draft.cfg, num_pages, page_size, kv_dtype, target.device)
        return cls(draft, kv)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.draft.cfg.target_layer_ids)

    def propose(
        self,
        anchors: torch.Tensor,
        anchor_pos: list[int],
        page_table: torch.Tensor,
        temperatures: list[float],
        generators: list[torch.Generator | None],
    ) -> BlockProposal:
        graphs = self.graphs
        if graphs is not None and graphs.fits(len(anchor_pos), page_table, temperatures):
            return BlockProposal(graphs.propose(anchors, anchor_pos, page_table), None)
        return propose(
            self.draft, self.kv, anchors, anchor_pos, page_table, temperatures, generators
        )

    def commit(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        write_context(self.draft, self.kv, features, positions, slots)
