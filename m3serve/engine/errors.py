"""The errors an engine call raises: the whole engine gone, or one request refused."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine (or one of its actors) is gone; no request can complete."""


class RequestError(RuntimeError):
    """The engine refused or failed one request (code: the HTTP status it maps to)."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code
