"""A step's uploads never wait for the kernels queued before them (H200): with torch's
synchronization debug mode set to error, a blocking copy would raise. The staging buffer they
pass through is reused only after the copies that read it have run."""

from __future__ import annotations

import numpy as np
import torch

from m3serve.model.batch import ForwardBatch
from m3serve.model.host_copy import Download, Packed, upload, upload_many
from m3serve.model.slot_pages import SlotPages
from m3serve.runtime.messages import SeqStep


def test_uploads_and_batch_building_do_not_synchronize() -> None:
    device = torch.device("cuda")
    slot_pages = SlotPages(4, 8, device)
    seqs = [SeqStep([1, 2, 3], 0, [0], slot=0), SeqStep(None, 2, [1], slot=1)]
    busy = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        busy @ busy  # keeps the stream busy while the host uploads
        ids = upload(np.arange(5), torch.int64, device)
        batch = ForwardBatch.build(seqs, 4, device, slot_pages=slot_pages)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.tolist() == [0, 1, 2, 3, 4]
    assert batch.positions.tolist() == [0, 1, 2, 2]
    assert batch.page_table.tolist() == [[0], [1]]
    assert batch.seq_lens_t.tolist() == [3, 3] and batch.extend_starts.tolist() == [0, 3, 4]


def test_staging_wraps_around_without_overwriting_queued_copies() -> None:
    """Many more bytes than the staging buffer holds, sent while the stream is busy: every
    tensor still holds what was sent."""
    device = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=device)
    sent, got = [], []
    for i in range(600):  # ~8 MB through a 2 MB buffer
        if i % 50 == 0:
            busy @ busy
        values = np.arange(i, i + 1700, dtype=np.int64)
        a, b = upload_many([(values, torch.int64), (values[:3], torch.int32)], device)
        sent.append(values)
        got.append((a, b))
    torch.cuda.synchronize()
    for values, (a, b) in zip(sent, got, strict=True):
        assert a.tolist() == values.tolist() and b.tolist() == values[:3].tolist()


def test_packed_fills_queue_behind_the_work_before_them_without_a_sync() -> None:
    """A graph's static arrays refilled many times while the stream is busy: no sync, and
    each fill is what the work queued after it reads (a copy of its values taken then)."""
    device = torch.device("cuda")
    packed = Packed([(5, torch.float32), (5, torch.int64)], device)
    busy = torch.randn(4096, 4096, device=device)
    seen = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3000):  # ~0.4 MB: into a second part of the staging ring
            if i % 500 == 0:
                busy @ busy
            packed.fill([[i + 0.5] * 5, list(range(i, i + 5))])
            seen.append([v.clone() for v in packed.views])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, (floats, ints) in enumerate(seen):
        assert floats.tolist() == [i + 0.5] * 5 and ints.tolist() == list(range(i, i + 5))


def test_a_packed_fill_from_an_array_on_copies_only_those() -> None:
    """A suffix fill (a graph's knobs without its rows) leaves the arrays before it, on the
    device as on the CPU."""
    device = torch.device("cuda")
    packed = Packed([(3, torch.int64), (4, torch.float32), (2, torch.int64)], device)
    packed.fill([[1, 2, 3], [0.5] * 4, [7, 8]])
    packed.fill([[1.5] * 4, [-1, -2]], first=1)
    assert [v.tolist() for v in packed.views] == [[1, 2, 3], [1.5] * 4, [-1, -2]]


def test_a_download_waits_for_its_own_tokens_not_for_work_queued_after() -> None:
    """A step's tokens come back through a copy queued right behind them: a step launched
    after them (here a long chain of matmuls) still runs when they are in."""
    device = torch.device("cuda")
    busy = torch.randn(8192, 8192, device=device)
    torch.cuda.synchronize()
    for turn in range(6):  # past the ring's four buffers: each reused only once read
        tokens = torch.arange(turn, turn + 33, device=device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            download = Download(tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for _ in range(8):
            busy = busy @ busy / 8192
        after = torch.cuda.Event()
        after.record()
        assert download.tolist() == list(range(turn, turn + 33))
        assert not after.query()  # the work queued after the copy was still running
    torch.cuda.synchronize()
