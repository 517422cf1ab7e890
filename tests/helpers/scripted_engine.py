"""A test-only engine whose outputs are scripted text pieces, so the HTTP layer's streaming of
reasoning and tool calls can be tested end to end with exact model output."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

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
    finish: str = "stop"  # why every request ends ("length": cut off by max_tokens)
    seen: list[GenerateReq] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    num_requests: int = 0  # streams open now

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

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        media: list[Any] | None = None,
    ) -> list[int]:
        assert prompt is not None, "the scripted engine tokenizes prompts only"
        return self._tokenizer.encode(prompt, add_special_tokens=False).ids

    async def detokenize(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    @functools.cached_property
    def _tokenizer(self) -> Any:
        """The model's tokenizer; None for a model path without one (some tests use none)."""
        path = Path(self.model_path) / "tokenizer.json"
        return Tokenizer.from_file(str(path)) if path.is_file() else None

    def _piece_id(self, piece: str, i: int) -> int:
        """One token a piece: the piece's own first id where the model has a tokenizer (the
        reasoning count reads the think tags' ids), else a stand-in."""
        if self._tokenizer is None:
            return 1000 + i
        ids = self._tokenizer.encode(piece, add_special_tokens=False).ids
        return ids[0] if ids else 1000 + i

    async def stream(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        self.seen.append(req)
        pieces = self.script(req) or [""]
        done = False
        self.num_requests += 1
        try:
            for i, piece in enumerate(pieces):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(pieces) - 1
                finish = Finish(self.finish) if last else None
                usage = Usage(prompt_tokens=10, completion_tokens=i + 1, cached_tokens=0)
                done = last
                yield RequestOutput(req.rid, piece, [self._piece_id(piece, i)], finish, usage)
        finally:
            self.num_requests -= 1
            if not done:
                self.aborted.append(req.rid)
