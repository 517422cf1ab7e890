"""A minimal single-request generate loop over the paged forward: chunked prefill, then one
token per step. The oracle the engine's outputs are tested against; the engine core replaces it
for serving."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from m3serve.kernels.sampling import draw_token
from m3serve.model.batch import ForwardBatch
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.messages import SamplingParams, SeqStep

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class PromptEmbeds:
    """Given input embeddings for some prompt positions: `rows` [R] (ascending) and `values`
    [R, hidden]."""

    rows: torch.Tensor
    values: torch.Tensor

    def chunk(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows (relative to `start`) and values of the positions [start, start + length)."""
        inside = (self.rows >= start) & (self.rows < start + length)
        return self.rows[inside] - start, self.values[inside]


@torch.inference_mode()
def stream_tokens(
    model: M3ForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    stop_ids: Sequence[int] | None = None,
    prefill_chunk: int | None = None,
    embeds: PromptEmbeds | None = None,
) -> Iterator[int]:
    """Yield new token ids until a stop id (yielded too) or max_new_tokens. `embeds`: prompt
    positions whose input embedding is given (image features), and those embeddings."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens <= 0:
        return
    stop = set(model.cfg.eos_token_ids if stop_ids is None else stop_ids)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(sampling.seed)
    page_size = model.cfg.page_size
    total = len(prompt_ids) + max_new_tokens
    num_pages = -(-total // page_size)
    kv = KVCache.allocate(model.cfg, num_pages, model.dtype, model.device, model.kv_heads)
    pages = list(range(kv.num_pages))
    tokens = list(prompt_ids)
    chunk = prefill_chunk or len(tokens)
    start = 0
    while True:
        new = tokens[start : start + chunk] if start < len(prompt_ids) else tokens[-1:]
        prompt_done = start + len(new) >= len(prompt_ids)
        seq = SeqStep(new, start, pages, sample=prompt_done)
        batch = ForwardBatch.build([seq], page_size, model.device)
        if embeds is not None and start < len(prompt_ids):
            batch = batch.with_embeds(*embeds.chunk(start, len(new)))
        logits = model(batch, kv)
        start += len(new)
        if not prompt_done:
            continue
        token = next_token(logits[-1], sampling, generator)
        tokens.append(token)
        yield token
        if token in stop or len(tokens) - len(prompt_ids) >= max_new_tokens:
            return


def next_token(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> int:
    """The next token id from logits [V]: the argmax when `sampling` is greedy, else a draw."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    return draw_token(
        logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, generator
    )


def generate(
    model: M3ForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    stop_ids: Sequence[int] | None = None,
    prefill_chunk: int | None = None,
    embeds: PromptEmbeds | None = None,
) -> list[int]:
    tokens = stream_tokens(
        model, prompt_ids, max_new_tokens, sampling, stop_ids, prefill_chunk, embeds
    )
    return list(tokens)
