"""Piecewise CUDA graphs on the GPU: captured pieces around eager attention give the eager
forward's logits for prefill and mixed steps of many sizes, on bf16 and on the quantized
(MXFP8 + NVFP4) tiny checkpoints, including a small step replayed after a larger one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.hf_oracle import random_prompt

from m3serve.backends.hopper import HopperBackend
from m3serve.core.piecewise import PiecewiseGraphs
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

NUM_PAGES = 4096
MAX_TOKENS = 384
# Relative to the logits' scale: bf16 rounding differs where padding changes a matmul's tiles.
TOLERANCE = 2e-2


@pytest.fixture(scope="module", params=["bf16", "modelopt-mixed"])
def model(request: pytest.FixtureRequest, tiny_checkpoint: Callable[[TinySpec], Path]):
    quant = "none" if request.param == "bf16" else request.param
    spec = TinySpec(dtype="bfloat16", seed=5, quant=quant)
    backend = HopperBackend(torch.device("cuda"))
    return load_model(tiny_checkpoint(spec), backend, "bfloat16", progress=False).model


def steps(model: M3ForCausalLM) -> list[list[SeqStep]]:
    """Mixed steps: decodes after long prompts beside chunks and new prompts, 1 to ~330 tokens."""
    ps, vocab = model.cfg.page_size, model.cfg.vocab_size - 64
    out = []
    for seed, (decodes, chunk, start) in enumerate(
        [(0, 37, 0), (3, 0, 0), (5, 64, 41), (12, 250, 17), (1, 7, 3), (30, 300, 0)]
    ):
        page = iter(range(NUM_PAGES))  # each step's requests hold distinct pages

        def pages(n: int, page=page) -> list[int]:  # type: ignore[no-untyped-def]
            return [next(page) for _ in range(-(-n // ps))]

        seqs = [SeqStep([1 + i], 40 + 11 * i, pages(41 + 11 * i)) for i in range(decodes)]
        if chunk:
            ids = random_prompt(seed, chunk, vocab)
            seqs.append(SeqStep(ids, start, pages(start + chunk)))
        out.append(seqs)
    return out


@torch.inference_mode()
def test_piecewise_graphs_give_the_eager_logits(model: M3ForCausalLM) -> None:
    kv = KVCache.allocate(model.cfg, NUM_PAGES + 1, model.dtype, model.device)
    graphs = PiecewiseGraphs(model, kv, NUM_PAGES, MAX_TOKENS)
    graphs.capture()
    for seqs in steps(model):
        batch = ForwardBatch.build(seqs, model.cfg.page_size, model.device)
        eager = model(batch, kv)  # writes the step's KV; the replay writes the same values
        pieced = model.compute_logits(graphs.run(batch)[batch.logit_rows])
        scale = eager.abs().max().item()
        assert (pieced - eager).abs().max().item() <= TOLERANCE * scale, batch.num_tokens
        assert (pieced.argmax(-1) == eager.argmax(-1)).float().mean().item() >= 0.9
