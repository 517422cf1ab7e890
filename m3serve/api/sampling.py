"""OpenAI request sampling fields -> the engine's `SamplingParams`: the checkpoint's defaults
for unset fields, and every out-of-range value refused as a 400 naming the request's field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from m3serve.api.errors import APIError
from m3serve.api.protocol import SamplingFields
from m3serve.runtime.messages import Constraint, SamplingParams

MAX_N = 16
MAX_TEMPERATURE = 2.0  # OpenAI's bound; the engine itself would take any value


def sampling_params(
    req: SamplingFields,
    defaults: Mapping[str, float],
    max_tokens: int | None,
    *,
    logprobs: bool = False,
    top_logprobs: int = 0,
    skip_special_tokens: bool = True,
    seed_offset: int = 0,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """Request fields -> SamplingParams; unset fields take `defaults` (generation_config.json).
    Each of n choices gets its own `seed_offset`, so seeded choices still differ."""

    def pick(name: str, fallback: float) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=int(pick("top_k", -1)),
        min_p=pick("min_p", 0.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        seed=None if req.seed is None else req.seed + seed_offset,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        skip_special_tokens=skip_special_tokens,
        constraint=constraint,
    )
    _check(params)
    return params


def check_n(req: SamplingFields) -> None:
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in 1..{MAX_N}", "n")


def _check(params: SamplingParams) -> None:
    # OpenAI's field names in the messages, not the engine's.
    problems = [p.replace("max_new_tokens", "max_tokens") for p in params.problems()]
    if params.temperature > MAX_TEMPERATURE:
        problems.append("temperature must be <= 2")
    if problems:
        raise APIError(400, "; ".join(problems), _param_of(problems[0]))


def _param_of(problem: str) -> str | None:
    word = problem.split(" ", 1)[0]
    return word if word.isidentifier() else None
