"""Hardware backends, chosen by name at start. A backend owns how every model op runs.

`reference` (pure torch, exact, any device) is always available; faster backends register here
and refuse to start, with a message naming what is missing, where they cannot run.
"""

from __future__ import annotations

import torch

from m3serve.backends.base import Backend, BackendUnavailable
from m3serve.backends.hopper import HopperBackend, check_hopper
from m3serve.backends.reference import ReferenceBackend

# Names accepted by --backend; those mapped to None are planned but not built yet.
_BACKENDS: dict[str, type[Backend] | None] = {
    "reference": ReferenceBackend,
    "hopper": HopperBackend,
    "blackwell": None,
    "rocm": None,
}

BACKEND_NAMES = ("auto", *_BACKENDS)


def auto_backend(device: torch.device) -> str:
    """Hopper where it can run (an sm_90+ GPU with triton), else the reference backend."""
    try:
        check_hopper(device)
    except BackendUnavailable:
        return "reference"
    return "hopper"


def backend_class(name: str) -> type[Backend]:
    """The class behind a --backend name; raises BackendUnavailable with the reason."""
    if name == "auto":
        name = "reference"
    if name not in _BACKENDS:
        choices = ", ".join(BACKEND_NAMES)
        raise BackendUnavailable(f"unknown backend {name!r} (choose from {choices})")
    cls = _BACKENDS[name]
    if cls is None:
        raise BackendUnavailable(
            f"backend {name!r} is not built yet in this release; use --backend reference"
        )
    return cls


def check_backend(name: str, device: torch.device) -> str:
    """The backend name `name` resolves to on `device`; BackendUnavailable if it cannot run."""
    resolved = auto_backend(device) if name == "auto" else name
    backend_class(resolved)
    if resolved == "hopper":
        check_hopper(device)
    return resolved


def create_backend(name: str, device: torch.device) -> Backend:
    if name == "auto":
        name = auto_backend(device)
    return backend_class(name)(device)


__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "BackendUnavailable",
    "backend_class",
    "check_backend",
    "create_backend",
]
