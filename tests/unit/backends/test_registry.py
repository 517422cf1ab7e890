"""Backend selection (m3serve.backends): what `--backend` and `--moe-runner-backend` resolve to,
and the one-line refusals when they cannot run here."""

from __future__ import annotations

import argparse

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


def test_the_mxfp8_bf16_copy_flag_reaches_the_kernel_section_and_the_reference_ignores_it() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_arguments(parser)
    args = ServerArgs.from_args(parser.parse_args([]))
    assert args.kernel.mxfp8_bf16_copy and ServerArgs().kernel.mxfp8_bf16_copy  # the default
    saving = ServerArgs.from_args(parser.parse_args(["--no-mxfp8-bf16-copy"]))
    assert not saving.kernel.mxfp8_bf16_copy
    assert args.unsupported() == []  # built: not refused at start with the planned flags
    # The reference backend holds MXFP8 projections dequantized already: nothing to copy.
    backend = create_backend("reference", CPU, "auto", mxfp8_bf16_copy=True)
    assert backend.name == "reference" and backend.weight_formats == frozenset()
