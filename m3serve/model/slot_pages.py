"""Each slot's KV page list, kept where the kernels read it: a device table updated by the
changes a step's rows carry (`SeqStep.page_start` on), and a host copy for the few entries the
batch builder reads (the pages its new tokens are written to).

A running request changes its list only when it crosses a page boundary (or a speculative step
gives pages back), so a step writes a handful of entries, not every request's whole list: at a
1M-token context that list is 8192 pages. A slot's row is -1 past its list, as a batch's page
table is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from m3serve.model.host_copy import upload_many
from m3serve.runtime.messages import SeqStep


class SlotPages:
    def __init__(self, num_slots: int, max_pages: int, device: torch.device | str) -> None:
        self.host = np.full((num_slots, max_pages), -1, np.int64)
        self.lengths = np.zeros(num_slots, np.int64)
        self.table = torch.full((num_slots, max_pages), -1, dtype=torch.int32, device=device)

    @property
    def max_pages(self) -> int:
        return self.host.shape[1]

    def update(self, seqs: Sequence[SeqStep]) -> None:
        """Apply each row's change to its slot's list: `pages` from `page_start` on, the rest
        of the old list dropped. One host-to-device copy for all rows (none if none changed)."""
        changed = self.changes(seqs)
        if changed is not None:
            self.write(*upload_many(changed, self.table.device))

    def changes(self, seqs: Sequence[SeqStep]) -> list[tuple[np.ndarray, torch.dtype]] | None:
        """Apply the rows' changes to the host lists; the device table's changed entries, as
        the arrays `write` takes once uploaded (a step's batch sends them in its one copy), or
        None where no list changed."""
        flat: list[np.ndarray] = []  # entries of the flattened table
        values: list[np.ndarray] = []
        for seq in seqs:
            old, new = int(self.lengths[seq.slot]), seq.num_pages
            if seq.page_start > old:
                raise ValueError(
                    f"slot {seq.slot}: pages from index {seq.page_start} on, but the slot "
                    f"holds {old}"
                )
            if new > self.max_pages:
                raise ValueError(f"slot {seq.slot}: {new} pages, the table holds {self.max_pages}")
            if not seq.pages and new == old:
                continue
            row = self.host[seq.slot]
            row[seq.page_start : new] = seq.pages
            row[new:old] = -1
            self.lengths[seq.slot] = new
            changed = np.arange(seq.page_start, max(new, old))
            flat.append(seq.slot * self.max_pages + changed)
            values.append(row[changed])
        if not flat:
            return None
        return [(np.concatenate(flat), torch.int64), (np.concatenate(values), torch.int32)]

    def write(self, index: torch.Tensor, value: torch.Tensor) -> None:
        """The device table's entries at flat `index` set to `value` (`changes`, uploaded).
        Flat indices and one index_copy_: a two-tensor index_put_ cost the host several times
        as much (its index tensors expanded and checked every step)."""
        self.table.view(-1).index_copy_(0, index, value)
