"""Host time per decode step of handing the batch its page table: every row's whole page list
(the plan carries it, the builder writes a [batch, pages] table and copies it over) against
slot page lists kept in place (`SlotPages`: the rows carry only changes, the table is gathered
where it lives).

A decode step at `--batch` rows, each at a context of each `--contexts` tokens (page 128), one
row in 128 crossing a page boundary per step as in steady decode. Times the row building (the
scheduler's part) plus `ForwardBatch.build`, on this machine's CPU (the host work is the same
with a GPU; the device table lives on the CPU here). Prints a table, writes JSON.

    python perf/bench_page_table.py [--batch 64 256] [--contexts 4096 131072 1048576]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from m3serve.model.batch import ForwardBatch
from m3serve.model.slot_pages import SlotPages
from m3serve.runtime.messages import SeqStep

PAGE = 128
STEPS = 64


def per_step_us(batch: int, context: int, deltas: bool) -> float:
    pages_each = -(-(context + 1) // PAGE)
    lists = [list(range(r * pages_each, (r + 1) * pages_each)) for r in range(batch)]
    slot_pages = SlotPages(batch, pages_each + 1, "cpu") if deltas else None
    if slot_pages is not None:  # the first step of each slot sends its whole list
        first = [SeqStep([1], context, lists[r], slot=r) for r in range(batch)]
        ForwardBatch.build(first, PAGE, "cpu", slot_pages=slot_pages)
    started = time.perf_counter()
    for step in range(STEPS):
        rows = []
        for r in range(batch):
            crossing = (r + step) % PAGE == 0  # this row's list grew by a page
            if deltas:
                new = [lists[r][-1]] if crossing else []
                start = len(lists[r]) - len(new)
                rows.append(SeqStep([1], context, new, slot=r, page_start=start))
            else:
                rows.append(SeqStep([1], context, list(lists[r]), slot=r))
        ForwardBatch.build(rows, PAGE, "cpu", slot_pages=slot_pages)
    return (time.perf_counter() - started) / STEPS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 131072, 1048576])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'batch':>5} {'context':>8} {'whole lists µs':>15} {'slot pages µs':>14} {'ratio':>6}")
    for batch in args.batch:
        for context in args.contexts:
            whole = per_step_us(batch, context, deltas=False)
            kept = per_step_us(batch, context, deltas=True)
            rows.append({"batch": batch, "context": context, "whole_us": whole, "slot_us": kept})
            print(f"{batch:5d} {context:8d} {whole:15.0f} {kept:14.0f} {whole / kept:5.1f}x")
    out = args.out or Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out = out / "bench_page_table.json" if out.suffix != ".json" else out
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "bench_page_table", "machine": platform.machine(), "rows": rows}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
