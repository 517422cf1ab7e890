"""The reference backend is exact on any device: on CUDA it reproduces the CPU logits (fp32) and
stays close in bf16, with the same greedy tokens in fp32."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.hf_oracle import random_prompt

from m3serve.backends.reference import ReferenceBackend
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.generate import generate
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

SPEC = TinySpec(dtype="float32", seed=1)


def load(path: Path, device: str, dtype: str) -> M3ForCausalLM:
    return load_model(path, ReferenceBackend(torch.device(device)), dtype, progress=False).model


@torch.inference_mode()
def logits(model: M3ForCausalLM, ids: list[int]) -> torch.Tensor:
    pages = -(-len(ids) // model.cfg.page_size)
    kv = KVCache.allocate(model.cfg, pages, model.dtype, model.device)
    chunk = SeqStep(ids, 0, list(range(pages))[::-1])
    batch = ForwardBatch.build([chunk], model.cfg.page_size, model.device, all_logits=True)
    return model(batch, kv).cpu()


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[TinySpec], Path]) -> Path:
    torch.backends.cuda.matmul.allow_tf32 = False
    return tiny_checkpoint(SPEC)


def test_fp32_on_cuda_matches_cpu(path: Path) -> None:
    ids = random_prompt(1, 60, SPEC.vocab_size)
    cpu, gpu = load(path, "cpu", "float32"), load(path, "cuda", "float32")
    assert (logits(cpu, ids) - logits(gpu, ids)).abs().max().item() <= 1e-4
    assert generate(cpu, ids, 32) == generate(gpu, ids, 32)


def test_bf16_on_cuda_stays_close_to_fp32(path: Path) -> None:
    ids = random_prompt(2, 60, SPEC.vocab_size)
    ref = logits(load(path, "cpu", "float32"), ids)
    bf16 = logits(load(path, "cuda", "bfloat16"), ids)
    # A random tiny MoE is chaotic under bf16 noise: an occasional position flips an expert or a
    # block choice (transformers' own bf16 run shows the same), so judge the typical position.
    per_position = (bf16 - ref).abs().amax(dim=-1)
    assert per_position.median().item() <= 0.05 * ref.abs().max().item()
    agree = (bf16.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8
