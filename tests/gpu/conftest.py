"""GPU tests run on the lent H200 by the developer; without CUDA they are skipped."""

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.path):
            item.add_marker(skip)
