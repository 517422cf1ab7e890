"""TokenizerActor: chat template, encode, incremental detokenize, stop strings, and the
one-shot /v1/tokenize and /v1/detokenize round trips.

One or more worker processes (`--tokenizer-worker-num`); the API routes a request to worker
`hash(rid) % N`, and the scheduler sends each worker the outputs of the requests it owns.
Long prompts go to the scheduler as shared-memory segments, never inline. A prompt longer than
`--max-prompt-chars` is refused before the tokenizer sees it; a long one is encoded on a thread
(the tokenizer's batch call releases the GIL), so an event loop shared with the API (single
process) keeps serving meanwhile. A chat request's images and videos are preprocessed here too
(`actors/media.py`): their placeholders expanded in the prompt, their patches sent as
`MediaInput`s in shared memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3serve.actors.detokenize import IncrementalDetokenizer
from m3serve.actors.media import MediaPreprocessor, Prepared, write_media
from m3serve.model.chat_template import ChatTemplateError, load_chat_template, render_chat
from m3serve.model.config import load_generation_config, load_model_config
from m3serve.model.special_tokens import THINK_END, THINK_START
from m3serve.model.thinking import ThinkingInvalid, resolve_thinking
from m3serve.model.vision.processor import DEFAULT_MAX_IMAGE_PIXELS, MediaDecodeError
from m3serve.model.vision.prompt import MARKERS, Escaper, PromptMediaError, VisionTokens, expand
from m3serve.runtime.actor import Actor, handles
from m3serve.runtime.messages import (
    Abort,
    DetokenizeReq,
    DetokenizeResult,
    Error,
    Finish,
    GenerateReq,
    RequestOutput,
    SamplingParams,
    TextBatch,
    TokenBatch,
    Tokenized,
    TokenizeReq,
    TokenizeResult,
    Usage,
)
from m3serve.runtime.shm import pack_token_ids, unpack_token_ids
from m3serve.runtime.transport import Inbox, Outbox

log = logging.getLogger(__name__)


# Arguments render_chat sets itself; a request cannot override them through the template kwargs.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "tools", "template", "add_generation_prompt"})
# Default --max-prompt-chars, per token of context: a prompt this long cannot fit the context
# in any realistic tokenization, and refusing it spares the tokenizer (a 64 MB single word took
# 86 s and 13 GB).
PROMPT_CHARS_PER_TOKEN = 16
# Shorter texts are encoded inline: a thread hop costs more than they take.
THREAD_MIN_CHARS = 1 << 16


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


@dataclass
class Pending:
    """A request this worker owns: its detokenizer and usage counters."""

    detok: IncrementalDetokenizer | None
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0
    stopped: bool = False


class TokenizerActor(Actor):
    name = "tokenizer"

    def __init__(
        self,
        inbox: Inbox,
        scheduler: Outbox,
        api: Outbox,
        control: Outbox | None,
        model_dir: Path,
        worker: int,
        session: str,
        skip_tokenizer_init: bool = False,
        context_length: int | None = None,
        max_prompt_chars: int | None = None,
        max_image_pixels: int | None = None,
    ) -> None:
        super().__init__(inbox, control)
        self.name = f"tokenizer{worker}"
        self.scheduler = scheduler
        self.api = api
        self.model_dir = Path(model_dir)
        self.worker = worker
        self.session = session
        self.skip_tokenizer_init = skip_tokenizer_init
        self.facts = ModelFacts.read(self.model_dir, context_length)
        self.max_prompt_chars = (
            max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.facts.context_length
        )
        self.tokenizer: Any = None
        # Encodes marker text a client wrote as plain text, never as the placeholder token.
        self.literal_tokenizer: Any = None
        self.vision: VisionTokens | None = None
        self.media = MediaPreprocessor(self.model_dir, max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS)
        self.template: str | None = None
        self.pending: dict[str, Pending] = {}

    async def on_start(self) -> dict[str, Any]:
        if not self.skip_tokenizer_init:
            from tokenizers import Tokenizer

            path = self.model_dir / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(
                    f"no tokenizer.json in {self.model_dir} "
                    "(use skip_tokenizer_init=True to serve token ids only)"
                )
            self.tokenizer = Tokenizer.from_file(str(path))
            self.vision = VisionTokens.lookup(self.tokenizer.token_to_id)
            self.template = load_chat_template(self.model_dir)
        info: dict[str, Any] = {
            "context_length": self.facts.context_length,
            "eos_ids": list(self.facts.eos_ids),
        }
        if self.tokenizer is not None:
            specials = {"think_start": THINK_START, "think_end": THINK_END}
            info["special_ids"] = {
                name: self.tokenizer.token_to_id(token) for name, token in specials.items()
            }
        return info

    # ------------------------------------------------------------------ requests in

    @handles(GenerateReq)
    async def on_generate(self, req: GenerateReq) -> None:
        try:
            ids, prepared, spans = await self.encode_with_media(req)
            max_new = self.check(req.sampling, len(ids))
            media = write_media(prepared, spans, self.session)
        except (RequestInvalid, ChatTemplateError, MediaDecodeError, PromptMediaError) as exc:
            await self.api.send(Error(req.rid, str(exc), 400))
            return
        except Exception as exc:
            # One bad request must never take the actor (and every other request) down.
            log.exception("request %s could not be tokenized", req.rid)
            await self.api.send(Error(req.rid, f"cannot process the request: {exc!r}", 400))
            return
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, ids[-8:], req.sampling.skip_special_tokens, req.sampling.stop
            )
        self.pending[req.rid] = Pending(detok, prompt_tokens=len(ids))
        stop_ids = [] if req.sampling.ignore_eos else list(self.facts.eos_ids)
        await self.scheduler.send(
            Tokenized(
                rid=req.rid,
                input_ids=pack_token_ids(ids, self.session),
                sampling=req.sampling,
                stop_token_ids=sorted(set(stop_ids) | set(req.sampling.stop_token_ids)),
                max_new_tokens=max_new,
                fit_to_pool=req.sampling.max_new_tokens is None,
                worker=self.worker,
                media=media,
            )
        )

    @handles(Abort)
    async def on_abort(self, abort: Abort) -> None:
        if self.pending.pop(abort.rid, None) is not None:
            await self.scheduler.send(abort)

    async def encode_with_media(
        self, req: GenerateReq
    ) -> tuple[list[int], list[Prepared], list[list[tuple[int, int]]]]:
        """input_ids, the preprocessed media and each one's placeholder spans in the ids."""
        if not req.media:
            return await self.encode(req), [], []
        prepared = await self._prepare(req)
        ids, spans = await self._encode_chat(req, prepared)
        self._check_ids(ids)
        return ids, prepared, spans

    async def _prepare(self, req: GenerateReq) -> list[Prepared]:
        """The request's media decoded and preprocessed (on a thread), once it may have any."""
        if not self.facts.vision:  # refused before any decoding work
            raise RequestInvalid("this model takes no images or videos (it has no vision tower)")
        if req.messages is None or self.tokenizer is None:
            raise RequestInvalid("images and videos need chat messages")
        if self.vision is None:
            raise RequestInvalid("this model's tokenizer has no image placeholder tokens")
        return await self.media.prepare_all(req.media)

    async def _encode_chat(
        self, req: GenerateReq, prepared: list[Prepared], add_generation_prompt: bool = True
    ) -> tuple[list[int], list[list[tuple[int, int]]]]:
        vision = self.vision
        if not prepared:
            text = self.render(req, add_generation_prompt=add_generation_prompt)
            if vision is None or not any(marker in text for marker in MARKERS.values()):
                return await self._encode_text(text), []
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
            ids, _ = await self._encode_chat(req, [])
        elif req.prompt is not None:
            ids = await self._encode_text(req.prompt)
        else:
            raise RequestInvalid("a request needs a prompt, messages or input_ids")
        self._check_ids(ids)
        return ids

    def _check_ids(self, ids: list[int]) -> None:
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

    async def _encode_text(self, text: str) -> list[int]:
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

    # ------------------------------------------------------------------ tokenize, detokenize

    @handles(TokenizeReq)
    async def on_tokenize(self, req: TokenizeReq) -> None:
        await self._answer(req.rid, lambda: self._tokenize(req))

    @handles(DetokenizeReq)
    async def on_detokenize(self, req: DetokenizeReq) -> None:
        await self._answer(req.rid, lambda: self._detokenize(req))

    async def _tokenize(self, req: TokenizeReq) -> TokenizeResult:
        self._need_tokenizer()
        if req.messages is None:
            return TokenizeResult(req.rid, await self._encode_text(req.prompt or ""))
        # Encoded as generation encodes it: client marker text stays text, and each image or
        # video is its full placeholder run (so the count is the chat's prompt_tokens).
        as_chat = GenerateReq(rid=req.rid, messages=req.messages, media=req.media)
        prepared = await self._prepare(as_chat) if req.media else []
        ids, _ = await self._encode_chat(as_chat, prepared, req.add_generation_prompt)
        return TokenizeResult(req.rid, ids)

    async def _detokenize(self, req: DetokenizeReq) -> DetokenizeResult:
        self._need_tokenizer()
        vocab = self.facts.vocab_size
        bad = [t for t in req.token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestInvalid(f"token id {bad[0]} is outside the vocabulary")
        return DetokenizeResult(
            req.rid, self.tokenizer.decode(req.token_ids, skip_special_tokens=False)
        )

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise RequestInvalid("this server runs without a tokenizer")

    async def _answer(
        self, rid: str, work: Callable[[], Awaitable[TokenizeResult | DetokenizeResult]]
    ) -> None:
        """Send the API `work`'s reply, or an Error for its rid: a refusal is a 400, and no
        request may take the actor down."""
        reply: TokenizeResult | DetokenizeResult | Error
        try:
            reply = await work()
        except (RequestInvalid, ChatTemplateError, MediaDecodeError, PromptMediaError) as exc:
            reply = Error(rid, str(exc), 400)
        except Exception as exc:
            log.exception("request %s could not be processed", rid)
            reply = Error(rid, f"cannot process the request: {exc!r}", 400)
        await self.api.send(reply)

    # ------------------------------------------------------------------ tokens out

    @handles(TokenBatch)
    async def on_tokens(self, batch: TokenBatch) -> None:
        outputs: list[RequestOutput] = []
        aborts = []
        for i, rid in enumerate(batch.rids):
            state = self.pending.get(rid)
            if state is None or state.stopped:
                continue  # finished by a stop string, or aborted, while this step ran
            new_ids, finish = batch.new_ids[i], batch.finish[i]
            state.completion_tokens += len(new_ids)
            state.cached_tokens = batch.cached_tokens[i]
            accepted = batch.spec_accepted[i] if batch.spec_accepted else 0
            if accepted:
                state.spec_verify_steps += 1
                state.spec_accepted_tokens += accepted
            text = ""
            if state.detok is not None:
                # A matched stop token ends the output but is not part of its text.
                stopped_by_token = finish is not None and isinstance(finish.matched, int)
                text = state.detok.push(new_ids[:-1] if stopped_by_token else new_ids)
                if state.detok.stopped is not None and (finish is None or finish.reason != "stop"):
                    finish = Finish("stop", state.detok.stopped)
                    state.stopped = True
                    aborts.append(Abort(rid))
                elif finish is not None:
                    text += state.detok.finish()
            usage = Usage(
                state.prompt_tokens,
                state.completion_tokens,
                state.cached_tokens,
                state.spec_verify_steps,
                state.spec_accepted_tokens,
            )
            logprobs = batch.logprobs[i] if batch.logprobs is not None else []
            outputs.append(RequestOutput(rid, text, new_ids, finish, usage, logprobs))
            if finish is not None:
                self.pending.pop(rid, None)
        if outputs:
            await self.api.send(TextBatch(outputs))
        for abort in aborts:
            await self.scheduler.send(abort)

    @handles(Error)
    async def on_error(self, error: Error) -> None:
        # A request the scheduler failed: forget it and tell the API.
        if error.rid is not None:
            self.pending.pop(error.rid, None)
        await self.api.send(error)
