"""LayerCalls: a call's launches replayed with the next layer's tensors give what the call gives,
and a call the replay could get wrong is run as it is (on the GPU when there is one, where the
replay launches the compiled kernel; else in Triton's interpreter)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import triton
import triton.language as tl
from helpers.devices import DEVICE

from m3serve.kernels.triton.launches import LayerCalls, Recorded, launch, recording


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, A: tl.constexpr, BLOCK: tl.constexpr = 16):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, A * x + y, mask=mask)


def axpy(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = 2x + y, then out + 1 in place (two launches; the second reads the first's)."""
    n = x.numel()
    launch(_axpy_kernel, (triton.cdiv(n, 16),), x, y, out, n, A=2, num_warps=1)
    launch(_axpy_kernel, (triton.cdiv(n, 16),), out, torch.ones_like(y), out, n, A=1)
    return out


def _vectors(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, y and an output of n elements."""
    return (
        torch.randn(n, device=DEVICE),
        torch.zeros(n, device=DEVICE),
        torch.empty(n, device=DEVICE),
    )


def _counted(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], list[int]]:
    calls = [0]

    def call() -> torch.Tensor:
        calls[0] += 1
        return fn()

    return call, calls


def test_a_replay_launches_the_first_calls_kernels_with_the_next_layers_tensors() -> None:
    y = torch.arange(40, dtype=torch.float32, device=DEVICE)
    layers = [torch.randn(40, device=DEVICE) for _ in range(3)]
    calls, batch = LayerCalls(), object()
    outs, ran = [], []
    with calls.scope(batch):
        for x in layers:
            out = torch.full_like(x, float("nan"))
            call, count = _counted(lambda x=x, out=out: axpy(x, y, out))
            outs.append(calls.run(batch, "axpy", (x, out), call))
            ran.append(count[0])
    assert ran == [1, 0, 0]  # only the first layer went through the call
    for x, out in zip(layers, outs, strict=True):
        assert torch.equal(out, 2 * x + y + 1)


def test_a_recorded_launch_keeps_every_parameter_in_order_with_defaults_and_options() -> None:
    x, y, out = _vectors(8)
    with recording() as launches:
        launch(_axpy_kernel, (1,), x, y, out, 8, A=3, num_warps=1)
    [one] = launches
    assert one.values == [x, y, out, 8, 3, 16] and one.options == {"num_warps": 1}
    assert one.grid == (1, 1, 1)


def test_a_call_that_passes_an_input_on_as_a_view_is_not_replayed() -> None:
    y = torch.zeros(16, device=DEVICE)
    x, out = torch.randn(17, device=DEVICE), torch.empty(16, device=DEVICE)
    with recording() as launches:
        axpy(x[1:], y, out)  # the kernel reads a view of x: a swap of x would miss it
    assert Recorded.make(launches, (x, out), out) is None


def test_a_call_whose_input_reaches_no_kernel_is_not_replayed() -> None:
    x, y, out = _vectors(16)
    with recording() as launches:
        axpy(x.clone(), y, out)
    assert Recorded.make(launches, (x, out), out) is None


@pytest.mark.parametrize(
    "other",
    [
        lambda: torch.randn(24, device=DEVICE),  # another shape
        lambda: torch.randn(16, dtype=torch.float64, device=DEVICE),  # another dtype
        lambda: torch.randn(32, device=DEVICE)[::2],  # other strides
    ],
)
def test_a_layer_whose_tensors_differ_in_form_runs_the_call(
    other: Callable[[], torch.Tensor],
) -> None:
    calls, batch = LayerCalls(), object()
    with calls.scope(batch):
        first, first_out = torch.randn(16, device=DEVICE), torch.empty(16, device=DEVICE)
        calls.run(batch, "axpy", (first, first_out), lambda: axpy(first, first, first_out))
        same, same_out = torch.randn(16, device=DEVICE), torch.empty(16, device=DEVICE)
        call, replayed = _counted(lambda: axpy(same, same, same_out))
        calls.run(batch, "axpy", (same, same_out), call)
        x = other()
        out = torch.empty_like(x)
        call, count = _counted(lambda: axpy(x, x, out))
        calls.run(batch, "axpy", (x, out), call)
    assert replayed[0] == 0 and count[0] == 1


def _runs(calls: LayerCalls, batch: object) -> int:
    x, out = torch.randn(16, device=DEVICE), torch.empty(16, device=DEVICE)
    call, count = _counted(lambda: axpy(x, x, out))
    calls.run(batch, "axpy", (x, out), call)
    return count[0]


def test_outside_the_scope_or_for_another_batch_every_call_runs() -> None:
    calls, batch = LayerCalls(), object()
    assert [_runs(calls, batch) for _ in range(2)] == [1, 1]
    with calls.scope(batch):
        assert [_runs(calls, object()) for _ in range(2)] == [1, 1]
        assert [_runs(calls, batch) for _ in range(2)] == [1, 0]
    assert _runs(calls, batch) == 1


def test_with_the_replay_off_every_call_in_the_scope_runs() -> None:
    calls, batch = LayerCalls(), object()
    calls.replay = False
    with calls.scope(batch):
        assert [_runs(calls, batch) for _ in range(2)] == [1, 1]
