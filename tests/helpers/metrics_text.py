"""Reading a Prometheus text exposition back in tests."""

from __future__ import annotations


def samples(text: str) -> dict[str, float]:
    """Each sample line's series (name with its labels, as written) -> value."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found
