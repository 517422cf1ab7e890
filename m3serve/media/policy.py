"""What a media fetch may do: byte and time caps, the hosts exempt from the address checks, the
one local directory `file://` may read, and how many redirects are followed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import idna  # httpx's own IDNA codec, so names compare as httpx encodes them

DEFAULT_MAX_REDIRECTS = 3


def normalize_host(host: str) -> str:
    """The form hosts are compared in: lower case, no trailing dot, IPv6 without brackets,
    international names in their ASCII (punycode) form, as a URL's host arrives."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host.isascii():
        # A name idna refuses stays as is: it matches no URL's host, so it allows nothing.
        with contextlib.suppress(idna.IDNAError):
            host = idna.encode(host, uts46=True).decode("ascii")
    return host


def _domains(values: Iterable[str] | str | None) -> frozenset[str]:
    # A CLI flag may hand over one comma-separated string or a list of them.
    if values is None:
        return frozenset()
    items = [values] if isinstance(values, str) else list(values)
    hosts = (normalize_host(part) for item in items for part in item.split(","))
    return frozenset(host for host in hosts if host)


@dataclass(frozen=True)
class MediaPolicy:
    """Limits of one fetch. `allowed_domains` lists hosts (names or IP literals, exact match)
    that may resolve to loopback, private, link-local or metadata addresses; every other host
    must resolve to public addresses only. `allowed_local_path` is the only directory `file://`
    URLs may read (None: `file://` refused)."""

    max_bytes: int
    timeout_s: float
    allowed_domains: frozenset[str] = frozenset()
    allowed_local_path: Path | None = None
    max_redirects: int = DEFAULT_MAX_REDIRECTS

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")

    @classmethod
    def from_values(
        cls,
        *,
        max_bytes: int,
        timeout_s: float,
        allowed_domains: Iterable[str] | str | None = None,
        allowed_local_path: str | Path | None = None,
        max_redirects: int = DEFAULT_MAX_REDIRECTS,
    ) -> MediaPolicy:
        """From config values as the CLI gives them: domains as a list or a comma-separated
        string, the local path as a string ('' or None: no local files)."""
        local = Path(allowed_local_path).expanduser() if allowed_local_path else None
        return cls(
            max_bytes=max_bytes,
            timeout_s=timeout_s,
            allowed_domains=_domains(allowed_domains),
            allowed_local_path=local,
            max_redirects=max_redirects,
        )

    def host_allowed(self, host: str) -> bool:
        """Whether `host` is exempt from the address checks."""
        return normalize_host(host) in self.allowed_domains
