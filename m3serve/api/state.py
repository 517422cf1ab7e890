"""`ServerState`: what every handler reads, built once when the engine is up — the engine, the
API settings, the metrics, the served model's name, context length, tokenizer, chat template and
sampling defaults."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m3serve.api.choice import TagIds
from m3serve.api.metrics import ServerMetrics
from m3serve.engine import AsyncEngine
from m3serve.model.chat_template import load_chat_template
from m3serve.model.config import load_generation_config
from m3serve.runtime.config import ApiArgs

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """Everything a handler needs, built once when the engine is up."""

    engine: AsyncEngine
    args: ApiArgs
    metrics: ServerMetrics
    model_name: str = ""
    context_length: int = 0
    tokenizer: Any = None  # tokenizers.Tokenizer, for logprob token strings and /v1/tokenize
    reasoning_tag_ids: TagIds | None = None  # for an exact reasoning-token count
    chat_template: str | None = None
    defaults: dict[str, float] = field(default_factory=dict)  # from generation_config.json
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, engine: AsyncEngine, args: ApiArgs, metrics: ServerMetrics) -> ServerState:
        path = Path(engine.info["model_path"])
        state = cls(
            engine=engine,
            args=args,
            metrics=metrics,
            model_name=args.served_model_name or str(engine.args.model.model_path or path.name),
            context_length=int(engine.info.get("context_length", 0)),
            defaults=load_generation_config(path).sampling,
        )
        if (path / "tokenizer.json").is_file() and not engine.args.runtime.skip_tokenizer_init:
            from tokenizers import Tokenizer

            state.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            state.reasoning_tag_ids = TagIds.of(state.tokenizer)
            state.chat_template = load_chat_template(path)
        return state

    def log_exchange(self, rid: str, kind: str, payload: Any) -> None:
        """Prompts and outputs are user data: logged only with --log-requests."""
        if self.args.log_requests:
            log.info("%s %s: %s", rid, kind, payload)
