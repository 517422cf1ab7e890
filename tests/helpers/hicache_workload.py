"""The HiCache end-to-end workload: a shared prefix, evicted from a small device pool by an
unrelated prompt, then asked for again (tests/e2e/test_hicache*.py)."""

from __future__ import annotations

from pathlib import Path

from helpers.hf_oracle import random_prompt
from m3serve import Engine
from m3serve.model.tiny.checkpoint import TinySpec

VOCAB = TinySpec().vocab_size - 64
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
PREFIX = random_prompt(700, 40, VOCAB)  # 10 pages of the tiny model's 4-token pages
# Three turns on the prefix (a selective backup needs two hits), one unrelated prompt that
# takes nearly the whole 16-page device pool, then the prefix again.
PROMPTS = [
    *[[*PREFIX, *random_prompt(710 + i, 4, VOCAB)] for i in range(3)],
    random_prompt(720, 48, VOCAB),
    [*PREFIX, *random_prompt(730, 6, VOCAB)],
]
SMALL_POOL = 64  # tokens: the unrelated prompt evicts the prefix from the device


def large_pool_outputs(model_path: Path) -> list[list[int]]:
    """Each prompt's greedy ids from one rank with the default (large) device pool: what HiCache
    must reproduce."""
    with Engine(str(model_path), single_process=True, skip_warmup=True) as engine:
        return [
            engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
            for prompt in PROMPTS
        ]
