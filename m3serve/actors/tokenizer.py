"""TokenizerActor: requests in (encoded by `actors/prompt.py`'s PromptEncoder: chat template,
tokenizer, media placeholders, prompt checks), incremental detokenize and stop strings out, and
the one-shot /v1/tokenize and /v1/detokenize round trips.

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

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3serve.actors.detokenize import IncrementalDetokenizer
from m3serve.actors.media import MediaPreprocessor, write_media
from m3serve.actors.prompt import ModelFacts, PromptEncoder, RequestInvalid
from m3serve.model.chat_template import ChatTemplateError
from m3serve.model.special_tokens import THINK_END, THINK_START
from m3serve.model.vision.processor import DEFAULT_MAX_IMAGE_PIXELS, MediaDecodeError
from m3serve.model.vision.prompt import PromptMediaError
from m3serve.runtime.actor import Actor, handles
from m3serve.runtime.messages import (
    Abort,
    DetokenizeReq,
    DetokenizeResult,
    Error,
    Finish,
    GenerateReq,
    RequestOutput,
    TextBatch,
    TokenBatch,
    Tokenized,
    TokenizeReq,
    TokenizeResult,
    Usage,
)
from m3serve.runtime.shm import pack_token_ids
from m3serve.runtime.transport import Inbox, Outbox

log = logging.getLogger(__name__)


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
        media = MediaPreprocessor(self.model_dir, max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS)
        self.prompts = PromptEncoder(self.facts, media, max_prompt_chars)
        self.pending: dict[str, Pending] = {}

    @property
    def tokenizer(self) -> Any:
        return self.prompts.tokenizer

    async def on_start(self) -> dict[str, Any]:
        if not self.skip_tokenizer_init:
            self.prompts.load(self.model_dir)
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
            ids, prepared, spans = await self.prompts.encode_with_media(req)
            max_new = self.prompts.check(req.sampling, len(ids))
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
            return TokenizeResult(req.rid, await self.prompts.encode_text(req.prompt or ""))
        # Encoded as generation encodes it: client marker text stays text, and each image or
        # video is its full placeholder run (so the count is the chat's prompt_tokens).
        as_chat = GenerateReq(rid=req.rid, messages=req.messages, media=req.media)
        prepared = await self.prompts.prepare(as_chat) if req.media else []
        ids, _ = await self.prompts.encode_chat(as_chat, prepared, req.add_generation_prompt)
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
