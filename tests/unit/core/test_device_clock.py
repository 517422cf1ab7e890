"""A CPU has no device span: its steps run in their launch, and the run's time is theirs."""

from __future__ import annotations

import torch

from m3serve.core.device_clock import start_span


def test_a_cpu_step_has_no_device_span() -> None:
    assert start_span(torch.device("cpu")) is None
