"""SGLang-style generate calls as engine requests and their results as SGLang's dicts
(`text`, `output_ids`, `meta_info`): what `AsyncEngine.generate` and `Engine` share, so that
callers pass prompts, token ids and plain sampling dicts, never the engine's message types."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from m3serve.engine.errors import RequestError
from m3serve.runtime.messages import (
    Finish,
    GenerateReq,
    RequestOutput,
    SamplingParams,
    TokenIds,
    TokenLogprob,
    Usage,
)

Prompt = str | list[int]
SamplingArg = dict[str, Any] | list[dict[str, Any]] | None


def with_keywords(params: SamplingArg, keywords: Mapping[str, Any]) -> SamplingArg:
    """Sampling given as a dict (or one per prompt) and as keywords: the keywords win."""
    if not keywords:
        return params
    if isinstance(params, list):
        return [{**p, **keywords} for p in params]
    return {**(params or {}), **keywords}


def stream_request(reqs: list[GenerateReq], single: bool) -> GenerateReq:
    """The one request of a streamed call."""
    if not single:
        raise ValueError("stream=True takes one prompt")
    req = reqs[0]
    req.stream = True
    return req


@dataclass
class Result:
    """One request's outputs so far, as SGLang's result dict (`as_dict`)."""

    rid: str
    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish: Finish | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, chunk: RequestOutput) -> None:
        self.text += chunk.text
        self.ids.extend(chunk.output_ids)
        self.finish = chunk.finish or self.finish
        self.usage = chunk.usage
        self.logprobs.extend(chunk.logprobs)

    def as_dict(self, latency: float) -> dict[str, Any]:
        usage = self.usage or Usage(0, 0, 0)
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
            "finish_reason": finish_dict(self.finish),
            "e2e_latency": latency,
        }
        if usage.spec_verify_steps:  # SGLang's names
            meta["spec_verify_ct"] = usage.spec_verify_steps
            meta["spec_accept_length"] = usage.spec_accept_length
        if self.logprobs:
            meta["output_token_logprobs"] = [(lp.logprob, lp.token_id) for lp in self.logprobs]
            if any(lp.top for lp in self.logprobs):
                meta["output_top_logprobs"] = [
                    [(value, token) for token, value in lp.top] for lp in self.logprobs
                ]
        return {"text": self.text, "output_ids": self.ids, "meta_info": meta}


def finish_dict(finish: Finish | None) -> dict[str, Any] | None:
    if finish is None:
        return None
    out: dict[str, Any] = {"type": finish.reason}
    if finish.reason == "stop" and finish.matched is not None:
        out["matched"] = finish.matched
    if finish.reason == "error" and finish.matched is not None:
        out["message"] = finish.matched
    return out


def sampling(params: dict[str, Any] | None, logprob: bool = False, top: int = 0) -> SamplingParams:
    """A plain dict of SGLang sampling keys -> SamplingParams; a bad key or value is a
    RequestError."""
    values = dict(params or {})
    if logprob or top:
        values.setdefault("logprobs", True)
        values.setdefault("top_logprobs", top)
    try:
        return msgspec.convert(values, SamplingParams)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid sampling_params: {exc}") from exc


def generate_requests(
    prompt: Prompt | list[Prompt] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    rid: str | list[str] | None,
    return_logprob: bool,
    top_logprobs_num: int,
) -> tuple[list[GenerateReq], bool]:
    """The engine requests for SGLang-style generate arguments, and whether there was one prompt
    (so one result, not a list)."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt or input_ids")
    if prompt is not None:
        single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
        items: list[Any] = [prompt] if single else list(prompt)
    else:
        assert input_ids is not None
        single = not input_ids or isinstance(input_ids[0], int)
        items = [input_ids] if single else list(input_ids)
    params = (
        sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
    )
    rids = rid if isinstance(rid, list) else [rid] * len(items)
    if len(params) != len(items) or len(rids) != len(items):
        raise ValueError("sampling_params and rid lists must match the number of prompts")
    reqs = []
    for item, param, one_rid in zip(items, params, rids, strict=True):
        req = GenerateReq(
            rid=one_rid or uuid.uuid4().hex,
            sampling=sampling(param, return_logprob, top_logprobs_num),
        )
        if isinstance(item, str):
            req.prompt = item
        else:
            if any(not 0 <= t < 2**31 for t in item):
                raise RequestError(f"token id outside the vocabulary in {item[:8]}...")
            req.input_ids = TokenIds(len(item), np.asarray(item, dtype=np.int32))
        reqs.append(req)
    return reqs, single
