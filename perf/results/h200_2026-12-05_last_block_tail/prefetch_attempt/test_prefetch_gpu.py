"""The L2 prefetch on the GPU: any byte count is asked for without a fault and changes no value,
and a prefetching block inside a CUDA graph capture joins its side stream (the capture ends) and
leaves the captured outputs as they are without it."""

from __future__ import annotations

import pytest
import torch

from m3serve.backends.hopper import HopperBackend
from m3serve.kernels.quant import quant_mxfp8
from m3serve.kernels.triton.prefetch import CHUNK, l2_prefetch
from m3serve.model.weights import Mxfp8Weight

DEVICE = torch.device("cuda")


@pytest.mark.parametrize("nbytes", [0, 15, 16, 17, CHUNK - 1, 32 * CHUNK + 5, 1 << 40])
def test_a_prefetch_of_any_length_changes_no_value(nbytes: int) -> None:
    t = torch.randn(70 * CHUNK // 4, device=DEVICE)
    before = t.clone()
    l2_prefetch(t[: t.numel() // 2], nbytes)  # past the slice's end: clipped to it
    torch.cuda.synchronize()
    assert torch.equal(t, before)


def mxfp8_weight(n: int, k: int, seed: int) -> Mxfp8Weight:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    codes, scales = quant_mxfp8(torch.randn(n, k, device=DEVICE, generator=gen))
    return Mxfp8Weight(codes, scales)


@pytest.mark.parametrize("tokens", [1, 64, 65])
def test_a_captured_prefetching_block_gives_the_outputs_without_it(tokens: int) -> None:
    a, b = mxfp8_weight(1024, 2048, seed=1), mxfp8_weight(2048, 1024, seed=2)
    x = torch.randn(tokens, 2048, device=DEVICE, dtype=torch.bfloat16)

    def step(backend: HopperBackend) -> torch.Tensor:
        with backend.prefetching([b], tokens):  # b is read after the block
            h = backend.linear(x, a)
        return backend.linear(h, b)

    outputs = []
    for budget in (0, 1 << 20, 64 << 20):
        backend = HopperBackend(DEVICE, prefetch_bytes=budget)
        eager = step(backend)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(backend)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                captured = step(backend)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        outputs.append(eager)
    assert all(torch.equal(o, outputs[0]) for o in outputs)
