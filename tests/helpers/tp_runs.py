"""What the tensor-parallel tests compare: a prompt's logits at every position (one paged
forward) and the greedy tokens of a short paged decode, on one rank or on every rank of a TP
group."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.hf_oracle import full_logits, random_prompt
from m3serve.backends.hopper import HopperBackend
from m3serve.backends.reference import ReferenceBackend
from m3serve.model.backend import Backend
from m3serve.model.build import load_model
from m3serve.model.generate import generate
from m3serve.model.parallel import SINGLE, Parallel, RankGroup
from m3serve.model.tiny.checkpoint import TinySpec

# MXFP8 projections and NVFP4 experts; widths chosen so that at tp 4 every split along a
# weight's inputs still keeps whole scale blocks of 32 (o_proj, down_proj, w2).
MIXED = TinySpec(
    dtype="bfloat16",
    seed=12,
    quant="modelopt-mixed",
    num_heads=8,
    dense_intermediate_size=128,
    intermediate_size=128,
)

# Blocks of 4 and top-3: queries from position 12 on drop blocks; 43 ends mid-block.
PROMPT_LEN = 43
DECODE_TOKENS = 8


@dataclass(frozen=True)
class Setup:
    """One way to load a checkpoint: its path, --ep, and whether the quantized weights stay as
    stored (`keep_quantized`: the holders a quantized backend reads) or are dequantized."""

    path: Path
    ep: int = 1
    keep_quantized: bool = False
    hopper: bool = False  # the hopper backend's Triton kernels, in the interpreter
    # Greedy tokens of the decode: each is a paged decode step through every layer, which the
    # Triton interpreter makes the cost of the hopper setup's test.
    decode_tokens: int = DECODE_TOKENS


def outputs(setup: Setup, parallel: Parallel = SINGLE) -> tuple[torch.Tensor, list[int]]:
    """(logits [PROMPT_LEN, vocab], greedy tokens) of the fixed prompt, fp32 compute."""
    cpu = torch.device("cpu")
    backend: Backend = ReferenceBackend(cpu, keep_quantized=setup.keep_quantized)
    if setup.hopper:
        backend = HopperBackend(cpu, interpreter=True)
    model = load_model(setup.path, backend, "float32", progress=False, parallel=parallel).model
    prompt = random_prompt(5, PROMPT_LEN, model.cfg.vocab_size)
    logits = full_logits(model, prompt)
    with torch.inference_mode():
        tokens = generate(model, prompt[:20], setup.decode_tokens, stop_ids=[])
    return logits, tokens


def rank_outputs(ranks: RankGroup, setups: list[Setup]) -> list[tuple[torch.Tensor, list[int]]]:
    """A rank job (`helpers.ranks.run_on_ranks`): each setup's outputs from this rank's share
    of the model (the logits are gathered, so every rank has all of them)."""
    return [outputs(s, Parallel(ranks, s.ep)) for s in setups]
