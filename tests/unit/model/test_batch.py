"""ForwardBatch.build's vectorized metadata against the per-token definition, for random steps
(hypothesis): positions, cache slots, page table, lengths, logit rows, the decode rows in front."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from m3serve.model.batch import ForwardBatch
from m3serve.runtime.messages import SeqStep

PAGE = 4


@st.composite
def steps(draw: st.DrawFn) -> list[SeqStep]:
    seqs, next_page = [], 0
    for slot in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 30))
        extend = draw(st.integers(1, 12))
        decode = extend == 1 and draw(st.booleans())
        pages = list(range(next_page, next_page + -(-(start + extend) // PAGE)))
        pages += list(range(pages[-1] + 1, pages[-1] + 1 + draw(st.integers(0, 2))))  # spare
        next_page = pages[-1] + 1
        tokens = st.lists(st.integers(0, 99), min_size=extend, max_size=extend)
        ids = None if decode else draw(tokens)
        seqs.append(SeqStep(ids, start, pages, slot=slot, sample=draw(st.booleans())))
    return seqs


@settings(max_examples=200, deadline=None)
@given(steps(), st.booleans())
def test_the_batch_metadata_is_the_per_token_definition(seqs: list[SeqStep], every: bool) -> None:
    batch = ForwardBatch.build(seqs, PAGE, "cpu", all_logits=every)
    positions, slots, ids, logit_rows = [], [], [], []
    for seq in seqs:
        first = len(ids)
        ids += [0] if seq.input_ids is None else seq.input_ids
        for pos in range(seq.start, seq.start + seq.extend):
            positions.append(pos)
            slots.append(seq.pages[pos // PAGE] * PAGE + pos % PAGE)
        rows = list(range(first, len(ids)))
        logit_rows += rows if every else rows[-1:] if seq.sample else []
    width = max(len(s.pages) for s in seqs)
    assert batch.input_ids.tolist() == ids
    assert batch.positions.tolist() == positions
    assert batch.out_slots.tolist() == slots
    assert batch.page_table.tolist() == [s.pages + [-1] * (width - len(s.pages)) for s in seqs]
    assert batch.seq_lens == [s.start + s.extend for s in seqs]
    assert batch.extend_lens == [s.extend for s in seqs]
    assert batch.logit_rows.tolist() == logit_rows
    assert batch.seq_lens_t is not None and batch.seq_lens_t.tolist() == batch.seq_lens
    assert batch.extend_starts is not None
    starts = batch.extend_starts.tolist()
    assert starts[0] == 0 and [b - a for a, b in itertools.pairwise(starts)] == batch.extend_lens
    assert batch.max_extend == max(batch.extend_lens)
    front = list(itertools.takewhile(lambda e: e == 1, batch.extend_lens))
    assert batch.decode_rows == len(front)
