"""`upload` and `upload_many`: a step's small host arrays onto the device, values and dtype kept."""

from __future__ import annotations

import numpy as np
import torch

from m3serve.model.host_copy import upload, upload_many


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
