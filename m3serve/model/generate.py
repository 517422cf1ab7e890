"""A minimal single-request generate loop over the paged forward: chunked prefill, then one
token per step. Good for tests and `m3serve generate`; the engine's scheduler replaces it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from m3serve.kernels.sampling import SamplingConfig, sample_token
from m3serve.model.batch import ForwardBatch, SeqChunk
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM


@torch.inference_mode()
def stream_tokens(
    model: M3ForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    seed: int | None = None,
    stop_ids: Sequence[int] | None = None,
    prefill_chunk: int | None = None,
) -> Iterator[int]:
    """Yield new token ids until a stop id (yielded too) or max_new_tokens."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens <= 0:
        return
    sampling = sampling or SamplingConfig()
    stop = set(model.cfg.eos_token_ids if stop_ids is None else stop_ids)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)
    page_size = model.cfg.page_size
    total = len(prompt_ids) + max_new_tokens
    kv = KVCache.allocate(model.cfg, -(-total // page_size), model.dtype, model.device)
    pages = list(range(kv.num_pages))
    tokens = list(prompt_ids)
    chunk = prefill_chunk or len(tokens)
    start = 0
    while True:
        new = tokens[start : start + chunk] if start < len(prompt_ids) else tokens[-1:]
        batch = ForwardBatch.build([SeqChunk(new, start, pages)], page_size, model.device)
        logits = model(batch, kv)
        start += len(new)
        if start < len(prompt_ids):
            continue
        token = sample_token(logits[-1], sampling, generator)
        tokens.append(token)
        yield token
        if token in stop or len(tokens) - len(prompt_ids) >= max_new_tokens:
            return


def generate(
    model: M3ForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    seed: int | None = None,
    stop_ids: Sequence[int] | None = None,
    prefill_chunk: int | None = None,
) -> list[int]:
    return list(
        stream_tokens(model, prompt_ids, max_new_tokens, sampling, seed, stop_ids, prefill_chunk)
    )
