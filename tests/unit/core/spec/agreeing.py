"""A test-only proposer that agrees with the target: it drafts each block by decoding the
target itself, one token at a time, at the verify row's own KV slots (the verify forward
rewrites those slots with the same values): greedy rows take the argmax, sampled rows draw
from the target's tempered distribution without its top-k / top-p cut, which is then the
draft's q. Its acceptance shows that acceptance is wired."""

from __future__ import annotations

import torch

from m3serve.model.batch import ForwardBatch
from m3serve.model.dspark_paged import BlockProposal
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.messages import SeqStep


class TargetProposer:
    def __init__(self, model: M3ForCausalLM, kv: KVCache, block: int, layer_ids: list[int]):
        self.model, self.kv, self.block, self._layer_ids = model, kv, block, layer_ids
        self.proposed = 0

    @property
    def layer_ids(self) -> list[int]:
        return self._layer_ids

    def propose(
        self,
        anchors: torch.Tensor,
        anchor_pos: list[int],
        page_table: torch.Tensor,
        temperatures: list[float],
        generators: list[torch.Generator | None],
    ) -> BlockProposal:
        pages = [[p for p in row if p >= 0] for row in page_table.tolist()]
        tokens, logits, prev = [], [], anchors.tolist()
        for k in range(self.block):
            seqs = [
                SeqStep([t], pos + k, row, slot=i)
                for i, (t, pos, row) in enumerate(zip(prev, anchor_pos, pages, strict=True))
            ]
            step = self.model(ForwardBatch.build(seqs, self.kv.page_size, "cpu"), self.kv)
            prev = step.argmax(dim=-1).tolist()
            for row, temperature in enumerate(temperatures):
                if temperature > 0:
                    probs = torch.softmax(step[row] / temperature, dim=-1)
                    prev[row] = int(torch.multinomial(probs, 1, generator=generators[row])[0])
            tokens.append(torch.tensor(prev))
            logits.append(step)
        self.proposed += len(anchor_pos)
        return BlockProposal(torch.stack(tokens, dim=1), torch.stack(logits, dim=1))

    def commit(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        pass  # it keeps no draft KV
