"""Every message that crosses an actor boundary, as msgspec Structs, grouped by channel.

Channels: API → tokenizer, tokenizer → scheduler, scheduler → tokenizer, tokenizer → API,
launcher → engine ranks (spawn arguments), scheduler ↔ engine core (in-process), engine ↔ host
cache, control (any actor → supervisor). Each channel has a tagged union type its receiver
decodes. Request messages carry their `rid`; an
`Error` with a rid fails that request, an `Error` without one means the sender is going down.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

FinishReason = Literal["stop", "length", "abort", "error"]


class ShmRef(msgspec.Struct, array_like=True, frozen=True):
    """A payload in a shared-memory segment; the receiver reads it once and unlinks it."""

    name: str
    nbytes: int


class TokenIds(msgspec.Struct, array_like=True):
    """Token ids (int32): an array in the message (sent as a zero-copy frame by the codec) or,
    for long prompts, a shared-memory segment."""

    count: int
    array: np.ndarray | None = None
    shm: ShmRef | None = None


class Constraint(msgspec.Struct, frozen=True):
    """What a request's output must match, as the grammar engine compiles it: a JSON schema
    (JSON text), any JSON object (`text` unused), or an EBNF grammar. The engine caches compiled
    grammars by this value, so equal constraints compile once."""

    kind: Literal["json_schema", "json_object", "ebnf"]
    text: str = ""


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. Keys follow SGLang's `sampling_params`."""

    max_new_tokens: int | None = 128  # None: as many as the context and the KV pool allow
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k cut
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # structured output / an enforced tool call

    def problems(self) -> list[str]:
        """Every invalid setting, as messages naming the key (empty when valid)."""
        checks = [
            (
                self.max_new_tokens is None or self.max_new_tokens >= 1,
                "max_new_tokens must be >= 1",
            ),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1 (disabled) or >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
        ]
        return [message for ok, message in checks if not ok]

    @property
    def greedy(self) -> bool:
        """The one greedy rule: temperature 0 or top_k 1 takes the argmax."""
        return self.temperature <= 0.0 or self.top_k == 1


class Finish(msgspec.Struct, array_like=True, frozen=True):
    reason: FinishReason
    # The stop token id or stop string that ended the request, or an error message.
    matched: int | str | None = None


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------- API -> tokenizer


class MediaBlob(msgspec.Struct, array_like=True, frozen=True):
    """One image or video of a request, fetched and size-checked by the API, still encoded (PNG,
    JPEG, MP4, ...). A chat message's media part is replaced by `{"type": kind, "media": i}`
    with i its index in `GenerateReq.media`, so the template renders its placeholder in order."""

    kind: Literal["image", "video"]
    data: bytes
    max_long_side_pixel: int | None = None
    fps: float | None = None  # a video's requested sampling rate (None: the processor's)


class GenerateReq(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    rid: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: TokenIds | None = None
    tools: list[dict[str, Any]] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    thinking: str | None = None  # enabled | disabled | adaptive -> the template's thinking_mode
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Text appended after the rendered chat prompt: the start of the answer the model must
    # continue.
    assistant_prefix: str | None = None
    media: list[MediaBlob] = msgspec.field(default_factory=list)


class Abort(msgspec.Struct, tag=True, array_like=True):
    rid: str


class TokenizeReq(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    """/v1/tokenize: encode a prompt, or the chat template rendered over messages; answered with
    `TokenizeResult` or an `Error` with this rid."""

    rid: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    # The messages' media, loaded as for a GenerateReq: their placeholders are expanded to the
    # ids generation would see.
    media: list[MediaBlob] = msgspec.field(default_factory=list)


class DetokenizeReq(msgspec.Struct, tag=True, array_like=True):
    """/v1/detokenize: token ids -> text, special tokens kept; answered with `DetokenizeResult`
    or an `Error` with this rid."""

    rid: str
    token_ids: list[int]


# ---------------------------------------------------------------- tokenizer -> scheduler


class MediaInput(msgspec.Struct, array_like=True, frozen=True):
    """One preprocessed image or video: its patches (float32 [patches, 1176], merge-window-major)
    in shared memory, and where its placeholder tokens sit in the prompt. The vision features
    (one row per placeholder token) replace those positions' embeddings, in order. An image is
    one span; a video has one per temporal patch (timestamps and frame markers between them)."""

    kind: Literal["image", "video"]
    pixels: ShmRef
    grids: list[tuple[int, int, int]]  # (t, h, w) in patches per attention segment
    spans: list[tuple[int, int]]  # (offset in input_ids, placeholder count); counts sum to rows
    content_hash: int  # of the pixels: the prefix cache keys these positions by it


class Tokenized(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    rid: str
    input_ids: TokenIds
    sampling: SamplingParams
    stop_token_ids: list[int]  # EOS ids (unless ignore_eos) plus the request's own
    max_new_tokens: int  # resolved: the request's own, or what the context leaves
    fit_to_pool: bool  # no explicit limit: the scheduler may lower it to what the KV pool holds
    worker: int  # the tokenizer worker that owns this request's detokenization
    media: list[MediaInput] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------- scheduler -> tokenizer


class TokenBatch(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    """One engine step's new tokens for the requests one tokenizer worker owns."""

    rids: list[str]
    new_ids: list[list[int]]
    finish: list[Finish | None]
    cached_tokens: list[int]
    logprobs: list[list[TokenLogprob]] | None = None
    # Per row: the tokens a speculative verify step committed for it (0: not a verify row).
    spec_accepted: list[int] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------- tokenizer -> API


class Usage(msgspec.Struct, array_like=True, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Speculative decoding: verify steps that ran for the request, and the tokens they
    # committed (their ratio is its mean acceptance length).
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_accept_length(self) -> float | None:
        """Tokens committed per verify step (None: no verify step ran)."""
        if not self.spec_verify_steps:
            return None
        return self.spec_accepted_tokens / self.spec_verify_steps


class RequestOutput(msgspec.Struct, array_like=True):
    """A piece of one request's output: the text and token ids new since the last piece, and
    `finish` on the last one. `AsyncEngine.stream` yields these as they arrive."""

    rid: str
    text: str
    output_ids: list[int]
    finish: Finish | None
    usage: Usage
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)


class TextBatch(msgspec.Struct, tag=True, array_like=True):
    """One engine step's outputs for the requests of one tokenizer worker."""

    outputs: list[RequestOutput]


class TokenizeResult(msgspec.Struct, tag=True, array_like=True):
    rid: str
    token_ids: list[int]


class DetokenizeResult(msgspec.Struct, tag=True, array_like=True):
    rid: str
    text: str


# ---------------------------------------------------------------- control


class Ready(msgspec.Struct, tag=True, array_like=True):
    actor: str
    pid: int
    # Facts the engine learned at start that clients need (context length, eos ids, ...).
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class Error(msgspec.Struct, tag=True, array_like=True):
    """With a rid: that request failed. Without: the sender (`actor`) is going down."""

    rid: str | None
    message: str
    code: int = 500
    actor: str | None = None


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


# ---------------------------------------------------------------- launcher -> engine ranks


class RankAddress(msgspec.Struct, array_like=True, frozen=True):
    """Where one engine process of a tensor-parallel group joins it (launcher -> each rank):
    its rank of `size`, and the TCP rendezvous port on 127.0.0.1 the launcher chose."""

    rank: int
    size: int
    port: int


# ---------------------------------------------------------------- scheduler <-> engine core


class SeqStep(msgspec.Struct, array_like=True):
    """One request's part of a step: new tokens at positions [start, start + extend), whose KV is
    written to the request's pages, which cover every position up to the end.

    `pages` are those pages from index `page_start` on. The engine core keeps each slot's page
    list on the device (`model/slot_pages.py`), so a running request sends only what changed
    since its slot's last step (usually nothing; a page every page_size tokens); 0 sends the
    whole list, and replaces the slot's.

    `input_ids` None is one token: the one this slot sampled last step, which may not have
    reached the CPU yet (overlap); the engine core reads it from its device-side token table.
    """

    input_ids: list[int] | None
    start: int  # tokens already in the KV cache
    pages: list[int]
    slot: int = 0
    sample: bool = True  # False for a prefill chunk that does not end the prompt
    new_request: bool = False  # first step of this slot: reset its sampling state
    # Speculative verify row: this many draft tokens follow the anchor (the `input_ids` None
    # token); the engine core proposes them and verifies all of them in this step.
    draft: int = 0
    page_start: int = 0

    @property
    def extend(self) -> int:
        return 1 + self.draft if self.input_ids is None else len(self.input_ids)

    @property
    def num_pages(self) -> int:
        """The request's page count after this step's update."""
        return self.page_start + len(self.pages)


class PageCopy(msgspec.Struct, array_like=True):
    """A HiCache load-back that a step runs inside its forward, layer by layer before each layer
    reads it: host page `host[i]` -> device page `device[i]`. `op` names the copy's ticket."""

    op: int
    device: list[int]
    host: list[int]


class StepPlan(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    step: int
    seqs: list[SeqStep]  # may be empty: a step that only loads pages back
    # Slots that start (or resume after retraction) this step: their sampling settings, prompt
    # and the output they already produced.
    sampling: dict[int, SamplingParams] = msgspec.field(default_factory=dict)
    prompt_ids: dict[int, list[int]] = msgspec.field(default_factory=dict)
    output_ids: dict[int, list[int]] = msgspec.field(default_factory=dict)
    loads: list[PageCopy] = msgspec.field(default_factory=list)
    # The token ids that end each starting slot's request (so the engine core can drop its
    # decode row from a step planned before the CPU saw the stop token).
    stop_ids: dict[int, list[int]] = msgspec.field(default_factory=dict)
    # Rows of this step's prefill chunks that take image/video features (the follower ranks of
    # a tensor-parallel engine receive that many from rank 0: core/ranks.py MediaShare).
    media_rows: int = 0
    # HiCache backups (device -> host pages) that rank 0 of a tensor-parallel engine ran just
    # now: the follower ranks copy their own KV slices of those pages before the next step.
    # Only in a plan of its own (no seqs), sent to the followers alone.
    backups: list[PageCopy] = msgspec.field(default_factory=list)


# A sampled row the engine core dropped: its request had ended on the step before (overlap).
SKIPPED_TOKEN = -1


class StepResult(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    step: int
    slots: list[int]
    tokens: list[int]
    logprobs: list[TokenLogprob | None] = msgspec.field(default_factory=list)
    # Per token: its request's grammar accepted it as the last one (empty: no grammar ran).
    grammar_ended: list[bool] = msgspec.field(default_factory=list)
    # Per row, speculative verify rows only: every token the row commits (the accepted drafts,
    # then the correction or bonus token, which is also `tokens[row]`); [] for other rows, and
    # the whole list empty when no row verified.
    spec_tokens: list[list[int]] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------- engine <-> host cache
# Only page ids and keys travel here; page bytes stay in the host-pool segment. A host page named
# in a Backup or Prefetch belongs to that ticket until its Done arrives (or the host-cache actor
# is known dead): the engine must not overwrite a page a Backup reads, nor read or reuse a page a
# Prefetch writes, before then.


class HostPoolSpec(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """engine → host cache, once at start: make the host KV pool, `num_pages` pages of
    `page_bytes` bytes each, page-major (page h is bytes [h * page_bytes, (h + 1) * page_bytes)).
    `ranks` > 1 (tensor parallelism): one such pool per rank, one after another in the segment
    (rank r's starts at byte r * num_pages * page_bytes), each holding that rank's KV slice."""

    page_bytes: int
    num_pages: int
    ranks: int = 1


class HostPoolReady(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """host cache → engine: the pool's segment (attach it by name) and the owner's pid."""

    segment: str
    page_bytes: int
    num_pages: int
    pid: int
    ranks: int = 1


class Backup(msgspec.Struct, tag=True, array_like=True):
    """engine → host cache: write host page `host_pages[i]` to L3 storage under `keys[i]` (with
    several ranks, every rank's slice of it, each under a key of its own derived from keys[i])."""

    ticket: int
    keys: list[str]
    host_pages: list[int]


class Prefetch(msgspec.Struct, tag=True, array_like=True):
    """engine → host cache: read the leading run of `keys` that L3 holds into `host_pages`."""

    ticket: int
    keys: list[str]
    host_pages: list[int]


class Done(msgspec.Struct, tag=True, array_like=True):
    """host cache → engine: a ticket is finished and its host pages are the engine's again.

    `pages`: for a Backup, how many of its pages L3 now holds; for a Prefetch, how many leading
    pages were found and are now in their host pages. `error`: the request itself was invalid
    (a page out of range, mismatched lengths); storage trouble only lowers `pages`.
    """

    ticket: int
    pages: int
    error: str | None = None


# Channel unions: what each receiver decodes.
ToTokenizer = GenerateReq | Abort | TokenizeReq | DetokenizeReq | TokenBatch | Error | Shutdown
ToScheduler = Tokenized | Abort | Shutdown
ToApi = TextBatch | TokenizeResult | DetokenizeResult | Error | Ready
ToSupervisor = Ready | Error
ToHiCache = HostPoolSpec | Backup | Prefetch | Shutdown
FromHiCache = HostPoolReady | Done | Error
