"""`upload` and `upload_many`: a step's small host arrays onto the device, values and dtype kept;
`Download`: device values back; `Packed`: a graph's static arrays in one allocation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m3serve.model.host_copy import Download, Packed, _per_device, upload, upload_many


def test_upload_keeps_values_and_takes_the_asked_dtype() -> None:
    ids = upload([3, 1, 2], torch.int64, "cpu")
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 1, 2]
    knobs = upload([[1.0, 0.95], [0.7, 1.0]], torch.float32, torch.device("cpu"))
    assert knobs.dtype == torch.float32 and knobs.shape == (2, 2)
    table = upload(np.array([[5, -1]], np.int64), torch.int32, "cpu")
    assert table.dtype == torch.int32 and table.tolist() == [[5, -1]]
    assert upload([], torch.int64, "cpu").shape == (0,)


def test_upload_many_returns_each_array_with_its_dtype_and_shape() -> None:
    ids, knobs, table = upload_many(
        [
            ([3, 1, 2], torch.int64),
            ([[1.0, 0.95], [0.7, 1.0]], torch.float32),
            (np.array([[5, -1]], np.int64), torch.int32),
        ],
        "cpu",
    )
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 1, 2]
    assert knobs.dtype == torch.float32
    assert torch.equal(knobs, torch.tensor([[1.0, 0.95], [0.7, 1.0]]))
    assert table.dtype == torch.int32 and table.tolist() == [[5, -1]]


def test_a_download_of_a_host_tensor_gives_its_values() -> None:
    tokens = torch.tensor([[3, 1], [4, 1]])
    assert Download(tokens).tolist() == [[3, 1], [4, 1]]


def test_each_device_gets_one_staging_entry_made_on_first_use() -> None:
    made: list[torch.device] = []
    table: dict[torch.device, object] = {}
    device = torch.device("cuda", 1)  # an explicit index: no CUDA call needed
    first = _per_device(table, device, lambda d: made.append(d) or object())
    assert _per_device(table, device, lambda d: made.append(d) or object()) is first
    assert made == [device]


def test_packed_views_sit_at_64_byte_boundaries_of_one_allocation_and_fill_in_order() -> None:
    packed = Packed([(3, torch.float32), (5, torch.int32), (2, torch.int64)], torch.device("cpu"))
    assert packed.offsets == [0, 64, 128]
    base = packed.buffer.data_ptr()
    assert [v.data_ptr() - base for v in packed.views] == packed.offsets
    assert [(v.dtype, v.numel()) for v in packed.views] == [
        (torch.float32, 3), (torch.int32, 5), (torch.int64, 2)
    ]  # fmt: skip
    packed.fill([[0.5, 1.0, 2.0], np.arange(5), [7, -1]])
    assert packed.views[0].tolist() == [0.5, 1.0, 2.0]
    assert packed.views[1].tolist() == [0, 1, 2, 3, 4] and packed.views[2].tolist() == [7, -1]
    with pytest.raises(ValueError, match="shape"):
        packed.fill([[0.5], np.arange(5), [7, -1]])
    with pytest.raises(ValueError, match="2 arrays for 3"):
        packed.fill([[0.5, 1.0, 2.0], np.arange(5)])


def test_a_packed_fill_from_an_array_on_leaves_the_ones_before_it() -> None:
    packed = Packed([(2, torch.int64), (3, torch.float32), (1, torch.int32)], torch.device("cpu"))
    packed.fill([[4, 5], [1.5, 2.5, 3.5], [9]])
    packed.fill([[0.25] * 3, [-3]], first=1)
    assert [v.tolist() for v in packed.views] == [[4, 5], [0.25] * 3, [-3]]
    with pytest.raises(ValueError, match="1 arrays for 2"):
        packed.fill([[0.25] * 3], first=1)
