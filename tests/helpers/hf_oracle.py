"""Helpers shared by the parity tests: our model and transformers' on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.devices import CPU_REFERENCE
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.messages import SeqStep


def load_ours(path: Path) -> M3ForCausalLM:
    return load_model(path, CPU_REFERENCE, "float32", progress=False).model


def load_hf(path: Path) -> torch.nn.Module:
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    # Eager attention: the only backend (with sdpa) that applies the sparse block mask.
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def random_prompt(seed: int, length: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


@torch.inference_mode()
def full_logits(model: M3ForCausalLM, ids: list[int], shuffle_pages: bool = True) -> torch.Tensor:
    """Logits at every position of one prompt, through the paged forward in a single step."""
    page_size = model.cfg.page_size
    num_pages = -(-len(ids) // page_size) + 3
    kv = KVCache.allocate(model.cfg, num_pages, model.dtype, model.device, model.kv_heads)
    pages = list(range(num_pages))
    if shuffle_pages:
        pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(7)).tolist()
    batch = ForwardBatch.build([SeqStep(ids, 0, pages)], page_size, "cpu", all_logits=True)
    return model(batch, kv)


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(ids) :].tolist()
