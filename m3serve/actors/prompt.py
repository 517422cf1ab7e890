"""PromptEncoder: a request to its input ids — the chat template, the tokenizer, the image and
video placeholders, and the checks that refuse a prompt before it costs anything (too many
characters, an empty prompt, ids outside the vocabulary, more tokens than the context holds).

The tokenizer actor owns one per worker and calls it for generation and for /v1/tokenize; the
media themselves are decoded and preprocessed by `actors/media.py`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3serve.actors.media import MediaPreprocessor, Prepared
from m3serve.model.chat_template import load_chat_template, render_chat
from m3serve.model.config import load_generation_config, load_model_config
from m3serve.model.thinking import ThinkingInvalid, resolve_thinking
from m3serve.model.vision.prompt import MARKERS, Escaper, VisionTokens, expand
from m3serve.runtime.messages import GenerateReq, SamplingParams
from m3serve.runtime.shm import unpack_token_ids

# Arguments render_chat sets itself; a request cannot override them through the template kwargs.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "tools", "template", "add_generation_prompt"})
# Default --max-prompt-chars, per token of context: a prompt this long cannot fit the context
# in any realistic tokenization, and refusing it spares the tokenizer (a 64 MB single word took
# 86 s and 13 GB).
PROMPT_CHARS_PER_TOKEN = 16
# Texts this long are encoded on a thread, by the tokenizer's batch call, which releases the GIL:
# this worker's event loop also detokenizes the outputs of every stream it owns, and an inline
# encode holds all of them back (a 1K-token chat prompt on a slow core: the loop stopped 1.21 ms
# inline, 0.19 ms with the thread; perf/bench_tokenizer_stall.py). Shorter texts (~0.6 ms there)
# are encoded inline, where a thread hop would be a good share of their time.
THREAD_MIN_CHARS = 1 << 11


class RequestInvalid(ValueError):
    """A request the model cannot run; becomes an HTTP 400 / a raised error for the caller."""


@dataclass(frozen=True)
class ModelFacts:
    """What the tokenizer needs to know about the model, from its config files."""

    eos_ids: tuple[int, ...]
    context_length: int
    vocab_size: int
    vision: bool = False  # the config has a vision tower: images and videos may come

    @classmethod
    def read(cls, model_dir: Path, context_length: int | None) -> ModelFacts:
        config = load_model_config(model_dir)
        text = config.text
        eos = set(text.eos_token_ids) | set(load_generation_config(model_dir).eos_token_ids)
        limit = context_length or text.max_position_embeddings
        return cls(tuple(sorted(eos)), limit, text.vocab_size, config.vision is not None)


class PromptEncoder:
    """One worker's request-to-ids path; `load` gives it the model's tokenizer and template
    (without them it takes token ids only)."""

    def __init__(
        self, facts: ModelFacts, media: MediaPreprocessor, max_prompt_chars: int | None = None
    ) -> None:
        self.facts = facts
        self.media = media
        self.max_prompt_chars = max_prompt_chars or PROMPT_CHARS_PER_TOKEN * facts.context_length
        self.tokenizer: Any = None  # None: the engine serves token ids only
        # Encodes marker text a client wrote as plain text, never as the placeholder token.
        self.literal_tokenizer: Any = None
        self.vision: VisionTokens | None = None
        self.template: str | None = None

    def load(self, model_dir: Path) -> None:
        """The model's tokenizer.json, its image/video placeholder ids and its chat template."""
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir} "
                "(use skip_tokenizer_init=True to serve token ids only)"
            )
        self.tokenizer = Tokenizer.from_file(str(path))
        self.vision = VisionTokens.lookup(self.tokenizer.token_to_id)
        self.template = load_chat_template(model_dir)

    async def encode_with_media(
        self, req: GenerateReq
    ) -> tuple[list[int], list[Prepared], list[list[tuple[int, int]]]]:
        """input_ids, the preprocessed media and each one's placeholder spans in the ids."""
        if not req.media:
            return await self.encode(req), [], []
        prepared = await self.prepare(req)
        ids, spans = await self.encode_chat(req, prepared)
        self.check_ids(ids)
        return ids, prepared, spans

    async def prepare(self, req: GenerateReq) -> list[Prepared]:
        """The request's media decoded and preprocessed (on a thread), once it may have any."""
        if not self.facts.vision:  # refused before any decoding work
            raise RequestInvalid("this model takes no images or videos (it has no vision tower)")
        if req.messages is None or self.tokenizer is None:
            raise RequestInvalid("images and videos need chat messages")
        if self.vision is None:
            raise RequestInvalid("this model's tokenizer has no image placeholder tokens")
        return await self.media.prepare_all(req.media)

    async def encode_chat(
        self, req: GenerateReq, prepared: list[Prepared], add_generation_prompt: bool = True
    ) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """The chat's ids, each of `prepared`'s media expanded to its placeholder run, and each
        one's spans in the ids."""
        vision = self.vision
        if not prepared:
            text = self.render(req, add_generation_prompt=add_generation_prompt)
            if vision is None or not any(marker in text for marker in MARKERS.values()):
                return await self.encode_text(text), []
        if vision is None:
            raise RequestInvalid("this model's tokenizer has no image placeholder tokens")
        # Rendered with the client's own marker strings escaped: every marker left in the text
        # came from a media part.
        escaper = Escaper()
        text = self.render(req, escaper, add_generation_prompt)
        self._check_chars(text)
        tokens = [item.tokens for item in prepared]

        def run() -> tuple[list[int], list[list[tuple[int, int]]]]:
            pieces = escaper.split(text)
            done = expand(pieces, tokens, vision, escaper, self._ids, self._literal_ids)
            return done.ids, done.spans

        if len(text) < THREAD_MIN_CHARS:
            return run()
        return await asyncio.to_thread(run)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _literal_ids(self, text: str) -> list[int]:
        if self.literal_tokenizer is None:  # built on first need: most prompts never do
            from tokenizers import Tokenizer

            self.literal_tokenizer = Tokenizer.from_str(self.tokenizer.to_str())
            self.literal_tokenizer.encode_special_tokens = True
        return self.literal_tokenizer.encode(text, add_special_tokens=False).ids

    async def encode(self, req: GenerateReq) -> list[int]:
        if req.input_ids is not None:
            ids = unpack_token_ids(req.input_ids).tolist()
        elif self.tokenizer is None:
            raise RequestInvalid("this engine runs without a tokenizer: send input_ids")
        elif req.messages is not None:
            ids, _ = await self.encode_chat(req, [])
        elif req.prompt is not None:
            ids = await self.encode_text(req.prompt)
        else:
            raise RequestInvalid("a request needs a prompt, messages or input_ids")
        self.check_ids(ids)
        return ids

    def check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise RequestInvalid("the prompt is empty")
        vocab = self.facts.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise RequestInvalid(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")

    def _check_chars(self, text: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise RequestInvalid(
                f"the prompt has {len(text)} characters; at most {self.max_prompt_chars} are "
                "tokenized (--max-prompt-chars)"
            )

    async def encode_text(self, text: str) -> list[int]:
        self._check_chars(text)
        if len(text) < THREAD_MIN_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        # encode_batch releases the GIL (encode does not), so the loop runs on meanwhile.
        encode = self.tokenizer.encode_batch
        batch = await asyncio.to_thread(encode, [text], add_special_tokens=False)
        return batch[0].ids

    def render(
        self, req: GenerateReq, escaper: Escaper | None = None, add_generation_prompt: bool = True
    ) -> str:
        if self.template is None:
            raise RequestInvalid("the model has no chat template: send a prompt instead")
        given = req.chat_template_kwargs or {}
        reserved = sorted(RESERVED_TEMPLATE_ARGS & given.keys())
        if reserved:
            raise RequestInvalid(f"chat_template_kwargs may not set {', '.join(reserved)}")
        kwargs = {
            k: v
            for k, v in given.items()
            if k not in ("thinking", "thinking_mode", "reasoning_effort")
        }
        try:
            mode, effort = resolve_thinking(
                req.thinking, req.reasoning_effort, req.chat_template_kwargs
            )
        except ThinkingInvalid as exc:
            raise RequestInvalid(str(exc)) from exc
        kwargs["thinking_mode"] = mode
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        messages, tools, prefix = req.messages or [], req.tools, req.assistant_prefix or ""
        if escaper is not None:
            messages, tools, prefix = escaper.escape([messages, tools, prefix])
            kwargs = escaper.escape(kwargs)
        text = render_chat(
            self.template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        return text + prefix

    def check(self, sampling: SamplingParams, prompt_len: int) -> int:
        """Validate; returns the resolved max_new_tokens (None: what the context leaves)."""
        problems = sampling.problems()
        if problems:
            raise RequestInvalid("; ".join(problems))
        limit = self.facts.context_length
        if sampling.max_new_tokens is None:
            if prompt_len >= limit:
                raise RequestInvalid(
                    f"the prompt ({prompt_len} tokens) fills the context length ({limit})"
                )
            return limit - prompt_len
        if prompt_len + sampling.max_new_tokens > limit:
            raise RequestInvalid(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                f"exceeds the context length ({limit})"
            )
        return sampling.max_new_tokens
