"""Hardware backends, chosen by name at start: each implements the model's op contract
(`m3serve.model.backend.Backend`) for one kind of device.

`reference` (pure torch, exact, any device) is always available; `hopper` runs Triton kernels
on sm_90+. A backend is imported only when it is asked for, and one that cannot run here refuses
with a message naming what is missing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from m3serve.model.backend import Backend


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why and what to use instead."""


# --moe-runner-backend: what runs the routed experts. auto: the backend's best; triton: the
# W4A16 NVFP4 fused-MoE kernels (hopper); torch: dense experts (NVFP4 dequantized at load).
MOE_RUNNERS: dict[str, tuple[str, ...]] = {
    "reference": ("auto", "torch"),
    "hopper": ("auto", "triton", "torch"),
}


def _reference(device: torch.device, moe_runner: str, mxfp8_bf16_copy: bool) -> Backend:
    from m3serve.backends.reference import ReferenceBackend

    return ReferenceBackend(device)  # its MXFP8 projections are bf16 already (dequantized at load)


def _hopper(device: torch.device, moe_runner: str, mxfp8_bf16_copy: bool) -> Backend:
    from m3serve.backends.hopper import HopperBackend

    return HopperBackend(device, moe_runner, mxfp8_bf16_copy=mxfp8_bf16_copy)


def _check_hopper(device: torch.device) -> None:
    from m3serve.backends.hopper import check_hopper

    check_hopper(device)


# Names accepted by --backend; those mapped to None are registered but not built in this release.
_BACKENDS: dict[str, Callable[[torch.device, str, bool], Backend] | None] = {
    "reference": _reference,
    "hopper": _hopper,
    "blackwell": None,
    "rocm": None,
}

BACKEND_NAMES = ("auto", *_BACKENDS)


def auto_backend(device: torch.device) -> str:
    """Hopper where it can run (an sm_90+ GPU with triton), else the reference backend."""
    try:
        _check_hopper(device)
    except BackendUnavailable:
        return "reference"
    return "hopper"


def check_backend(name: str, device: torch.device, moe_runner: str = "auto") -> str:
    """The backend name `name` resolves to on `device`; BackendUnavailable if it cannot run
    (or cannot run the experts with `moe_runner`)."""
    resolved = auto_backend(device) if name == "auto" else name
    _factory(resolved)
    if resolved == "hopper":
        _check_hopper(device)
    runners = MOE_RUNNERS[resolved]
    if moe_runner not in runners:
        raise BackendUnavailable(
            f"--moe-runner-backend {moe_runner} does not run on backend {resolved!r} "
            f"(choose from {', '.join(runners)})"
        )
    return resolved


def create_backend(
    name: str, device: torch.device, moe_runner: str = "auto", mxfp8_bf16_copy: bool = False
) -> Backend:
    """The backend `name` resolves to on `device`; `mxfp8_bf16_copy`: `--mxfp8-bf16-copy`, on
    in the server (ServerArgs) but off here, so benchmarks and tests that build a backend hold
    only the checkpoint's weights unless they ask."""
    return _factory(check_backend(name, device, moe_runner))(device, moe_runner, mxfp8_bf16_copy)


def _factory(name: str) -> Callable[[torch.device, str, bool], Backend]:
    if name not in _BACKENDS:
        choices = ", ".join(BACKEND_NAMES)
        raise BackendUnavailable(f"unknown backend {name!r} (choose from {choices})")
    factory = _BACKENDS[name]
    if factory is None:
        raise BackendUnavailable(
            f"backend {name!r} is not built yet in this release; use --backend reference or hopper"
        )
    return factory


__all__ = [
    "BACKEND_NAMES",
    "MOE_RUNNERS",
    "Backend",
    "BackendUnavailable",
    "auto_backend",
    "check_backend",
    "create_backend",
]
