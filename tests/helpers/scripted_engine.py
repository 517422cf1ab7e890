"""A test-only engine whose outputs are scripted text pieces, so the HTTP layer's streaming of
reasoning and tool calls can be tested end to end with exact model output."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from m3serve.runtime.config import ServerArgs
from m3serve.runtime.messages import Finish, GenerateReq, RequestOutput, Usage

Script = Callable[[GenerateReq], list[str]]


@dataclass
class ScriptedEngine:
    """Duck-types the parts of AsyncEngine the API uses. Each request streams the pieces the
    script returns, one chunk per piece, one fake token id per piece."""

    script: Script
    model_path: str
    args: ServerArgs = field(default_factory=ServerArgs)
    healthy: bool = True
    dead: Exception | None = None
    metrics: Any = None  # no engine metrics to render
    delay_s: float = 0.0
    seen: list[GenerateReq] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    @property
    def unavailable(self) -> str | None:
        if self.dead is not None:
            return str(self.dead)
        return None if self.healthy else "not running"

    @property
    def info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "context_length": 4096, "special_ids": {}}

    async def start(self) -> None:
        self.healthy = True

    async def shutdown(self) -> None:
        self.healthy = False

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def stream(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        self.seen.append(req)
        pieces = self.script(req) or [""]
        done = False
        try:
            for i, piece in enumerate(pieces):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(pieces) - 1
                finish = Finish("stop") if last else None
                usage = Usage(prompt_tokens=10, completion_tokens=i + 1, cached_tokens=0)
                done = last
                yield RequestOutput(req.rid, piece, [1000 + i], finish, usage)
        finally:
            if not done:
                self.aborted.append(req.rid)
