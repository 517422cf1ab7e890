"""Backend selection (m3serve.backends): what `--backend` and `--moe-runner-backend` resolve to,
and the one-line refusals when they cannot run here."""

from __future__ import annotations

import pytest
import torch

from m3serve.backends import BackendUnavailable, check_backend, create_backend
from m3serve.runtime.config import ServerArgs

CPU = torch.device("cpu")


def test_the_reference_backend_runs_dense_experts_and_dequantizes_at_load() -> None:
    backend = create_backend("reference", CPU, "torch")
    assert backend.name == "reference" and not backend.capturable
    assert backend.weight_formats == frozenset()
    assert check_backend("auto", CPU) == "reference"


def test_a_moe_runner_the_backend_lacks_is_refused_with_the_choices() -> None:
    with pytest.raises(BackendUnavailable, match=r"triton does not run on backend 'reference'"):
        check_backend("reference", CPU, "triton")
    with pytest.raises(BackendUnavailable, match=r"choose from auto, torch"):
        create_backend("reference", CPU, "marlin")


def test_a_moe_runner_this_build_lacks_is_listed_with_the_other_unsupported_settings() -> None:
    problems = ServerArgs.from_kwargs(moe_runner_backend="flashinfer_cutlass").unsupported()
    assert problems == ["--moe-runner-backend flashinfer_cutlass (auto, triton, torch)"]
    assert ServerArgs.from_kwargs(moe_runner_backend="triton").unsupported() == []
