"""A batch of attention inputs over a paged KV cache, shared by the Triton attention tests (tiny
shapes in the interpreter, real shapes on the GPU); each test file builds its own."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class AttentionBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    seq_lens: list[int]
    extend_lens: list[int]
    positions: torch.Tensor
    block_ids: torch.Tensor | None

    @property
    def seq_lens_t(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=self.q.device)

    @property
    def extend_starts(self) -> torch.Tensor:
        starts = [0]
        for ext in self.extend_lens:
            starts.append(starts[-1] + ext)
        return torch.tensor(starts, dtype=torch.int32, device=self.q.device)

    def as_fp8(self) -> AttentionBatch:
        fp8 = torch.float8_e4m3fn
        return replace(self, k_cache=self.k_cache.to(fp8), v_cache=self.v_cache.to(fp8))
