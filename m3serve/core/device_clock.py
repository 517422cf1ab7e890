"""A step's device time: two CUDA timing events around its kernels (`DeviceSpan`).

The executor's wall time around a step's run is what a step cost only while each step is
launched after the one before it has given its tokens back. A step launched ahead
(core/step_runner.py) may have been queued, or even begun on the device, before its run starts:
where its launch came after the step before had finished (the executor waited for its plan), the
kernels queued meanwhile ran before the run's clock started, and the run read short. The
mixed-step budget (core/mixed_budget.py), fed such runs, let mixed steps grow past its stretch
(an H100 at 64 streams: budgets of ~1000 prompt tokens, whose steps ran 10.3 ms beside 2.7 ms
decode steps, 3.8x where the stretch is 2.5). The events time a step from where the device
reaches its first kernel (the step before it done, or the step's launch, whichever is later) to
its draw: that includes any wait of the device for the host's launch inside the step, and no
idle gap before it. None on a CPU, whose steps run in their launch (the run's time is theirs).
"""

from __future__ import annotations

import torch


class DeviceSpan:
    """Started where a step's kernels begin to be queued; `stop` after its draw is queued."""

    def __init__(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()
        self._end: torch.cuda.Event | None = None

    def stop(self) -> None:
        self._end = torch.cuda.Event(enable_timing=True)
        self._end.record()

    def seconds(self) -> float | None:
        """The device time between the two events, once the second has been reached (after
        the step's tokens are on the host it has); None before, or if never stopped."""
        end = self._end
        if end is None or not end.query():
            return None
        return self._start.elapsed_time(end) / 1e3


def start_span(device: torch.device) -> DeviceSpan | None:
    """A span started now on the current stream; None on a CPU or while a CUDA graph is being
    captured (a timing event cannot be part of one)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    return DeviceSpan()


def seconds_of(span: DeviceSpan | None) -> float | None:
    """`span.seconds()`, None without a span."""
    return span.seconds() if span is not None else None
