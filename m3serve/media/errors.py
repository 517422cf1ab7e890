"""The one exception of media input."""

from __future__ import annotations


class MediaError(ValueError):
    """A media URL or payload was refused. The message is written for the API's client (it
    becomes a 400 `invalid_request_error`), so it says why without leaking what the host sees
    beyond it (no resolved addresses, no local paths outside the allowed directory)."""
