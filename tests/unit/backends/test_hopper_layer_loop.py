"""The hopper backend's layer loop: with the first layer's attention launches replayed for the
layers after it (kernels/triton/launches.py), a step's logits are those of launching every
layer's kernels through Triton, on prefill, decode and mixed steps over full-attention and
sparse layers (on the GPU, where the replay launches the compiled kernels, when there is one;
else in Triton's interpreter on the CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import M3_SPEC
from helpers.devices import DEVICE, ON_GPU

from m3serve.backends.hopper import HopperBackend
from m3serve.kernels.triton.launches import LayerCalls, Recorded
from m3serve.model.batch import ForwardBatch
from m3serve.model.build import load_model
from m3serve.model.kv_cache import KVCache
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.tiny.checkpoint import TinySpec
from m3serve.runtime.messages import SeqStep

NUM_PAGES = 64


def _steps(page: int) -> list[list[SeqStep]]:
    """Two prompts past the sparse layers' top-k blocks, a decode of both, then a mixed step
    (both decode beside a third prompt's chunk)."""

    def pages(slot: int, tokens: int) -> list[int]:
        return list(range(slot * 16, slot * 16 + -(-tokens // page)))

    a, b, c = [3 + i % 200 for i in range(30)], [7 + i % 190 for i in range(21)], [5] * 26
    return [
        [SeqStep(a, 0, pages(0, 30), 0), SeqStep(b, 0, pages(1, 21), 1)],
        [SeqStep([11], 30, pages(0, 31), 0), SeqStep([12], 21, pages(1, 22), 1)],
        [
            SeqStep([13], 31, pages(0, 32), 0),
            SeqStep([14], 22, pages(1, 23), 1),
            SeqStep(c, 0, pages(2, 26), 2),
        ],
    ]


def _logits(model: M3ForCausalLM) -> list[torch.Tensor]:
    cfg = model.cfg
    kv = KVCache.allocate(cfg, NUM_PAGES, model.dtype, DEVICE)
    out = []
    with torch.inference_mode():
        for seqs in _steps(cfg.page_size):
            out.append(model(ForwardBatch.build(seqs, cfg.page_size, DEVICE), kv))
    return out


def test_replayed_attention_gives_the_logits_of_launching_every_layer(
    tiny_checkpoint: Callable[[TinySpec], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = HopperBackend(DEVICE, interpreter=not ON_GPU)
    model = load_model(tiny_checkpoint(M3_SPEC), backend, "float32", progress=False).model
    replays = []
    replay = Recorded.replay

    def counted(self: Recorded, inputs: tuple[torch.Tensor, ...]) -> object:
        replays.append(len(self.launches))
        return replay(self, inputs)

    monkeypatch.setattr(Recorded, "replay", counted)
    replayed = _logits(model)
    # 2 full-attention and 3 sparse layers: per step, 1 + 2 attention calls replayed and 2
    # index calls; a decode's attention is 2 kernels (split + merge) or 1.
    assert len(replays) == 3 * 5 and all(n >= 1 for n in replays)
    monkeypatch.setattr(LayerCalls, "run", lambda self, batch, key, inputs, call: call())
    launched = _logits(model)
    for got, want in zip(replayed, launched, strict=True):
        assert torch.equal(got, want)
